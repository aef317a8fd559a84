"""HiCache (SGLang 0.5.23's hierarchical cache, host memory only): the pages a load-back brings back to the device,
and when a request may read them.

With ``enable_hierarchical_cache=True`` the radix tree (``UnifiedRadixCache`` with a ``HybridCacheController`` and a
host pool) copies its nodes' KV to host memory (write-through when a node is inserted or hit, write-back when it is
evicted) and evicts their device pages (``UnifiedRadixCache.evict``: the allocator's ``free``, bumped by kvguard like
every release). A request whose prefix lives on host only is admitted through ``PrefillAdder.add_one_req`` ->
``tree.init_load_back`` -> ``load_back``: ``HybridCacheController.load`` allocates new device pages from the
allocator kvguard wraps (tags bumped), queues the host->device copy, and ``tree_core.commit_load_back`` makes those
pages the node's value. The scheduler then submits the queued copies (``ready_to_load_host_cache`` ->
``HiCacheController.start_loading``, which returns the producer index that becomes the new batch's
``hicache_consumer_index``) and prepares the batch (``alloc_for_extend`` writes the tree's pages into the rows as
prefix: kvguard records them with the tags the tree adopted them with, :class:`kvguard.sglang.radix.RadixTags`).

=====================================================================  ======  =======================================
target (``sglang.srt.``)                                               type    what kvguard does there
=====================================================================  ======  =======================================
``mem_cache.hybrid_cache.hybrid_cache_controller.                      AROUND  a load-back's new device pages: the
HybridCacheController.load``                                                   tags this allocation gave them are kept
                                                                               aside; until the copy is submitted the
                                                                               tree's pages expect :data:`LOADING` (no
                                                                               page carries it: a read fails its check)
``managers.cache_controller.HiCacheController.start_loading``          AROUND  the queued copies submitted: the tree
                                                                               adopts their pages with those tags, so a
                                                                               request matching the loaded-back prefix
                                                                               expects exactly this allocation
=====================================================================  ======  =======================================

NOTE (why adoption waits for the submission, and what orders the read after the copy). kvguard checks an extend
batch at ``prepare_for_extend``, after ``ready_to_load_host_cache`` submitted the batch's loads and before its forward;
the bytes arrive later, layer by layer, on the controller's host->device stream. SGLang orders the read itself: the
worker hands the batch's ``hicache_consumer_index`` to the ``LayerDoneCounter`` (``TpModelWorker.set_hicache_consumer``)
and every attention layer waits for its layer's load event before it reads the KV pool (``MHATokenToKVPool.
get_key_buffer`` / ``get_value_buffer`` -> ``layer_transfer_counter.wait_until``); a later batch's forward runs behind
that one on the same forward stream. What SGLang does not order is a read of a loaded-back page by a batch prepared
before the copy was submitted (a scheduling path that builds a batch without ``ready_to_load_host_cache``): no layer
event guards that forward. kvguard catches it: such a page still expects :data:`LOADING` when the request's row is
recorded and checked, so the request is flagged (and its writes guarded) before its forward. A load that is never
submitted leaves its pages expecting :data:`LOADING` for good (until a checkpoint adopts them again).

NOTE (evicted pages). ``UnifiedRadixCache.evict`` frees a backed-up node's device pages through the allocator's
``free`` (``_free_values`` -> ``_drain_device_frees``), i.e. through kvguard's release wrapper: the pages' tags move
on, so a request that still maps one (a lock not honoured) is flagged at its next check; the tree's adopted tag
stays behind, so a match of such a stale page fails too. The next load-back of that node allocates new pages and
adopts them here. A node re-inserted from a request's row while evicted (``_unevict_node_on_insert``) is a
checkpoint: adopted from the row by :class:`kvguard.sglang.radix.RadixTags`.

NOTE (speculative decoding: the draft model's KV). An EAGLE draft model's KV pool is backed up and loaded back by
the same operations as the target's, on the same device slots: SGLang's draft plan (``BaseSpecWorker.
_build_hicache_draft_plan``, ``SIDECAR`` for a draft that is not an MTP/NextN layer) registers a draft host pool whose
transfers take their indices from the target's (``indices_from_pool=KV``); ``UnifiedRadixCache.load_back`` passes
it to the same ``HybridCacheController.load`` (``_resolve_device_transfers``: the draft's device indices are the
tensor this load allocated), which queues one ``CacheOperation`` for both, submitted by the same ``start_loading``
under the same layer events (draft layer ``i`` is copied before target layer ``i``'s event). So the expectations
above, per slot id, cover the draft's bytes too. The draft's own pool waits on no layer event: its reads (the draft
extend after the target's prefill, then the spec steps) are ordered after the copy by running on the forward stream
behind the target forward that waited. Packed MTP/NextN draft layers (``PACKED``) are refused
(:func:`kvguard.sglang.model_facts.hicache_refusal`).

Shown on SGLang's real ``UnifiedRadixCache`` + ``HybridCacheController`` + ``MHATokenToKVPoolHost`` driven step by
step on the CPU (tests/test_kvguard/test_sglang/test_sglang_hicache.py; with an EAGLE draft pool and spec steps:
test_sglang_hicache_spec.py). A live CPU server does not start: the host
pool registers its buffer with ``cudaHostRegister`` and the copies are ``sgl_kernel`` CUDA kernels.

Only functions of this subpackage import SGLang, and only when they run.
"""
from __future__ import annotations

