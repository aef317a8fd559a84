"""The guard kvguard installs on one SGLang 0.5.23 pool set: the batched check and safe aborts.

:class:`SGLangGuard` is a :class:`~kvguard.sglang.follow.PoolFollower` (what it follows: pages, tags,
expectations, the safe release) plus what runs every step: the check launched before each forward (here: armed,
fired eagerly or run inside SGLang's decode graph replay, with the write-slot guard), its verdict read
(:class:`~kvguard.sglang.verdicts.VerdictSide`, from the buffers of :mod:`kvguard.sglang.verdict_ring`) and the
abort of exactly the flagged requests (:class:`~kvguard.sglang.aborts.AbortSide`).

Only functions of this subpackage import SGLang, and only when they run.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..kernels.graph_check import GraphCheck
from ..kernels.tag_check import BoundCheck, WriteGuard, apply_guard
from ..tracker import Check
from .aborts import ABORT_MESSAGE, AbortSide, mark_aborted
from .follow import PoolFollower
from .verdict_ring import STAMP_LIMIT, VERDICT_RING, VerdictRing
from .verdicts import VerdictSide

log = logging.getLogger("kvguard.sglang")

SCRATCH_SLOT = 0  # slot 0 (page 0) is SGLang's padding slot: never allocated, CUDA-graph padding writes it
PADDING_ROW = 0  # req_to_token row 0 is SGLang's padding row: never given to a request (free rows start at 1)

# (the abort's and the ring's names too, as before they had modules of their own)
__all__ = ["ABORT_MESSAGE", "PADDING_ROW", "SCRATCH_SLOT", "STAMP_LIMIT", "VERDICT_RING", "Pending", "SGLangGuard",
           "VerdictRing", "mark_aborted"]


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


class SGLangGuard(VerdictSide, AbortSide, PoolFollower):
    """The batched check over one SGLang scheduler's pools, and the abort of exactly the flagged requests."""

    _ring: "VerdictRing | None" = None  # the per-step check's buffers, made at warm-up (or the first launch)
    graph: GraphCheck | None = None  # the check captured into SGLang's decode graphs (enable_graph), if any
    graph_runners: dict = {}  # (the instance's own dict from enable_graph on; never written here)
    armed: Pending | None = None  # the decode check prepared for the coming forward, not launched yet
    model_config: Any = None  # SGLang's model config, once a decode step found it decoder-only (kvguard.sglang.batches)
    # Decode checks wait for the forward that runs them (set once every decode forward of this scheduler goes
    # through a runner kvguard hooks: kvguard.sglang.graphs); otherwise launched as the batch is prepared.
    defer: bool = False
    swa: Any = None  # a sliding-window hybrid's SWA namespace (kvguard.sglang.swa.SWASide): checked after each launch
    # Attention TP: a side check launched right before a check's verdict is agreed, ``fold(pending, table_rows)`` ->
    # its per-request flags (int32 [n], device), folded into the agreement (kvguard.sglang.mamba); None: none
    fold: Any = None

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
        the batch (kvguard.sglang.graphs): inside SGLang's decode graph replay, where it was captured (nothing
        launched from the host: :meth:`graph_step`), or eagerly right before an eager forward (:meth:`fire`: one
        direct launch, bound to the batch's rows once per batch composition, into the ring's buffers). Either
        writes "anything bad?" straight into a pinned host cell (:meth:`resolve` reads it with the sampled ids)
        and the per-request verdict into a device buffer read only when that cell says so.

        ``agreement`` (attention TP of two or more ranks: their :class:`kvguard.sglang.agree.VerdictAgreement`):
        the ranks agree on the stream, with one MAX all-reduce of the verdict (stale requests and the side check's
        flags, :attr:`fold`, counted in), copied to the host beside the flag; no CPU collective per step. A decode
        step's check is armed and fired as on one rank (no graph carries it: :meth:`fire` all-reduces right after its
        launch, :meth:`VerdictRing.agree`).

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
        pending = Pending(self, check, list(batch.reqs), slot, stamp, stale, None, None, rows_.owner_dev,
                          batch.req_pool_indices, any_stale=any_stale)
        if agreement is not None:
            pending.agreed = ring.agree(slot, check.verdict.numel(), len(batch.reqs), stale if any_stale else None,
                                        agreement, self._side(pending, batch.req_pool_indices))
        ring.copy_flag(slot)
        # NOTE: everything above is on the stream before the forward; resolve() reads it after SGLang's own
        # wait for the forward's sampled ids (copy_done, the overlap scheduler's). A scheduler whose results
        # carry none (no overlap) gets an event per check instead (VerdictRing.use_events, set by resolve).
        pending.ready = ring.record(slot) if ring.use_events else None
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
        bound = self.bound(batch, self.batch_rows(batch), ring, batch.req_pool_indices, batch.seq_lens.dtype, out.dtype)
        with self.tracker.lock:
            pending.cells = bound(slot, table_rows, n_entries, out, max_entries, stamp)
            if self.swa is not None:  # the SWA window, into the same verdict
                self.swa.check(table_rows, n_entries, ring.buffers()[slot][:pending.cells].view(len(pending.reqs), -1),
                               guard=WriteGuard(out, scratch=SCRATCH_SLOT), flag=ring.flag_cells[slot], stamp=stamp)
        self.tracker.count_check(total)
        if pending.group is not None:  # attention TP: every rank fires this step's check; all agree on it
            pending.agreed = ring.agree(slot, pending.cells, len(pending.reqs),
                                        pending.stale if pending.any_stale else None, pending.group,
                                        self._side(pending, table_rows))
        ring.copy_flag(slot)
        pending.slot, pending.stamp = slot, stamp
        pending.ready = ring.record(slot) if ring.use_events else None

    def _side(self, pending: Pending, table_rows) -> torch.Tensor | None:
        """Attention TP, right before ``pending``'s verdict is agreed: the side check's flags to fold in, or None."""
        return None if self.fold is None else self.fold(pending, table_rows)

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

    def bound(self, holder, rows_, ring, table_rows, n_dtype, slot_dtype, tail: bool = False) -> BoundCheck:
        """The check bound to a batch composition's rows (``kvguard.kernels.tag_check.BoundCheck``; ``tail``: a spec
        step's row-tail write guard), built right before its launch (a binding holds the ring buffers' pointers) and
        cached on ``holder`` while the composition and the ring's buffers stay the same."""
        cached = holder.__dict__.get("_kvguard_bound")
        if cached is not None and cached[0] is rows_ and cached[1] is ring.generation:
            return cached[2]
        ring.reserve(table_rows.numel(), self.req_to_token_pool.req_to_token.shape[1])
        ring.bindings += 1
        bound = BoundCheck(ring.launch, table_rows, rows_.owner_dev, ring.buffers(), ring.flag_cells,
                           scratch_slot=SCRATCH_SLOT, n_dtype=n_dtype, slot_dtype=slot_dtype, tail=tail)
        holder._kvguard_bound = (rows_, ring.generation, bound)
        return bound

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


def _device_lengths(batch, ahead: int = 0) -> torch.Tensor:
    """The batch's lengths on the device, with ``ahead`` more tokens per request than they count yet."""
    return batch.seq_lens + ahead if ahead else batch.seq_lens


def _lengths(batch, ahead: int = 0) -> tuple[int, int]:
    """The batch's longest row and its total entries, from its host lengths (no torch op: a per-step cost), with
    ``ahead`` more tokens per request than the lengths count yet."""
    lens = batch.seq_lens_cpu
    longest, total = max_and_sum(lens)
    return (longest + ahead, total + ahead * lens.numel()) if lens.numel() else (0, 0)


SMALL = 64  # host lengths of up to this many requests are reduced as a list (see max_and_sum)


def max_and_sum(lens: torch.Tensor) -> tuple[int, int]:
    """A host length tensor's max and sum, (0, 0) when empty: a list's ``max``/``sum`` up to SMALL entries (a few
    times faster than numpy's reductions there: a per-step cost), numpy's past that."""
    if lens.numel() <= SMALL:
        values = lens.tolist()
        return (max(values), sum(values)) if values else (0, 0)
    values = lens.numpy()
    return int(np.maximum.reduce(values)), int(np.add.reduce(values))

