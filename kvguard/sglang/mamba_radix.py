"""kvguard on a hybrid model's radix tree (SGLang 0.5.23's ``UnifiedRadixCache``, mamba component, ``no_buffer``):
the recurrent-state slots the tree keeps, checked where a matching request copies one.

With the radix cache on, the tree keeps state slots of its own (``MambaComponent``, one slot per node that holds a
state), and a request that matches a node copies that slot's state into its own slot before its prefill:

- **where the tree takes a slot** (``MambaComponent.cleanup_after_caching_req``, AROUND, right after
  ``UnifiedRadixCache.checkpoint_into_tree``'s insert): ``prepare_for_caching_req`` put the slot in
  ``insert_params.mamba_value``: a finished request's own slot (it hands its state over), or a slot just allocated
  for a running request's checkpoint (a copy of its state). The insert took it unless the node already had a state
  (``insert_result.mamba_exist``), or there was no insert (``insert_result`` None): then SGLang frees it. A slot the
  tree took records its generation in :attr:`TreeStates.taken`: the generation the finished request was given it
  at (:data:`POISONED` if the request's record names another slot or none), or the fresh slot's current one.
- **where a request matches** (``MambaComponent.finalize_match_result_in_cache``, AFTER): SGLang defers the copy
  (``req.kv.mamba_cow_src_index``: the node's slot); the generation the tree recorded for that slot is read now.
- **where the copy is staged** (``ScheduleBatch._collect_deferred_mamba_cow_and_clear``, AROUND, inside
  ``prepare_for_extend``; the copy itself runs in ``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear`` on the
  forward stream, before the mamba layers): each copy source's current generation is compared, on the device, with
  what the tree recorded; a failed source is pointed at SGLang's dummy slot 0 in ``batch.mamba_cow_src_indices``
  (the copy never reads another request's state), and its request is flagged in the state check launched beside
  the extend's KV check (:meth:`TreeStates.fold`): discarded at prefill through the guard, alone.

The tree's frees go through ``MambaSlotAllocator.free``; a freed slot moves to a new generation when it is handed
out again (kvguard.sglang.mamba's AFTER hook on ``_do_alloc``). So a node whose slot was freed (or double-freed)
and handed to another request fails every later match.

NOTE (what a per-slot record cannot tell): the record is per slot, not per node. A slot freed while its node still
names it, handed to a request, and taken by the tree again at another node carries the new node's generation: a
match of the first node then passes (two nodes name one slot; the tree's structure is broken, and kvguard does not
repair it). kvguard.sglang.radix's per-page tags share this limit.

Followed only where :func:`follows` says so (the plain tree, ``no_buffer``): ``extra_buffer``'s ping-pong tracking
slots, the int8 checkpoint pool, HiCache's load-back of states and the external cache linker put states into nodes
through paths of their own, and stay refused (kvguard.sglang.mamba.pool_refusal).

Only functions of this module import SGLang, and only when they run.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("kvguard.sglang")

_SRT = "sglang.srt"
_COMPONENT = f"{_SRT}.mem_cache.unified_cache.components.mamba.MambaComponent"
UNTAKEN = -1  # a slot the tree never took: a copy from it is flagged
POISONED = -2  # a slot the tree took from a finished request that did not hold it (another's, or none)
COW = "kvguard_cow"  # on a request: (copy source slot, the generation the tree recorded for it), device [1] each
COW_FLAG = "kvguard_cow_flag"  # on a request: its copy source's check (int32 device scalar), until the launch folds it


def follows(tree) -> bool:
    """The tree is SGLang's plain ``UnifiedRadixCache`` with a mamba component on ``no_buffer`` slots, no HiCache and
    no external cache linker: the paths this module follows."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return type(tree) is UnifiedRadixCache and tree.supports_mamba() and not tree.enable_mamba_extra_buffer \
        and getattr(tree, "cache_controller", None) is None and getattr(tree, "linker", None) is None


