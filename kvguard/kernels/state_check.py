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

:class:`GraphStateCheck` is the same check as a node of SGLang's decode CUDA graphs, captured beside the decode
KV check (:class:`kvguard.kernels.graph_check.GraphCheck`, one of its ``sides``): it reads the batch's rows from the
graph's static input buffer, which entries are live from the KV check's ``owner`` buffer, each entry's expected
(slot, generation) from buffers of its own written only when the batch's composition changes, and the epoch from
the KV check's counter; a mismatch sets the epoch's flag before the epoch's result word is written, so one word
still carries the whole verdict. ``graph_state_check_ref`` is its reference.
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


@triton.jit(do_not_specialize=["n_rows", "n_slots", "scratch_slot", "batch", "batch_cap"])
def _graph_state_kernel(table_ptr, rows_ptr, owner_ptr, expected_slot_ptr, expected_gen_ptr, gens_ptr, bad_ptr,
                        flag_ptr, epoch_ptr, n_rows, n_slots, scratch_slot, batch, batch_cap,
                        RING: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    epoch = tl.load(epoch_ptr)
    ring = epoch % RING
    in_batch = offs < batch
    owner = tl.load(owner_ptr + offs, mask=in_batch, other=-1)
    live = in_batch & (owner >= 0)  # a padding entry of the captured batch size (owner -1): nothing to check
    row = tl.load(rows_ptr + offs, mask=live, other=0).to(tl.int64)
    row_ok = (row >= 0) & (row < n_rows)
    slot = tl.load(table_ptr + row, mask=live & row_ok, other=-1).to(tl.int64)
    want = tl.load(expected_slot_ptr + offs, mask=live, other=-1)
    in_pool = (want >= 0) & (want < n_slots)
    gen = tl.load(gens_ptr + tl.where(in_pool, want, 0), mask=live & in_pool, other=-1)
    want_gen = tl.load(expected_gen_ptr + offs, mask=live, other=-2)
    bad = live & ((row_ok == 0) | (slot != want) | (gen != want_gen) | (in_pool == 0))
    tl.store(table_ptr + row, tl.zeros_like(slot) + scratch_slot, mask=bad & row_ok)
    tl.store(bad_ptr + ring * batch_cap + offs, bad.to(tl.int32), mask=in_batch)
    tl.store(flag_ptr + ring, epoch + 1, mask=tl.max(bad.to(tl.int32), axis=0) > 0)


class GraphStateCheck:
    """The state check captured beside ``graph``'s KV check (appended to ``graph.sides``: every decode graph captured
    with the check runs it, before the epoch's result word). ``expect`` fills its expectation buffers (on the stream,
    before the replay), ``flags`` reads an epoch's per-entry flags (device)."""

    def __init__(self, table: torch.Tensor, gens: torch.Tensor, graph, scratch_slot: int = 0):
        from .graph_check import RING

        dev = table.device
        self.table, self.gens, self.graph, self.scratch = table, gens, graph, int(scratch_slot)
        cap = graph.batch_cap
        self.expected_slot = torch.full((cap,), -1, dtype=torch.int64, device=dev)
        self.expected_gen = torch.full((cap,), -2, dtype=torch.int64, device=dev)
        self.bad = torch.zeros((RING, cap), dtype=torch.int32, device=dev)
        self.ring = RING
        self.expected_of: tuple | None = None  # the (slots, gens) tensors now in the buffers (expect)
        # compiled now, before any capture (a capture must not compile): both row dtypes, every entry padding (the
        # owner buffer is all -1 before the first batch), so nothing is checked, flagged or advanced
        for dtype in (torch.int64, torch.int32):
            self(torch.zeros(1, dtype=dtype, device=dev), 1)
        graph.sides.append(self)

    def __call__(self, table_rows: torch.Tensor, batch: int) -> None:
        """Enqueue the check of the first ``batch`` entries (captured: the graph's static row buffer)."""
        g = self.graph
        _graph_state_kernel[(triton.cdiv(batch, BLOCK),)](
            self.table, table_rows, g.owner, self.expected_slot, self.expected_gen, self.gens, self.bad, g.flag,
            g.epoch, self.table.shape[0], self.gens.numel(), self.scratch, batch, g.batch_cap, RING=self.ring,
            BLOCK=BLOCK)

    def expect(self, slots: torch.Tensor, gens: torch.Tensor) -> None:
        """Entry ``i`` expects slot ``slots[i]`` at generation ``gens[i]`` from now on (device copies on the stream,
        made only when these are not the tensors already in the buffers)."""
        held = self.expected_of
        if held is not None and held[0] is slots and held[1] is gens:
            return
        n = slots.numel()
        self.expected_slot[:n].copy_(slots, non_blocking=True)
        self.expected_gen[:n].copy_(gens, non_blocking=True)
        self.expected_of = (slots, gens)

    def flags(self, epoch: int, n: int) -> torch.Tensor:
        """The per-entry flags (int32 ``[n]``, device) of the check of ``epoch``."""
        return self.bad[epoch % self.ring, :n]


def graph_state_check_ref(table, rows, owner, expected_slot, expected_gen, gens, scratch_slot: int = 0):
    """The torch reference of one captured state check over ``rows.numel()`` entries (same effect on ``table``):
    int32 flags; entries whose ``owner`` is negative are padding (0, untouched)."""
    live = owner >= 0
    rows = rows.long()
    row_ok = (rows >= 0) & (rows < table.numel())
    slot = torch.where(live & row_ok, table[rows.clamp(0, table.numel() - 1)].long(), torch.full_like(rows, -1))
    want = expected_slot.long()
    in_pool = (want >= 0) & (want < gens.numel())
    gen = torch.where(in_pool, gens[want.clamp(0, gens.numel() - 1)], torch.full_like(want, -1))
    bad = live & (~row_ok | (slot != want) | (gen != expected_gen.long()) | ~in_pool)
    hit = rows[bad & row_ok]
    table[hit] = scratch_slot
    return bad.to(torch.int32)


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