import logging

from .runtime import guard_of

log = logging.getLogger("kvguard.sglang")

_SRT = "sglang.srt"
LOADING = -3  # a tree tag no page carries (tags >= 0; UNSET -1, radix.POISONED -2): a load-back not yet submitted
PENDING = "_kvguard_loads"  # guard.__dict__: id(device_indices) -> (device_indices, pages, tags) of queued loads


def _pending(guard) -> dict:
    return guard.__dict__.setdefault(PENDING, {})


def around_load(original, controller, host_indices, *args, **kwargs):
    """``HybridCacheController.load``: the device pages it allocates for a load-back expect :data:`LOADING` in the
    tree until the copy is submitted; the tags this allocation gave them are kept for then.

    A load into caller-owned device pages (``device_indices=``: PD decode's retraction restore) allocates nothing
    and is left alone."""
    guard = guard_of(controller.mem_pool_device_allocator)
    if guard is None or kwargs.get("device_indices") is not None:
        return original(controller, host_indices, *args, **kwargs)
    guard._fresh = None  # set by this load's allocation (the allocator's alloc, wrapped)
    out = original(controller, host_indices, *args, **kwargs)
    if out is None or out.numel() == 0:
        return out
    ps = guard.page_size
    assert out.numel() % ps == 0, f"a load-back of {out.numel()} slots is not page-aligned (page size {ps})"
    pages = out[::ps].long() // ps
    tags = guard._fresh_for(pages.numel())  # (fail closed: UNSET where this allocation's tags are not known)
    guard.radix.tags[pages] = LOADING
    _pending(guard)[id(out)] = (out, pages, tags)
    return out


def around_start_loading(original, controller, *args, **kwargs):
    """``HiCacheController.start_loading``: the queued copies are submitted (the consumer batch's forward waits for
    each layer): the tree adopts their pages with the tags of the allocation that made them."""
    guard = guard_of(controller.mem_pool_device_allocator)
    if guard is None:
        return original(controller, *args, **kwargs)
    queued = [op.device_indices for op in controller.load_queue]
    producer = original(controller, *args, **kwargs)
    pending = _pending(guard)
    for indices in queued:
        entry = pending.pop(id(indices), None)
        if entry is not None:
            guard.radix.tags[entry[1]] = entry[2]
    if pending:  # loads dropped from the queue unsubmitted (a controller reset): their pages keep LOADING
        log.warning("kvguard: %d HiCache load(s) were never submitted; their pages fail every match", len(pending))
        pending.clear()
    return producer


HOOKS = {  # name: (SGLang target, kvguard's hook, HookRegistry type); composed into kvguard.sglang.plugin's table
    "hicache_load": (f"{_SRT}.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.load",
                     around_load, "AROUND"),
    "hicache_start_loading": (f"{_SRT}.managers.cache_controller.HiCacheController.start_loading",
                              around_start_loading, "AROUND"),
}
