"""The engine's decode step under CUDA graphs: one graph per (batch bucket, page-width bucket).

A decode step launches a few hundred small kernels (per layer: norms, GEMMs, RoPE, the K/V store,
paged attention); at small batch the CPU cannot launch them as fast as the GPU runs them. A CUDA graph
replays the whole step with one launch. Graphs have fixed shapes and fixed addresses, so each graph
owns static input buffers and the step is padded up to the next bucket:

- batch B -> the next power of 2 (at most ``max_batch``); padding rows decode token 0 at position 0
  over the scratch page 0 and write their K/V into scratch slot 0, which no request owns;
- block-table width W -> the next power of 2 pages (at most ``max_pages``); the extra columns are
  scratch page 0, past every row's length, so attention never reads them.

A row's logits depend only on its own inputs and the bucket's shape, not on the other rows.
Graphs are captured lazily on first use of a bucket (warm-up on a side stream first, so Triton
compiles outside the capture) and share one memory pool. ``capture=False`` runs the same padded
buffers eagerly: the CPU path of the bucketing, for tests.

The tracker's validation stays outside the graph, as its own launch before the step (the write-up's
separate batched pass); its verdict is read with the sampled tokens as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .context import StepContext


def bucket(n: int, cap: int) -> int:
    """The smallest power of 2 >= n, capped at cap (n >= 1)."""
    if n < 1 or n > cap:
        raise ValueError(f"need 1 <= n <= {cap}, got {n}")
    return min(cap, 1 << (n - 1).bit_length())


@dataclass(eq=False)
class _Bucket:
    tokens: torch.Tensor  # long [Bb]
    positions: torch.Tensor  # long [Bb]
    block: torch.Tensor  # int32 [Bb, Wb]
    slots: torch.Tensor  # long [Bb]
    rows: torch.Tensor  # long [Bb]: request rows (the KV residual reads them)
    out: torch.Tensor | None = None  # float32 [Bb, vocab], the graph's output
    graph: "torch.cuda.CUDAGraph | None" = None

    @property
    def ctx(self) -> StepContext:
        """The bucket's decode context: its static buffers (fixed addresses), no verdict ride."""
        return StepContext.for_decode(self.positions, self.slots, self.block, self.rows)


class GraphedDecode:
    """``model.forward(tokens, kv, ctx)`` of a decode context through padded, graph-captured buckets.

    Call it with ``(tokens, ctx)``; it returns logits [B, vocab], a copy of the
    bucket's static output (the next replay of the bucket overwrites that output: a batch-invariant
    engine decodes row by row through one bucket and keeps every row's logits).
    """

    PAD_SLOT = 0  # scratch page 0, slot 0

    def __init__(self, model, kv, max_batch: int, max_pages: int, *, capture: bool = True):
        if capture and kv.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA KV cache, got device {kv.device}")
        self.model, self.kv = model, kv
        self.max_batch, self.max_pages, self.capture = max_batch, max_pages, capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.replays = 0
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def __call__(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if ctx.is_prefill or ctx.ride is not None:
            raise ValueError("GraphedDecode replays decode contexts without a verdict ride")
        b, w = ctx.block.shape
        key = (bucket(b, self.max_batch), bucket(w, self.max_pages))
        buf = self.buckets.get(key) or self._build(key)
        self._fill(buf, tokens, ctx)
        if buf.graph is None:  # eager (capture=False)
            buf.out = self._forward(buf)
        else:
            buf.graph.replay()
            self.replays += 1
        return buf.out[:b].clone()

    def _forward(self, buf: _Bucket) -> torch.Tensor:
        return self.model.forward(buf.tokens, self.kv, buf.ctx)

    def _pad_row(self) -> int:
        """The request row of padding rows: the KV residual's scratch row (no request owns it)."""
        return 0 if self.kv.residual is None else self.kv.residual.rows

    def _fill(self, buf: _Bucket, tokens, ctx: StepContext) -> None:
        b, w = ctx.block.shape
        buf.tokens[:b].copy_(tokens)
        buf.positions[:b].copy_(ctx.positions)
        buf.slots[:b].copy_(ctx.slots)
        if ctx.rows is not None:
            buf.rows[:b].copy_(ctx.rows)
        elif self.kv.residual is not None:
            raise ValueError("this cache keeps a KV residual: a graphed decode needs the context's request rows")
        else:  # nothing reads them
            buf.rows[:b].fill_(self._pad_row())
        buf.rows[b:].fill_(self._pad_row())
        buf.block[:b, :w].copy_(ctx.block)
        # NOTE: rows and columns past this step's shape go back to padding: a previous, larger step
        # left its own rows there, and a padding row must not write into a page someone owns.
        buf.tokens[b:].zero_()
        buf.positions[b:].zero_()
        buf.slots[b:].fill_(GraphedDecode.PAD_SLOT)
        buf.block[b:].zero_()
        buf.block[:b, w:].zero_()

    def _build(self, key: tuple[int, int]) -> _Bucket:
        bb, wb = key
        dev = self.kv.device
        buf = _Bucket(tokens=torch.zeros(bb, dtype=torch.long, device=dev),
                      positions=torch.zeros(bb, dtype=torch.long, device=dev),
                      block=torch.zeros(bb, wb, dtype=torch.int32, device=dev),
                      slots=torch.full((bb,), self.PAD_SLOT, dtype=torch.long, device=dev),
                      rows=torch.full((bb,), self._pad_row(), dtype=torch.long, device=dev))
        if self.capture:  # all rows are padding now: warm-up and capture write scratch slot 0 only
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(buf)
            torch.cuda.current_stream(dev).wait_stream(side)
            buf.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(buf.graph, pool=self._pool):
                buf.out = self._forward(buf)
        self.buckets[key] = buf
        return buf
