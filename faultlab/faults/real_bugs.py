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

This module: the suite's base class and hosts, and the bugs where a page or row is handed back while work
in flight still uses it (decode-side offload, PD transfer, growth, overlap scheduling: 1-4).
faults/real_bugs_release.py: bugs of the release path (radix tree, free list: 5-9) and the controls (10).
Both register in that order (faults/__init__.py), the catalog order of the suite.
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


def free_now(engine) -> set[int]:
    return set(engine.allocator.free_pages.tolist())


def will_hit(engine, tokens) -> bool:
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
        if not published or not will_hit(engine, request.tokens[:(request.n_shared + 1) * ps]):
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
