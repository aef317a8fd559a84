"""Real bugs, replayed: published KV-cache corruption bugs (SGLang, vLLM, mini-sglang) as catalog faults.

Each replay performs, on the engine's structures, the mechanism the maintainers stated in the thread or
fix (``source`` and ``maintainers`` say which and what), and says where it runs (``host``): the decode
side of the phase-split engine (``requires = "phase_split"``: the PD shape #24226 and #24527 live in),
over SGLang 0.5.23's own PagedTokenToKVPoolAllocator / ReqToTokenPool / MHATokenToKVPool when the
scenario sets ``memory = "sglang"`` (scenarios/real_bugs.toml); the radix tree, the scheduler and the
transfer are faultlab's (faultlab/engine/), as SGLang's cannot run outside its scheduler.

They are the "real_bugs" suite (``suite``): `faultlab matrix` runs them for a scenario whose
``[faults].suite`` names it, and never mixes them into the first-principles catalog.

Strike points: ``apply`` at the engine's ``after_schedule`` (as every fault), or ``on_finish`` (the
injector calls it right after a request's release, for bugs in the release path).
"""
from __future__ import annotations

import torch

from .catalog import Fault, _in_flight_pick, _owned, register


class RealBug(Fault):
    """A published bug, replayed. ``source``: repository and thread(s); ``maintainers``: the mechanism
    as the thread states it; ``host``: what the replay runs on and why."""

    suite = "real_bugs"
    requires = "phase_split"
    source = ""
    maintainers = ""
    host = ""

    def apply(self, engine, rng, ctx):
        return None  # release-path replays strike in on_finish

    def describe(self) -> dict:
        return {**super().describe(), "source": self.source, "maintainers": self.maintainers, "host": self.host}


SGLANG_POOLS = "SGLang's allocator and req_to_token pool (memory = \"sglang\"), decode side of the phase split"
TREE = "faultlab's radix tree (SGLang's RadixCache needs its scheduler) over SGLang's allocator"


def _free_now(engine) -> set[int]:
    return set(engine.allocator.free_pages.tolist())


def _will_hit(engine, tokens) -> bool:
    """Will a waiting request hit the cached prefix ``tokens`` spell? (A free under the tree harms only the
    requests that hit it later, so these replays strike where one will.)"""
    return any(len(w.prompt) > len(tokens) and w.prompt[:len(tokens)] == tokens for w in engine.waiting)


