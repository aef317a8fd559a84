"""KV bookkeeping with SGLang's semantics, one owner per structure.

- ``PageAllocator`` owns the free-page list (pages ``1..num_pages``; page 0 is scratch). Like SGLang's
  paged allocator, an allocation takes a prefix of the free list and a free *prepends* (LIFO reuse),
  with no duplicate check: a double free really leaves a page twice in the list.
- ``ReqToPagePool`` owns the request->page table: one int32 row per request slot.
- ``RadixCache`` (in radix.py) owns cached prefix pages and their lock counts.

Listeners (the tracker, the oracle) observe ``on_alloc(pages)`` / ``on_free(pages)``. One of them may be
the allocator's *tagger* (the tracker): its ``on_alloc`` reply, the tag each slot of the allocation got, is
what ``alloc_tagged`` returns with the pages, so the engine records exactly those tags.
"""
import torch


class OutOfPages(RuntimeError):
    """The allocator cannot satisfy a request (callers check ``can_alloc`` first)."""


class PageAllocator:
    """Free-page list. ``alloc`` takes a prefix; ``free`` prepends; listeners see every page move."""

    def __init__(self, num_pages: int, listeners=(), *, tagger=None):
        if num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.free_pages = torch.arange(1, num_pages + 1, dtype=torch.int64)  # [n_free]
        self.tagger = tagger
        self.listeners = with_tagger(listeners, tagger)

    def available(self) -> int:
        return int(self.free_pages.numel())

    def can_alloc(self, n: int) -> bool:
        return n <= self.available()

    def alloc(self, n: int) -> torch.Tensor:
        """Hand out ``n`` pages (int64 [n], CPU)."""
        return self.alloc_tagged(n)[0]

    def alloc_tagged(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``alloc(n)`` and the tags the tagger gave the pages, one per slot (None: no tags)."""
        if not self.can_alloc(n):
            raise OutOfPages(f"need {n} pages, {self.available()} free")
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages, notify_alloc(self.listeners, self.tagger, pages)

    def free(self, pages: torch.Tensor) -> None:
        """Return pages (prepended: the next allocation reuses them first)."""
        pages = torch.as_tensor(pages, dtype=torch.int64).flatten().cpu()  # the free list lives on the host
        if pages.numel() == 0:
            return
        self.free_pages = torch.cat([pages, self.free_pages])
        for listener in self.listeners:
            listener.on_free(pages)

    def duplicate_free_pages(self) -> int:
        """SGLang-style check: how many entries of the free list are duplicates."""
        return int(self.free_pages.numel() - torch.unique(self.free_pages).numel())


class ReqToPagePool:
    """Request slots and their page-table rows (``table[row, j]`` = physical page of logical page j)."""

    def __init__(self, num_rows: int, max_pages: int, device="cpu"):
        self.table = torch.zeros((num_rows, max_pages), dtype=torch.int32, device=device)
        self.free_rows = list(range(num_rows - 1, -1, -1))  # pop() hands out low rows first

    @property
    def max_pages(self) -> int:
        return self.table.shape[1]

    def can_alloc(self) -> bool:
        return bool(self.free_rows)

    def alloc_row(self) -> int:
        if not self.free_rows:
            raise OutOfPages("no free request slot")
        return self.free_rows.pop()

    def free_row(self, row: int) -> None:
        # NOTE: like SGLang, rows are not cleared: stale entries remain past the live length.
        self.free_rows.append(row)

    def write(self, row: int, first: int, pages: torch.Tensor) -> None:
        """``table[row, first:first+len(pages)] = pages``."""
        n = pages.numel()
        if first + n > self.max_pages:
            raise ValueError(f"row {row}: logical pages {first}..{first + n} exceed max_pages {self.max_pages}")
        self.table[row, first:first + n] = pages.to(self.table.device, torch.int32)


def with_tagger(listeners, tagger) -> list:
    """The listener list: the tagger first (it tags the pages before anyone else sees them)."""
    return ([] if tagger is None else [tagger]) + [x for x in listeners if x is not tagger]


def notify_alloc(listeners, tagger, pages: torch.Tensor) -> torch.Tensor | None:
    """Tell every listener about an allocation; the tagger's reply (the tags) or None."""
    tags = None
    for listener in listeners:
        reply = listener.on_alloc(pages)
        if listener is tagger:
            tags = reply
    return tags
