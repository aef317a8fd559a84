"""kvguard on hybrid linear-attention / mamba models (SGLang 0.5.23): each request's recurrent-state slot checked.

A hybrid model (NemotronH's mamba2, Qwen3-Next / Qwen3.5's GDN, ...) keeps one recurrent-state slot per request
in ``HybridReqToTokenPool.mamba_pool``, handed out by its ``MambaSlotAllocator``; the linear-attention layers read
and update the slot ``req_index_to_mamba_index_mapping[req_pool_indices]`` names (``get_mamba_indices``, read by
the hybrid backend when the forward starts). Its full-attention layers' pages are checked as for any model
(:mod:`kvguard.sglang.guard`). What this module adds:

- **Generations.** Every slot carries a generation, bumped each time the allocator hands it out
  (``MambaSlotAllocator._do_alloc``, AFTER): a slot given to a second request moves past the generation its
  first holder was given it at.
- **Records.** Where SGLang gives a request its row and slot (``HybridReqToTokenPool.alloc``, AROUND), the
  (slot, generation) of each request that got a fresh row is recorded on it (``req.kvguard_state``): a
  continuing chunk keeps its record, a retracted request is recorded again when readmitted.
- **The check.** Beside every KV check (the guard's launch, eager fire or decode graph step, on the row indices
  the forward reads), one launch (:class:`kvguard.kernels.state_check.StateCheck`) compares each request's table
  entry with its own slot and the slot's generation with its own; a bad entry is pointed at SGLang's dummy slot 0
  in the same launch, so the coming forward never reads or writes another request's state. Its verdict is
  copied to the host and read with the KV check's (the guard's ``resolve``): a flagged request is aborted (or
  discarded at prefill) through the guard, alone.
- **Safe release.** An aborted or retracted request whose slot was handed to another request since does not free it
  (``HybridReqToTokenPool.free_mamba_cache``, AROUND): the slot stays with its new holder and the pool balances.
- **Attention TP.** Each rank checks its own table and slots; every rank must abort the same requests (ranks that ran
  different batches would hang). A check whose KV verdict the ranks agree on the device is launched right before
  that agreement (the guard's ``fold``), and its flags are MAXed into each request's first cell of the all-reduced
  verdict (``VerdictRing.agree``): no collective of its own, no host sync. A flagged request is aborted on every
  rank; the rank that saw it says why, the others that a peer flagged it; each releases it safely (above).

- **Decode graphs.** Where the decode KV check is captured into SGLang's decode CUDA graphs, this check is captured
  beside it (:class:`kvguard.kernels.state_check.GraphStateCheck`, made before the capture): a replay reads the
  expectations from buffers written when the batch's composition changes, and its flags set the same epoch result
  word the KV check's do, so a clean step is read before any wait with no per-step host work of this module.

NOTE (cost): eager (extends, eager decodes, spec steps): one extra launch per forward (a few hundred bytes read), one
async copy of B int32 to pinned memory and one event (attention TP: two small launches more, folding it into the
agreed verdict); the per-composition expectation tensors are built once (a stack of B device scalars) when the
batch's requests change. Measured on an H100 (``python bench/state_check_gpu.py``,
bench/results/state_check_h100.json): 22 us of host time per direct launch at any batch size 1..512 (a torch
``add_`` there: 11). Eager beside a captured decode check it took ~100-120 us of host time per decode step on a
served GDN model (``hook:execute``, bench/results/sglang_gpu_dec06f/call1_mamba): hence the captured check.

With the radix cache on (``no_buffer``), the tree's own state slots and each copy out of them are followed by
:mod:`kvguard.sglang.mamba_radix` (``follower.tree``; its flags are folded into this check's); a speculative step's
check and its commit by :mod:`kvguard.sglang.mamba_spec`. Not followed, and refused by the registry (kvguard.sglang.paths): the extra-buffer
tracking slots and the int8 checkpoint pool, ReplaySSM's state rings, virtual slot ids (the unified memory pool).

Only functions of this module import SGLang, and only when they run.
"""
from __future__ import annotations

import logging

import torch

from ..kernels.state_check import GraphStateCheck, StateCheck
from .mamba_radix import TreeStates

log = logging.getLogger("kvguard.sglang")

