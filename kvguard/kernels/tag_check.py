"""The batched KV-page validation pass: tag check, bounds check and quarantine in one launch.

For each batch entry ``b`` the kernel reads the live entries ``j < n_entries[b]`` of its page-table row,
gathers the current tag of each referenced page, compares it with the tag the request expects
(``expected[expected_rows[b], j]``) and bounds-checks the page id. A failing entry is redirected to
``scratch_page`` in the same table (quarantine), so the attention that runs next can neither read out
of bounds nor read another request's pages. Each program writes one cell of ``verdict[b, chunk]`` (the
number of bad entries in its chunk), so the launch initializes its own output: no zeroing, no atomics,
no host synchronization.

Two table shapes are supported:
- a batch-packed page table ``[B, max_pages]`` (``table_rows = arange(B)``), what our engine's attention
  reads;
- a token-level table such as SGLang's ``req_to_token [rows, max_context]``: entry ``j`` is the slot at
  token ``j * entry_step`` and its page is ``slot // page_div`` (quarantine off: the verdict aborts).
  With ``per_token`` every token entry is read (``entry_step`` 1): its page must be the one expected
  for logical page ``j // page_div`` and its in-page offset must be ``j % page_div``, so an entry changed
  inside a page is caught too, not only the first entry of each page.

A write guard (:class:`WriteGuard`) may ride on the same launch: every program that finds a bad entry
also rewrites its request's KV write slots for the coming forward to a scratch slot, so a flagged
request's new K/V cannot land in another request's page before the verdict is read (one launch instead
of a row sum, a compare, an expansion and a masked fill on the stream).

Nothing the caller asks for is skipped silently: entries past what one launch can reach (``max_entries``,
the table's width, ``expected``'s width) count as bad, and a row index outside ``table`` or ``expected``
flags its request without any load.
"""
import torch
import triton
import triton.language as tl

from .launch import I32, DirectLaunch, spec
from .write_guard import (GUARD_NONE, GUARD_ONE, GUARD_SEGMENTS, GUARD_TAIL, WriteGuard, apply_guard,  # noqa: F401
                          guard_mode, guard_tail, guard_writes)  # (WriteGuard, apply_guard: also imported from here)

DEFAULT_BLOCK = 256  # NOTE: short chunks spread one long row over many programs (latency, not bandwidth, bounds a small check)


# NOTE: the grid-shaped integers change from step to step (n_chunks is 1 for a short batch, many for a long
# one); specializing on them (== 1, % 16) would compile new variants mid-serving. Only BLOCK and the flags
# select a variant, so warming up every block size (TagTracker.warm_up) compiles all of them.
_PER_STEP = ["table_rows_ptr", "expected_rows_ptr", "n_entries_ptr", "verdict_ptr", "out_ptr", "out_starts_ptr",
             "out_lens_ptr", "flag_ptr", "cap", "n_chunks", "stamp", "scratch_slot"]


