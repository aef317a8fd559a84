"""``TagTracker``'s violation methods: a check's verdict resolved into violations, each explained (its first bad
entry and why) and reported (counted, logged, written as an incident).

A mixin of :class:`kvguard.tracker.TagTracker`, which owns every structure these methods read (the tag table, the
expectations, the metrics, the incident log, the lock); the records are ``kvguard.violations``'.
"""
import torch

from . import incidents
from .noop import Check
from .tags import UNSET
from .violations import KVGuardViolation, Violation, log_violation


class ViolationMethods:
    """resolve, report, _explain (state: :class:`TagTracker`'s)."""

    def resolve(self, check: Check | None, verdict_host: torch.Tensor | None,
                request_ids: list[str], ignore: list[bool] | None = None) -> list[KVGuardViolation]:
        """The violations of a check's verdict, counted and logged once each.

        ``ignore`` (per batch entry): entries whose request is already gone (aborted on an earlier
        verdict, finished): not explained, not counted.
        """
        if check is None or verdict_host is None:
            return []
        batch = check.rows.numel()
        if len(request_ids) != batch:
            raise ValueError(f"TagTracker.resolve: {len(request_ids)} request ids for a check of {batch} "
                             f"batch entries; give one id per entry, in the order passed to validate()")
        if batch == 0:
            return []
        counts = verdict_host.reshape(batch, -1).sum(1)
        flagged = counts.nonzero().flatten().tolist()
        if ignore is not None:
            flagged = [b for b in flagged if not ignore[b]]
        with self.lock:
            found = [KVGuardViolation(self._explain(check, b, request_ids[b], int(counts[b]))) for b in flagged]
        for err in found:
            self.report(err.violation)
        return found

    def report(self, violation: Violation) -> None:
        """Count one violation, log it, and (``incident_dir`` set) write its incident record."""
        self.metrics.violations.labels(reason=violation.reason).inc()
        if self.incident_log is not None or self.history is not None:
            record = incidents.record_of(violation, rank=incidents.rank(), step=self.checks_launched,
                                         history=self.history)
            incidents.emit(record, self.incident_log)
        elif self.config.log_violations:
            log_violation(violation)

    def _explain(self, check: Check, b: int, request_id: str, bad: int) -> Violation:
        """Slow path, only on a violation: find the first bad entry on the host."""
        row = int(check.rows[b])
        src_row = int(check.source_rows[b])
        width = self.expected.shape[1]
        if not (0 <= row < self.expected.shape[0] and 0 <= src_row < check.source.shape[0]):
            return Violation(request_id=request_id, row=row, logical_position=0, page=-1, expected_tag=UNSET,
                             found_tag=None, reason="bad_row", bad_entries=bad)
        # entry j of the check: token j (per_token, logical page j // page_div) or page j
        per = check.page_div if check.per_token else 1
        raw = check.source[src_row, ::check.entry_step][:width * per].long().cpu()  # [entries]
        j_all = torch.arange(raw.numel())
        want = self.expected[row, :width].cpu()[torch.div(j_all, per, rounding_mode="floor")]
        limit = self.tags.num_pages * check.page_div
        in_range = (raw >= 0) & (raw < limit)
        tags = self.tags.tags.cpu()
        pages = torch.where(in_range, raw // check.page_div, torch.zeros_like(raw))
        mismatch = ~in_range | (tags[pages] != want)
        if check.per_token:
            mismatch |= (raw % check.page_div) != (j_all % check.page_div)
        j = int(mismatch.nonzero().flatten()[0]) if bool(mismatch.any()) else 0
        if check.per_token:
            position = j
        else:
            position = j * (check.entry_step if check.entry_step > 1 else self.page_size)
        if not bool(mismatch.any()):
            reason = "unchecked"  # the row index or the entry count was outside what the launch could read
        elif not in_range[j]:
            reason = "out_of_range"
        elif want[j] == UNSET:
            reason = "unrecorded"
        elif tags[pages[j]] == want[j]:
            reason = "misplaced_in_page"  # the right page, the wrong token slot inside it
        else:
            reason = "tag_mismatch"
        return Violation(
            request_id=request_id, row=row, logical_position=position,
            page=int(raw[j] // check.page_div) if in_range[j] else int(raw[j]),
            expected_tag=int(want[j]), found_tag=int(tags[pages[j]]) if in_range[j] else None,
            reason=reason, bad_entries=bad,
        )
