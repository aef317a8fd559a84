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
    ``slots[starts[b]:starts[b] + lens[b]]`` (an extend: one slot per new token).
    """

    slots: torch.Tensor
    starts: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    scratch: int = 0


GUARD_NONE, GUARD_ONE, GUARD_SEGMENTS = 0, 1, 2  # the kernel's write-guard modes


def apply_guard(guard: WriteGuard, flagged: torch.Tensor) -> None:
    """The write guard in torch: every slot of a flagged batch entry (bool ``[B]``) becomes ``guard.scratch``.

    The reference's guard, and how a caller guards requests it flags itself (reads the segment bounds on
    the host when there are segments: keep it off the common path)."""
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
