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
"""
import torch
import triton
import triton.language as tl

DEFAULT_BLOCK = 256  # NOTE: short chunks spread one long row over many programs (latency, not bandwidth, bounds a small check)


@triton.jit
def _tag_check_kernel(
    table_ptr, table_rows_ptr, expected_rows_ptr, n_entries_ptr, tags_ptr, expected_ptr, verdict_ptr,
    table_stride, expected_stride, slot_limit, scratch_page, n_chunks,
    ENTRY_STEP: tl.constexpr, PAGE_DIV: tl.constexpr, QUARANTINE: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    table_row = tl.load(table_rows_ptr + b).to(tl.int64)
    expected_row = tl.load(expected_rows_ptr + b).to(tl.int64)
    n = tl.load(n_entries_ptr + b)
    j = chunk * BLOCK + tl.arange(0, BLOCK)
    live = j < n
    entry_ptrs = table_ptr + table_row * table_stride + j.to(tl.int64) * ENTRY_STEP
    raw = tl.load(entry_ptrs, mask=live, other=0).to(tl.int64)
    out_of_range = (raw < 0) | (raw >= slot_limit)
    page = tl.where(out_of_range, 0, raw // PAGE_DIV)
    tag = tl.load(tags_ptr + page, mask=live & (out_of_range == 0), other=-1)
    want = tl.load(expected_ptr + expected_row * expected_stride + j, mask=live, other=-1)
    bad = live & (out_of_range | (tag != want))
    if QUARANTINE:
        tl.store(entry_ptrs, (raw * 0 + scratch_page).to(table_ptr.dtype.element_ty), mask=bad)
    tl.store(verdict_ptr + b * n_chunks + chunk, tl.sum(bad.to(tl.int32), axis=0))


def _block_for(max_entries: int, block: int | None) -> int:
    if block is not None:
        return block
    return max(16, min(DEFAULT_BLOCK, triton.next_power_of_2(max(1, max_entries))))


def _validate_args(table, table_rows, expected_rows, n_entries, tags, expected, entry_step, page_div):
    def fail(name, why):
        raise ValueError(f"tag_check: {name} {why}")

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
    devices = {t.device for t in (table, table_rows, expected_rows, n_entries, tags, expected)}
    if len(devices) != 1:
        fail("tensors", f"must share one device, got {sorted(map(str, devices))}")


def tag_check(table, table_rows, expected_rows, n_entries, tags, expected, *, max_entries: int,
              scratch_page: int = 0, entry_step: int = 1, page_div: int = 1, quarantine: bool = True,
              block: int | None = None) -> torch.Tensor:
    """Validate page-table entries against expected tags; quarantine bad entries in place.

    Args:
        table: int32/int64 ``[T_rows, W]`` page table (or token table, see ``entry_step``).
        table_rows: ``[B]`` row of ``table`` for each batch entry.
        expected_rows: ``[B]`` row of ``expected`` for each batch entry (the request slot).
        n_entries: ``[B]`` number of live entries (pages) per batch entry.
        tags: int64 ``[num_pages]`` current tag of every physical page.
        expected: int64 ``[R, P]`` tag each request slot expects at each logical page.
        max_entries: an upper bound of ``n_entries`` (host int; sizes the grid without a sync).
    Returns:
        verdict: int32 ``[B, n_chunks]``, bad entries per chunk; ``verdict.sum(1) > 0`` flags a request.
    """
    _validate_args(table, table_rows, expected_rows, n_entries, tags, expected, entry_step, page_div)
    blk = _block_for(max_entries, block)
    batch = table_rows.numel()
    n_chunks = max(1, triton.cdiv(max_entries, blk))
    verdict = torch.empty((batch, n_chunks), dtype=torch.int32, device=table.device)
    if batch == 0:
        return verdict
    _tag_check_kernel[(batch, n_chunks)](
        table, table_rows, expected_rows, n_entries, tags, expected, verdict,
        table.stride(0), expected.stride(0), tags.numel() * page_div, scratch_page, n_chunks,
        ENTRY_STEP=entry_step, PAGE_DIV=page_div, QUARANTINE=quarantine, BLOCK=blk,
    )
    return verdict


def tag_check_ref(table, table_rows, expected_rows, n_entries, tags, expected, *, max_entries: int,
                  scratch_page: int = 0, entry_step: int = 1, page_div: int = 1, quarantine: bool = True,
                  block: int | None = None) -> torch.Tensor:
    """Torch reference of :func:`tag_check` (same arguments, same verdict, same quarantine)."""
    _validate_args(table, table_rows, expected_rows, n_entries, tags, expected, entry_step, page_div)
    blk = _block_for(max_entries, block)
    n_chunks = max(1, -(-max_entries // blk))
    width = n_chunks * blk
    j = torch.arange(width, device=table.device)  # [W]
    live = j[None, :] < n_entries.long()[:, None]  # [B, W]
    cols = (j * entry_step).clamp(max=table.shape[1] - 1)
    raw = table.long()[table_rows.long()[:, None], cols[None, :]]  # [B, W]
    out_of_range = (raw < 0) | (raw >= tags.numel() * page_div)
    page = torch.where(out_of_range, torch.zeros_like(raw), torch.div(raw, page_div, rounding_mode="floor"))
    tag = tags[page]
    want_cols = j.clamp(max=expected.shape[1] - 1)
    want = expected[expected_rows.long()[:, None], want_cols[None, :]]
    bad = live & (out_of_range | (tag != want))  # [B, W]
    if quarantine and bool(bad.any()):
        b_idx, j_idx = bad.nonzero(as_tuple=True)
        table[table_rows.long()[b_idx], j_idx * entry_step] = scratch_page
    return bad.view(-1, n_chunks, blk).sum(-1).to(torch.int32)
