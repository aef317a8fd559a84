"""Real bugs, replayed (the "real_bugs" suite, faults/real_bugs.py): bugs of the release path, where a
request's pages go back while the radix tree or another entry still references them (5-9), and the
controls, which no tracker must flag (10).
"""
from __future__ import annotations

import torch

from .catalog import register
from .real_bugs import SGLANG_POOLS, TREE, RealBug, free_now, will_hit


# -- 5. sglang #38319 -> PR #38355 ------------------------------------------------------------------
@register
class ChunkedInsertThenFree(RealBug):
    name = "chunked_insert_then_free"
    where = "cache_unfinished_req (insert mid-prefill) + release of a retracted request (is_insert=False)"
    corrupts = ("a request's pages are inserted into the radix tree while it still owns them; it is retracted and "
                "its release frees them while the tree still references them; every later hit reads the pages' "
                "next owner's KV")
    why = ("the hit guard: nodes carry their pages' tags from insert to every hit, and the free bumped them; "
           "without it a hit records the page's current tag and passes (the corrupt prefix persists)")
    source = "sgl-project/sglang issue #38319 -> PR #38355"
    maintainers = ("MambaRadixCache.cache_unfinished_req inserts each chunk's pages into the tree mid-prefill; a "
                   "retract (decode OOM) or abort before the prefill completes runs release_kv_cache -> "
                   "cache_finished_req(is_insert=False), which frees those pages while the radix node still holds "
                   "them; the corrupt prefix then served every later hit until flush_cache")
    host = (TREE + ". faultlab's prefill is not chunked: the insert happens at a decode step, the state "
            "cache_unfinished_req leaves (pages in the tree, still the request's), then the request is retracted")

    def apply(self, engine, rng, ctx):
        if ctx.kind != "decode":
            return None
        ps = engine.page_size
        options = []
        for r in ctx.requests:
            full = min(len(r.prompt) // ps, r.n_pages)
            if r.status != "running" or r.row is None or full <= r.n_shared:
                continue
            # a waiting request that will hit the inserted pages (else nobody ever reads them)
            head = r.prompt[:(r.n_shared + 1) * ps]
            if any(w.prompt[:len(head)] == head for w in engine.waiting):
                options.append((r, full))
        if not options:
            return None
        request, full = rng.choice(options)
        pages = engine.table[request.row, :full].tolist()
        engine.cache.insert(request.prompt[:full * ps], pages)  # mid-prefill insert: the tree references them
        inserted = pages[request.n_shared:full]
        engine.abort(request, "retracted (decode out of memory)")  # release with is_insert=False frees them
        return {"request": request.rid, "pages_in_tree_and_freed": inserted}


# -- 6. sglang #23392 -> PR #24193 ------------------------------------------------------------------
@register
class StaleProtectedLen(RealBug):
    name = "stale_protected_len"
    where = "radix release of a finished request (cache_protected_len)"
    corrupts = ("a request re-matched to a longer prefix while waiting keeps its old, shorter protected length; "
                "its release treats the newly shared pages as its own and frees them under the tree")
    why = "the hit guard: later hits record the tags the nodes were inserted with, which the free bumped"
    source = "sgl-project/sglang issue #23392 -> PR #24193"
    maintainers = ("_compute_prefix_matches refreshed prefix_indices and last_node of waiting requests but not "
                   "cache_protected_len; release paths use it as the boundary between shared radix KV and "
                   "request-owned KV, so newly shared KV was treated as request-owned and freed (partial fix)")
    host = (TREE + ": faultlab matches once, at admission; the replay takes the request's protected length "
            "as the one from before the prefix was cached (0) and frees [0, shared) at its release")

    def on_finish(self, engine, rng, request, pages):
        shared = [p for p in pages[:request.n_shared]]
        cached = {n.page for n in engine.cache.nodes()}
        shared = [p for p in shared if p in cached]
        if not shared or not will_hit(engine, request.tokens[:engine.page_size]):
            return None
        engine.allocator.free(torch.tensor(shared, dtype=torch.int64))
        return {"request": request.rid, "protected_len": 0, "prefix_len": request.n_shared * engine.page_size,
                "pages_freed_under_tree": shared}


# -- 7. vllm #42571 -> PR #42615 --------------------------------------------------------------------
@register
class BlockAppendedTwice(RealBug):
    name = "block_appended_twice"
    where = "release of a request whose block list holds one block twice"
    corrupts = ("the same page appears twice in the list the release frees: it is freed twice and queued twice, "
                "so two later allocations share it (or, a page the prefix cache took, it is freed under the tree)")
    why = ("each allocation bumps the page's tag: the earlier owner's expected tag is stale at its next check; a "
           "page freed under the tree fails every later hit (the hit guard)")
    source = "vllm-project/vllm issue #42571 -> PR #42615 (also #42903)"
    maintainers = ("with eager SimpleCPUOffload and sliding-window attention the same KVCacheBlock entered a "
                   "request's list twice; free_blocks decremented its ref_cnt twice and appended it to the free "
                   "queue twice, which over-counted num_free_blocks and later handed the block out twice")
    host = SGLANG_POOLS + ": both frees go through SGLang's free_segment (prepends, no dedup)"

    def on_finish(self, engine, rng, request, pages):
        ps, free = engine.page_size, free_now(engine)
        own = [p for j, p in enumerate(pages) if j >= request.n_shared
               and (p in free or will_hit(engine, request.tokens[:(j + 1) * ps]))]
        if not own:
            return None
        # NOTE: any of the request's own blocks can re-enter the window; its release already dropped one
        # reference to each (the tree took the full pages, the rest went back free), so the duplicate's
        # free is one more: a page already free lands in the free list twice, a page the tree took is
        # freed under the tree (vLLM's cached free block handed out while still shared).
        page = rng.choice(own)
        state = "free" if page in free else "cached"
        engine.allocator.free(torch.tensor([page]))  # the duplicate entry's free
        return {"request": request.rid, "page": page, "was": state}


# -- 8. sglang PR #38941 ----------------------------------------------------------------------------
@register
class SeamDoubleFree(RealBug):
    name = "seam_double_free"
    where = "cache_finished_req: the two tail pieces of a finished request"
    corrupts = ("a page widened past the cache-cap grid puts the seam between the two freed tail pieces inside one "
                "page; each piece frees it, the second one a page the first already released")
    why = "a double free: the two later allocations bump the page's tag twice, the first owner's tag is stale"
    source = "sgl-project/sglang PR #38941"
    maintainers = ("with DCP the allocator page is page_size * dcp_size but the Mamba cache cap lands on the "
                   "unwidened grid; cache_finished_req hands back the unaligned tail and the truncation tail in "
                   "two pieces whose seam falls inside one page: free_segments asserts, and without the assertion "
                   "the second piece frees a page the first already released (fix: merge adjacent frees)")
    host = SGLANG_POOLS + ": the seam page is the request's last (partial) page, freed by two free_segment calls"

    def on_finish(self, engine, rng, request, pages):
        if not pages or len(pages) <= request.n_shared:
            return None
        seam = pages[-1]
        if seam not in free_now(engine):
            return None  # the release kept it (a full page the tree took): no seam
        engine.allocator.free(torch.tensor([seam]))  # the second piece
        return {"request": request.rid, "page": seam}


# -- 9. mini-sglang PR #52 --------------------------------------------------------------------------
@register
class LockHandleSkipsNode(RealBug):
    name = "lock_handle_skips_node"
    where = "radix cache lock_handle / unlock"
    corrupts = ("locking a matched prefix starts at the handle's parent, so the handle's own node stays unlocked; "
                "memory pressure evicts it while the request reads its page")
    why = "eviction frees the page: its tag bumps and the request's next check fails"
    source = "sgl-project/mini-sglang PR #52"
    maintainers = ("in lock_handle's while loop `node = node.parent` came first, so the handle's node itself was "
                   "skipped (only its ancestors' ref_count rose); under memory pressure eviction treats it as "
                   "unused and deletes it while the engine still reads it")
    host = (TREE + " (mini-sglang's tree is the same shape); memory pressure is replayed by evicting LRU "
            "unlocked leaves until the handle's node goes")

    def apply(self, engine, rng, ctx):
        if ctx.kind != "decode":
            return None
        options = [r for r in ctx.requests if r.status == "running" and r.nodes and r.nodes[-1].lock_ref == 1]
        if not options:
            return None
        request = rng.choice(options)
        node = request.nodes[-1]
        node.lock_ref -= 1  # lock_handle skipped it ...
        request.nodes = request.nodes[:-1]  # ... and so does the matching unlock
        evicted = []
        while node.parent is not None and node.parent.children.get(node.key) is node:
            freed = engine.cache.evict(1)
            if not freed:
                break
            evicted += freed
        return {"request": request.rid, "page": node.page, "evicted": evicted}


# -- 10. controls: must NOT be flagged --------------------------------------------------------------
@register
class LeakUnrecordedLen(RealBug):
    name = "leak_unrecorded_len"
    where = "an over-allocation whose allocated length is never recorded"
    corrupts = ("a page is allocated for a request and written into its row past the recorded length; the release "
                "frees only the recorded length and the next growth overwrites the entry: the page leaks")
    detectable = False
    why = "a control: no request reads a wrong page (nothing to flag); SGLang's idle accounting sees the leak"
    source = ("sgl-project/sglang PRs #13826, #31616 (threads not found in the search index; built from the issue's "
              "one-line description; the mechanism matches PR #22862's [prefix_len, kv_allocated_len) leak)")
    maintainers = ("(#22862) alloc_for_extend writes new indices over req_to_token entries past the recorded "
                   "length: the allocator still counts the old ones in use, no entry references them: a pure leak")
    host = SGLANG_POOLS + ": SGLang's allocator and req_to_token write"

    def apply(self, engine, rng, ctx):
        if ctx.kind != "decode":
            return None
        options = [r for r in ctx.requests if r.status == "running" and r.row is not None
                   and r.n_pages < engine.max_pages]
        if not options or not engine.allocator.can_alloc(1):
            return None
        request = rng.choice(options)
        page = engine.allocator.alloc(1)
        engine.req_pool.write(request.row, request.n_pages, page)  # past the recorded length
        return {"request": request.rid, "page": int(page[0]), "logical_page": request.n_pages}


@register
class Fp8ScalesLostOnWake(RealBug):
    name = "fp8_scales_lost_on_wake"
    where = "sleep(level=2) / wake_up of the KV cache"
    corrupts = "the KV pool comes back without its FP8 scales: every page is written and read with a garbage scale"
    detectable = False
    why = "a control: every mapping is right (nothing to flag); the output is gibberish (oracle: kv_scale)"
    source = "vllm-project/vllm issue #25800 -> PR #28783"
    maintainers = ("level-2 sleep discards all VRAM, the FP8 KV scales included; wake_up(tags=['kv_cache']) "
                   "re-allocated the cache but not the scales, left uninitialized: gibberish (fix: "
                   "init_fp8_kv_scales re-initializes them)")
    host = ("the engine's FP8 decode pool (SGLang's MHATokenToKVPool buffers with memory = \"sglang\"): its "
            "per-layer scales are replaced by garbage mid-run")

    def apply(self, engine, rng, ctx):
        kv = engine.kv
        if ctx.kind != "decode" or kv.dtype != "fp8":
            return None
        garbage = 10.0 ** rng.choice((-3, 3))
        for layer in range(kv.n_layers):
            k_scale, v_scale = kv.scales(layer)
            kv.set_scales(layer, k_scale * garbage, v_scale * garbage)
        engine.emit("on_kv_scales_lost", step=engine.step_id)
        return {"scale_factor": garbage}
