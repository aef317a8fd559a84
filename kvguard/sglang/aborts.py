"""The abort of exactly the flagged requests on one SGLang 0.5.23 pool set.

:class:`AbortSide` is the part of :class:`kvguard.sglang.guard.SGLangGuard` that acts on a verdict: the requests whose
row is not their own, found before a decode step is prepared (:meth:`AbortSide.stale_aborts`, agreed across
attention-TP ranks), and SGLang's own per-request abort of flagged requests, released safely (:meth:`AbortSide.abort`),
or a prefill's discard (:meth:`AbortSide.discard`).

Only functions of this subpackage import SGLang, and only when they run.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("kvguard.sglang")

ABORT_MESSAGE = "kvguard: KV page mapping broken"


class AbortSide:
    """:class:`kvguard.sglang.guard.SGLangGuard`'s aborts: which requests a stale row drops, and the abort itself."""

    def stale_aborts(self, batch, group=None) -> list[tuple[Any, str, bool]]:
        """Before a decode step is prepared: (req, message, stale here) for every request whose row SGLang
        gave to another request, here or (attention TP, ``group``) on a peer rank: all ranks drop the same
        requests. A request stale only on a peer still owns its row here and is released normally."""
        stale, any_stale = self.stale_flags(batch)
        if group is None and not any_stale:
            return []  # the steady state (cached per batch composition and row-pool change)
        # NOTE (attention TP): a row changes hands only in the row pool's alloc, and every rank makes the same
        # allocations and the same batches (SGLang schedules alike on every rank); a bug on one rank changes
        # which row it hands out, not whether it allocates. So the ranks agree once per batch composition and
        # row-pool change, all at the same step, and skip the collective in the steady state.
        key = (len(batch.reqs), self.rows_version)
        agreed_for = batch.__dict__.get("_kvguard_agreed")
        if group is not None and agreed_for is not None and agreed_for[0] is batch.reqs and agreed_for[1:] == key:
            return []
        local = [s and not req.finished() for req, s in zip(batch.reqs, stale)]
        agreed = _all_reduce_max([int(s) for s in local], group)
        if group is not None:
            batch._kvguard_agreed = (batch.reqs,) + key
        return [(req, self.stale_message(req) if here else
                 f"{ABORT_MESSAGE} on a peer tensor-parallel rank (request {req.rid}, stale row)", bool(here))
                for req, here, flag in zip(batch.reqs, local, agreed) if flag]

    def stale_message(self, req, verb: str = "aborted") -> str:
        """The message of a request whose row is not its own (:meth:`stale_flags`: given to another request, or not
        followed by kvguard any more), counted once as a violation of that reason."""
        from ..violations import Violation
        from .release import row_cause

        row = int(req.kv.req_pool_idx) if req.kv.req_pool_idx is not None else -1
        reason, cause = row_cause(self, req)
        self.tracker.report(Violation(request_id=str(req.rid), row=row, logical_position=0, page=-1,
                                      expected_tag=-1, found_tag=None, reason=reason, bad_entries=0))
        return f"kvguard: request {req.rid} {verb}: its req_to_token row {row} {cause}"

    # -- abort and release -------------------------------------------------------------------------

    def abort(self, flagged, *, tree_cache, stream: Callable[[list, bool], Any] | None) -> list:
        """SGLang's own per-request abort (the _handle_kv_checksum_mismatch template), released safely."""
        from http import HTTPStatus

        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.mem_cache.common import release_kv_cache

        aborted = []
        for req, message, stale in flagged:
            if req.finished() or (not stale and not req.kv.holds_kv):
                continue  # overlap: finished/retracted requests reappear for one tick
            log.error(message)
            prepare_abort(req, message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
            mark_aborted(req, stale)
            if stream is not None:
                stream([req], req.return_logprob)
            release_kv_cache(req, tree_cache, checkpoint=False)  # hooked: releasing() / release_stale()
            aborted.append(req)
        if aborted:
            self.tracker.note_aborted(len(aborted))
        return aborted

    def discard(self, flagged) -> list:
        """Prefill: let SGLang finish flagged requests without committing their first token.

        ``Req.discard_output_reason`` is SGLang's own path for a failed KV load: the request finishes
        with that reason, its output is not committed, it is released without a checkpoint (through the
        hooked release_kv_cache, hence :meth:`releasing`) and its error is streamed.
        """
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        out = []
        for req, message, stale in flagged:
            if req.finished():
                continue
            log.error(message)
            req.discard_output_reason = FINISH_ABORT(message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
            mark_aborted(req, stale)
            out.append(req)
        if out:
            self.tracker.note_aborted(len(out))
        return out


def mark_aborted(req, stale: bool = False) -> None:
    req.skip_radix_cache_insert = True  # never publish this KV to the radix tree
    req.kvguard_aborted = True
    req.kvguard_stale = stale  # its row belongs to another request now: released without touching it


def _all_reduce_max(flags: list[int], group) -> list[int]:
    """Every TP rank must drop the same requests, or the ranks run different batches and hang."""
    if group is None or not flags:
        return flags
    from sglang.srt.disaggregation.utils import all_reduce_flags

    return all_reduce_flags(flags, group, torch.distributed.ReduceOp.MAX)