_SRT = "sglang.srt"
SCRATCH_STATE = 0  # MambaSlotAllocator never hands out slot 0: SGLang's dummy write target for padded entries
RING = 8  # checks in flight at most (as the guard's verdict ring)
REFUSED_POOL = "hybrid_linear_state_pool"  # kvguard.sglang.paths: a state pool variant this module does not follow
REFUSED_TREE = "hybrid_linear_radix_cache"  # kvguard.sglang.paths: state slots kept where this module does not follow


# ------------------------------------------------------------------------------------------------
# What is followed (the install-time decision; kvguard.sglang.model_facts.pool_refusal asks it)
# ------------------------------------------------------------------------------------------------
def pool_refusal(req_to_token_pool, build_result=None, tree_cache=None) -> str | None:
    """None when this module follows the pools' recurrent state; else the registry path that refuses them: a row
    pool other than SGLang's plain ``HybridReqToTokenPool``, or state slots kept where kvguard does not follow them
    (a live prefix tree other than :func:`kvguard.sglang.mamba_radix.follows`'s, extra-buffer tracking slots, the
    int8 checkpoint pool, virtual slot ids)."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from .mamba_radix import follows

    pool = req_to_token_pool
    if type(pool) is not HybridReqToTokenPool:  # PD decode's, the unified pool's (virtual ids), or none at all
        return REFUSED_POOL
    trees = (getattr(build_result, "tree_cache", None), tree_cache)
    live = [tree for tree in trees if tree is not None and not getattr(tree, "disable", False)]
    if not all(follows(tree) for tree in live) or pool.enable_mamba_extra_buffer \
            or pool.mamba_ckpt_pool is not None or pool.mamba_v2p_table is not None:
        return REFUSED_TREE
    return None


def follow(guard) -> "StateFollower":
    """The follower of ``guard``'s hybrid row pool (made once)."""
    pool = guard.req_to_token_pool
    follower = pool.__dict__.get("_kvguard_mamba")
    if follower is None:
        follower = StateFollower(guard)
    return follower


