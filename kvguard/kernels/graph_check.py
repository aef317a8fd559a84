"""The decode check as a CUDA-graph node: the same per-token check, with nothing the host passes per step.

A kernel captured into a CUDA graph replays with the arguments it was captured with. So everything that
changes from step to step is read from memory the graph owns or the host fills before the replay:

- the batch (the table's row indices, the lengths, the write slots) from the graph runner's static input
  buffers, which SGLang fills before every replay;
- each batch entry's expectation row from ``owner`` (kvguard's own static buffer, written only when the
  batch's composition changes; ``-1`` for a padding entry, which is not checked);
- which ring slot and stamp the check uses from a device ``epoch`` counter: the check reads it, and a
  second node (:func:`_epoch_bump_kernel`) advances it, so the host knows the epoch of every check by
  counting them (:class:`GraphCheck`). That node also writes the epoch's result word, ``done``: it runs after
  every program of the check finished, so a ``done`` cell holding the epoch means its whole check ran, and
  the same word says whether anything was bad (one 8-byte store: the host never sees one half without the
  other, so it may read the word before waiting for the forward).

The grid is fixed at capture (``[bs, PROGRAMS]``): each program loops over its request's chunks, so one
captured shape serves every length. Outputs, for ring slot ``s = epoch % RING``: ``verdict[s, b, k]`` (bad
entries found by program ``k``), ``flag[s] = epoch + 1`` when anything is bad (device),
``done[s] = 2 * (epoch + 1) + bad`` always, by the bump (pinned host memory: the host verifies it read this epoch's
result, not another one), and the write slot of a flagged request redirected to ``scratch_slot``.

``sides``: more checks captured in the same graph, between the check and the bump (each called with the graph's row
buffer and the captured batch size; each sets ``flag`` for the epoch on anything bad, so the one result word
covers them too): the recurrent-state check of a hybrid model (:class:`kvguard.kernels.state_check.GraphStateCheck`).

Per entry, the check is :func:`kvguard.kernels.tag_check.entries_bad` (per token, no quarantine): its
reference is :func:`graph_check_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tag_check import entries_bad

RING = 8  # epochs in flight at most (the overlap scheduler resolves step N after it launched N + 1)
PROGRAMS = 16  # programs per request: a long row is spread over them (latency), each loops over its chunks
BLOCK = 256


@triton.jit
def _graph_check_kernel(
    table_ptr, table_rows_ptr, owner_ptr, n_ptr, tags_ptr, expected_ptr, out_ptr,
    verdict_ptr, flag_ptr, epoch_ptr,
    table_stride, expected_stride, table_nrows, expected_nrows, cap, slot_limit, scratch_slot, batch_cap,
    PAGE_DIV: tl.constexpr, RING: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    k = tl.program_id(1)
    epoch = tl.load(epoch_ptr)
    slot = epoch % RING
    table_row = tl.load(table_rows_ptr + b).to(tl.int64)
    owner = tl.load(owner_ptr + b).to(tl.int64)
    n = tl.load(n_ptr + b).to(tl.int64)
    n = tl.where(owner >= 0, n, 0)  # a padding entry of the captured batch size: nothing to check
    rows_ok = (table_row >= 0) & (table_row < table_nrows) & (owner < expected_nrows)
    reach = tl.where(rows_ok, tl.minimum(n, cap), 0)
    count = 0
    for chunk in range(k, tl.cdiv(reach, BLOCK), PROGRAMS):
        j = chunk * BLOCK + tl.arange(0, BLOCK)
        bad, _, _ = entries_bad(table_ptr, table_row, table_stride, tags_ptr, expected_ptr, owner, expected_stride,
                                slot_limit, j, j < reach, 1, PAGE_DIV, True)
        count += tl.sum(bad.to(tl.int32), axis=0)
    # Entries the check cannot reach (past `cap`) and unreadable rows are counted, never skipped.
    unchecked = tl.where(rows_ok, tl.maximum(n - cap, 0), tl.maximum(n, 1) * (owner >= 0).to(tl.int64)).to(tl.int32)
    count += tl.where(k == 0, unchecked, 0)
    tl.store(verdict_ptr + slot * batch_cap * PROGRAMS + b * PROGRAMS + k, count)
    tl.store(flag_ptr + slot, epoch + 1, mask=count > 0)
    tl.store(out_ptr + b, (count * 0 + scratch_slot).to(out_ptr.dtype.element_ty), mask=count > 0)


@triton.jit
def _epoch_bump_kernel(epoch_ptr, flag_ptr, done_ptr, RING: tl.constexpr):
    # After the check kernel, on the same stream: every program of this epoch's check has finished (its flag is
    # in device memory), so this one store carries the whole result to the host.
    epoch = tl.load(epoch_ptr)
    slot = epoch % RING
    bad = (tl.load(flag_ptr + slot) == epoch + 1).to(tl.int64)
    tl.store(done_ptr + slot, (epoch + 1) * 2 + bad)
    tl.store(epoch_ptr, epoch + 1)


class GraphCheck:
    """The buffers a captured decode check reads and writes, and the host's count of its epochs.

    ``table``, ``tags``, ``expected``: the token table, page tags and expectations the check reads (their
    storage must outlive every graph captured with them). ``batch_cap``: the largest batch a captured check
    may cover (the ``owner`` buffer's size). On CUDA ``flag``/``done`` are pinned host memory the kernel
    writes directly; elsewhere (the interpreter) plain host tensors. The host reads ``done`` only (the result
    word), ``flag`` stays on the device.
    """

    def __init__(self, table, tags, expected, *, page_div: int, batch_cap: int, scratch_slot: int = 0):
        dev = table.device
        self.table, self.tags, self.expected = table, tags, expected
        self.page_div, self.batch_cap, self.scratch_slot = page_div, batch_cap, scratch_slot
        pinned = dev.type == "cuda"
        self.owner = torch.full((batch_cap,), -1, dtype=torch.int64, device=dev)
        self.verdicts = torch.zeros((RING, batch_cap, PROGRAMS), dtype=torch.int32, device=dev)
        self.flag = torch.zeros(RING, dtype=torch.int64, device=dev)
        self.done = torch.zeros(RING, dtype=torch.int64, pin_memory=pinned)
        # the host's view of the result words (a memoryview reads a Python int: no numpy scalar per step); epoch e's
        # is words[e % RING], 2 * (e + 1) when it ran clean (clean_cell)
        self.words = memoryview(self.done.numpy())
        self.epoch = torch.zeros(1, dtype=torch.int64, device=dev)
        self.host_epoch = 0  # checks enqueued (the device counter's value once they ran)
        self.recaptured = False  # a capture ran the check since the last reset (its warm-ups count on the device)
        self.owner_of: object = None  # the owner rows now in ``owner`` (set_owner)
        self._owner_n = 0
        self.cap = min(table.shape[1], expected.shape[1] * page_div)
        self.sides: list = []  # more captured checks, run after this one and before the bump (their flags too)
        self.slot_limit = tags.numel() * page_div

    def launch(self, table_rows, n_entries, slots, batch: int) -> None:
        """Enqueue one check over the first ``batch`` entries (captured: the graph's static buffers), then the
        epoch's advance. Raises ValueError for a batch over ``batch_cap`` (nothing is enqueued)."""
        if not 0 < batch <= self.batch_cap:
            raise ValueError(f"graph_check: batch {batch} outside 1..{self.batch_cap} (the owner buffer's size)")
        t, e = self.table, self.expected
        _graph_check_kernel[(batch, PROGRAMS)](
            t, table_rows, self.owner, n_entries, self.tags, e, slots, self.verdicts, self.flag, self.epoch,
            t.stride(0), e.stride(0), t.shape[0], e.shape[0], self.cap, self.slot_limit, self.scratch_slot,
            self.batch_cap, PAGE_DIV=self.page_div, RING=RING, PROGRAMS=PROGRAMS, BLOCK=BLOCK)
        for side in self.sides:
            side(table_rows, batch)
        _epoch_bump_kernel[(1,)](self.epoch, self.flag, self.done, RING=RING)

    def set_owner(self, rows: torch.Tensor) -> None:
        """The expectation row of each batch entry from now on (on the stream: after every check enqueued
        before, before every check after); the entries past them become padding (-1)."""
        n = rows.numel()
        if n > self.batch_cap:
            raise ValueError(f"graph_check: {n} owner rows for a buffer of {self.batch_cap}")
        self.owner[:n].copy_(rows, non_blocking=True)
        if self._owner_n > n:
            self.owner[n:self._owner_n].fill_(-1)
        self._owner_n, self.owner_of = n, rows

    def clear_owner(self) -> None:
        """No batch entry is checked from now on (a replay nothing was armed for checks nothing). Nothing is
        enqueued when no entry is set already (the idle replays: no per-step device work)."""
        if self._owner_n:
            self.set_owner(self.owner[:0])
        self.owner_of = None

    def resync(self) -> None:
        """After a capture while serving (a recapture: its warm-up runs advanced the device's count): wait for
        the device and count on from its value. A check in flight whose slot a warm-up reused reads as another
        epoch's result, and is refused (:meth:`flagged`)."""
        if self.epoch.is_cuda:
            torch.cuda.synchronize(self.epoch.device)
        self.host_epoch, self.recaptured = int(self.epoch.item()), False

    def next(self) -> int:
        """The epoch of the check the next replay runs (counted on the host, as the device counts it)."""
        epoch, self.host_epoch = self.host_epoch, self.host_epoch + 1
        return epoch

    def flagged(self, epoch: int) -> bool:
        """After the check of ``epoch`` ran: did it find anything bad? Raises RuntimeError when the slot holds
        another epoch's result (the host's count and the device's disagree: the verdict cannot be trusted)."""
        word = self.words[epoch % RING]
        if word >> 1 != epoch + 1:
            raise RuntimeError(f"kvguard: the captured decode check's result for epoch {epoch} is missing (its ring "
                               f"slot holds epoch {(word >> 1) - 1}): the host's count of checks and "
                               f"the device's disagree, and this step's verdict cannot be trusted")
        return word & 1 == 1

    def clean(self, epoch: int) -> bool:
        """True when the result of ``epoch`` is in its slot and nothing was bad (the steady state, without
        :meth:`flagged`'s error); False: not in yet, flagged, or another epoch's. Safe to call before the forward
        is waited for (one word holds the whole result)."""
        words, cell, word = self.clean_cell(epoch)
        return words[cell] == word

    def clean_cell(self, epoch: int) -> tuple:
        """(``words``, the index of ``epoch``'s word, the word it holds once ``epoch`` ran clean): :meth:`clean` as a
        comparison a caller makes itself later, ``words[i] == w`` (a per-step hook, without a call)."""
        return self.words, epoch % RING, 2 * epoch + 2

    def verdict(self, epoch: int, batch: int) -> torch.Tensor:
        """The per-program verdict ``[batch, PROGRAMS]`` of ``epoch`` (device)."""
        return self.verdicts[epoch % RING, :batch]

    def self_test(self, row: int) -> bool:
        """Before any capture: checks of one entry nothing was recorded for (``row``: SGLang's padding row) must
        flag, and of none must not, in the cells the host reads (a device that cannot write pinned host memory
        from a kernel fails). Compiles the kernels on the way; ends reset."""
        dev = self.owner.device
        rows = torch.full((1,), row, dtype=torch.int64, device=dev)
        slots = torch.zeros(1, dtype=torch.int64, device=dev)
        self.set_owner(rows)
        ok = True
        for n in (1, 0, 1, 0):
            epoch = self.next()
            self.launch(rows, torch.full((1,), n, dtype=torch.int64, device=dev), slots, 1)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            try:
                ok = ok and self.flagged(epoch) == (n > 0)
            except RuntimeError:
                ok = False
        self.reset()
        return ok

    def reset(self) -> None:
        """After capture (whose warm-up and capture runs advanced the counter): epoch 0 on both sides, no result."""
        self.epoch.zero_()
        self.flag.zero_()
        self.done.zero_()
        self.owner.fill_(-1)
        self.host_epoch, self._owner_n, self.owner_of, self.recaptured = 0, 0, None, False
        if self.epoch.is_cuda:
            torch.cuda.synchronize(self.epoch.device)


def graph_check_ref(table, table_rows, owner, n_entries, tags, expected, slots, *, page_div: int,
                    scratch_slot: int = 0) -> tuple[torch.Tensor, bool]:
    """Torch reference of one captured check: (bad entries per request ``[B]``, anything bad);
    flagged requests' ``slots`` become ``scratch_slot`` (in place). Padding entries (``owner < 0``) are skipped."""
    from .tag_check import tag_check_ref

    live = owner >= 0
    width = int(n_entries.max()) if n_entries.numel() else 0
    verdict = tag_check_ref(table, table_rows, owner.clamp(min=0), torch.where(live, n_entries, 0), tags, expected,
                            max_entries=max(width, 1), page_div=page_div, per_token=True, quarantine=False)
    counts = torch.where(live, verdict.sum(1), 0)
    slots.masked_fill_(counts > 0, scratch_slot)
    return counts, bool((counts > 0).any())
