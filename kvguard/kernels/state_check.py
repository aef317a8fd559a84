"""The recurrent-state slot check of a hybrid linear-attention / mamba batch: one launch per forward.

For each batch entry ``b`` the kernel reads the state slot the forward will read for it
(``slot_table[rows[b]]``: SGLang's ``req_index_to_mamba_index_mapping`` at the batch's row indices), compares it
with the slot the request was given (``expected_slot[b]``) and compares that slot's current generation
(``gens[expected_slot[b]]``, bumped each time the slot is handed out) with the one the request was given it at
(``expected_gen[b]``). A mismatch, or an expected slot off the pool, is bad: ``bad[b]`` is 1, and the table entry
is pointed at ``scratch_slot`` (SGLang's dummy slot 0) in the same launch, so the coming forward reads and writes
the dummy slot for that request, never another request's state. No host synchronisation, no atomics.

``state_check_ref`` is the torch reference (ground truth for the tests; what runs on a CPU without Triton's
interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import DirectLaunch, interpreted, spec

BLOCK = 128
_PER_STEP = ["rows_ptr", "expected_slot_ptr", "expected_gen_ptr", "bad_ptr", "n"]


@triton.jit(do_not_specialize=["n_slots", "scratch_slot"] + _PER_STEP, do_not_specialize_on_alignment=_PER_STEP)
def _state_check_kernel(table_ptr, rows_ptr, expected_slot_ptr, expected_gen_ptr, gens_ptr, bad_ptr, n, n_slots,
                        scratch_slot, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    row = tl.load(rows_ptr + offs, mask=live, other=0).to(tl.int64)
    slot = tl.load(table_ptr + row, mask=live, other=0).to(tl.int64)
    want = tl.load(expected_slot_ptr + offs, mask=live, other=0).to(tl.int64)
    in_pool = (want >= 0) & (want < n_slots)
    gen = tl.load(gens_ptr + tl.where(in_pool, want, 0), mask=live & in_pool, other=-1)
    want_gen = tl.load(expected_gen_ptr + offs, mask=live, other=-2)
    bad = live & ((slot != want) | (gen != want_gen) | (in_pool == 0))
    tl.store(table_ptr + row, tl.zeros_like(slot) + scratch_slot, mask=bad)
    tl.store(bad_ptr + offs, bad.to(tl.int32), mask=live)


class StateCheck:
    """The launcher over one state-slot table and its generations (fixed for its life); validates its inputs."""

    def __init__(self, table: torch.Tensor, gens: torch.Tensor, scratch_slot: int = 0):
        assert table.dim() == 1 and table.dtype in (torch.int32, torch.int64), f"slot table {table.shape} {table.dtype}"
        assert gens.dim() == 1 and gens.dtype == torch.int64 and gens.device == table.device, \
            f"generations {gens.shape} {gens.dtype} on {gens.device}, table on {table.device}"
        self.table, self.gens, self.scratch = table, gens, int(scratch_slot)
        self.kernel = table.is_cuda or interpreted()  # else the torch reference (a CPU without the interpreter)
        self.launch = DirectLaunch(_state_check_kernel, table.device) if self.kernel else None

    def __call__(self, rows: torch.Tensor, expected_slot: torch.Tensor, expected_gen: torch.Tensor,
                 bad: torch.Tensor) -> torch.Tensor:
        """``bad[:n]`` (int32) for the ``n = rows.numel()`` entries; flagged entries' table cells -> scratch."""
        n = rows.numel()
        # rows, expected_slot, expected_gen, bad: [n] on the table's device
        assert expected_slot.numel() == n and expected_gen.numel() == n and bad.numel() >= n, \
            f"state check of {n} rows with {expected_slot.numel()} slots, {expected_gen.numel()} generations, " \
            f"{bad.numel()} verdict cells"
        if not n:
            return bad[:0]
        if not self.kernel:
            bad[:n] = state_check_ref(self.table, rows, expected_slot, expected_gen, self.gens, self.scratch)
            return bad[:n]
        key = (spec(rows), spec(expected_slot), spec(bad))
        self.launch((triton.cdiv(n, BLOCK),), key,
                    (self.table, rows, expected_slot, expected_gen, self.gens, bad, n, self.gens.numel(),
                     self.scratch), {"BLOCK": BLOCK})
        return bad[:n]


def state_check_ref(table, rows, expected_slot, expected_gen, gens, scratch_slot: int = 0) -> torch.Tensor:
    """The torch reference of :class:`StateCheck` (same effect on ``table``): int32 [n]."""
    rows = rows.long()
    slot = table[rows].long()
    want = expected_slot.long()
    in_pool = (want >= 0) & (want < gens.numel())
    gen = torch.where(in_pool, gens[want.clamp(0, gens.numel() - 1)], torch.full_like(want, -1))
    bad = (slot != want) | (gen != expected_gen.long()) | ~in_pool
    table[rows] = torch.where(bad, torch.full_like(slot, scratch_slot), slot).to(table.dtype)
    return bad.to(torch.int32)
