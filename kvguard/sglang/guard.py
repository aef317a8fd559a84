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

import numpy as np
import torch

from ..kernels.graph_check import GraphCheck
from ..kernels.launch import cuda_index
from ..kernels.tag_check import BoundCheck, WriteGuard, apply_guard, n_chunks_for
from ..tracker import Check
from ..violations import KVGuardViolation
from .follow import PoolFollower

log = logging.getLogger("kvguard.sglang")

ABORT_MESSAGE = "kvguard: KV page mapping broken"
SCRATCH_SLOT = 0  # slot 0 (page 0) is SGLang's padding slot: never allocated, CUDA-graph padding writes it
PADDING_ROW = 0  # req_to_token row 0 is SGLang's padding row: never given to a request (free rows start at 1)
VERDICT_RING = 8  # checks in flight at most (see VerdictRing)
STAMP_LIMIT = 2**30  # flag stamps run 1..STAMP_LIMIT (an i32 kernel argument: one compiled variant)


@dataclass(slots=True)
class Pending:
    """A launched check, carried on the ScheduleBatch until its result is processed."""

    guard: "SGLangGuard"
    check: Check | None  # None for a bound launch until a flagged step needs it (SGLangGuard.check_of)
    reqs: list  # the Req objects, in batch order at check time (never changed: a composition's checks share one)
    slot: int  # the verdict ring slot: its host flag cell and its device verdict buffer
    stamp: int  # what the check writes into its flag cell when anything is bad
    stale: list  # per request: its row now belongs to a newer owner (host-side generation check)
    agreed: torch.Tensor | None = None  # attention TP: the ranks' verdicts, MAX-reduced on the device, on the host
    cells: int | None = None  # a bound launch: verdict cells written into the ring slot's buffer
    rows: torch.Tensor | None = None  # the owner rows checked (device)
    table_rows: torch.Tensor | None = None  # the batch's row indices the table was read at
    ready: Any = None  # a CUDA event recorded after the launch (schedulers without copy_done), or None
    batch: Any = None  # armed and not launched yet: the ScheduleBatch (SGLangGuard.fire / graph_step launch it)
    epoch: int | None = None  # launched inside a decode graph replay: its epoch (kvguard.kernels.graph_check)
    any_stale: bool = False  # any(stale)
    # A captured check with nothing stale: (its result words, the index and the word that say it ran clean), as
    # GraphCheck.clean_cell gives them, compared by the verdict's hook without a call
    clean: tuple | None = None
    group: Any = None  # attention TP: the VerdictAgreement the launch all-reduces the verdict with (None: one rank)


