"""Per-page tags: a device tensor that changes whenever a page is handed out or given back.

Tags come from one global counter (an int64 kept on the host), so every tag ever written is unique
across pages *and* time: a swapped, shifted, aliased or stale page-table entry can never carry the tag
the request expects by accident. Expected tags are >= 0; ``UNSET = -1`` marks "nothing expected", which
no page ever carries.

NOTE (wrap-around): the counter is int64 and starts at the pool size. A server that bumps a million
pages per second (an H200 decoding 256 requests at page size 1 is ~25,000 per second) needs
2**63 / 1e6 s = 292,000 years to wrap. We still assert that the counter stays below 2**63 - 1.

NOTE (bump on free): tags change on free as well as on allocation. A premature free (a page returned
while a request still maps it) is then caught at the very next check, before the page is even reused;
a free costs one small device write, like an allocation.
"""
import torch

UNSET = -1
_TAG_LIMIT = 2**63 - 1


class TagTable:
    """Owns the per-page tags. Pages are indices into the pool, page 0 (scratch) included."""

    def __init__(self, num_pages: int, device: torch.device | str, *, kernel: bool = False):
        if num_pages < 1:
            raise ValueError(f"TagTable: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.tags = torch.arange(num_pages, dtype=torch.int64, device=device)  # [num_pages]
        self.next_tag = num_pages
        self.bumps = 0
        self._bumper = None
        if kernel:  # one Triton launch per bump instead of two torch ops (lazy: Triton only when asked)
            from .kernels.record import Bumper

            self._bumper = Bumper(self.tags)

    def reserve(self, count: int) -> int:
        """Take ``count`` fresh tags for a bump the caller launches itself (``kvguard.kernels.record``): the first.

        The caller must bump with exactly these tags before anything reads the pages' tags again.
        """
        assert self.next_tag + count < _TAG_LIMIT, f"tag counter would wrap at {self.next_tag}"
        base = self.next_tag
        self.next_tag += count
        self.bumps += count
        return base

    def bump(self, pages: torch.Tensor) -> torch.Tensor:
        """Give each entry of ``pages`` a fresh, never-used tag; return them (int64 [n], no sync).

        NOTE: a corrupted free list can hand out one page twice in a single allocation (a double
        free followed by ``alloc(2)``). Each *slot* of the allocation gets its own tag, the page keeps
        the largest (``scatter_reduce`` amax: deterministic on every device, unlike ``index_put`` with
        duplicate indices), so the earlier slot's owner records a tag the page no longer carries.
        """
        count = pages.numel()
        if count == 0:
            return torch.empty(0, dtype=torch.int64, device=self.tags.device)
        base = self.reserve(count)
        if self._bumper is not None:
            fresh = torch.empty(count, dtype=torch.int64, device=self.tags.device)
            self._bumper(pages, base, fresh)
            return fresh
        fresh = torch.arange(base, base + count, device=self.tags.device)
        pages = pages.to(device=self.tags.device, dtype=torch.int64)
        self.tags.scatter_reduce_(0, pages, fresh, reduce="amax")
        return fresh

    def gather(self, pages: torch.Tensor) -> torch.Tensor:
        """Current tags of ``pages`` (device gather, no sync)."""
        return self.tags[pages.to(device=self.tags.device, dtype=torch.int64)]
