"""kvguard on SGLang 0.5.23's sliding-window hybrids: the SWA namespace, followed and checked beside the full one.

A hybrid sliding-window model (GPT-OSS, Gemma-2/3 style: ``ModelConfig.is_hybrid_swa``) gets a
``SWATokenToKVPoolAllocator``: two sub-allocators (``full_attn_allocator``, ``swa_attn_allocator``) and one
index map, ``full_to_swa_index_mapping``. ``req_to_token`` holds full slots; full-attention layers read them
(kvguard's main check), sliding-window layers read ``mapping[full]`` for the last ``window`` tokens only.

What kvguard follows here (:class:`SWASide`, wrapping methods of the *instances* SGLang built, as
:mod:`kvguard.sglang.follow` does for the plain pools; the full sub-allocator is the main guard's):

- **SWA page tags** (:class:`kvguard.tags.TagTable` over the SWA pool): bumped when the SWA sub-allocator hands a
  page out (``alloc`` / ``alloc_extend`` / ``alloc_decode``: a prefix of its free list) and when a page goes back
  (``_release_page_ids``; ``free`` at page size 1): every release counts, whether the page slid out of the window
  (``ScheduleBatch.maybe_evict_swa`` -> ``free_swa_segment``), was evicted from the radix tree, or was retracted;
- **the pairing** ``pair[full] = swa`` and ``pair_tag[full]`` (the SWA page's tag then), recorded where SGLang pairs
  a full slot with an SWA slot through the allocator: ``set_full_to_swa_mapping`` (extend, page-size-1 alloc, SWA
  tail, the tree's radix recovery) and ``alloc_decode`` (which writes the map directly): from the allocators'
  outputs, never from the map itself.

What it checks (:meth:`SWASide.check`, one extra launch per forward and per spec step (:mod:`kvguard.sglang.spec`),
:mod:`kvguard.kernels.window_check`): every position a sliding-window layer of the step may read,
``[n - window - new tokens, n)``, maps through the request's ``req_to_token`` entry (whose full slot the main check
proves is the request's own, with its tag) and the map to the SWA slot kvguard saw paired with that full slot,
whose page still carries the tag it had then. A cleared (0), foreign or stale map entry, or an in-window SWA page
released since, flags the request in the main check's verdict; it is aborted with the same verdict, its write slots
redirected. Positions before the window, which SGLang legitimately frees, are never read. ``window`` is the tree's
``sliding_window_size`` (SGLang's retain window: what it keeps, at least what attention reads).

NOTE (one extra launch): the main kernel is shared with the graph-captured check and reads one table; this one
reads a second table (the map) over a per-request range. Cost per forward: one launch, measured on an H100 at
~15 us of host time (direct launch of a warmed variant) and 16 us (window 128) to 46 us (window 4096, one program
per request walks it) of GPU time per call at batch 1-256 (``python bench/swa_window_check.py OUT.json``;
bench/results/swa_window_check_h100.json). Per allocation two small device scatters (the pairing); per SWA free
by full slot (the slide: at page size 1 once per request and step, at page 16 once per page) a few small device
ops (:meth:`SWASide.restore`); no host sync anywhere on the steady path. Checks are launched eagerly (the decode
check is not captured into SGLang's CUDA graphs while this side is on).

Safe release: while kvguard releases an aborted or retracted request (:meth:`PoolFollower.releasing`), SGLang's
SWA frees of the full slots its row names are replaced: only the SWA pages paired with full pages the request
legitimately holds, and still carrying their pairing tag, are freed, and only those full slots' map entries are
cleared; a broken entry never frees or clears anything of another request.

Imports SGLang only inside functions.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from ..tags import UNSET, TagTable
from .pool_wraps import bump_on_release

log = logging.getLogger("kvguard.sglang")

# SGLang targets of this path: none. Every SWA event passes through the allocator instance SGLang built (wrapped at
# install, :class:`SWASide`), and the check rides the main guard's launch; the table is merged into the plugin's.
HOOKS: dict[str, tuple[str, Callable, str]] = {}

REASON = "swa_mapping"  # a violation found by this check (kvguard.violations.REASONS)


def follows(allocator) -> bool:
    """kvguard follows this allocator's SWA side: SGLang's own ``SWATokenToKVPoolAllocator`` (not a subclass: the
    pure-SWA, unified and HiSparse ones keep other maps), paged SWA (no per-request ring), both sub-allocators
    SGLang's plain paged / token ones, and a map tensor on the pools' device."""
    try:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    except ImportError:
        return False
    if type(allocator) is not SWATokenToKVPoolAllocator or allocator.swa_req_ring:
        return False
    plain = (PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator)
    subs = (allocator.full_attn_allocator, allocator.swa_attn_allocator)
    return all(type(a) in plain for a in subs) and isinstance(allocator.full_to_swa_index_mapping, torch.Tensor)


def full_side(allocator):
    """The allocator the main guard follows: the full sub-allocator of a followed SWA allocator, else itself."""
    return allocator.full_attn_allocator if follows(allocator) else allocator


def attach(guard, allocator) -> "SWASide | None":
    """Follow ``allocator``'s SWA side for ``guard`` (installed on its full sub-allocator); None for a plain one."""
    if not follows(allocator):
        return None
    if guard.swa is None:
        guard.swa = side = SWASide(guard, allocator)
        explain = guard.tracker._explain

        def _explain(check, b, request_id, bad):
            # the main explanation reads the whole row: a first "bad" entry past the live ones means it found nothing;
            # one in the step's write span may be the write guard's own rewrite (a spec step rewrites a flagged
            # request's entries there, kvguard.sglang.spec): an earlier bad window entry is then the fault
            found = explain(check, b, request_id, bad)
            if found.reason == "unchecked" or found.logical_position >= side.live_length(check, b):
                return side.explain(check, b, request_id, bad) or found
            if found.logical_position >= side.write_start(check, b):
                window = side.explain(check, b, request_id, bad)
                if window is not None and window.logical_position < found.logical_position:
                    return window
            return found

        guard.tracker._explain = _explain
        warm_up = guard.warm_up

        def _warm_up():  # the server's warm-up compiles the window check's variants too (no compile mid-serving)
            warm_up()
            side.launcher().warm_up()

        guard.warm_up = _warm_up
        log.info("kvguard: following the SWA namespace of %s (%d SWA pages)", type(allocator).__name__,
                 guard.swa.tags.num_pages)
    return guard.swa


