"""``TagTracker``, the checking tracker, and ``make_tracker``; the protocol and the default no-op
tracker are in ``kvguard.noop`` (re-exported here). Two of the tracker's method groups live in mixins of their
own: the verdict's violations (``resolve``, ``report``, ``_explain``: ``kvguard.tracker_violations``) and the
PD transfer tags (``transfer_issue``, ``transfer_land``, ``transfer_stamp``, ``transfer_violation``:
``kvguard.tracker_transfers``); the tracker owns every structure they touch.
"""
import operator
import threading

import torch
from prometheus_client import CollectorRegistry

from .metrics import METRICS_EVERY, metrics_for
from .noop import Check, NoopTracker
from .settings import TrackerConfig
from . import incidents
from .tags import UNSET, TagTable
from .tracker_transfers import TransferTagMethods
from .tracker_violations import ViolationMethods


def copy_to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int64 copy of host indices on ``device`` that never blocks the host.

    NOTE: a pageable host->device copy waits for the stream's earlier work (under SGLang's overlap scheduler: the
    previous step's whole forward); a pinned one is queued and returns (measured on an H100, EAGLE 1B c=1: one
    such copy per reserving spec step made kvguard's host time p99 11 ms)."""
    if index.device == device:
        return index.to(torch.int64)
    host = index.to(torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _as_index(value) -> int | None:
    """``value`` as an int index (Python, numpy or 0-d torch integers), or None (bools are not indices)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


class TagTracker(ViolationMethods, TransferTagMethods, NoopTracker):
    """Tag-versioned page tracker: tags bump on alloc and free; expected (page, tag) per request slot.

    Threads: safe to share. One lock (``self.lock``, re-entrant) serialises tag issuance (``on_alloc``,
    ``on_free``) and every write or read of the expected tags (``record``, ``record_many``, ``drop``,
    ``held_pages``, ``resolve``, transfers), so tags stay unique under concurrent callers.
    ``on_alloc`` returns the tags it issued (one per slot), so each caller records its own allocation's tags.
    A caller that must make several calls atomically (alloc then record) holds ``with tracker.lock:``.

    Misuse raises ValueError (or RuntimeError before ``attach``) naming the argument: a row outside
    ``0..num_rows-1``, a negative first entry, entries past the row width, host page ids outside the pool,
    a resolve whose request ids do not match the check's batch. Page ids in device tensors are not
    range-checked here (that would cost a host sync per call).
    """

    enabled = True

    def __init__(self, config: TrackerConfig | None = None, registry: CollectorRegistry | None = None):
        self.config = config or TrackerConfig(mode="check")
        self.metrics = metrics_for(registry)
        self.tags: TagTable | None = None
        self.expected: torch.Tensor | None = None  # int64 [num_rows, max_entries]
        self._aranges: torch.Tensor | None = None
        self.lock = threading.RLock()
        self.history: incidents.PageHistory | None = None
        self.incident_log = incidents.IncidentLog(self.config.incident_dir) if self.config.incident_dir else None
        self.checks_launched = 0
        self._uncounted = self._uncounted_entries = 0  # count_check's checks not in the counters yet

    # -- lifecycle ---------------------------------------------------------------------------------
    def attach(self, *, num_pages: int, num_rows: int, max_entries: int, device, page_size: int = 1) -> None:
        for name, value in (("num_pages", num_pages), ("num_rows", num_rows), ("max_entries", max_entries),
                            ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TagTracker.attach: {name}={value!r} is not valid; it must be an int >= 1")
        self.page_size = page_size
        self.use_triton = self._pick_triton(torch.device(device))
        self.tags = TagTable(num_pages, device, kernel=self.use_triton)
        # The tag a transfer stamp overwrote on each page (UNSET: none): a page whose tag a late write replaced
        # is still held by its owner, who gets it back on abort (held_pages).
        self.overwritten = torch.full((num_pages,), UNSET, dtype=torch.int64, device=device)
        if self.config.history:
            self.history = incidents.PageHistory(num_pages, self.config.history, device)
        self.expected = torch.full((num_rows, max_entries), UNSET, dtype=torch.int64, device=device)
        self.expected_pages = torch.zeros((num_rows, max_entries), dtype=torch.int32, device=device)
        self._aranges = torch.arange(max(num_rows, 1), dtype=torch.int32, device=device)
        self.scratch_page = 0
        from .kernels import tag_check  # lazy: Triton is imported only by a checking tracker

        from .kernels import record

        self._check = tag_check.tag_check if self.use_triton else tag_check.tag_check_ref
        self._recorder = record.DecodeRecorder(self.expected, self.expected_pages, self.tags.tags,
                                               page_size=page_size, reference=not self.use_triton)
        self._reserve_recorder = record.ReserveRecorder(self.expected, self.expected_pages, self.tags.tags,
                                                        page_size=page_size, reference=not self.use_triton)

    def _pick_triton(self, device: torch.device) -> bool:
        backend = self.config.backend
        if backend == "auto":
            return device.type == "cuda"
        return backend == "triton"

    def _require_attached(self) -> None:
        if self.tags is None:
            raise RuntimeError("TagTracker: call attach(num_pages=..., num_rows=..., ...) before use")

    def _check_row(self, where: str, row) -> int:
        rows = self.expected.shape[0]
        index = _as_index(row)
        if index is None or not 0 <= index < rows:
            raise ValueError(f"TagTracker.{where}: row={row!r} is not valid; rows are 0..{rows - 1} "
                             f"(num_rows={rows} given to attach())")
        return index

    def _check_pages(self, where: str, pages: torch.Tensor) -> None:
        """Host page ids must lie in the pool (a negative id would wrap to the last page)."""
        if pages.device.type == "cpu" and pages.numel():
            low, high = int(pages.min()), int(pages.max())
            if low < 0 or high >= self.tags.num_pages:
                raise ValueError(f"TagTracker.{where}: page ids {low}..{high} are outside the pool; "
                                 f"valid pages are 0..{self.tags.num_pages - 1}")

    # -- bookkeeping events ------------------------------------------------------------------------
    def on_alloc(self, pages: torch.Tensor) -> torch.Tensor:
        self._require_attached()
        self._check_pages("on_alloc", pages)
        with self.lock:
            fresh = self.tags.bump(pages)  # [n] tag of each slot of this allocation (a page twice: two tags)
            if self.history is not None:
                self.history.note(pages, fresh, incidents.ALLOC)
            return fresh

    def on_free(self, pages: torch.Tensor) -> None:
        self._require_attached()
        self._check_pages("on_free", pages)
        with self.lock:
            fresh = self.tags.bump(pages)
            if self.history is not None:
                self.history.note(pages, fresh, incidents.FREE)

    def record(self, row: int, first: int, pages: torch.Tensor, tags: torch.Tensor | None = None) -> None:
        self._require_attached()
        row, index = self._check_row("record", row), _as_index(first)
        count = pages.numel()
        if index is None or index < 0:
            raise ValueError(f"TagTracker.record: first={first!r} is not valid; it must be an int >= 0")
        first = index
        if first + count > self.expected.shape[1]:
            raise ValueError(f"TagTracker.record: row {row} pages {first}..{first + count} exceed the "
                             f"row width {self.expected.shape[1]} given to attach()")
        if tags is not None and tags.numel() != count:
            raise ValueError(f"TagTracker.record: {tags.numel()} tags for {count} pages; give one tag per page")
        self._check_pages("record", pages)
        with self.lock:
            self.expected[row, first:first + count] = self.tags.gather(pages) if tags is None else tags
            self.expected_pages[row, first:first + count] = pages.to(self.expected_pages.device, torch.int32)

    def record_many(self, rows: torch.Tensor, cols: torch.Tensor, pages: torch.Tensor,
                    where: torch.Tensor | None = None, tags: torch.Tensor | None = None) -> None:
        self._require_attached()
        if not rows.numel() == cols.numel() == pages.numel():
            raise ValueError(f"TagTracker.record_many: rows, cols and pages differ in length "
                             f"({rows.numel()}, {cols.numel()}, {pages.numel()})")
        for name, index, size in (("rows", rows, self.expected.shape[0]), ("cols", cols, self.expected.shape[1])):
            if index.device.type == "cpu" and index.numel() and not (0 <= int(index.min()) and int(index.max()) < size):
                raise ValueError(f"TagTracker.record_many: {name} {int(index.min())}..{int(index.max())} are "
                                 f"outside 0..{size - 1} (the shape given to attach())")
        self._check_pages("record_many", pages)
        dev = self.expected.device
        rows, cols = copy_to_device(rows, dev), copy_to_device(cols, dev)
        with self.lock:
            tags = self.tags.gather(pages) if tags is None else tags.to(dev, torch.int64)
            pages32 = pages.to(dev, torch.int32)
            if where is not None:  # device mask, no sync: entries outside it keep their expectation
                where = where.to(dev)
                tags = torch.where(where, tags, self.expected[rows, cols])
                pages32 = torch.where(where, pages32, self.expected_pages[rows, cols])
            self.expected[rows, cols] = tags
            self.expected_pages[rows, cols] = pages32

    def record_decode(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, *,
                      fresh: torch.Tensor | None = None, skip: torch.Tensor | None = None,
                      alloc: torch.Tensor | None = None, n_alloc: int | None = None) -> None:
        """One decode step: each request whose position starts a page expects its new page (one launch).

        ``positions[b]`` is the token request ``b`` writes into ``slots[b]``; the k-th request whose
        position starts a page got the step's k-th allocated page, tagged ``fresh[k]`` (the tags
        :meth:`on_alloc` returned; None: the pages' current tags). ``alloc``: the step's allocated pages
        (allocation order) not yet bumped, its first ``n_alloc`` entries (default: all): the same launch bumps
        them (:meth:`on_alloc`'s tags, without its launches). ``skip`` (bool) leaves requests out. No sync
        (``kvguard.kernels.record``; tensors on another device are moved there).
        """
        self._require_attached()
        with self.lock:
            n_alloc, base = self._alloc_base(alloc, n_alloc)
            self._recorder(rows, positions, slots, fresh=fresh, skip=skip, alloc=alloc, n_alloc=n_alloc, base=base)

    def record_reserve(self, rows: torch.Tensor, cur: torch.Tensor, nxt: torch.Tensor, slots: torch.Tensor, *,
                       fresh: torch.Tensor | None = None, alloc: torch.Tensor | None = None,
                       n_alloc: int | None = None) -> None:
        """A spec step's reserve in one launch: request ``b`` got positions ``[cur[b], nxt[b])`` (device lengths) at
        ``slots`` (batch order), recorded as :meth:`record_decode` records one entry per position. No sync."""
        self._require_attached()
        with self.lock:
            n_alloc, base = self._alloc_base(alloc, n_alloc)
            self._reserve_recorder(rows, cur, nxt, slots, fresh=fresh, alloc=alloc, n_alloc=n_alloc, base=base)

    def _alloc_base(self, alloc, n_alloc) -> tuple:
        """(n_alloc, the allocation's first tag) for a record that bumps ``alloc`` in its own launch (0: no alloc)."""
        if alloc is None:
            return n_alloc, 0
        n_alloc = alloc.numel() if n_alloc is None else n_alloc
        base = self.tags.reserve(n_alloc)
        if self.history is not None:
            self.history.note(alloc[:n_alloc], torch.arange(base, base + n_alloc, device=self.expected.device),
                              incidents.ALLOC)
        return n_alloc, base

    def drop(self, row: int) -> None:
        self._require_attached()
        row = self._check_row("drop", row)
        with self.lock:
            self.expected[row].fill_(UNSET)

    def held_pages(self, row: int, first: int, end: int) -> torch.Tensor:
        """Recorded pages of ``row`` (logical ``first..end``) whose tag is still the one recorded.

        Used to release an aborted request safely: its table row may name pages that were freed or
        handed to another request since; only pages it still holds go back to the allocator.
        """
        self._require_attached()
        row = self._check_row("held_pages", row)
        with self.lock:
            pages = self.expected_pages[row, first:end].long()
            want = self.expected[row, first:end]
            still = ((self.tags.tags[pages] == want) | (self.overwritten[pages] == want)) & (want != UNSET)
            return pages[still].cpu()

    def expectation(self, row: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, tags) recorded for ``row`` at logical ``first..end`` (copies; UNSET tags: nothing)."""
        self._require_attached()
        row = self._check_row("expectation", row)
        with self.lock:
            return self.expected_pages[row, first:end].long().clone(), self.expected[row, first:end].clone()

    def current_tags(self, pages: torch.Tensor) -> torch.Tensor:
        """The tags ``pages`` carry now (device gather, no sync)."""
        self._require_attached()
        with self.lock:
            return self.tags.gather(pages)

    def warm_up(self, table: torch.Tensor, *, page_div: int = 1, per_token: bool = False,
                slot_dtype: torch.dtype = torch.int64, launch=None) -> None:
        """Compile every kernel variant a server uses now, so no request pays for a compile.

        The check: every block size, row indices as int32 or int64, lengths as int64, without and with
        a write guard over ``slot_dtype`` slots (one per request, or segments), without and with the host
        flag (a server's launch); the decode and spec reserve recorders (with and without their bump); the tag
        bump. Launches with nothing live; counts no check and changes no state. ``launch``: the server's own
        :meth:`launcher` (its variants are then also its direct launches' first calls).
        """
        self._require_attached()
        if not self.use_triton:
            return
        from .kernels.tag_check import WriteGuard, block_sizes, n_chunks_for

        dev = self.expected.device
        lens = torch.zeros(1, dtype=torch.int64, device=dev)
        slots = torch.full((1,), self.scratch_page * page_div, dtype=slot_dtype, device=dev)
        guards = (None, WriteGuard(slots), WriteGuard(slots, lens, lens))
        # A server's launch (``launch`` given) always writes its host flag (pinned memory on CUDA); the plain
        # tag_check API none: one set of variants each, not both.
        flags = (None,) if launch is None else \
            (torch.zeros(1, dtype=torch.int64, pin_memory=dev.type == "cuda"),)
        launch = launch or self.launcher(table, page_div=page_div, per_token=per_token)
        guards += (WriteGuard.row_tail(launch.table, lens),)  # a spec step's (kvguard.sglang.spec)
        for dtype in (torch.int32, torch.int64):  # row indices arrive as either
            rows = torch.zeros(1, dtype=dtype, device=dev)
            for n_entries, guard in [(rows, None)] + [(lens, g) for g in guards]:
                for flag in flags:
                    for block in block_sizes():
                        verdict = torch.empty(n_chunks_for(block), dtype=torch.int32, device=dev)
                        with self.lock:
                            launch(rows, rows, n_entries, max_entries=block, verdict=verdict, guard=guard, flag=flag)
            pos = torch.ones(1, dtype=torch.int64, device=dev)  # not a page start: nothing is recorded
            empty = torch.zeros(0, dtype=torch.int64, device=dev)
            for fresh, alloc in ((None, None), (self.tags.tags[:1], None), (None, slots[:1] // max(page_div, 1))):
                for skip in (None, torch.zeros(1, dtype=torch.bool, device=dev)):
                    with self.lock:  # an alloc of page 0 (scratch) at its own tag: nothing changes
                        base = int(self.tags.tags[0]) if alloc is not None else 0
                        self._recorder(rows, pos, slots, fresh=fresh, skip=skip, alloc=alloc, base=base)
                with self.lock:  # a spec reserve of nothing (cur = nxt), its lengths int32 and int64
                    for t in (torch.int32, torch.int64):
                        self._reserve_recorder(rows, pos.to(t), pos.to(t), slots, fresh=fresh, alloc=alloc, base=base)
        if self.tags._bumper is not None:
            zero = torch.zeros(1, dtype=torch.int64, device=dev)
            for fresh in (None, torch.empty(1, dtype=torch.int64, device=dev)):
                self.tags._bumper(zero, int(self.tags.tags[0]), fresh)  # page 0 keeps its tag (max)
            self.tags._bumper(empty, 0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def launcher(self, table: torch.Tensor, *, page_div: int = 1, per_token: bool = False):
        """The check bound to ``table`` and this tracker (``kvguard.kernels.tag_check.CheckLaunch``): a server's
        per-step launch, with :meth:`check`. No quarantine for a token table (``per_token``)."""
        self._require_attached()
        from .kernels.tag_check import CheckLaunch

        return CheckLaunch(table, self.tags.tags, self.expected, scratch_page=self.scratch_page, page_div=page_div,
                           per_token=per_token, quarantine=self.config.quarantine and not per_token,
                           reference=not self.use_triton)

    def check(self, launch, rows, n_entries, *, table_rows, max_entries: int, verdict: torch.Tensor,
              flag: torch.Tensor | None = None, stamp: int = 1, guard=None, entries_hint: int | None = None) -> Check:
        """:meth:`validate` through a bound :meth:`launcher`, into a caller-owned ``verdict`` buffer, with the
        host ``flag`` set to ``stamp`` when anything is bad (the per-step path: no allocation, no clone)."""
        with self.lock:
            verdict = launch(table_rows, rows, n_entries, max_entries=max_entries, verdict=verdict, guard=guard,
                             flag=flag, stamp=stamp)
        self.count_check(entries_hint)
        return Check(verdict, rows, launch.table, table_rows, launch.entry_step, launch.page_div, launch.per_token)

    def count_check(self, entries: int | None = None) -> None:
        """One per-step check launched (``entries`` entries read): the metrics a bound launch counts itself.

        NOTE: counted into the Prometheus counters in batches of METRICS_EVERY and at :meth:`flush_metrics` (the
        SGLang guard flushes at every request's release, so the counters are exact whenever no request runs): a
        counter's inc takes a lock (and writes a file in a multiprocess registry) on the scheduler's thread.
        """
        self.checks_launched += 1
        self._uncounted += 1
        if entries is not None:
            self._uncounted_entries += entries
        if self._uncounted >= METRICS_EVERY:
            self.flush_metrics()

    def flush_metrics(self) -> None:
        """The per-step checks :meth:`count_check` has not counted into the Prometheus counters yet, counted now."""
        checks, entries, self._uncounted, self._uncounted_entries = self._uncounted, self._uncounted_entries, 0, 0
        if checks:
            self.metrics.checks.inc(checks)
        if entries:
            self.metrics.entries.inc(entries)

    # -- the check ---------------------------------------------------------------------------------
    def validate(self, table, rows, n_entries, *, max_entries, table_rows=None, source=None,
                 source_rows=None, entry_step=1, page_div=1, per_token=False, entries_hint=None,
                 guard=None) -> Check:
        """Check ``table`` rows against expected tags; quarantine failing entries in ``table``.

        ``table`` is what the next kernel reads: a batch-packed page table ``[B, P]`` (then
        ``table_rows`` defaults to ``0..B-1``) or a token table indexed by ``table_rows``. ``rows`` are
        the request slots. ``source`` (default: ``table``) is the engine's untouched table, used only to
        explain a failure. ``guard`` (a ``kvguard.kernels.tag_check.WriteGuard``): the forward's write
        slots, rewritten to a scratch slot for every flagged request in the same launch.
        """
        self._require_attached()
        batch = rows.numel()
        if table_rows is None:
            table_rows = self._aranges[:batch]
        quarantine = self.config.quarantine and entry_step == 1 and not per_token
        if source is None:
            # The check quarantines `table` in place: explain failures from a snapshot taken before it
            # (pass `source` to avoid the copy).
            source, source_rows = (table.clone() if quarantine else table), table_rows
        with self.lock:  # the launch reads tags and expectations (on the CPU path, synchronously)
            verdict = self._check(table, table_rows, rows, n_entries, self.tags.tags, self.expected,
                                  max_entries=max_entries, scratch_page=self.scratch_page,
                                  entry_step=entry_step, page_div=page_div, per_token=per_token,
                                  quarantine=quarantine, guard=guard)
        self.metrics.checks.inc()
        self.checks_launched += 1
        if entries_hint is not None:
            self.metrics.entries.inc(entries_hint)
        return Check(verdict, rows, source, table_rows if source_rows is None else source_rows,
                     entry_step, page_div, per_token)

    def note_aborted(self, count: int = 1) -> None:
        """The engine aborted ``count`` requests on our verdict."""
        self.flush_metrics()
        self.metrics.aborted.inc(count)


def make_tracker(config: TrackerConfig | None = None, registry: CollectorRegistry | None = None, *,
                 checking: type[TagTracker] = TagTracker, **options):
    """The tracker a deployment asked for: ``config`` or, if None, the ``KVGUARD_*`` environment.

    Mode off gives the ``NoopTracker``; mode check a ``checking(config, registry, **options)`` (a
    ``TagTracker``; one TP rank's ``RankTracker`` comes from ``kvguard.distributed.make_rank_tracker``).
    """
    config = config or TrackerConfig.from_env()
    if config.mode == "off":
        return NoopTracker()
    return checking(config, registry, **options)