class StateFollower:
    """Slot generations, each request's (slot, generation), and the per-forward check of one hybrid pool set."""

    def __init__(self, guard):
        pool = guard.req_to_token_pool
        self.guard, self.pool = guard, pool
        self.device = guard.device
        self.table = pool.req_index_to_mamba_index_mapping  # int32 [rows]: the slot each row's forward reads
        allocator = pool.mamba_allocator
        self.gens = torch.zeros(int(allocator.size) + 1, dtype=torch.int64, device=self.device)  # [slots]
        # NOTE: made once, on the device: a CUDA tensor built from a host scalar per call is a pageable copy that waits
        # for the stream (under the overlap scheduler, the forward in flight: 200 ms per prefill batch at c=64 on an
        # H100, GDN; bench/results/sglang_gpu_dec06e/call3_mamba_c64)
        self._none = torch.full((), -1, dtype=torch.int64, device=self.device)  # a request with no record expects it
        self.check = StateCheck(self.table, self.gens, SCRATCH_STATE)
        cap = self.table.shape[0]
        self.bad = [torch.zeros(cap, dtype=torch.int32, device=self.device) for _ in range(RING)]
        cuda = self.device.type == "cuda"
        self.host = [torch.zeros(cap, dtype=torch.int32, pin_memory=True) for _ in range(RING)] if cuda else self.bad
        self.host_np = [h.numpy() for h in self.host]  # the same host buffers, read without a torch op
        self.events = [torch.cuda.Event() for _ in range(RING)] if cuda else None
        self.turn = 0
        self.version = 0  # bumped on every record (what a composition's expectation depends on)
        # id(pending) -> (pending, ring slot, n, folded into its agreed KV verdict: True, "agreed" after a spec commit
        # agreed its own flags, kvguard.sglang.mamba_spec, then this rank's own flags fifth): launched, verdict unread
        self.open: dict[int, tuple] = {}
        self.kept = 0  # slots an aborted request did not free (handed to another request since)
        self.tree = TreeStates(self, SCRATCH_STATE)  # the radix tree's state slots (kvguard.sglang.mamba_radix)
        self.side: GraphStateCheck | None = None  # the check captured beside the decode graphs' KV check, if any
        self._wrap_guard(guard)
        allocator._kvguard_mamba = pool._kvguard_mamba = self
        guard.mamba, guard.fold = self, self.fold
        log.info("kvguard: following %d recurrent-state slots (%s)", int(allocator.size),
                 type(pool.mamba_pool).__name__)

    # -- recording -----------------------------------------------------------------------------
    def bump(self, slots: torch.Tensor) -> None:
        """The allocator handed ``slots`` out: their generations move (device, no sync)."""
        if slots.numel():
            self.gens.index_add_(0, slots.reshape(-1).to(self.device, torch.int64),
                                 torch.ones(slots.numel(), dtype=torch.int64, device=self.device))

    def record(self, reqs: list) -> None:
        """Each request's own (slot, generation), as SGLang gave it the slot (device scalars, no sync)."""
        if not reqs:
            return
        slots = torch.stack([req.kv.mamba_pool_idx.reshape(()) for req in reqs]).to(torch.int64)  # [n]
        gens = self.gens[slots]  # [n]
        for i, req in enumerate(reqs):
            req.kvguard_state = (slots[i], gens[i])
        self.version += 1

    def owns_slot(self, req) -> bool:
        """``req`` still holds the slot it was given (not handed to another request since). Reads the device."""
        rec, slot = req.__dict__.get("kvguard_state"), req.kv.mamba_pool_idx
        return rec is not None and slot is not None and int(rec[0]) == int(slot) \
            and int(self.gens[rec[0]]) == int(rec[1])

    def expected(self, reqs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's expected slots and generations ([B] each, on the device), once per composition. A request
        with no record expects slot -1 (off the pool): flagged, never run on a slot kvguard did not give it."""
        cached = self.__dict__.get("_expected")
        if cached is not None and cached[0] is reqs and cached[1] == len(reqs) and cached[2] == self.version:
            return cached[3], cached[4]
        none = (self._none, self._none)
        recs = [req.__dict__.get("kvguard_state") or none for req in reqs]
        slots = torch.stack([r[0] for r in recs])
        gens = torch.stack([r[1] for r in recs])
        self._expected = (reqs, len(reqs), self.version, slots, gens)
        return slots, gens

    # -- the check -----------------------------------------------------------------------------
    def launch(self, pending, rows: torch.Tensor, folded: bool = False) -> None:
        """Right beside ``pending``'s KV check, before the forward: check the state slots it reads at ``rows``
        (``folded``: its flags go into the agreed KV verdict, :meth:`fold`)."""
        if pending is None or id(pending) in self.open:
            return
        n = len(pending.reqs)
        slots, gens = self.expected(pending.reqs)
        self.turn = (self.turn + 1) % RING
        k = self.turn
        self.check(rows[:n], slots, gens, self.bad[k])
        self.tree.fold(pending.reqs, self.bad[k][:n])  # a copy out of the radix tree whose source failed
        self.publish(k, n)
        if len(self.open) >= RING:  # a check whose batch never reached its result (dropped): forgotten
            self.open.pop(next(iter(self.open)))
        self.open[id(pending)] = (pending, k, n, folded)

    def publish(self, k: int, n: int) -> None:
        """Ring slot ``k``'s flags (its first ``n``) copied to the host behind an event the verdict waits on (CUDA;
        on a CPU the flags are the host's already)."""
        if self.events is not None:
            self.host[k][:n].copy_(self.bad[k][:n], non_blocking=True)
            ring = self.guard._ring
            if ring is not None:
                ring.record_event(self.events[k])  # (the raw-stream record: no current_stream() lookup)
            else:
                self.events[k].record()

    def fold(self, pending, rows: torch.Tensor) -> torch.Tensor:
        """Attention TP (the guard's ``fold``, right before ``pending``'s KV verdict is agreed): its state check
        launched now, at ``rows``; its flags (int32 [n], device), which the agreement folds in."""
        self.launch(pending, rows, folded=True)
        _, k, n, _ = self.open[id(pending)]
        return self.bad[k][:n]

    def flagged(self, pending) -> list[tuple]:
        """(req, message, False) for each request of ``pending`` whose state slot is not its own; [] when none."""
        entry = self.open.pop(id(pending), None)
        if entry is None or entry[0] is not pending:
            if self.side is None or pending.epoch is None or self.guard.graph.clean(pending.epoch):
                return []
            # a replay's captured check (rare path: its epoch's word says something was bad; the forward is done)
            bad = self.side.flags(pending.epoch, len(pending.reqs)).cpu().numpy()
        else:
            k, n = entry[1], entry[2]
            if self.events is not None:
                self.events[k].synchronize()  # recorded right after the check: long done when the ids are in
            bad = self.host_np[k][:n]
        if not bad.any():
            return []
        # (a spec commit agreed under attention TP, kvguard.sglang.mamba_spec: this rank's own flags, the rest a peer's)
        own = entry[4].tolist() if entry is not None and len(entry) > 4 else None
        return [(req, self.message(req, i, pending) if own is None or own[i] else self._peer(req), False)
                for i, req in enumerate(pending.reqs)
                if bad[i] and not req.finished() and not req.__dict__.get("kvguard_aborted")]

    def message(self, req, i: int, pending) -> str:
        """The rare path: why request ``req`` (entry ``i``) was flagged, counted once as a violation."""
        from ..violations import Violation

        row = int(pending.table_rows[i]) if pending.table_rows is not None else -1
        rec = req.__dict__.get("kvguard_state")
        tree_cause = self.tree.cause(req)
        if tree_cause is not None:
            cause = tree_cause
        elif rec is None:
            cause = "was given by a path kvguard does not follow"
        elif int(self.gens[rec[0]]) != int(rec[1]):
            cause = f"{int(rec[0])} was handed to another request since (generation {int(rec[1])} -> " \
                    f"{int(self.gens[rec[0]])})"
        else:
            cause = f"{int(rec[0])} was not the slot its row's state index named (another request's, or none)"
        self.guard.tracker.report(Violation(request_id=str(req.rid), row=row, logical_position=0, page=-1,
                                            expected_tag=int(rec[1]) if rec is not None else -1, found_tag=None,
                                            reason="state_slot", bad_entries=1))
        return f"kvguard: request {req.rid} aborted: its recurrent-state slot {cause}"

    # -- riding on the guard's check -------------------------------------------------------------
    def _wrap_guard(self, guard) -> None:
        """The state check launched wherever the guard launches its KV check, its verdict read with the guard's."""
        launch, fire, graph_step, resolve = guard.launch, guard.fire, guard.graph_step, guard.resolve
        enable_graph = guard.enable_graph

        def _enable_graph(batch_cap):
            graph = enable_graph(batch_cap)
            if graph is not None and self.side is None:  # before the capture: every graph captured carries both
                self.side = GraphStateCheck(self.table, self.gens, graph, SCRATCH_STATE)
            return graph

        def _launch(batch, *args, **kwargs):
            pending = launch(batch, *args, **kwargs)
            if pending is not None and pending.batch is None:  # launched now (an extend, an eager decode)
                self.launch(pending, batch.req_pool_indices)
            return pending

        def _fire(pending, table_rows, *args, **kwargs):
            fire(pending, table_rows, *args, **kwargs)
            self.launch(pending, table_rows)

        def _graph_step(runner, forward_batch):
            pending = graph_step(runner, forward_batch)
            if pending is None:
                return None  # (no check armed: the replay's captured checks check nothing, owner cleared)
            if self.side is not None:  # (always, where the graphs carry the KV check: made before their capture)
                self.side.expect(*self.expected(pending.reqs))  # (only when the composition or the records changed)
            if self.side is None or self.tree.unread:  # (a radix-tree copy not checked yet: its flag rides on this)
                self.launch(pending, forward_batch.req_pool_indices)
                pending.clean = None  # the verdict is read through resolve, which reads this check's too
            return pending

        def _resolve(pending, group=None, *args, **kwargs):
            flagged = resolve(pending, group, *args, **kwargs)
            entry = self.open.get(id(pending))
            if entry is not None and entry[3] is True:  # attention TP: the agreed verdict carried this check's flags
                if not flagged:  # nothing flagged on any rank, this check's flags included
                    del self.open[id(pending)]
                    return flagged
                return self._own_cause(flagged, self.flagged(pending))
            agreed = entry is not None and entry[3] == "agreed"  # (and a spec commit's: kvguard.sglang.mamba_spec)
            mine = self.flagged(pending)
            if agreed:  # the check's flags came in the agreed verdict too: this rank's own cause where it has one
                flagged = self._own_cause(flagged, mine)
            elif group is not None:  # not agreed on the device: every rank drops the same requests
                mine = self._agree(pending, mine, group)
            if not mine:
                return flagged
            have = {id(item[0]) for item in flagged}
            return flagged + [item for item in mine if id(item[0]) not in have]

        guard.launch, guard.fire, guard.graph_step, guard.resolve = _launch, _fire, _graph_step, _resolve
        guard.enable_graph = _enable_graph

    @staticmethod
    def _own_cause(flagged: list, mine: list) -> list:
        """The agreed ``flagged`` (req, message, stale), with this rank's own message for a request whose state check
        failed here (a stale row keeps its item: its release must not touch the row)."""
        here = {id(item[0]): item for item in mine}
        return [item if item[2] else here.get(id(item[0]), item) for item in flagged]

    @staticmethod
    def _agree(pending, mine: list, group) -> list:
        """The requests flagged on any rank (one CPU all-reduce): (req, message, False)."""
        from .aborts import _all_reduce_max

        here = {id(item[0]): item for item in mine}
        agreed = _all_reduce_max([int(id(req) in here) for req in pending.reqs], group)
        return [here.get(id(req)) or (req, StateFollower._peer(req), False) for req, flag in zip(pending.reqs, agreed)
                if flag]

    @staticmethod
    def _peer(req) -> str:
        """Why a request flagged on another attention-TP rank only is aborted here."""
        from .aborts import ABORT_MESSAGE

        return f"{ABORT_MESSAGE} on a peer tensor-parallel rank (request {req.rid}, recurrent-state slot)"


# ------------------------------------------------------------------------------------------------
# Hook bodies (named in HOOKS)
# ------------------------------------------------------------------------------------------------
def after_slot_alloc(result, allocator, *args, **kwargs):
    follower = allocator.__dict__.get("_kvguard_mamba")
    if follower is not None and result is not None:
        follower.bump(result)
    return None


def around_rows_alloc(original, pool, reqs, *args, **kwargs):
    follower = pool.__dict__.get("_kvguard_mamba")
    if follower is None:
        return original(pool, reqs, *args, **kwargs)
    fresh = [req.kv.req_pool_idx is None for req in reqs]  # a continuing chunk keeps its row, slot and record
    rows = original(pool, reqs, *args, **kwargs)
    if rows is not None:
        follower.record([req for req, new in zip(reqs, fresh) if new])
    return rows


def around_free_mamba_cache(original, pool, req, *args, **kwargs):
    # NOTE: SGLang frees the slot the request names (req.kv.mamba_pool_idx). A request kvguard aborted, or one SGLang
    # releases between steps (retraction, pause, preemption: kvguard.sglang.release), whose slot was handed to another
    # request since must not free it: the slot is the new holder's. (One device read, on those releases only.)
    follower = pool.__dict__.get("_kvguard_mamba")
    if follower is None or not (req.__dict__.get("kvguard_aborted") or follower.guard.retracting) \
            or follower.owns_slot(req):
        return original(pool, req, *args, **kwargs)
    follower.kept += 1
    log.error("kvguard: request %s released without freeing state slot %s (held by another request now)",
              req.rid, int(req.kv.mamba_pool_idx))
    req.kv.mamba_pool_idx = None
    return None


# name -> (SGLang target, hook, HookRegistry type); composed into kvguard.sglang.plugin's TARGETS and hooks()
HOOKS = {
    "mamba_slot_alloc": (f"{_SRT}.mem_cache.allocator.mamba.MambaSlotAllocator._do_alloc", after_slot_alloc, "AFTER"),
    "mamba_rows_alloc": (f"{_SRT}.mem_cache.memory_pool.HybridReqToTokenPool.alloc", around_rows_alloc, "AROUND"),
    "mamba_free": (f"{_SRT}.mem_cache.memory_pool.HybridReqToTokenPool.free_mamba_cache", around_free_mamba_cache,
                   "AROUND"),
}