@triton.jit
def entries_bad(table_ptr, table_row, table_stride, tags_ptr, expected_ptr, expected_row, expected_stride,
                slot_limit, j, live, ENTRY_STEP: tl.constexpr, PAGE_DIV: tl.constexpr, PER_TOKEN: tl.constexpr):
    """The check of one chunk of entries ``j`` (``live``: the ones to read) of one request: (bad mask, the
    entries' pointers, their values). Shared by the eager kernel and the graph kernel (kvguard.kernels.graph_check)."""
    entry_ptrs = table_ptr + table_row * table_stride + j.to(tl.int64) * ENTRY_STEP
    raw = tl.load(entry_ptrs, mask=live, other=0).to(tl.int64)
    out_of_range = (raw < 0) | (raw >= slot_limit)
    page = tl.where(out_of_range, 0, raw // PAGE_DIV)
    tag = tl.load(tags_ptr + page, mask=live & (out_of_range == 0), other=-1)
    if PER_TOKEN:
        # token j lives in logical page j // PAGE_DIV at in-page offset j % PAGE_DIV
        col = j // PAGE_DIV
        misplaced = (raw % PAGE_DIV) != (j % PAGE_DIV)
    else:
        col = j
        misplaced = j < 0
    want = tl.load(expected_ptr + expected_row * expected_stride + col, mask=live, other=-1)
    return live & (out_of_range | (tag != want) | misplaced), entry_ptrs, raw


# NOTE: what changes between steps (the per-step tensors, their offsets, the grid-shaped integers) is never
# specialized on, value or alignment: one compiled variant serves every step (no compile mid-serving), and a
# direct launch (kvguard.kernels.launch) needs to know only the dtypes to pick it.
@triton.jit(do_not_specialize=["table_nrows", "expected_nrows", "slot_limit", "scratch_page"] + _PER_STEP,
            do_not_specialize_on_alignment=_PER_STEP)
def _tag_check_kernel(
    table_ptr, table_rows_ptr, expected_rows_ptr, n_entries_ptr, tags_ptr, expected_ptr, verdict_ptr,
    table_stride, expected_stride, table_nrows, expected_nrows, cap, slot_limit, scratch_page, n_chunks,
    out_ptr, out_starts_ptr, out_lens_ptr, scratch_slot, flag_ptr, stamp,
    ENTRY_STEP: tl.constexpr, PAGE_DIV: tl.constexpr, PER_TOKEN: tl.constexpr, QUARANTINE: tl.constexpr,
    GUARD: tl.constexpr, FLAG: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    table_row = tl.load(table_rows_ptr + b).to(tl.int64)
    expected_row = tl.load(expected_rows_ptr + b).to(tl.int64)
    n = tl.load(n_entries_ptr + b).to(tl.int64)
    # A row index outside either table cannot be checked: the whole request fails (no load is made).
    rows_ok = (table_row >= 0) & (table_row < table_nrows) & (expected_row >= 0) & (expected_row < expected_nrows)
    j = chunk * BLOCK + tl.arange(0, BLOCK)
    live = (j < n) & (j < cap) & rows_ok
    bad, entry_ptrs, raw = entries_bad(table_ptr, table_row, table_stride, tags_ptr, expected_ptr, expected_row,
                                       expected_stride, slot_limit, j, live, ENTRY_STEP, PAGE_DIV, PER_TOKEN)
    if QUARANTINE:
        tl.store(entry_ptrs, (raw * 0 + scratch_page).to(table_ptr.dtype.element_ty), mask=bad)
    count = tl.sum(bad.to(tl.int32), axis=0)
    # Entries the launch cannot reach (past `cap`) and unreadable rows are counted, never skipped.
    unchecked = tl.where(rows_ok, tl.maximum(n - cap, 0), tl.maximum(n, 1)).to(tl.int32)
    count += tl.where(chunk == 0, unchecked, 0)
    tl.store(verdict_ptr + b * n_chunks + chunk, count)
    if FLAG:
        # "anything flagged?" in one cell the host reads directly (pinned memory): written only when a
        # program finds a bad entry, with this launch's stamp, so nothing has to clear it between launches.
        tl.store(flag_ptr, stamp, mask=count > 0)
    # The write guard: any program that found a bad entry rewrites its request's write slots.
    guard_writes(out_ptr, out_starts_ptr, out_lens_ptr, b, count, scratch_slot, GUARD, BLOCK)
    guard_tail(table_ptr, table_row, table_stride, out_starts_ptr, b, n, rows_ok, count, scratch_slot, GUARD, BLOCK)


def block_sizes() -> list[int]:
    """Every block size :func:`_block_for` can pick (each is its own compiled kernel variant)."""
    sizes, block = [], 16
    while block <= DEFAULT_BLOCK:
        sizes.append(block)
        block *= 2
    return sizes


def _block_for(max_entries: int, block: int | None) -> int:
    if block is not None:
        return block
    return max(16, min(DEFAULT_BLOCK, triton.next_power_of_2(max(1, max_entries))))


def _validate_args(table, table_rows, expected_rows, n_entries, tags, expected, entry_step, page_div, per_token,
                   guard=None, flag=None):
    def fail(name, why):
        raise ValueError(f"tag_check: {name} {why}")

    if flag is not None and (flag.dtype != torch.int64 or flag.numel() < 1 or not flag.is_contiguous()):
        fail("flag", f"must be a contiguous int64 tensor of at least one cell, got {tuple(flag.shape)} {flag.dtype}")

    if guard is not None and guard.tail:
        if guard.slots is not table or entry_step != 1:
            fail("guard", "with tail must guard the checked table itself (entry_step 1)")
        if guard.starts is None or guard.starts.dim() != 1 or guard.starts.numel() != table_rows.numel() \
                or guard.starts.dtype not in (torch.int32, torch.int64) or guard.starts.device != table.device:
            fail("guard.starts", f"must be a 1-D int32/int64 tensor of one entry per batch entry "
                                 f"({table_rows.numel()}) on {table.device}")
    elif guard is not None:
        for name, t in (("guard.slots", guard.slots), ("guard.starts", guard.starts), ("guard.lens", guard.lens)):
            if t is not None and (t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or t.device != table.device):
                fail(name, f"must be a 1-D int32/int64 tensor on {table.device}, got {tuple(t.shape)} {t.dtype} {t.device}")
        if (guard.starts is None) != (guard.lens is None):
            fail("guard", "needs both starts and lens, or neither")
        if guard.starts is None and guard.slots.numel() != table_rows.numel():
            fail("guard.slots", f"has {guard.slots.numel()} slots for {table_rows.numel()} batch entries "
                                f"(give starts/lens when a request writes several slots)")
        if guard.starts is not None and not guard.starts.numel() == guard.lens.numel() == table_rows.numel():
            fail("guard.starts/lens", f"must have one entry per batch entry ({table_rows.numel()})")

    if table.dim() != 2 or table.dtype not in (torch.int32, torch.int64):
        fail("table", f"must be a 2-D int32/int64 tensor, got {tuple(table.shape)} {table.dtype}")
    if table.stride(1) != 1:
        fail("table", "must be contiguous along its last dimension")
    for name, t in (("table_rows", table_rows), ("expected_rows", expected_rows), ("n_entries", n_entries)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            fail(name, f"must be a 1-D int32/int64 tensor, got {tuple(t.shape)} {t.dtype}")
        if t.numel() != table_rows.numel():
            fail(name, f"has {t.numel()} entries but table_rows has {table_rows.numel()}")
    if tags.dim() != 1 or tags.dtype != torch.int64:
        fail("tags", f"must be a 1-D int64 tensor, got {tuple(tags.shape)} {tags.dtype}")
    if expected.dim() != 2 or expected.dtype != torch.int64 or expected.stride(1) != 1:
        fail("expected", f"must be a 2-D int64 tensor contiguous along dim 1, got {expected.dtype}")
    if entry_step < 1 or page_div < 1:
        fail("entry_step/page_div", f"must be >= 1, got {entry_step}/{page_div}")
    if per_token and entry_step != 1:
        fail("entry_step", f"must be 1 with per_token (every token entry is read), got {entry_step}")
    devices = {t.device for t in (table, table_rows, expected_rows, n_entries, tags, expected)}
    if len(devices) != 1:
        fail("tensors", f"must share one device, got {sorted(map(str, devices))}")


def _cap(table, expected, n_chunks: int, blk: int, entry_step: int, page_div: int, per_token: bool) -> int:
    """How many entries per row one launch can check: the grid, the table row and the expected row."""
    table_entries = -(-table.shape[1] // entry_step)
    expected_entries = expected.shape[1] * (page_div if per_token else 1)
    return min(n_chunks * blk, table_entries, expected_entries)


def tag_check(table, table_rows, expected_rows, n_entries, tags, expected, *, max_entries: int,
              scratch_page: int = 0, entry_step: int = 1, page_div: int = 1, per_token: bool = False,
              quarantine: bool = True, block: int | None = None, guard: WriteGuard | None = None,
              flag: torch.Tensor | None = None, stamp: int = 1) -> torch.Tensor:
    """Validate page-table entries against expected tags; quarantine bad entries in place.

    Args:
        table: int32/int64 ``[T_rows, W]`` page table (or token table, see ``entry_step``).
        table_rows: ``[B]`` row of ``table`` for each batch entry.
        expected_rows: ``[B]`` row of ``expected`` for each batch entry (the request slot).
        n_entries: ``[B]`` number of live entries per batch entry (pages; tokens with ``per_token``).
        tags: int64 ``[num_pages]`` current tag of every physical page.
        expected: int64 ``[R, P]`` tag each request slot expects at each logical page.
        max_entries: an upper bound of ``n_entries`` (host int; sizes the grid without a sync). Entries
            past it (or past the table's or ``expected``'s width) are counted as bad, never skipped.
        per_token: ``table`` is a token table (``entry_step`` 1) and every token entry is checked: its
            page against ``expected[row, j // page_div]`` and its in-page offset against ``j % page_div``.
        guard: the coming forward's write slots; those of every flagged request become
            ``guard.scratch`` (:class:`WriteGuard`).
        flag: int64 ``[1]`` (device, or pinned host memory the kernel writes directly): set to ``stamp``
            when any entry is bad, left as it was otherwise.
    A row index outside ``table`` or ``expected`` flags its request without reading anything.
    Returns:
        verdict: int32 ``[B, n_chunks]``, bad entries per chunk; ``verdict.sum(1) > 0`` flags a request.
    """
    launch = CheckLaunch(table, tags, expected, scratch_page=scratch_page, entry_step=entry_step,
                         page_div=page_div, per_token=per_token, quarantine=quarantine)
    batch = table_rows.numel()
    verdict = torch.empty(batch * n_chunks_for(max_entries, block), dtype=torch.int32, device=table.device)
    return launch(table_rows, expected_rows, n_entries, max_entries=max_entries, verdict=verdict, guard=guard,
                  flag=flag, stamp=stamp, block=block)


def cap_fits(table, expected) -> bool:
    """The widest ``cap`` of a check over these tables fits an i32 argument (it always does in practice)."""
    return max(table.shape[1], expected.shape[1]) * 256 < I32


def n_chunks_for(max_entries: int, block: int | None = None) -> int:
    """How many programs per batch entry a check of ``max_entries`` entries launches (verdict columns)."""
    return max(1, -(-max_entries // _block_for(max_entries, block)))


class CheckLaunch:
    """The check bound to one table, tag array and expectation table: what a server launches every step.

    The fixed arguments are read once, here; each call passes what changes per step and writes the
    verdict into ``verdict`` (a caller-owned int32 buffer of at least ``B * n_chunks_for(max_entries)``
    cells: no allocation per step). Every argument variant is validated in full the first time it is seen;
    later calls of a seen variant only check the batch sizes agree. On CUDA the compiled kernel is
    launched directly (:class:`kvguard.kernels.launch.DirectLaunch`).
    """

    def __init__(self, table, tags, expected, *, scratch_page: int = 0, entry_step: int = 1, page_div: int = 1,
                 per_token: bool = False, quarantine: bool = True, reference: bool = False):
        self.table, self.tags, self.expected = table, tags, expected
        self.reference = reference  # run tag_check_ref instead (a tracker's torch backend)
        self.scratch_page, self.entry_step, self.page_div = scratch_page, entry_step, page_div
        self.per_token, self.quarantine = per_token, quarantine
        self.kernel = DirectLaunch(_tag_check_kernel, table.device)
        self._seen: set = set()  # argument variants validated in full
        self._fixed = (table.stride(0), expected.stride(0), table.shape[0], expected.shape[0])
        self._cap_fits = table.dim() == 2 and expected.dim() == 2 and cap_fits(table, expected)
        self.last_key: tuple | None = None  # the variant of the last call (BoundCheck picks its compiled kernel)
        self.bound_kernels: dict = {}  # BoundCheck's compiled variants, per (block, dtypes)

    def __call__(self, table_rows, expected_rows, n_entries, *, max_entries: int, verdict: torch.Tensor,
                 guard: WriteGuard | None = None, flag: torch.Tensor | None = None, stamp: int = 1,
                 block: int | None = None) -> torch.Tensor:
        table, tags, expected = self.table, self.tags, self.expected
        blk = _block_for(max_entries, block)
        batch = table_rows.numel()
        n_chunks = max(1, -(-max_entries // blk))
        if verdict.dtype != torch.int32 or verdict.numel() < batch * n_chunks:
            raise ValueError(f"tag_check: verdict must be an int32 buffer of at least {batch * n_chunks} cells, "
                             f"got {verdict.numel()} {verdict.dtype}")
        out_verdict = verdict[:batch * n_chunks].view(batch, n_chunks)
        mode = guard_mode(guard)
        out = verdict if guard is None else guard.slots
        starts = guard.starts if mode in (GUARD_SEGMENTS, GUARD_TAIL) else verdict
        lens = verdict if mode != GUARD_SEGMENTS else guard.lens
        flag_t = verdict if flag is None else flag
        key = (blk, mode, flag is not None, spec(table_rows), spec(expected_rows), spec(n_entries), spec(verdict),
               spec(out), spec(starts), spec(lens), spec(flag_t), 0 < stamp < I32, self._cap_fits)
        self.last_key = key
        if key not in self._seen or not expected_rows.numel() == n_entries.numel() == batch:
            _validate_args(table, table_rows, expected_rows, n_entries, tags, expected, self.entry_step,
                           self.page_div, self.per_token, guard, flag)  # a mismatch raises, naming the argument
            self._seen.add(key)
        if batch == 0:
            return out_verdict
        if self.reference:
            out_verdict.copy_(tag_check_ref(
                table, table_rows, expected_rows, n_entries, tags, expected, max_entries=max_entries,
                scratch_page=self.scratch_page, entry_step=self.entry_step, page_div=self.page_div,
                per_token=self.per_token, quarantine=self.quarantine, block=block, guard=guard, flag=flag,
                stamp=stamp))
            return out_verdict
        cap = _cap(table, expected, n_chunks, blk, self.entry_step, self.page_div, self.per_token)
        t_stride, e_stride, t_rows, e_rows = self._fixed
        self.kernel((batch, n_chunks), key, (
            table, table_rows, expected_rows, n_entries, tags, expected, verdict,
            t_stride, e_stride, t_rows, e_rows, cap, tags.numel() * self.page_div, self.scratch_page, n_chunks,
            out, starts, lens, 0 if guard is None else guard.scratch, flag_t, stamp,
        ), dict(ENTRY_STEP=self.entry_step, PAGE_DIV=self.page_div, PER_TOKEN=self.per_token,
                QUARANTINE=self.quarantine, GUARD=mode, FLAG=flag is not None, BLOCK=blk))
        return out_verdict


class BoundCheck:
    """A per-token check with a one-slot-per-request (or row-tail) write guard, bound to one batch's expectation rows and to
    the caller's verdict buffers and flag cells (one of each per ring slot): a decode step's launch, in which
    only the table's row indices, the lengths, the write slots, the grid and the stamp change.

    On CUDA the argument list is built once per ring slot; a step copies it, sets five entries and hands it to
    the compiled kernel of its block size (the first step of each block size goes through
    :class:`CheckLaunch`, which validates it in full and compiles or finds the variant). Anything unusual
    (lengths or slots of another dtype or count, a launch hook set, no GPU) goes through :class:`CheckLaunch`.
    Returns the number of verdict cells written (``B * n_chunks``).
    """

    def __init__(self, launch: CheckLaunch, table_rows: torch.Tensor, expected_rows: torch.Tensor,
                 verdicts: list, flags: list, *, scratch_slot: int, n_dtype: torch.dtype, slot_dtype: torch.dtype,
                 tail: bool = False):
        self.launch, self.table_rows, self.expected_rows = launch, table_rows, expected_rows
        self.tail = tail  # the write guard is WriteGuard.row_tail's (a step's ``slots`` are then its starts)
        self.verdicts, self.flags, self.scratch_slot = verdicts, flags, scratch_slot
        self.batch = table_rows.numel()
        if expected_rows.numel() != self.batch:
            raise ValueError(f"tag_check: expected_rows has {expected_rows.numel()} entries for {self.batch} rows")
        self.n_dtype, self.slot_dtype = n_dtype, slot_dtype
        t, e = launch.table, launch.expected
        self._widths = (-(-t.shape[1] // launch.entry_step), e.shape[1] * (launch.page_div if launch.per_token else 1))
        self._kernels = launch.bound_kernels  # compiled variants per (block, dtypes), shared by every binding
        mode = GUARD_TAIL if tail else GUARD_ONE
        self._dtypes = (table_rows.dtype, expected_rows.dtype, n_dtype, slot_dtype, mode)
        kernel = launch.kernel
        self.direct = kernel.direct and not launch.reference
        self._raw = []
        if self.direct:
            t_stride, e_stride, t_rows, e_rows = launch._fixed
            for verdict, flag in zip(verdicts, flags):
                self._raw.append([t.data_ptr(), table_rows.data_ptr(), expected_rows.data_ptr(), 0, launch.tags.data_ptr(),
                                  e.data_ptr(), verdict.data_ptr(), t_stride, e_stride, t_rows, e_rows, 0,
                                  launch.tags.numel() * launch.page_div, launch.scratch_page, 0,
                                  t.data_ptr() if tail else 0, verdict.data_ptr(), verdict.data_ptr(), scratch_slot,
                                  flag.data_ptr(), 0, launch.entry_step, launch.page_div, launch.per_token,
                                  launch.quarantine, mode, True, 0])

    def __call__(self, slot: int, table_rows: torch.Tensor, n_entries: torch.Tensor, slots: torch.Tensor,
                 max_entries: int, stamp: int) -> int:
        """One step: ``table_rows`` (the batch's row indices now: SGLang may hand a new tensor each step),
        ``n_entries`` and ``slots`` (a tail guard's starts) of the bound batch size and dtypes."""
        blk = _block_for(max_entries, None)
        n_chunks = max(1, -(-max_entries // blk))
        kernel = self._kernels.get((blk,) + self._dtypes) if self.direct else None
        if kernel is None or n_entries.dtype != self.n_dtype or slots.dtype != self.slot_dtype \
                or table_rows.dtype != self._dtypes[0] or not n_entries.numel() == slots.numel() \
                == table_rows.numel() == self.batch or self.launch.kernel.hooked():
            guard = WriteGuard.row_tail(self.launch.table, slots, self.scratch_slot) if self.tail else \
                WriteGuard(slots, scratch=self.scratch_slot)
            self.launch(table_rows, self.expected_rows, n_entries, max_entries=max_entries,
                        verdict=self.verdicts[slot], guard=guard, flag=self.flags[slot], stamp=stamp)
            if self.direct and (n_entries.dtype, slots.dtype, table_rows.dtype) == \
                    (self.n_dtype, self.slot_dtype, self._dtypes[0]):
                self._kernels[(blk,) + self._dtypes] = self.launch.kernel.kernels.get(self.launch.last_key)
            return self.batch * n_chunks
        args = self._raw[slot].copy()
        args[1], args[3], args[16 if self.tail else 15] = table_rows.data_ptr(), n_entries.data_ptr(), slots.data_ptr()
        args[20], args[27] = stamp, blk
        args[11], args[14] = min(n_chunks * blk, *self._widths), n_chunks
        self.launch.kernel.run(kernel, (self.batch, n_chunks, 1), args)
        return self.batch * n_chunks


def tag_check_ref(table, table_rows, expected_rows, n_entries, tags, expected, *, max_entries: int,
                  scratch_page: int = 0, entry_step: int = 1, page_div: int = 1, per_token: bool = False,
                  quarantine: bool = True, block: int | None = None, guard: WriteGuard | None = None,
                  flag: torch.Tensor | None = None, stamp: int = 1) -> torch.Tensor:
    """Torch reference of :func:`tag_check` (same arguments, same verdict, quarantine, guard and flag)."""
    _validate_args(table, table_rows, expected_rows, n_entries, tags, expected, entry_step, page_div, per_token,
                   guard, flag)
    blk = _block_for(max_entries, block)
    n_chunks = max(1, -(-max_entries // blk))
    batch = table_rows.numel()
    if batch == 0:
        return torch.empty((0, n_chunks), dtype=torch.int32, device=table.device)
    cap = _cap(table, expected, n_chunks, blk, entry_step, page_div, per_token)
    width = n_chunks * blk
    t_rows, e_rows, n = table_rows.long(), expected_rows.long(), n_entries.long()
    rows_ok = (t_rows >= 0) & (t_rows < table.shape[0]) & (e_rows >= 0) & (e_rows < expected.shape[0])
    t_rows, e_rows = t_rows.where(rows_ok, 0), e_rows.where(rows_ok, 0)  # never index with a bad row
    j = torch.arange(width, device=table.device)  # [W]
    live = (j[None, :] < n[:, None]) & (j[None, :] < cap) & rows_ok[:, None]  # [B, W]
    cols = (j * entry_step).clamp(max=table.shape[1] - 1)
    raw = table.long()[t_rows[:, None], cols[None, :]]  # [B, W]
    out_of_range = (raw < 0) | (raw >= tags.numel() * page_div)
    page = torch.where(out_of_range, torch.zeros_like(raw), torch.div(raw, page_div, rounding_mode="floor"))
    tag = tags[page]
    if per_token:
        want_cols = torch.div(j, page_div, rounding_mode="floor")
        misplaced = torch.remainder(raw, page_div) != torch.remainder(j, page_div)[None, :]
    else:
        want_cols, misplaced = j, torch.zeros_like(live)
    want = expected[e_rows[:, None], want_cols.clamp(max=expected.shape[1] - 1)[None, :]]
    bad = live & (out_of_range | (tag != want) | misplaced)  # [B, W]
    if quarantine and bool(bad.any()):
        b_idx, j_idx = bad.nonzero(as_tuple=True)
        table[t_rows[b_idx], j_idx * entry_step] = scratch_page
    verdict = bad.view(-1, n_chunks, blk).sum(-1).to(torch.int32)
    unchecked = torch.where(rows_ok, (n - cap).clamp(min=0), n.clamp(min=1)).to(torch.int32)
    verdict[:, 0] += unchecked
    if guard is not None:
        apply_guard(guard, verdict.sum(1) > 0, t_rows.where(rows_ok, -1), n)
    if flag is not None and bool(verdict.any()):
        flag.view(-1)[0] = stamp
    return verdict