class TreeStates:
    """The generation the radix tree took each state slot at, and the check of each copy out of the tree.

    Owned by one :class:`kvguard.sglang.mamba.StateFollower` (``follower.tree``): its slot generations and check.
    """

    def __init__(self, follower, scratch: int):
        self.follower = follower
        self.scratch = scratch  # SGLang's dummy state slot: where a failed copy's source is pointed
        self.gens = follower.gens  # int64 [slots]: each slot's current generation (bumped at every hand-out)
        self.taken = torch.full_like(self.gens, UNTAKEN)  # int64 [slots]: the generation the tree took each at
        self.unread = 0  # requests carrying a copy check the next launch has not folded yet
        self.flagged = 0  # copies whose source failed (pointed at the dummy slot)

    def took(self, slot: torch.Tensor, gen: torch.Tensor) -> None:
        """The tree took ``slot`` ([1]) at generation ``gen`` (device scalar; no sync)."""
        self.taken.index_copy_(0, slot.reshape(-1).to(self.taken.device, torch.int64), gen.reshape(1))

    def took_from(self, req, slot: torch.Tensor, finished: bool) -> None:
        """``slot`` entered a node from ``req``: its own slot when it finished, else one just allocated for it."""
        slot = slot.reshape(-1).to(self.gens.device, torch.int64)
        if not finished:
            self.took(slot, self.gens[slot])
            return
        rec = req.__dict__.get("kvguard_state")
        if rec is None:
            self.took(slot, torch.full((), POISONED, dtype=torch.int64, device=self.gens.device))  # (no host copy)
            return
        self.took(slot, torch.where(rec[0] == slot, rec[1], POISONED))

    def matched(self, req, src: torch.Tensor) -> None:
        """``req`` will copy the state of tree slot ``src``: what the tree recorded for it, read now."""
        src = src.reshape(-1)[:1].to(self.gens.device, torch.int64)
        setattr(req, COW, (src, self.taken[src]))

    def stage(self, reqs: list, batch) -> None:
        """The batch staged a copy for each of ``reqs`` (in order) in ``batch.mamba_cow_src_indices``: each source
        checked against the tree's record; a failed one is pointed at the dummy slot and its request flagged."""
        src = batch.mamba_cow_src_indices  # [m]: the node slots, in the order of reqs
        assert src is not None and src.numel() == len(reqs), (None if src is None else src.shape, len(reqs))
        here = src.to(self.gens.device, torch.int64)
        none = (here[:1], torch.full((1,), UNTAKEN, dtype=torch.int64, device=here.device))
        recs = [req.__dict__.pop(COW, None) or none for req in reqs]
        rec_src = torch.cat([r[0] for r in recs])  # [m]
        rec_gen = torch.cat([r[1] for r in recs])  # [m]
        bad = (rec_src != here) | (rec_gen < 0) | (self.gens[here] != rec_gen)  # [m]
        batch.mamba_cow_src_indices = torch.where(bad.to(src.device), torch.full_like(src, self.scratch), src)
        flags = bad.to(torch.int32)
        for i, req in enumerate(reqs):
            req.__dict__[COW_FLAG] = (flags[i], rec_src[i], rec_gen[i], here[i])
        self.unread += len(reqs)

    def fold(self, reqs: list, bad: torch.Tensor) -> None:
        """Into a state check's flags (``bad``: int32 [n], entry i for ``reqs[i]``): each request's copy check."""
        if not self.unread:
            return
        idx, flags = [], []
        for i, req in enumerate(reqs):
            entry = req.__dict__.get(COW_FLAG)
            if entry is not None:
                idx.append(i)
                flags.append(entry[0])
                req.__dict__["kvguard_cow_read"] = req.__dict__.pop(COW_FLAG)  # what the message reads
        self.unread = max(0, self.unread - len(idx))
        if idx:
            where = self.follower.guard.to_device(idx, torch.int64)  # (pinned, async: no wait for the stream)
            bad.index_copy_(0, where, torch.maximum(bad[where], torch.stack(flags).to(bad.device)))

    def cause(self, req) -> str | None:
        """Why ``req``'s copy out of the tree failed, or None (the rare path: reads the device)."""
        entry = req.__dict__.get("kvguard_cow_read")
        if entry is None or not int(entry[0]):
            return None
        self.flagged += 1
        _, rec_src, rec_gen, src = (int(x) for x in entry)
        if rec_src != src or rec_gen == UNTAKEN:
            return f"{src} it matched in the radix tree was never taken by the tree as kvguard saw it"
        if rec_gen == POISONED:
            return f"{src} it matched in the radix tree was taken from a request that did not hold it"
        return (f"{src} it matched in the radix tree was handed to another request past the generation the tree "
                f"took it at ({rec_gen} -> {int(self.gens[src])})")


def _states(pool) -> TreeStates | None:
    follower = pool.__dict__.get("_kvguard_mamba") if pool is not None else None
    return None if follower is None else follower.__dict__.get("tree")


# ------------------------------------------------------------------------------------------------
# Hook bodies (named in HOOKS)
# ------------------------------------------------------------------------------------------------
def around_cleanup_after_caching(original, component, req, is_finished, insert_result=None, insert_params=None,
                                 *args, **kwargs):
    states = _states(component.cache.req_to_token_pool)
    value = getattr(insert_params, "mamba_value", None)
    if states is not None and value is not None and insert_result is not None and not insert_result.mamba_exist:
        states.took_from(req, value, bool(is_finished))  # before the original: it may clear the request's record
    return original(component, req, is_finished, insert_result, insert_params, *args, **kwargs)


def after_finalize_match(result, component, params, *args, **kwargs):
    req = getattr(params, "req", None)
    states = _states(component.cache.req_to_token_pool)
    if states is not None and req is not None and getattr(params, "cow_mamba", False) \
            and req.kv.mamba_cow_src_index is not None:
        states.matched(req, req.kv.mamba_cow_src_index)
    return None


def around_collect_cow(original, batch, reqs, *args, **kwargs):
    states = _states(batch.req_to_token_pool)
    copying = [] if states is None else [req for req in reqs if req.kv.mamba_cow_src_index is not None]
    out = original(batch, reqs, *args, **kwargs)
    if copying:
        states.stage(copying, batch)
    return out


# name -> (SGLang target, hook, HookRegistry type); composed into kvguard.sglang.plugin's TARGETS and hooks()
HOOKS = {
    "mamba_tree_take": (f"{_COMPONENT}.cleanup_after_caching_req", around_cleanup_after_caching, "AROUND"),
    "mamba_tree_match": (f"{_COMPONENT}.finalize_match_result_in_cache", after_finalize_match, "AFTER"),
    "mamba_tree_copy": (f"{_SRT}.managers.schedule_batch.ScheduleBatch._collect_deferred_mamba_cow_and_clear",
                        around_collect_cow, "AROUND"),
}
