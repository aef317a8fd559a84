"""memory = "sglang": the engine's bookkeeping on SGLang 0.5.23's own classes.

- ``SGLangPageAllocator`` has ``PageAllocator``'s interface (pages in, pages out) over a real
  ``PagedTokenToKVPoolAllocator``: ``alloc`` is SGLang's ``alloc`` (a prefix of its ``free_pages``),
  ``free`` is SGLang's ``free_segment`` (the release path of ``free_kv_row``: prepends, no dedup), so a
  double free really leaves a page twice in SGLang's ``free_pages`` and the next allocations share it.
- ``SGLangReqToPagePool`` has ``ReqToPagePool``'s interface over a real ``ReqToTokenPool``: rows come
  from ``alloc_rows`` / ``free_rows`` (engine row r is SGLang row r + 1: SGLang's row 0 is padding) and
  every mapping is written, token slot by token slot, through ``ReqToTokenPool.write``.
- ``build_sglang_kv`` backs ``PagedKVCache`` with an ``MHATokenToKVPool``'s per-layer buffers (FP8 kept
  as uint8 by SGLang, viewed as fp8 here), with guard pages past what the allocator hands out.

SGLang is imported lazily (about 10 s on a CPU the first time); nothing else in faultlab needs it.
"""
from __future__ import annotations

import torch

from .kvcache import KV_DTYPES, PagedKVCache
from .memory import OutOfPages, notify_alloc, with_tagger

GUARD_PAGES = 4  # pages past the allocator's: what out-of-range page ids read without the tracker


def _sglang():
    """SGLang's (PagedTokenToKVPoolAllocator, ReqToTokenPool, MHATokenToKVPool)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    return PagedTokenToKVPoolAllocator, ReqToTokenPool, MHATokenToKVPool


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of ``pages`` (int64 [n]) -> int64 [n * page_size], SGLang's ``page * ps + off``."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages[:, None] * page_size + offsets).flatten()


# -- KV cache ----------------------------------------------------------------------------------------
def build_sglang_kv(engine, num_pages: int, guard_pages: int = GUARD_PAGES) -> PagedKVCache:
    """A PagedKVCache whose K/V are the buffers of a real MHATokenToKVPool (no copy).

    The pool is sized for ``num_pages + guard_pages`` pages; with SGLang's padding page 0 its buffers
    ``[size + page_size, H, D]`` are exactly ``[num_pages + 1 + guard_pages, page_size, H, D]``. The pool
    is kept as ``kv.sglang_pool`` (the allocator is built over it).
    """
    mc, cfg, ps = engine.model.config, engine.config, engine.page_size
    dtype = KV_DTYPES[cfg.kv_dtype]
    pool = _sglang()[2](size=(num_pages + guard_pages) * ps, page_size=ps, dtype=dtype,
                        head_num=mc.n_kv_heads, head_dim=mc.head_dim, layer_num=mc.n_layers,
                        device=cfg.device, enable_memory_saver=False)
    k = [_paged(b, ps, dtype) for b in pool.k_buffer]
    v = [_paged(b, ps, dtype) for b in pool.v_buffer]
    kv = PagedKVCache.over_buffers(k, v, cfg.kv_dtype, backend=cfg.backend, guard_pages=guard_pages,
                                   rotate_k=cfg.kv_rotate_k, residual=engine.residual)
    kv.sglang_pool = pool
    return kv


def _paged(buffer: torch.Tensor, page_size: int, dtype: torch.dtype) -> torch.Tensor:
    """SGLang's ``[slots, H, D]`` store (uint8 for FP8) as ``[pages, page_size, H, D]`` of ``dtype``."""
    return buffer.view(dtype).view(-1, page_size, *buffer.shape[1:])


