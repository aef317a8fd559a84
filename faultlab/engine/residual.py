"""The KV residual's layout: which pages of a request keep a second FP8 byte per K/V element, and where.

docs/structures.md ("KV residual") has the design and its measurements; ``PagedKVCache(residual=...)`` holds
the pages, ``StepContext.rows`` addresses them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

RESIDUAL_SINK, RESIDUAL_WINDOW = 16, 128  # default tokens with a residual: first (sink), most recent


@dataclass(frozen=True)
class ResidualLayout:
    """Which KV pages of a request keep a residual byte, and where the residual lives.

    FP8 K/V have 3 mantissa bits; a second e4m3 byte per element, the residual `(y - e4m3(y)) * 16`,
    brings a page back to about BF16 precision. Each request row owns `pages_per_row` residual pages:
    `sink_pages` for its first logical pages (the attention sink) and a ring of `ring_pages` for its
    most recent ones. At length L (tokens, the one being written or read included) logical page j has
    a residual iff j < sink_pages, or window_start <= j and cur - ring_pages < j <= cur, with
    cur = (L - 1) // page_size and `window_start` the row's first page eligible for the ring (the engine
    sets it past the prompt pages the prefix cache could share, so that a request's numerics do not
    depend on cache hits). Ring page j lives in slot sink_pages + j % ring_pages, so a page leaves the
    ring exactly when the page that overwrites its slot starts. Row `rows` is scratch (CUDA-graph
    padding rows use it). Rows are zeroed on admission: a page nobody wrote a residual for reads 0.
    """

    rows: int
    page_size: int
    sink_pages: int
    ring_pages: int

    @classmethod
    def of(cls, rows: int, page_size: int, sink_tokens: int = RESIDUAL_SINK,
           window_tokens: int = RESIDUAL_WINDOW) -> "ResidualLayout":
        """At least `sink_tokens` first and `window_tokens` most recent tokens of each request."""
        if rows < 1 or sink_tokens < 0 or window_tokens < 1:
            raise ValueError(f"KV residual: need rows >= 1, sink_tokens >= 0, window_tokens >= 1; got "
                             f"{rows}, {sink_tokens}, {window_tokens}")
        return cls(rows, page_size, -(-sink_tokens // page_size), -(-window_tokens // page_size) + 1)

    @property
    def pages_per_row(self) -> int:
        return self.sink_pages + self.ring_pages

    @property
    def max_tokens(self) -> int:
        """The most tokens of one request that can have a residual at once (the kernel's res_max_tokens)."""
        return self.pages_per_row * self.page_size

    @property
    def num_pages(self) -> int:
        """Residual pages in all, the scratch row's included."""
        return (self.rows + 1) * self.pages_per_row

    def pages(self, rows: torch.Tensor, logical: torch.Tensor, lengths: torch.Tensor,
              window_start: torch.Tensor | int = 0) -> torch.Tensor:
        """Residual page (long) of logical page `logical` of row `rows` at `lengths` tokens, -1 if none
        (arguments broadcast)."""
        cur = torch.div(lengths - 1, self.page_size, rounding_mode="floor")
        sink = logical < self.sink_pages
        recent = (logical > cur - self.ring_pages) & (logical <= cur) & (logical >= window_start)
        slot = torch.where(sink, logical, self.sink_pages + logical % self.ring_pages)
        return torch.where(sink | recent, rows.long() * self.pages_per_row + slot, -1)

    def table(self, rows: torch.Tensor, width: int, lengths: torch.Tensor,
              window_start: torch.Tensor | int = 0) -> torch.Tensor:
        """int32 [B, width]: the residual page of each logical page of rows [B] at lengths [B] (window_start
        [B] or one int), or -1."""
        logical = torch.arange(width, device=rows.device)[None, :]
        if isinstance(window_start, torch.Tensor):
            window_start = window_start[:, None]
        return self.pages(rows[:, None], logical, lengths[:, None], window_start).to(torch.int32)

    def bounds(self, lengths: torch.Tensor, window_start: torch.Tensor) -> torch.Tensor:
        """int32 [B, 2]: (a, c) per request at lengths [B]: only tokens < a (the sink) or >= c (the ring)
        can have a residual (the attention kernel's `res_bounds`)."""
        cur = torch.div(lengths - 1, self.page_size, rounding_mode="floor")
        ring_lo = torch.maximum(window_start, cur - self.ring_pages + 1)
        sink = torch.full_like(ring_lo, self.sink_pages * self.page_size)
        return torch.stack([sink, ring_lo * self.page_size], dim=1).to(torch.int32)

    def write_slots(self, rows: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                    window_start: torch.Tensor | int = 0) -> torch.Tensor:
        """long [T]: the residual slot of tokens at positions [T] of rows [T] when the request is
        `lengths` [T] tokens long after the write; -1 where the token's page keeps no residual."""
        ps = self.page_size
        page = self.pages(rows, torch.div(positions, ps, rounding_mode="floor"), lengths, window_start)
        return torch.where(page >= 0, page * ps + positions % ps, -1)

    def nbytes(self, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
        """Bytes of this layout's pages over all layers (one FP8 byte per K and V element)."""
        return 2 * self.num_pages * self.page_size * n_layers * n_kv_heads * head_dim
