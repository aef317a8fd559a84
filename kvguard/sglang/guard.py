"""The guard kvguard installs on one SGLang 0.5.23 pool set: the batched check and safe aborts.

:class:`SGLangGuard` is a :class:`~kvguard.sglang.follow.PoolFollower` (what it follows: pages, tags,
expectations, the safe release) plus what runs every step: the check launched before each forward, the
write-slot guard, the verdict and the abort of exactly the flagged requests.

Only functions of this subpackage import SGLang, and only when they run.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..kernels.tag_check import WriteGuard, apply_guard
from ..tracker import Check
from ..violations import KVGuardViolation
from .follow import PoolFollower

log = logging.getLogger("kvguard.sglang")

ABORT_MESSAGE = "kvguard: KV page mapping broken"
SCRATCH_SLOT = 0  # slot 0 (page 0) is SGLang's padding slot: never allocated, CUDA-graph padding writes it
PADDING_ROW = 0  # req_to_token row 0 is SGLang's padding row: never given to a request (free rows start at 1)
VERDICT_RING = 8  # pinned verdict buffers per verdict shape (see SGLangGuard._verdict_slot)


@dataclass
class Pending:
    """A launched check, carried on the ScheduleBatch until its result is processed."""

    guard: "SGLangGuard"
    check: Check
    reqs: list  # the Req objects, in batch order at check time
    verdict_host: torch.Tensor
    ready: Any  # a CUDA event for the async verdict copy, or None (already on the host)
    stale: list  # per request: its row now belongs to a newer owner (host-side generation check)


class SGLangGuard(PoolFollower):
    """The batched check over one SGLang scheduler's pools, and the abort of exactly the flagged requests."""

    def launch(self, batch) -> Pending | None:
        """Right before the forward: one batched validation of every token entry the batch maps.

        Every token ``t < seq_len`` of each request (the slot this step writes included: SGLang has
        written it into ``req_to_token`` already) must sit in the page the request expects at logical
        page ``t // page_size``, at in-page offset ``t % page_size``. One launch, no host sync; then the
        write slots of flagged requests are redirected to the padding slot in the same launch
        (:meth:`write_guard`).
        """
        rows_ = self.batch_rows(batch)
        if rows_.all_known:  # the normal case: every row followed, the batch's own lengths
            lens = batch.seq_lens_cpu.tolist()
            max_entries, total, n_entries = (max(lens) if lens else 0), sum(lens), batch.seq_lens
        else:
            n_cpu = torch.where(rows_.known, batch.seq_lens_cpu, 0)
            max_entries, total = (int(n_cpu.max()) if n_cpu.numel() else 0), int(n_cpu.sum())
            n_entries = self.to_device(n_cpu.tolist(), n_cpu.dtype)
        if max_entries == 0:
            return None
        stale = batch.__dict__.pop("_kvguard_stale", None)  # computed by this step's alloc_for_decode
        if stale is None or len(stale) != len(batch.reqs):
            stale = self.stale(batch)
        rows = batch.req_pool_indices
        on_cuda = rows.device.type == "cuda"
        guard = self.write_guard(batch)
        check = self.tracker.validate(self.req_to_token_pool.req_to_token, rows_.owner_dev, n_entries,
                                      max_entries=max_entries, table_rows=rows, page_div=self.page_size,
                                      per_token=True, entries_hint=total, guard=guard)
        if guard is not None and any(stale):
            # Rare: requests whose row went to a newer owner write nothing either (their check may pass)
            apply_guard(guard, self.to_device(stale, torch.bool))
        if on_cuda:
            host, ready = self._verdict_slot(check.verdict)
            host.copy_(check.verdict, non_blocking=True)
            ready.record()
        else:
            host, ready = check.verdict, None
        pending = Pending(self, check, list(batch.reqs), host, ready, stale)
        batch._kvguard = pending
        return pending

    def _verdict_slot(self, verdict: torch.Tensor):
        """A pinned host buffer and an event for one verdict copy, reused round robin per verdict shape.

        NOTE: at most two checks are in flight (the overlap scheduler's batch N, resolved after N+1 was
        launched, plus a prefill's); a ring of VERDICT_RING slots per shape is never overwritten before its
        verdict was read. No pinned allocation and no new event per step.
        """
        ring = self.__dict__.setdefault("_verdict_ring", {})
        key = (tuple(verdict.shape), verdict.dtype)
        slots, turn = ring.setdefault(key, ([], [0]))
        if len(slots) < VERDICT_RING:
            slots.append((torch.empty(verdict.shape, dtype=verdict.dtype, pin_memory=True), torch.cuda.Event()))
            return slots[-1]
        turn[0] = (turn[0] + 1) % VERDICT_RING
        return slots[turn[0]]

    def write_guard(self, batch) -> WriteGuard | None:
        """This step's KV write slots, which the check rewrites to the padding slot for flagged requests.

        SGLang writes a decode token at ``out_cache_loc`` = ``last_loc + 1`` read from ``req_to_token``,
        and extend tokens at the slots alloc_for_extend chose; a broken entry would land this step's K/V
        in another live request's page before the verdict is read. The check runs before the forward on
        the same stream and, in the same launch, points a flagged request's writes at the slot SGLang
        itself uses for padding (device, no sync).
        """
        out = batch.out_cache_loc
        if out is None or out.numel() == 0:
            return None
        if out.numel() == len(batch.reqs):  # decode (or one new token each): slot b is request b's
            return WriteGuard(out, scratch=SCRATCH_SLOT)
        lens = getattr(batch, "extend_lens", None)
        if lens is None or sum(lens) != out.numel():
            self.warn_once("write_guard", "kvguard: cannot map write slots to requests; writes unguarded")
            return None
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        segments = self.to_device([starts, list(lens)], torch.int64)
        return WriteGuard(out, segments[0], segments[1], scratch=SCRATCH_SLOT)

    def warm_up(self) -> None:
        """Compile every variant of the check kernel at install, so that no request pays for a compile."""
        self.tracker.warm_up(self.req_to_token_pool.req_to_token, page_div=self.page_size, per_token=True)

    def resolve(self, pending: Pending, group=None) -> list[tuple[Any, str, bool]]:
        """Read the verdict (with the sampled ids); agree across TP ranks; (req, message, stale)."""
        if pending.ready is not None:
            pending.ready.synchronize()
        if group is None and not any(pending.stale) and not bool(pending.verdict_host.any()):
            return []  # the steady state: nothing flagged, nothing to agree on
        rids = [str(req.rid) for req in pending.reqs]
        # NOTE: a request already finished (aborted on an earlier verdict, or finished since: the overlap
        # scheduler's in-flight batch still holds it) is neither counted nor aborted again: one violation
        # per flagged request. Every rank skips the same requests (finishing is agreed across ranks).
        done = [bool(req.finished() or req.__dict__.get("kvguard_aborted")) for req in pending.reqs]
        found = {err.request_id: err for err in
                 self.tracker.resolve(pending.check, pending.verdict_host, rids, ignore=done)}
        flags = [0 if d else 1 if rid in found or stale else 0 for rid, stale, d in zip(rids, pending.stale, done)]
        flags = _all_reduce_max(flags, group)
        out = []
        for req, rid, flag, stale in zip(pending.reqs, rids, flags, pending.stale):
            if not flag:
                continue
            err: KVGuardViolation | None = found.get(rid)
            if err is not None:
                message = str(err)
            elif stale:
                message = self.stale_message(req)
            else:
                message = f"{ABORT_MESSAGE} on a peer tensor-parallel rank (request {rid})"
            out.append((req, message, bool(stale)))
        return out

    def stale_aborts(self, batch, group=None) -> list[tuple[Any, str, bool]]:
        """Before a decode step is prepared: (req, message, stale here) for every request whose row SGLang
        gave to another request, here or (attention TP, ``group``) on a peer rank: all ranks drop the same
        requests. A request stale only on a peer still owns its row here and is released normally."""
        local = [s and not req.finished() for req, s in zip(batch.reqs, self.stale(batch))]
        agreed = _all_reduce_max([int(s) for s in local], group)
        return [(req, self.stale_message(req) if here else
                 f"{ABORT_MESSAGE} on a peer tensor-parallel rank (request {req.rid}, stale row)", bool(here))
                for req, here, flag in zip(batch.reqs, local, agreed) if flag]

    def stale_message(self, req) -> str:
        """The abort message of a request whose row SGLang gave to another request (counted once)."""
        from ..violations import Violation

        row = int(req.kv.req_pool_idx) if req.kv.req_pool_idx is not None else -1
        self.tracker.report(Violation(request_id=str(req.rid), row=row, logical_position=0, page=-1,
                                      expected_tag=-1, found_tag=None, reason="stale_row", bad_entries=0))
        return (f"kvguard: request {req.rid} aborted: its req_to_token row {row} was "
                f"reallocated to another request (stale row)")

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