# -- allocator ---------------------------------------------------------------------------------------
class SGLangPageAllocator:
    """``PageAllocator``'s interface over SGLang's PagedTokenToKVPoolAllocator (page ids, not slots)."""

    def __init__(self, allocator, listeners=(), *, tagger=None):
        self.sglang = allocator
        self.page_size = allocator.page_size
        self.num_pages = allocator.num_pages
        self.tagger = tagger
        self.listeners = with_tagger(listeners, tagger)

    @property
    def free_pages(self) -> torch.Tensor:
        """SGLang's free page ids (int64, CPU), duplicates included, in allocation order."""
        return self.sglang.get_all_free_pages().cpu()

    def available(self) -> int:
        return self.sglang.available_size() // self.page_size

    def can_alloc(self, n: int) -> bool:
        return n <= self.available()

    def alloc(self, n: int) -> torch.Tensor:
        """Hand out ``n`` pages (int64 [n], CPU) through SGLang's ``alloc(n * page_size)``."""
        return self.alloc_tagged(n)[0]

    def alloc_tagged(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``alloc(n)`` and the tags the tagger gave the pages, one per slot (None: no tags)."""
        slots = self.sglang.alloc(n * self.page_size)
        if slots is None:
            raise OutOfPages(f"need {n} pages, {self.available()} free")
        pages = (slots[::self.page_size] // self.page_size).cpu()
        return pages, notify_alloc(self.listeners, self.tagger, pages)

    def free(self, pages: torch.Tensor) -> None:
        """Return pages through SGLang's ``free_segment`` (prepended, no duplicate check)."""
        pages = torch.as_tensor(pages, dtype=torch.int64).flatten().cpu()
        if pages.numel() == 0:
            return
        slots = page_slots(pages, self.page_size).to(self.sglang.device)
        self.sglang.free_segment(slots, start_pos=0)
        for listener in self.listeners:
            listener.on_free(pages)

    def duplicate_free_pages(self) -> int:
        """SGLang's debug check (``_debug_check_no_duplicate_pages``) as a count."""
        free = self.sglang.get_all_free_pages()
        return int(free.numel() - torch.unique(free).numel())


# -- request rows and the page table -----------------------------------------------------------------
class SGLangReqToPagePool:
    """``ReqToPagePool``'s interface over SGLang's ReqToTokenPool (engine row r = SGLang row r + 1).

    NOTE: the page table the engine, the faults, the tracker and the oracle use is SGLang's
    ``req_to_token`` read at page starts, ``table[r, j] == req_to_token[r + 1, j * ps] // ps``:
    - page size 1: ``table`` IS ``req_to_token[1:]`` (a view): the engine reads SGLang's tensor, and a
      fault writing ``engine.table`` writes SGLang's ``req_to_token``.
    - page size > 1: a token-slot tensor has no page-id view, so ``table`` is an int32 mirror kept
      identical to it at every access of ``table`` (which is how everyone reaches it: ``engine.table``
      is a property). A write to the mirror since the last access (a fault corrupting ``engine.table``)
      is pushed into ``req_to_token`` as that page's slots (``page * ps + off``, what SGLang's allocation
      kernels write); a write to ``req_to_token`` alone is pulled into the mirror. So what the engine
      reads and what SGLang's ``req_to_token`` holds never differ when either is read.
    The engine's own mappings go through ``ReqToTokenPool.write`` with every slot of the granted pages.
    Like SGLang (and ``ReqToPagePool``), freed rows are not cleared: stale entries stay.
    """

    def __init__(self, pool, page_size: int, max_pages: int):
        self.sglang = pool
        self.page_size = page_size
        self._starts = pool.req_to_token[1:, ::page_size][:, :max_pages]  # view: slot at each page start
        if page_size == 1:
            self._table = self._starts
        else:
            self._table = (self._starts // page_size).to(torch.int32)
            self._synced = self._table.clone()  # the table as of the last sync

    @property
    def table(self) -> torch.Tensor:
        """int32 [rows, max_pages] page ids, identical to ``req_to_token`` at page starts."""
        self._sync()
        return self._table

    @property
    def max_pages(self) -> int:
        return self._table.shape[1]

    def can_alloc(self) -> bool:
        return self.sglang.available_size() > 0

    def alloc_row(self) -> int:
        rows = self.sglang.alloc_rows(1)
        if rows is None:
            raise OutOfPages("no free request slot")
        return rows[0] - 1

    def free_row(self, row: int) -> None:
        self.sglang.free_rows([row + 1])

    def write(self, row: int, first: int, pages: torch.Tensor) -> None:
        """Map logical pages ``first..`` of ``row`` to ``pages``: their slots into ``req_to_token``."""
        n = pages.numel()
        if first + n > self.max_pages:
            raise ValueError(f"row {row}: logical pages {first}..{first + n} exceed max_pages {self.max_pages}")
        self._sync()
        pages = pages.to(self._table.device, torch.int64).flatten()
        ps = self.page_size
        self.sglang.write((row + 1, slice(first * ps, (first + n) * ps)), page_slots(pages, ps).to(torch.int32))
        if ps > 1:
            self._table[row, first:first + n] = pages.to(torch.int32)
            self._synced[row, first:first + n] = pages.to(torch.int32)

    def _sync(self) -> None:
        """Make the mirror and ``req_to_token`` agree (page size > 1); see the class NOTE."""
        if self.page_size == 1:
            return
        derived = (self._starts // self.page_size).to(torch.int32)
        pushed = self._table != self._synced
        pulled = (derived != self._synced) & ~pushed
        if bool(pushed.any()):
            self._push(pushed.nonzero())
        if bool(pulled.any()):
            self._table[pulled] = derived[pulled]
        self._synced.copy_(self._table)

    def _push(self, entries: torch.Tensor) -> None:
        """Write the mirror's ``entries`` ([k, 2] (row, logical page)) into ``req_to_token``."""
        ps = self.page_size
        rows, cols = entries[:, 0], entries[:, 1]
        offsets = torch.arange(ps, device=entries.device)
        index = ((rows + 1)[:, None], cols[:, None] * ps + offsets)
        values = self._table[rows, cols].long()[:, None] * ps + offsets
        self.sglang.write(index, values.to(torch.int32))


def build_sglang_memory(engine, num_pages: int, listeners, *,
                        tagger=None) -> tuple[SGLangPageAllocator, SGLangReqToPagePool]:
    """(allocator, request pool) over SGLang's PagedTokenToKVPoolAllocator and ReqToTokenPool; ``tagger``
    (the tracker) tags every allocation (``SGLangPageAllocator.alloc_tagged``).

    The allocator hands out pages ``1..num_pages`` (page 0 is SGLang's padding page, our scratch) over
    the engine's MHATokenToKVPool (``engine.kv.sglang_pool``); the request pool has one row per
    running slot, ``max_pages * page_size`` token slots wide.
    """
    allocator_cls, req_pool_cls, _ = _sglang()
    cfg, ps = engine.config, engine.page_size
    kvcache = getattr(engine.kv, "sglang_pool", None)
    allocator = allocator_cls(num_pages * ps, page_size=ps, dtype=KV_DTYPES[cfg.kv_dtype], device=cfg.device,
                              kvcache=kvcache, need_sort=False)
    pool = req_pool_cls(size=cfg.max_running, max_context_len=engine.max_pages * ps, device=cfg.device,
                        enable_memory_saver=False)
    return SGLangPageAllocator(allocator, listeners, tagger=tagger), SGLangReqToPagePool(pool, ps, engine.max_pages)