class SGLangGuard(PoolFollower):
    """The batched check over one SGLang scheduler's pools, and the abort of exactly the flagged requests."""

    _ring: "VerdictRing | None" = None  # the per-step check's buffers, made at warm-up (or the first launch)
    graph: GraphCheck | None = None  # the check captured into SGLang's decode graphs (enable_graph), if any
    graph_runners: dict = {}  # (the instance's own dict from enable_graph on; never written here)
    armed: Pending | None = None  # the decode check prepared for the coming forward, not launched yet
    model_config: Any = None  # SGLang's model config, once a decode step found it decoder-only (kvguard.sglang.plugin)
    # Decode checks wait for the forward that runs them (set once every decode forward of this scheduler goes
    # through a runner kvguard hooks: kvguard.sglang.plugin); otherwise launched as the batch is prepared.
    defer: bool = False
    swa: Any = None  # a sliding-window hybrid's SWA namespace (kvguard.sglang.swa.SWASide): checked after each launch

    def __init__(self, *args, **kwargs):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        super().__init__(*args, **kwargs)
        # SGLang's decode mode, compared with ``==`` as ForwardMode.is_decode() compares it: the per-step tests
        # read it here, without is_decode()'s method call and module lookup (microseconds each on a cold cache).
        self.decode_mode = ForwardMode.DECODE

    def launch(self, batch, agreement=None, out=None, ahead: int = 0, flags=None) -> Pending | None:
        """Right before the forward: one batched validation of every token entry the batch maps.

        Every token ``t < seq_len`` of each request (the slot this step writes included: SGLang has
        written it into ``req_to_token`` already) must sit in the page the request expects at logical
        page ``t // page_size``, at in-page offset ``t % page_size``. One launch, no host sync; then the
        write slots of flagged requests are redirected to the padding slot in the same launch
        (:meth:`write_guard`).

        NOTE (the steady state, a decode step): the check is armed here and launched by the forward that runs
        the batch (kvguard.sglang.plugin): inside SGLang's decode graph replay, where it was captured (nothing
        launched from the host: :meth:`graph_step`), or eagerly right before an eager forward (:meth:`fire`: one
        direct launch, bound to the batch's rows once per batch composition, into the ring's buffers). Either
        writes "anything bad?" straight into a pinned host cell (:meth:`resolve` reads it with the sampled ids)
        and the per-request verdict into a device buffer read only when that cell says so.

        ``agreement`` (attention TP of two or more ranks: their :class:`kvguard.sglang.agree.VerdictAgreement`):
        the ranks agree on the stream, with one MAX all-reduce of the verdict (stale requests counted in), copied
        to the host beside the flag; no CPU collective per step. A decode step's check is armed and fired as on one rank
        (no graph carries it: :meth:`fire` all-reduces right after its launch, :meth:`VerdictRing.agree`).

        ``out``: the batch's write slots (default ``batch.out_cache_loc``); ``ahead``: tokens the batch's lengths
        do not count yet (1 for a decode step armed inside its prepare_for_decode, before SGLang counts the step's
        token); ``flags``: the batch's stale flags, if known (:meth:`stale_flags`).
        """
        rows_ = self.batch_rows(batch)
        out = batch.out_cache_loc if out is None else out
        if rows_.all_known and out is not None and out.numel() == len(batch.reqs):
            # The decode step (the steady state), or an extend of one token each. A decode step's check is
            # deferred: launched by the forward that runs this batch (captured in SGLang's decode graph:
            # graph_step; eager: fire_armed), or here when its forward might not tell us (and for an extend).
            pending = self._arm(batch, rows_, out, flags, agreement)
            if not (self.defer and batch.forward_mode == self.decode_mode):
                self.fire(pending, batch.req_pool_indices, _device_lengths(batch, ahead), out, ahead)
            return pending
        if rows_.all_known:  # every row followed: the batch's own lengths (attention TP's decode step)
            n_entries, max_entries, total = (_device_lengths(batch, ahead),) + _lengths(batch, ahead)
        else:
            # A row kvguard does not follow has no expectations to check its entries against: none are read (its
            # request is flagged by its stale flag, which also redirects its writes). NOTE: the check is sized by
            # the batch's own lengths all the same, so that attention-TP ranks, which may differ in what they
            # follow, launch and agree on verdicts of one size.
            n_cpu = torch.where(rows_.known, batch.seq_lens_cpu + ahead, 0)
            max_entries, total = _lengths(batch, ahead)[0], int(n_cpu.sum())
            n_entries = self.to_device(n_cpu.tolist(), n_cpu.dtype)
        if max_entries == 0:
            return None
        stale, any_stale = flags if flags is not None else self.stale_flags(batch)
        ring = self._ring or self._make_ring()
        slot, stamp = ring.next()
        guard = self.write_guard(batch, out)
        check = self.tracker.check(ring.launch, rows_.owner_dev, n_entries, max_entries=max_entries,
                                   table_rows=batch.req_pool_indices,
                                   verdict=ring.verdict(slot, len(batch.reqs), max_entries),
                                   flag=ring.flag_cells[slot], stamp=stamp, guard=guard, entries_hint=total)
        if self.swa is not None:  # the SWA window, into the same verdict (an extend's new tokens: its write segments)
            self.swa.check(batch.req_pool_indices, n_entries, check.verdict, q=None if guard is None else guard.lens,
                           guard=guard, flag=ring.flag_cells[slot], stamp=stamp)
        if guard is not None and any_stale:
            apply_guard(guard, self.to_device(stale, torch.bool))
        agreed = None if agreement is None else \
            ring.agree(slot, check.verdict.numel(), len(batch.reqs), stale if any_stale else None, agreement)
        ring.copy_flag(slot)
        # NOTE: everything above is on the stream before the forward; resolve() reads it after SGLang's own
        # wait for the forward's sampled ids (copy_done, the overlap scheduler's). A scheduler whose results
        # carry none (no overlap) gets an event per check instead (VerdictRing.use_events, set by resolve).
        ready = ring.record(slot) if ring.use_events else None
        pending = Pending(self, check, list(batch.reqs), slot, stamp, stale, agreed, None, rows_.owner_dev,
                          batch.req_pool_indices, ready, any_stale=any_stale)
        batch._kvguard = pending
        return pending

    def arm_decode(self, batch, out, flags, agreement=None) -> Pending | None:
        """A decode step, inside its ``alloc_for_decode`` (``out``: its write slots; ``flags``: its stale flags;
        ``agreement``: attention TP's, or None on one rank): armed for the forward that runs it, as
        :meth:`launch` with ``ahead=1`` arms it, without :meth:`launch`'s general cases on the steady path (one
        call per decode step)."""
        rows_ = self.batch_rows(batch)
        if rows_.all_known and self.defer and out is not None and out.numel() == rows_.n \
                and batch.forward_mode == self.decode_mode:
            return self._arm(batch, rows_, out, flags, agreement)
        return self.launch(batch, agreement, out, 1, flags)

    def _arm(self, batch, rows_, out, flags=None, agreement=None) -> Pending:
        """A decode step's check, not launched yet (:meth:`fire` or :meth:`graph_step` launch it). Requests whose
        row went to a newer owner write nothing (their check may pass): their slots are redirected now, before
        SGLang copies the slots anywhere. ``agreement`` (attention TP): :meth:`fire` all-reduces the verdict
        over it."""
        stale, any_stale = flags if flags is not None else self.stale_flags(batch)
        if any_stale:
            apply_guard(WriteGuard(out, scratch=SCRATCH_SLOT), self.to_device(stale, torch.bool))
        # (positional: Pending's fields in order, a per-step construction)
        pending = Pending(self, None, rows_.snapshot, -1, 0, stale, None, None, rows_.owner_dev,
                          batch.req_pool_indices, None, batch, None, any_stale, None, agreement)
        self.armed = batch._kvguard = pending
        return pending

    def fire(self, pending: Pending, table_rows, n_entries, out, ahead: int = 0) -> None:
        """Launch an armed decode check now, eagerly, on what the forward reads (its row indices, lengths and
        write slots): the launch bound to the batch's rows (built once per batch composition), into the ring's
        buffers, with the write guard over the step's one slot each. ``ahead``: as for :meth:`launch`."""
        batch, pending.batch = pending.batch, None
        if self.armed is pending:
            self.armed = None
        max_entries, total = _lengths(batch, ahead)
        ring = self._ring or self._make_ring()
        slot, stamp = ring.next()
        bound = self._bound(batch, self.batch_rows(batch), ring, out)
        with self.tracker.lock:
            pending.cells = bound(slot, table_rows, n_entries, out, max_entries, stamp)
            if self.swa is not None:  # the SWA window, into the same verdict
                self.swa.check(table_rows, n_entries, ring.buffers()[slot][:pending.cells].view(len(pending.reqs), -1),
                               guard=WriteGuard(out, scratch=SCRATCH_SLOT), flag=ring.flag_cells[slot], stamp=stamp)
        self.tracker.count_check(total)
        if pending.group is not None:  # attention TP: every rank fires this step's check; all agree on it
            pending.agreed = ring.agree(slot, pending.cells, len(pending.reqs),
                                        pending.stale if pending.any_stale else None, pending.group)
        ring.copy_flag(slot)
        pending.slot, pending.stamp = slot, stamp
        pending.ready = ring.record(slot) if ring.use_events else None

    def fire_armed(self, forward_batch) -> None:
        """An eager decode forward is about to run: launch the armed check on its tensors."""
        pending = self.armed
        if pending is not None and pending.batch is not None and len(pending.reqs) == forward_batch.batch_size:
            self.fire(pending, forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.out_cache_loc)

    # -- the check inside SGLang's decode CUDA graph ------------------------------------------------

    def enable_graph(self, batch_cap: int) -> GraphCheck | None:
        """The buffers a check captured into SGLang's decode graphs reads (made before the capture), once their
        self-test passed on this device; None otherwise (decode checks are then launched eagerly). None with an SWA
        side: the captured check does not read the SWA window."""
        if self.swa is not None:
            return None
        if self.graph is None:
            graph = GraphCheck(self.req_to_token_pool.req_to_token, self.tracker.tags.tags, self.tracker.expected,
                               page_div=self.page_size, batch_cap=batch_cap, scratch_slot=SCRATCH_SLOT)
            if not graph.self_test(PADDING_ROW):
                log.warning("kvguard: the graph check's self-test failed on %s (its result cells in pinned host "
                            "memory); decode checks are launched before each decode forward instead", self.device)
                return None
            self.graph = graph
            self.graph_runners = {}  # graph runner -> every shape it captured carries the check
        return self.graph

    def capture_head(self, runner, forward_batch) -> None:
        """SGLang's capture head hook (``ModelRunner.capture_head_hooks``): first inside every decode graph
        capture, so every replay runs the check on the graph's own static buffers before the forward."""
        g = self.graph
        bs = forward_batch.batch_size
        ok = g is not None and forward_batch.forward_mode == self.decode_mode and bs <= g.batch_cap \
            and forward_batch.out_cache_loc is not None and forward_batch.out_cache_loc.numel() == bs
        if ok:
            g.launch(forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.out_cache_loc, bs)
            g.recaptured = True  # counted again before the next replay (GraphCheck.reset or resync)
        self.graph_runners[runner] = ok and self.graph_runners.get(runner, True)

    def graph_step(self, runner, forward_batch) -> Pending | None:
        """A decode graph is about to replay: its captured check takes the next epoch, for the armed check of this
        batch (its rows put in the graph's owner buffer when the batch's composition changed). A runner whose
        graphs were captured without the check gets the armed check launched eagerly."""
        pending = self.armed
        if not self.graph_runners.get(runner, False):
            if pending is not None:
                self.fire_armed(forward_batch)
            return None
        g = self.graph
        if g.recaptured:  # SGLang captured graphs while serving (a PD role switch, an elastic recapture)
            g.resync()
        epoch = g.next()
        if pending is None or pending.batch is None or len(pending.reqs) != forward_batch.batch_size:
            # No check armed for this replay: its captured check checks nothing (an armed check that was never
            # launched is refused at its verdict).
            g.clear_owner()
            return None
        if g.owner_of is not pending.rows:
            g.set_owner(pending.rows)
        self.armed = pending.batch = None
        pending.epoch = epoch
        if not pending.any_stale:
            pending.clean = g.clean_cell(epoch)
        self.tracker.count_check()
        return pending

    def _bound(self, batch, rows_, ring, out):
        """The check bound to this batch composition's rows (``kvguard.kernels.tag_check.BoundCheck``), cached
        on the batch while its composition and the ring's buffers stay the same."""
        cached = batch.__dict__.get("_kvguard_bound")
        if cached is not None and cached[0] is rows_ and cached[1] is ring.generation:
            return cached[2]
        ring.reserve(len(batch.reqs), self.req_to_token_pool.req_to_token.shape[1])
        ring.bindings += 1
        bound = BoundCheck(ring.launch, batch.req_pool_indices, rows_.owner_dev, ring.buffers(), ring.flag_cells,
                           scratch_slot=SCRATCH_SLOT, n_dtype=batch.seq_lens.dtype, slot_dtype=out.dtype)
        batch._kvguard_bound = (rows_, ring.generation, bound)
        return bound

    def check_of(self, pending: Pending) -> Check:
        """The launched check of ``pending`` as a :class:`kvguard.tracker.Check` (made here for a bound launch:
        only a flagged step needs it)."""
        if pending.check is None:
            verdict = self.graph.verdict(pending.epoch, len(pending.reqs)) if pending.epoch is not None else \
                self._ring.buffers()[pending.slot][:pending.cells].view(len(pending.reqs), -1)
            pending.check = Check(verdict, pending.rows, self.req_to_token_pool.req_to_token, pending.table_rows,
                                  1, self.page_size, True)
        return pending.check

    def _make_ring(self) -> "VerdictRing":
        self._ring = VerdictRing(self.tracker.launcher(self.req_to_token_pool.req_to_token, page_div=self.page_size,
                                                       per_token=True), self.device)
        return self._ring

    def write_guard(self, batch, out=None) -> WriteGuard | None:
        """This step's KV write slots, which the check rewrites to the padding slot for flagged requests.

        SGLang writes a decode token at ``out_cache_loc`` = ``last_loc + 1`` read from ``req_to_token``,
        and extend tokens at the slots alloc_for_extend chose; a broken entry would land this step's K/V
        in another live request's page before the verdict is read. The check runs before the forward on
        the same stream and, in the same launch, points a flagged request's writes at the slot SGLang
        itself uses for padding (device, no sync). ``out``: the write slots (default ``batch.out_cache_loc``).
        """
        out = batch.out_cache_loc if out is None else out
        if out is None or out.numel() == 0:
            return None
        if out.numel() == len(batch.reqs):  # decode (or one new token each): slot b is request b's
            return WriteGuard(out, scratch=SCRATCH_SLOT)
        lens = getattr(batch, "extend_lens", None)
        if lens is None or sum(lens) != out.numel():
            # Fail closed: a batch whose writes kvguard cannot guard is never run (no unguarded third state).
            message = (f"kvguard: an extend batch writes {out.numel()} slots for {len(batch.reqs)} requests with "
                       f"{'no' if lens is None else sum(lens)} new tokens; its writes cannot be mapped to its "
                       f"requests, and kvguard does not run a batch it cannot guard")
            log.critical(message)
            raise RuntimeError(message)
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        segments = self.to_device([starts, list(lens)], torch.int64)
        return WriteGuard(out, segments[0], segments[1], scratch=SCRATCH_SLOT)

    def warm_up(self) -> None:
        """Compile every variant of the check kernel at install, so that no request pays for a compile; then
        prove the per-step path on this device (:meth:`VerdictRing.self_test`): a launch that must flag does."""
        ring = self._ring or self._make_ring()
        self.tracker.warm_up(self.req_to_token_pool.req_to_token, page_div=self.page_size, per_token=True,
                             launch=ring.launch)
        ring.self_test(self.tracker, PADDING_ROW)

    def resolve(self, pending: Pending, group=None, done=None, result=None) -> list[tuple[Any, str, bool]]:
        """Read the verdict (with the sampled ids); agree across TP ranks; (req, message, stale).

        ``done``, ``result``: SGLang's wait for this batch's forward (its result's ``copy_done``) and the result
        (:meth:`wait_forward`). The ranks' agreement is the
        verdict all-reduced at launch (``pending.agreed``), or else, with a CPU ``group``, one small
        all-reduce here.
        """
        # NOTE (the steady state of a captured check on one rank): its result word is read before any wait. The check
        # is the first node of the forward's graph, so its result is in long before the sampled ids are; clean, the
        # step goes on to SGLang's own wait for them, and kvguard waits for nothing (after a wait the host's caches
        # are cold). Not in yet, or anything else: the wait, then the full read below.
        if pending.epoch is not None and not pending.any_stale and group is None and pending.agreed is None \
                and self.graph.clean(pending.epoch):
            return []
        # (attention TP's: every rank's verdict, all-reduced and marked, is in and clean)
        if pending.agreed is not None and not pending.any_stale \
                and self._ring.agreed_clean(pending.slot, pending.agreed.numel()):
            return []
        self.wait_forward(pending, done, result)
        if pending.epoch is not None:
            flagged = self.graph.flagged(pending.epoch)  # raises if this epoch's result is not in its slot
        elif pending.slot < 0:
            message = (f"kvguard: a decode batch of {len(pending.reqs)} requests ran without its check (no forward "
                       f"kvguard hooks launched it); kvguard does not serve a step it did not check")
            log.critical(message)
            raise RuntimeError(message)
        else:
            flagged = self._ring.flagged(pending.slot, pending.stamp)
        if not flagged and not pending.any_stale and (pending.agreed is None and group is None or
                                                       pending.agreed is not None and not pending.agreed.any()):
            return []  # the steady state: nothing flagged here or on any rank
        agreed = None if pending.agreed is None else (pending.agreed.reshape(len(pending.reqs), -1) > 0).any(1)
        check = self.check_of(pending)
        verdict_host = check.verdict.cpu() if flagged else None  # rare: which requests
        rids = [str(req.rid) for req in pending.reqs]
        # NOTE: a request already finished is never aborted again (every rank skips the same requests: finishing
        # is agreed across ranks), and one kvguard aborted on an earlier verdict is not counted again: one
        # violation per flagged request. One that finished since this check was launched (the overlap scheduler's
        # in-flight batch still holds it) is counted, and what it published to the radix tree, a step after its
        # last clean check, is poisoned (kvguard.sglang.radix).
        aborted = [bool(req.__dict__.get("kvguard_aborted")) for req in pending.reqs]
        found = {err.request_id: err for err in
                 self.tracker.resolve(check, verdict_host, rids, ignore=aborted)}
        finished = [a or bool(req.finished()) for a, req in zip(aborted, pending.reqs)]
        late = [req for req, rid, a, d in zip(pending.reqs, rids, aborted, finished) if d and not a and rid in found]
        if late:
            self.radix.late_flags(late)
        flags = [0 if d else 1 if rid in found or stale else 0 for rid, stale, d in zip(rids, pending.stale, finished)]
        if agreed is not None:
            flags = [0 if d else int(f or a) for f, a, d in zip(flags, agreed.tolist(), finished)]
        else:
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

    def wait_forward(self, pending: Pending, done=None, result=None) -> None:
        """Wait until the check of ``pending`` ran, with the wait SGLang makes next anyway for the forward's
        sampled ids:

        - ``done``: the result's ``copy_done`` (the overlap scheduler's copy of the sampled ids);
        - else the result's sampled ids still on the device (no overlap): copied to the host here, which waits
          for the stream the forward, and the check before it, ran on. SGLang's result processing takes the
          host tensor as it would have the device one (its ``tolist()``), so the copy and the wait are SGLang's
          own, made a moment earlier, and kvguard records no event;
        - else the event recorded after the check; the first time there is none, the stream, and events from
          then on.
        """
        if not self.on_cuda:
            return
        if done is not None:
            done.synchronize()
            return
        ids = getattr(result, "next_token_ids", None)
        if isinstance(ids, torch.Tensor) and ids.is_cuda:
            result.next_token_ids = ids.cpu()
        elif pending.ready is not None:
            pending.ready.synchronize()
        else:
            (self._ring or self._make_ring()).use_events = True
            torch.cuda.current_stream(self.device).synchronize()

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


