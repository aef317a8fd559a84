"""The write guard: a forward's KV write slots, rewritten to a scratch slot for every request a check flags.

A check kernel (``tag_check``, ``window_check``) applies it in its own launch (its ``GUARD`` mode, one of the
modes below); :func:`apply_guard` is the same guard in torch (the references', and a caller's own flags).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class WriteGuard:
    """The coming forward's KV write slots, rewritten to ``scratch`` for every flagged request.

    ``slots`` (1-D int32/int64, on the table's device) is changed in place. Without ``starts``/``lens``
    batch entry ``b`` owns ``slots[b]`` (a decode step); with them it owns
    ``slots[starts[b]:starts[b] + lens[b]]`` (an extend: one slot per new token). With ``tail`` (a tag check
    over a token table only, :func:`WriteGuard.row_tail`) ``slots`` is the checked table itself and batch entry
    ``b`` owns the entries ``[starts[b], n_entries[b])`` of the row it is checked at: the entries a spec step's
    writes are addressed through, with no tensor built per step.
    """

    slots: torch.Tensor
    starts: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    scratch: int = 0
    tail: bool = False

    @classmethod
    def row_tail(cls, table: torch.Tensor, starts: torch.Tensor, scratch: int = 0) -> "WriteGuard":
        """Entries ``[starts[b], n_entries[b])`` of each checked row of ``table`` (the check's own table)."""
        return cls(table, starts, None, scratch, True)


GUARD_NONE, GUARD_ONE, GUARD_SEGMENTS, GUARD_TAIL = 0, 1, 2, 3  # the kernel's write-guard modes


def guard_mode(guard: WriteGuard | None) -> int:
    return GUARD_NONE if guard is None else GUARD_TAIL if guard.tail else GUARD_ONE if guard.starts is None \
        else GUARD_SEGMENTS


def apply_guard(guard: WriteGuard, flagged: torch.Tensor, rows: torch.Tensor | None = None,
                ends: torch.Tensor | None = None) -> None:
    """The write guard in torch: every slot of a flagged batch entry (bool ``[B]``) becomes ``guard.scratch``.

    The reference's guard, and how a caller guards requests it flags itself (reads the segment bounds on
    the host when there are segments: keep it off the common path). A ``tail`` guard needs the batch's table
    ``rows`` and ``ends`` (its check's n_entries); a row outside the table is not written."""
    if guard.tail:
        table = guard.slots
        for b in flagged.nonzero().flatten().tolist():
            row, first, end = int(rows[b]), int(guard.starts[b]), int(ends[b])
            if 0 <= row < table.shape[0]:
                table[row, max(first, 0):max(end, 0)] = guard.scratch
        return
    if guard.starts is None:
        guard.slots.masked_fill_(flagged, guard.scratch)
        return
    for b in flagged.nonzero().flatten().tolist():
        first, length = int(guard.starts[b]), int(guard.lens[b])
        guard.slots[first:first + length] = guard.scratch


@triton.jit
def guard_writes(out_ptr, out_starts_ptr, out_lens_ptr, b, count, scratch_slot, GUARD: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The guard inside a check kernel's program for batch entry ``b`` that found ``count`` bad entries: its write
    slot (GUARD 1) or its segment of slots (GUARD 2) rewritten to ``scratch_slot``; programs of one request may
    store the same value (no atomics needed)."""
    if GUARD == 1:
        tl.store(out_ptr + b, (count * 0 + scratch_slot).to(out_ptr.dtype.element_ty), mask=count > 0)
    if GUARD == 2:
        first = tl.load(out_starts_ptr + b).to(tl.int64)
        length = tl.load(out_lens_ptr + b).to(tl.int64)
        for s in range(0, length, BLOCK):
            idx = s + tl.arange(0, BLOCK)
            tl.store(out_ptr + first + idx, (idx * 0 + scratch_slot).to(out_ptr.dtype.element_ty),
                     mask=(idx < length) & (count > 0))


@triton.jit
def guard_tail(table_ptr, table_row, table_stride, starts_ptr, b, end, row_ok, count, scratch_slot,
               GUARD: tl.constexpr, BLOCK: tl.constexpr):
    """GUARD 3 (a tag check's own token table): entries ``[starts[b], end)`` of row ``table_row`` rewritten to
    ``scratch_slot`` when the program found a bad entry (a row outside the table: nothing written)."""
    if GUARD == 3:
        first = tl.maximum(tl.load(starts_ptr + b).to(tl.int64), 0)
        stop = tl.where((count > 0) & row_ok, end, first)  # (a clean program loops no step)
        for s in range(first, stop, BLOCK):
            idx = s + tl.arange(0, BLOCK)
            tl.store(table_ptr + table_row * table_stride + idx,
                     (idx * 0 + scratch_slot).to(table_ptr.dtype.element_ty), mask=idx < stop)