class SWASide:
    """The SWA namespace of one pool set: its page tags, the full→SWA pairing, the window check, safe release."""

    def __init__(self, guard, allocator):
        self.guard, self.allocator = guard, allocator
        self.sub = allocator.swa_attn_allocator
        self.page_size = ps = int(allocator.page_size)
        self.map = allocator.full_to_swa_index_mapping  # int64 [full slots + ps + 1] (a trailing -1)
        dev = self.device = self.map.device
        slots = self.map.numel() - 1
        self.pair = torch.full((slots,), -1, dtype=torch.int64, device=dev)  # each full slot's SWA peer
        self.pair_tag = torch.full((slots,), UNSET, dtype=torch.int64, device=dev)  # that SWA page's tag then
        num_pages = int(getattr(self.sub, "num_pages", self.sub.size // ps)) + 1
        self.tags = TagTable(num_pages, dev, kernel=guard.tracker.use_triton)
        self.swa_limit = num_pages * ps
        self._launch = None  # the window check (made at the first check: the tree gives the window)
        self._last_swa: torch.Tensor | None = None  # the SWA sub-allocator's last output
        self._raw: dict[str, Callable] = {}
        self.windows: dict[int, tuple] = {}  # verdict buffer -> (table rows, lengths, new tokens) of its last check
        self._wrap_sub()
        self._wrap_pairing()
        self._wrap_release()

    # -- tags: the SWA sub-allocator -------------------------------------------------------------
    def _wrap_sub(self) -> None:
        a, ps = self.sub, self.page_size
        for name in ("alloc", "alloc_extend", "alloc_decode"):
            setattr(a, name, self._alloc_wrapper(getattr(a, name)))
        if hasattr(a, "_release_page_ids"):  # paged: the one place pages go back (kvguard.sglang.follow)
            bump_on_release(a, lambda ids: self.tags.bump(ids))
            self._raw = {"free": a.free, "free_page_ids": a.free_page_ids}
        else:  # page size 1: free() releases at once (the composite never opens the sub-allocator's free group)
            free = a.free

            def _free(free_index):
                if a.free_group is None and free_index.numel() > 0:
                    self.tags.bump(free_index)
                return free(free_index)

            a.free = _free
            self._raw = {"free": _free, "free_page_ids": _free}
        assert ps >= 1

    def _alloc_wrapper(self, original: Callable) -> Callable:
        a, ps = self.sub, self.page_size

        def alloc_wrapper(*args, **kwargs):
            before = a.free_pages
            staged = _staged(a)
            out = original(*args, **kwargs)
            self._last_swa = out
            if out is None:
                return out
            if _staged(a) == staged:  # every 0.5.23 allocation hands out a prefix of free_pages (follow.py)
                taken = before.shape[0] - a.free_pages.shape[0]
                if taken:
                    self.tags.bump(before[:taken])
            else:  # the free list was merged and sorted inside the call: the pages starting in the output
                self.tags.bump(out[out % ps == 0] // ps)
            return out

        alloc_wrapper.__wrapped__ = original
        return alloc_wrapper

    # -- the pairing: the composite allocator --------------------------------------------------------
    def _wrap_pairing(self) -> None:
        a = self.allocator
        set_mapping, alloc_decode = a.set_full_to_swa_mapping, a.alloc_decode

        def set_full_to_swa_mapping(full_indices, swa_indices):
            result = set_mapping(full_indices, swa_indices)
            if full_indices.numel():
                self.record_pairs(full_indices, swa_indices)
            return result

        def _alloc_decode(*args, **kwargs):
            self._last_swa = None
            out = alloc_decode(*args, **kwargs)
            if out is not None and self._last_swa is not None:  # (the map is written directly, not through set_)
                self.record_pairs(out, self._last_swa)
            return out

        a.set_full_to_swa_mapping, a.alloc_decode = set_full_to_swa_mapping, _alloc_decode
        clear_mapping, clear = a.clear_full_to_swa_mapping, a.clear

        def clear_full_to_swa_mapping(full_indices):  # SGLang unpairs: those slots have no SWA peer any more
            if full_indices.numel():
                self.pair[full_indices.to(self.device, torch.int64)] = -1
            return clear_mapping(full_indices)

        def _clear():  # SGLang's flush: every pairing is gone
            self.pair.fill_(-1)
            self.pair_tag.fill_(UNSET)
            return clear()

        a.clear_full_to_swa_mapping, a.clear = clear_full_to_swa_mapping, _clear

    def record_pairs(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        """SGLang paired ``full`` slots with ``swa`` slots (device, no sync)."""
        full, swa = full.to(self.device, torch.int64), swa.to(self.device, torch.int64)
        self.pair[full] = swa
        self.pair_tag[full] = self.tags.tags[torch.div(swa, self.page_size, rounding_mode="floor").clamp(min=0)]

    # -- the check -----------------------------------------------------------------------------------
    def window(self) -> int:
        """The tokens back a sliding-window layer may read: SGLang's retain window (the tree's)."""
        tree = self.guard.tree_cache
        window = getattr(tree, "sliding_window_size", None) if tree is not None else None
        if not isinstance(window, int) or window < 0:
            raise RuntimeError(f"kvguard: the SWA window of this scheduler is unknown (tree "
                               f"{type(tree).__name__}: sliding_window_size={window!r}); kvguard does not serve "
                               f"sliding-window layers it cannot check")
        return window

    def launcher(self):
        if self._launch is None:
            from ..kernels.window_check import WindowCheck

            table = self.guard.req_to_token_pool.req_to_token
            self._launch = WindowCheck(table, self.map, self.pair, self.pair_tag, self.tags.tags,
                                       page_div=self.page_size, window=self.window(), swa_limit=self.swa_limit,
                                       reference=not self.guard.tracker.use_triton)
        return self._launch

    def check(self, table_rows, n_entries, verdict, *, q=None, guard=None, flag=None, stamp: int = 1) -> None:
        """After the main check of a step, into its verdict ``[B, chunks]``: the window of every request (``q``:
        the step's new tokens per request, None: one each)."""
        self.launcher()(table_rows, n_entries, verdict, q=q, guard=guard, flag=flag, stamp=stamp)
        self.windows[verdict.data_ptr()] = (table_rows, n_entries, q)

    def live_length(self, check, b: int) -> int:
        """The entries request ``b`` of ``check`` held when its window was checked (huge when not known)."""
        lens = self.windows.get(check.verdict.data_ptr(), (None, None, None))[1]
        return 1 << 62 if lens is None else int(lens[b])

    def write_start(self, check, b: int) -> int:
        """The first of the entries request ``b`` of ``check`` wrote (its new tokens; huge when not known)."""
        _, lens, q = self.windows.get(check.verdict.data_ptr(), (None, None, None))
        return 1 << 62 if lens is None else int(lens[b]) - (1 if q is None else int(q[b]))

    def explain(self, check, b: int, request_id: str, bad: int):
        """Slow path, a flagged request the main check found nothing wrong with (or only in its write span): its first
        bad window entry."""
        from ..violations import Violation

        rows, lens, q = self.windows.get(check.verdict.data_ptr(), (None, None, None))
        if rows is None:
            return None
        row, n = int(rows[b]), int(lens[b])
        lo = max(n - self.launcher().window - (1 if q is None else int(q[b])), 0)
        table = self.guard.req_to_token_pool.req_to_token
        if not 0 <= row < table.shape[0]:
            return None
        full = table[row, lo:n].long().cpu()
        ok = (full >= 0) & (full < self.pair.numel())
        f = full.where(ok, 0)
        swa, want, want_tag = self.map.cpu()[f], self.pair.cpu()[f], self.pair_tag.cpu()[f]
        in_pool = (swa > 0) & (swa < self.swa_limit)
        tags = self.tags.tags.cpu()[(swa.where(in_pool, 0) // self.page_size)]
        bad_at = (~ok | ~in_pool | (swa != want) | (tags != want_tag)).nonzero().flatten()
        if not bad_at.numel():
            return None
        k = int(bad_at[0])
        return Violation(request_id=request_id, row=row, logical_position=lo + k,
                         page=int(swa[k]) // self.page_size if in_pool[k] else int(swa[k]),
                         expected_tag=int(want_tag[k]), found_tag=int(tags[k]) if in_pool[k] else None,
                         reason=REASON, bad_entries=bad)

    # -- safe release ---------------------------------------------------------------------------------
    def _wrap_release(self) -> None:
        """While the main guard releases a request safely (its ``_holds`` set: kvguard.sglang.follow), SGLang's SWA
        frees by full slot are replaced by :meth:`free_peers` over the slots it legitimately holds; the full pages
        kvguard frees itself (leftovers, stale rows) free their SWA peers too."""
        a, guard = self.allocator, self.guard
        for name in ("free_swa", "free_swa_segment"):
            original = getattr(a, name)
            setattr(a, name, self._swa_free_wrapper(original))
        raw_free_pages = guard._raw["free_page_ids"]

        def free_full_pages(page_ids):
            self.free_peers(page_ids)
            return raw_free_pages(page_ids)

        guard._raw["free_page_ids"] = free_full_pages

    def _swa_free_wrapper(self, original: Callable) -> Callable:
        guard, ps = self.guard, self.page_size

        def swa_free(free_index, *args, **kwargs):
            if free_index.numel() == 0:
                return original(free_index, *args, **kwargs)
            if guard._holds is None:  # the window sliding, a tree eviction, a plain release
                slots = self._page_slots(free_index)
                self._restore(slots)
                result = original(free_index, *args, **kwargs)
                # NOTE: SGLang has cleared those slots' map entries; on CUDA its fused kernel
                # (get_and_clear_swa_pages) does it without clear_full_to_swa_mapping, so the pairing is forgotten here
                self.pair[slots] = -1
                return result
            pages = sorted({int(s) // ps for s in free_index.tolist() if int(s) >= 0})
            legit = [p for p in pages if p in guard._holds]
            if legit:
                self.free_peers(torch.tensor(legit, dtype=torch.int64))
            return None

        swa_free.__wrapped__ = original
        return swa_free

    def restore(self, full_slots: torch.Tensor) -> None:
        """Before SGLang frees the SWA peers of ``full_slots`` by reading the map: the map there says what the allocator
        paired, where that SWA page is still held (a no-op while healthy). A map entry broken since the last check
        (cleared, foreign) then frees the request's own SWA page, never slot 0 or another request's page. A few small
        device ops per call, no sync (at page size 1 the window slides, and SGLang calls this, once per request and
        step); SGLang clears those entries right after."""
        self._restore(self._page_slots(full_slots))

    def _restore(self, f: torch.Tensor) -> None:
        ps = self.page_size
        peers = self.pair[f]
        pages = torch.div(peers, ps, rounding_mode="floor").clamp(min=0)
        held = (peers > 0) & (self.tags.tags[pages] == self.pair_tag[f])
        self.map[f] = torch.where(held, peers, self.map[f])

    def _page_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """The slots of the full pages ``full_slots`` fall in (SGLang reads and clears whole pages), in bounds."""
        ps, f = self.page_size, full_slots.to(self.device, torch.int64)
        if ps > 1:
            f = ((f // ps * ps)[:, None] + torch.arange(ps, device=self.device)[None, :]).reshape(-1)
        return f.clamp(0, self.pair.numel() - 1)

    def free_peers(self, full_pages: torch.Tensor) -> None:
        """Free the SWA pages paired with ``full_pages`` (page ids, legitimately held) that still carry their pairing
        tag, and clear those full slots' map entries. A page already released (tag moved) is not freed again."""
        ps = self.page_size
        if full_pages.numel() == 0:
            return
        firsts = full_pages.to(self.device, torch.int64) * ps
        firsts = firsts[(firsts >= 0) & (firsts < self.pair.numel())]
        # NOTE: a full page's SWA page is the one paired with its first slot (both allocators start a page together,
        # from their free lists); a later slot's peer follows last_loc through the map, which a broken entry moves.
        peers = self.pair[firsts]
        pages = torch.div(peers, ps, rounding_mode="floor").clamp(min=0)
        held = (peers > 0) & (self.tags.tags[pages] == self.pair_tag[firsts])
        swa_pages = sorted(set(pages[held].tolist()))
        slots = (firsts[:, None] + torch.arange(ps, device=self.device)[None, :]).reshape(-1)
        self.map[slots] = 0
        self.pair[slots] = -1
        if swa_pages:
            ids = torch.tensor(swa_pages, dtype=torch.int64, device=self.device)
            self._raw["free_page_ids"](ids)  # (page size 1: page ids are slots)


def _staged(allocator) -> int:
    """The allocator's count of pages staged for release (freed, not yet in free_pages)."""
    staged = getattr(allocator, "num_staged_pages", None)
    if staged is not None:
        return int(staged)
    pages = getattr(allocator, "release_pages", None)
    return 0 if pages is None else len(pages)
