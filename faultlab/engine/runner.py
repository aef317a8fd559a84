"""``ModelRunner``: runs the model over its KV cache for one step's ``StepContext``.

The engine schedules, keeps the books and drives the tracker; the runner only executes forwards: a
prefill's last-token logits, a decode batch's logits (through CUDA graphs when they are on), and the
KV-residual sink refresh after a prefix-cache hit. In batch-invariant mode it cuts the context into
pieces (token by token, row by row), and the piece that ends the forward carries the verdict ride.
"""
from __future__ import annotations

import torch

from .context import StepContext


class ModelRunner:
    """One model over one KV cache (the engine's decode side, or a phase split's prefill side)."""

    def __init__(self, model, kv, *, batch_invariant: bool, graphs=None):
        self.model, self.kv = model, kv
        self.batch_invariant = batch_invariant
        self.graphs = graphs  # a GraphedDecode (cuda_graphs.py) or None

    @property
    def graphed(self) -> bool:
        """Do decode forwards replay CUDA graphs (which take no verdict ride)?"""
        return self.graphs is not None

    def prefill(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Logits [1, vocab] of the prompt's last token; tokens [T] at the prefill context's positions."""
        if not self.batch_invariant:
            return self.model.forward(tokens, self.kv, ctx, last_only=True)
        # NOTE: token by token, each prompt position reads its prefix from the (FP8) cache whether or not
        # the prefix came from the prefix cache, and every GEMM has one row: a prompt's logits do not
        # depend on cache hits or on the shape of the prefill.
        n = tokens.numel()
        for t in range(n):
            logits = self.model.forward(tokens[t:t + 1], self.kv, ctx.piece(t, last=t == n - 1), last_only=True)
        return logits

    def decode(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Logits [B, vocab] of one token per request (tokens [B]) under the decode context."""
        if not self.batch_invariant:
            return self._decode_rows(tokens, ctx)
        # NOTE: row by row, each request's logits are bit-identical whatever else is in the batch, so
        # a chaos run can compare every non-victim's output with the fault-free run token for token.
        n = tokens.numel()
        return torch.cat([self._decode_rows(tokens[b:b + 1], ctx.piece(b, last=b == n - 1)) for b in range(n)])

    def _decode_rows(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs(tokens, ctx)
        return self.model.forward(tokens, self.kv, ctx)

    def refresh_sink(self, prompt: list[int], n_shared: int, ctx: StepContext) -> None:
        """A prefix-cache hit shares the sink pages but not their KV residual (it lives in the row of the
        request that wrote them): recompute the first sink tokens over the shared pages, writing their
        residual into this request's row and their K/V into scratch (the shared pages keep their bytes).
        The sink's K/V depend on the sink's tokens only, so the residual comes out as a miss would write
        it. ``ctx``: the step's prefill context (its page row is what the step's check covered).
        """
        layout = self.kv.residual
        if layout is None or not n_shared or not layout.sink_pages:
            return
        ps, device = self.kv.page_size, ctx.page_row.device
        n = min(layout.sink_pages, n_shared) * ps
        tokens = torch.tensor(prompt[:n], device=device)
        scratch = torch.arange(n, device=device) % ps  # slots of scratch page 0
        sink = StepContext.for_prefill(0, scratch, ctx.page_row, ctx.rows)
        chunk = 1 if self.batch_invariant else n  # as `prefill` computed them
        for t in range(0, n, chunk):
            self.model.forward(tokens[t:t + chunk], self.kv, sink.piece(t, chunk), last_only=True)