def _device_lengths(batch, ahead: int = 0) -> torch.Tensor:
    """The batch's lengths on the device, with ``ahead`` more tokens per request than they count yet."""
    return batch.seq_lens + ahead if ahead else batch.seq_lens


def _lengths(batch, ahead: int = 0) -> tuple[int, int]:
    """The batch's longest row and its total entries, from its host lengths (no torch op: a per-step cost), with
    ``ahead`` more tokens per request than the lengths count yet."""
    lens = batch.seq_lens_cpu.numpy()
    return (int(np.maximum.reduce(lens)) + ahead, int(np.add.reduce(lens)) + ahead * lens.size) if lens.size \
        else (0, 0)


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


class VerdictRing:
    """The per-step check's buffers, reused round robin: no allocation, no new event per step.

    Slot ``i`` has a flag cell in pinned host memory (the check writes its stamp there when anything is
    bad), a device verdict buffer (grown when a batch needs more cells) and a CUDA event. NOTE: at most two
    checks are in flight (the overlap scheduler's batch N, resolved after N+1 was launched, plus a
    prefill's); a ring of VERDICT_RING slots is never reused before its verdict was read.
    """

    def __init__(self, launch, device: torch.device):
        self.launch, self.device = launch, device
        cuda = device.type == "cuda"
        self.host_flags = torch.zeros(VERDICT_RING, dtype=torch.int64, pin_memory=cuda)
        self.host_cells = [self.host_flags[i:i + 1] for i in range(VERDICT_RING)]
        self._host_np = memoryview(self.host_flags.numpy())  # reads Python ints (no numpy scalar per step)
        self.device_flags = None  # set by self_test when the device cannot write pinned memory directly
        self.flag_cells = self.host_cells
        self._verdicts = [torch.empty(0, dtype=torch.int32, device=device) for _ in range(VERDICT_RING)]
        self.generation = object()  # replaced whenever a buffer or flag cell is (bound launches hold pointers)
        self.events = [torch.cuda.Event() for _ in range(VERDICT_RING)] if cuda else None
        self._streams: dict[int, torch.cuda.Stream] = {}  # raw handle -> stream object (see record)
        self._index = cuda_index(device) if cuda else None
        self.use_events = False  # set by SGLangGuard.resolve when a result carries no copy_done to wait on
        self._agreed = [torch.empty(0, dtype=torch.int32, pin_memory=cuda) for _ in range(VERDICT_RING)]
        self._agree_dev = [torch.empty(0, dtype=torch.int32, device=device) for _ in range(VERDICT_RING)]
        self._agreed_np = [a.numpy() for a in self._agreed]  # the same host buffers, read without a torch op
        self._one = torch.ones(1, dtype=torch.int32, device=device)  # copied after an agreed verdict (agree)
        self.turn, self.stamp = 0, 0
        self.bindings = 0  # bound launches built (once per batch composition; a benchmark reads it)

    def next(self) -> tuple[int, int]:
        """The next check's (slot, stamp): slots round robin, stamps 1..STAMP_LIMIT."""
        self.turn = (self.turn + 1) % VERDICT_RING
        self.stamp = self.stamp % STAMP_LIMIT + 1
        return self.turn, self.stamp

    def agreed_host(self, slot: int, need: int) -> torch.Tensor:
        """Attention TP: the host buffer (pinned) the agreed verdict of ``slot`` is copied into."""
        buf = self._agreed[slot]
        if buf.numel() < need:
            buf = self._agreed[slot] = torch.zeros(1 << (need - 1).bit_length(), dtype=torch.int32,
                                                   pin_memory=self.device.type == "cuda")
            self._agreed_np[slot] = buf.numpy()
        return buf[:need]

    def agree(self, slot: int, cells: int, n: int, stale: list | None, group) -> torch.Tensor:
        """Attention TP: the first ``cells`` of slot's verdict (``n`` requests' rows; ``stale``: per request, its row
        went to a newer owner here, or None when none did) MAX all-reduced across the ranks on the stream (``group``:
        the ranks' :class:`kvguard.sglang.agree.VerdictAgreement`) into a buffer of the slot's own, and copied to the
        slot's pinned host buffer (returned: its first ``cells``); then a one into the host cell after them, which
        the host cleared first, copied last: once the host sees it, the cells before it are in
        (:meth:`agreed_clean` reads them before any wait). One collective and two copies per step, no host sync, no
        allocation in the steady state."""
        dev = self._agree_dev[slot]
        if dev.numel() < cells:
            dev = self._agree_dev[slot] = torch.empty(1 << (cells - 1).bit_length(), dtype=torch.int32,
                                                      device=self.device)
        verdict = self._verdicts[slot][:cells]
        if stale is None:
            mine = group.max_(verdict, dev[:cells])
        else:  # rare: a stale row here counts as a verdict every rank sees
            mine = dev[:cells]
            mine.copy_(verdict)
            mine.view(n, -1)[:, 0] += torch.tensor(stale, dtype=torch.int32).to(self.device, non_blocking=True)
            group.max_(mine)
        host = self.agreed_host(slot, cells + 1)
        self._agreed_np[slot][cells] = 0  # (before the copies are enqueued: the second one writes the one)
        agreed = host[:cells]
        agreed.copy_(mine, non_blocking=True)
        host[cells:].copy_(self._one, non_blocking=True)  # after the cells, on the same stream
        return agreed

    def agreed_clean(self, slot: int, cells: int) -> bool:
        """Attention TP: slot's agreed verdict is in (the one after it) and no rank flagged anything in it. Read
        before any wait: False when not in yet (the caller then waits and reads it in full)."""
        view = self._agreed_np[slot]
        return view[cells] == 1 and not view[:cells].any()

    def verdict(self, slot: int, batch: int, max_entries: int) -> torch.Tensor:
        need = batch * n_chunks_for(max_entries)
        buf = self._verdicts[slot]
        if buf.numel() < need:  # rare: a bigger batch or longer rows than before (grown in powers of two)
            buf = self._verdicts[slot] = torch.empty(1 << (need - 1).bit_length(), dtype=torch.int32,
                                                     device=self.device)
            self.generation = object()
        return buf

    def reserve(self, batch: int, width: int) -> None:
        """Every slot's buffer holds a check of ``batch`` requests of up to ``width`` entries (a bound launch's
        whole life: no buffer moves under it)."""
        for slot in range(VERDICT_RING):
            self.verdict(slot, batch, width)

    def buffers(self) -> list:
        return self._verdicts

    def copy_flag(self, slot: int) -> None:
        """The fallback (a device that cannot write pinned memory): slot's device flag copied to its host cell."""
        if self.device_flags is not None:
            self.host_cells[slot].copy_(self.device_flags[slot:slot + 1], non_blocking=True)

    def record(self, slot: int) -> torch.cuda.Event:
        """Record slot's event on the current stream, now (after the check, before the forward)."""
        return self.record_event(self.events[slot])

    def record_event(self, event: torch.cuda.Event) -> torch.cuda.Event:
        """Record ``event`` on the current stream, now.

        NOTE: ``Event.record()`` looks the current stream up through ``torch.cuda.current_stream()``, tens of
        microseconds of Python per call on the scheduler's thread; the raw handle is one C call, and the
        stream object for it is made once."""
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        stream = self._streams.get(raw)
        if stream is None:
            if len(self._streams) > 64:  # a scheduler that makes streams as it goes: keep the map small
                self._streams.clear()
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        torch._C._CudaEventBase.record(event, stream)
        return event

    def flagged(self, slot: int, stamp: int) -> bool:
        return self._host_np[slot] == stamp

    def self_test(self, tracker, row: int) -> None:
        """At install: a check of one entry nothing was recorded for (the padding row) must flag, in the host
        cell and in the verdict, through both the first (JIT) and the direct launch; an empty one must not.
        Falls back to a device flag copied to the host if the device cannot write the pinned cell; raises
        if the verdict itself is wrong (kvguard must not serve a check it cannot trust)."""
        for fallback in (False, True):
            if fallback:
                if self.device.type != "cuda":
                    break
                log.warning("kvguard: this device does not write pinned host memory from a kernel; the "
                            "check's flag is copied to the host instead")
                self.device_flags = torch.zeros(VERDICT_RING, dtype=torch.int64, device=self.device)
                self.flag_cells = [self.device_flags[i:i + 1] for i in range(VERDICT_RING)]
                self.generation = object()
            if all(self._probe(tracker, row, n) for n in (1, 0, 1, 0, 1)):
                return
        raise RuntimeError(f"kvguard: the check's self-test failed on {self.device}: its flag cell does not "
                           f"show the verdict; refusing to serve")

    def _probe(self, tracker, row: int, n: int) -> bool:
        """One self-test launch of ``n`` unrecorded entries: True if the flag cell agrees with the verdict."""
        dev = self.device
        rows = torch.full((1,), row, dtype=torch.int64, device=dev)
        n_entries = torch.full((1,), n, dtype=torch.int64, device=dev)
        slot, stamp = self.next()
        verdict = self.verdict(slot, 1, 1)
        with tracker.lock:
            self.launch(rows, rows, n_entries, max_entries=1, verdict=verdict, flag=self.flag_cells[slot],
                        stamp=stamp)
        if self.device_flags is not None:
            self.host_cells[slot].copy_(self.device_flags[slot:slot + 1])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if (int(verdict[0]) > 0) != (n > 0):
            raise RuntimeError(f"kvguard: the check's self-test failed on {dev}: an entry with nothing recorded "
                               f"was {'not ' if n else ''}flagged; refusing to serve")
        return self.flagged(slot, stamp) == (n > 0)