# -- 1. sglang PR #24226 ----------------------------------------------------------------------------
@register
class OffloadFreesPrefill(RealBug):
    name = "offload_frees_prefill"
    where = "decode-side KV offload (DecodeKVCacheOffloadManager.offload_kv_cache)"
    corrupts = ("the first incremental offload frees the request's page-aligned prefill pages while it keeps "
                "decoding over them; a new prefill reuses them")
    why = "the free bumps the pages' tags: the request's next check fails before it reads a reused page"
    source = "sgl-project/sglang PR #24226 (a) (also PR #24063)"
    maintainers = ("offload_kv_cache called free(token_indices[:prefill_len]) at the first incremental offload "
                   "(after offload_stride = page_size decode tokens); the request kept attending to those slots "
                   "through req_to_token, a concurrent prefill reused them: ~5% of responses collapsed")
    host = SGLANG_POOLS + ": the free is SGLang's free_segment"

    def apply(self, engine, rng, ctx):
        ps = engine.page_size
        if ctx.kind != "decode":
            return None
        # NOTE: the decode side offloads past the prefill's page-aligned length (PR #11966); the pages the
        # prefix cache shares are the tree's, so the replay frees the request's own prefill pages.
        candidates = [r for r in ctx.requests if r.status == "running" and r.row is not None
                      and len(r.output) >= ps and len(r.prompt) // ps > r.n_shared]
        if not candidates:
            return None
        request = rng.choice(candidates)
        prefill_pages = len(request.prompt) // ps
        pages = engine.table[request.row, request.n_shared:prefill_pages].long().cpu().clone()
        engine.allocator.free(pages)
        return {"request": request.rid, "decoded": len(request.output), "prefill_len": prefill_pages * ps,
                "pages": pages.tolist()}


@register
class OffloadCopyRacesFree(RealBug):
    name = "offload_copy_races_free"
    where = "decode-side KV offload: release of a finished request"
    corrupts = ("a finished request's pages are freed while its device->host backup is still copying them; a new "
                "prefill overwrites them, and the backed-up prefix serves the new owner's KV to every later hit")
    why = ("a copy racing its source: kvguard's read checks see nothing at the copy; the hit guard (radix.py: "
           "the prefix carries its pages' tags from backup to hit) fails every later hit's check")
    source = "sgl-project/sglang PR #24226 (b)"
    maintainers = ("even once the request finished, the cache controller could still have async device->host copies "
                   "in flight; freeing the slots before the copies landed let a new prefill overwrite KV the offload "
                   "DMA was still reading, corrupting the bytes that end up in the host pool")
    host = (TREE + ": faultlab has no host tier, so the backup is the prefix the finished request publishes; "
            "the copy 'lands' when the prefix is hit, and reads whatever the page holds then")

    def on_finish(self, engine, rng, request, pages):
        ps = engine.page_size
        cached = {n.page for n in engine.cache.nodes()}
        published = [p for p in pages[request.n_shared:len(request.tokens[:request.kv_len]) // ps] if p in cached]
        if not published or not _will_hit(engine, request.tokens[:(request.n_shared + 1) * ps]):
            return None
        engine.allocator.free(torch.tensor(published, dtype=torch.int64))  # freed before the copy landed
        return {"request": request.rid, "pages": published}


# -- 2. sglang #24527 -> PR #32564 -> PR #35049 -------------------------------------------------------
@register
class PdAbortMidTransfer(RealBug):
    name = "pd_abort_mid_transfer"
    where = "PD decode side: abort of a request whose KV transfer is in flight"
    corrupts = ("the decode side aborts the request and frees its pages without cancelling the transfer; the "
                "pages go to a new owner and the late write lands on its KV")
    why = "the transfer guard compares the target pages' tags at issue and at landing, and discards the write"
    source = "sgl-project/sglang issue #24527 -> PR #32564 -> PR #35049 (also PRs #24526, #24580)"
    maintainers = ("decode preallocates destination pages; an abort/timeout released them through the request "
                   "lifetime while the prefill-side writer's lifetime was untracked; the allocator reassigned "
                   "them and the stale writer overwrote the new request's KV (fix: deferred release until drain)")
    host = (SGLANG_POOLS + ": faultlab's transfer (staged, lands transfer_lag steps later) stands in for "
            "Mooncake; the abort is the engine's own release path, minus the transfer cancel")

    def apply(self, engine, rng, ctx):
        from ..engine.engine import Engine

        picked = _in_flight_pick(engine, rng, ctx)
        if picked is None:
            return None
        transfer, takers = picked
        # the bug: the request's release path (Engine.abort) without the phase-split cancel
        Engine.abort(engine, transfer.request, "aborted (client timeout) while its KV transfer was in flight")
        return {"request": transfer.request.rid, "pages": transfer.pages.tolist(), "lands": transfer.land_step,
                "takers": [r.rid for r in takers]}


# -- 3. sglang PR #27731 / PR #28754 ----------------------------------------------------------------
@register
class AllocExtendAlias(RealBug):
    name = "alloc_extend_alias"
    where = "alloc_extend: the page a request's growth continues in"
    corrupts = ("committed > allocated makes the growth continue in a page another live request owns; nothing "
                "moves through the allocator, so the counts stay balanced while the page is double-owned")
    detectable = False
    why = ("by design: tags change on alloc and free, and the alias moves the page through neither, so both rows' "
           "records hold; kvguard sees it only once one owner's release frees the page under the other")
    source = "sgl-project/sglang PR #27731 (invariant checks) / PR #28754 (the streaming-session fix)"
    maintainers = ("committed > allocated -> nxt wrong -> alloc_extend aliases a page -> close double-counts; the "
                   "accounting check (available + held == total) stays balanced while a page is double-owned, so "
                   "only a watermark check (committed <= allocated) and use-after-free checks see the cause")
    host = SGLANG_POOLS + ": the alias is written into SGLang's req_to_token"

    def apply(self, engine, rng, ctx):
        if ctx.kind != "decode":
            return None
        takers = [g for g in ctx.grants if g[0].status == "running" and g[1] > 0]
        owners = [r for r in engine.running if r.status == "running" and r.row is not None and len(_owned(r))]
        if not takers or not owners:
            return None
        taker, first, pages, _ = rng.choice(takers)
        victims = [r for r in owners if r is not taker]
        if not victims:
            return None
        victim = rng.choice(victims)
        alias = int(engine.table[victim.row, victim.n_pages - 1])  # the page the wrong `nxt` continues in
        j = first + len(pages) - 1
        engine.req_pool.write(taker.row, j, torch.tensor([alias]))
        engine.tracker.record(taker.row, j, torch.tensor([alias]))  # a continuation: the page's current tag
        engine.emit("on_grant", request=taker, first=j, pages=[alias], previous=[pages[-1]], step=engine.step_id)
        # NOTE: the page allocated for the growth stays allocated and unmapped: the counts balance because
        # the alias is counted twice (free + owned + cached == total), as in the thread.
        return {"taker": taker.rid, "victim": victim.rid, "page": alias, "unmapped": pages[-1]}


# -- 4. sglang PR #18803 ----------------------------------------------------------------------------
@register
class OverlapRowFree(RealBug):
    name = "overlap_row_free"
    where = "overlap scheduling: release of a finished request's req_pool_idx"
    corrupts = ("a finished request's row is freed at once; a new request takes the row and rewrites it while the "
                "in-flight forward of the finished request still reads it")
    detectable = False
    why = ("by design: the in-flight read is validated against the row's current records, which are the new "
           "owner's; a row generation carried by the forward would catch it. Its result is discarded, so no "
           "token is corrupted (SGLang saw device-side index assertions)")
    source = "sgl-project/sglang PR #18803 (fixes #18744)"
    maintainers = ("process_batch_result(N-1) runs concurrently with forward(N); a finished request's req_pool_idx "
                   "went back to the free list at once, a new request recycled it and prepare_for_decode overwrote "
                   "the req_to_token row while forward(N) still read it (fix: defer the free one iteration)")
    host = (SGLANG_POOLS + ": SGLang's ReqToTokenPool hands the row out again; the engine is not overlapped, so "
            "the finished request's in-flight read is replayed as a tracker check of the row after the new owner "
            "wrote it")

    def __init__(self):
        self.freed: dict[int, tuple[str, int, int]] = {}  # engine row -> (rid, entries, step it was freed)

    def on_finish(self, engine, rng, request, pages):
        """Note the row the finished request just gave back (rows are not cleared: it still holds its pages)."""
        if not pages:
            return
        want = torch.tensor(pages, dtype=engine.table.dtype, device=engine.table.device)
        rows = (engine.table[:, :len(pages)] == want).all(1).nonzero().flatten().tolist()
        if len(rows) == 1:
            self.freed[rows[0]] = (request.rid, len(pages), engine.step_id)

    def apply(self, engine, rng, ctx):
        if ctx.kind != "prefill" or not ctx.requests:
            return None
        new = ctx.requests[0]
        old = self.freed.pop(new.row, None)
        if old is None or old[2] < engine.step_id - 1:
            return None  # not the row of a request that finished one iteration ago
        rid, entries, _ = old
        rows = torch.tensor([new.row], dtype=torch.int32, device=engine.device)
        block = engine.table[new.row:new.row + 1, :entries].clone()  # what forward(N) of `rid` reads now
        check = engine.tracker.validate(block, rows, torch.tensor([entries], dtype=torch.int32, device=engine.device),
                                        max_entries=entries, source=engine.table, source_rows=rows)
        flagged = [] if check is None else engine.tracker.resolve(check, check.verdict.cpu(), [rid])
        return {"finished": rid, "new": new.rid, "row": new.row, "entries_read": entries,
                "kvguard": "off" if check is None else ("flagged" if flagged else "passed")}


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
        if not shared or not _will_hit(engine, request.tokens[:engine.page_size]):
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
        ps, free = engine.page_size, _free_now(engine)
        own = [p for j, p in enumerate(pages) if j >= request.n_shared
               and (p in free or _will_hit(engine, request.tokens[:(j + 1) * ps]))]
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
        if seam not in _free_now(engine):
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
        from ..engine.kvcache import fp8_table

        kv = engine.kv
        if ctx.kind != "decode" or kv.dtype != "fp8":
            return None
        garbage = 10.0 ** rng.choice((-3, 3))
        for layer in range(kv.n_layers):
            kv.k_scale[layer] = kv.k_scale[layer] * garbage
            kv.v_scale[layer] = kv.v_scale[layer] * garbage
            kv._k_tables[layer] = fp8_table(kv.k_scale[layer], kv.device)
            kv._v_tables[layer] = fp8_table(kv.v_scale[layer], kv.device)
        engine.emit("on_kv_scales_lost", step=engine.step_id)
        return {"scale_factor": garbage}
