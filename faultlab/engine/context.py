"""``StepContext``: what one forward needs besides its tokens, built once per step and passed down.

The engine builds one per forward right before it runs (after the check, once the write slots are final) and
hands it to the model, which hands it to the KV cache and, at the end, to the last all-reduce: the write
slots, the kernel-visible page table, the positions, the request rows a KV residual is addressed by, and a
tensor-parallel check's verdict ride. Nothing of it is parked on an object between calls (nano-vllm's
``Context``, passed explicitly instead of held in a global).

Two kinds: a decode context (one token per request, ``B = T``) and a prefill context (``T`` tokens of one
request at host positions ``start..start+T-1``, ``B = 1``). ``piece`` cuts one out for a batch-invariant
forward that runs row by row (decode) or token by token (prefill); the ride goes with the last piece only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class StepContext:
    """One forward's per-step state (see the module docstring). Shapes: ``T`` tokens, ``B`` requests."""

    positions: torch.Tensor  # long [T]: the position of each token fed
    slots: torch.Tensor  # long [T]: the flat KV slot each token's K/V is written to (page * page_size + offset)
    block: torch.Tensor  # int32 [B, P]: the kernel-visible page table (the check quarantined it in place)
    rows: torch.Tensor | None = None  # [B] request rows: where a KV residual lives (None: read by nothing)
    ride: Any = None  # a kvguard VerdictRide: the check's flags, boarded on the forward's last all-reduce (TP)
    start: int | None = None  # prefill: host position of the first token; None: a decode context

    @classmethod
    def for_decode(cls, positions: torch.Tensor, slots: torch.Tensor, block: torch.Tensor,
                   rows: torch.Tensor | None = None, ride: Any = None) -> "StepContext":
        """One token per request: positions/slots [B], block [B, P], rows [B]."""
        return cls(positions, slots, block, rows, ride)

    @classmethod
    def for_prefill(cls, start: int, slots: torch.Tensor, page_row: torch.Tensor, row: int | torch.Tensor | None = None,
                    ride: Any = None, positions: torch.Tensor | None = None) -> "StepContext":
        """``slots.numel()`` tokens of one request from position ``start`` over ``page_row`` (int32 [P]);
        ``row``: its request row (an int or a 0-d/1-element tensor)."""
        if positions is None:
            positions = torch.arange(start, start + slots.numel(), device=slots.device)
        rows = None if row is None else torch.as_tensor(row, device=positions.device).reshape(1)
        return cls(positions, slots, page_row.reshape(1, -1), rows, ride, start)

    @property
    def is_prefill(self) -> bool:
        return self.start is not None

    @property
    def page_row(self) -> torch.Tensor:
        """int32 [P]: a prefill's page row."""
        return self.block[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        """int32 [B]: the tokens each request holds once this forward has written its own."""
        if self.is_prefill:
            return torch.full((1,), self.start + self.positions.numel(), dtype=torch.int32,
                              device=self.positions.device)
        return (self.positions + 1).to(torch.int32)

    def token_rows(self) -> torch.Tensor | None:
        """[T]: the request row of each token (None without rows)."""
        if self.rows is None or not self.is_prefill:
            return self.rows
        return self.rows.expand(self.positions.numel())

    def token_lens(self) -> torch.Tensor:
        """[T]: the length of each token's request once this forward has written its own."""
        lens = self.seq_lens
        return lens.expand(self.positions.numel()) if self.is_prefill else lens

    def piece(self, i: int, n: int = 1, *, last: bool = False) -> "StepContext":
        """Tokens (prefill) or requests (decode) ``i..i+n`` as a context of their own; the ride stays only
        on the ``last`` piece (the forward that ends the step carries the verdict)."""
        ride = self.ride if last else None
        if self.is_prefill:
            return replace(self, positions=self.positions[i:i + n], slots=self.slots[i:i + n], ride=ride,
                           start=self.start + i)
        rows = None if self.rows is None else self.rows[i:i + n]
        return replace(self, positions=self.positions[i:i + n], slots=self.slots[i:i + n],
                       block=self.block[i:i + n], rows=rows, ride=ride)
