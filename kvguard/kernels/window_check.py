"""The sliding-window check: every token a sliding-window layer reads, through the full→SWA index map.

A hybrid sliding-window model (SGLang's ``SWATokenToKVPoolAllocator``) keeps two KV namespaces: full-attention
layers read ``req_to_token[row, j]`` (a full slot, checked by :mod:`kvguard.kernels.tag_check`), sliding-window
layers read ``index_map[req_to_token[row, j]]`` (an SWA slot) for the last ``window`` tokens only. For each
batch entry ``b`` this kernel reads the entries ``j`` in ``[n - window - q, n)`` (``n = n_entries[b]``, ``q``
the step's new tokens: the earliest query of the step reads ``window`` tokens back) and flags an entry whose

- full slot is outside ``[0, full_limit)``;
- SWA slot ``index_map[full]`` is not the one the allocator paired with that full slot (``pair[full]``: a
  cleared entry reads 0, SGLang's padding slot; a foreign or stale one another slot), or is outside
  ``[1, swa_limit)``;
- SWA page (``swa // page_div``) carries another tag than it carried when paired (``pair_tag[full]``): it was
  released since (slid out of the window, evicted, retracted) and maybe handed to somebody else.

One program per batch entry. Its count of bad entries is ADDED to ``verdict[b, 0]`` (the cell the main check
wrote for that request, on the same stream before this launch), the host flag is set to ``stamp`` and the
request's write slots are redirected to ``scratch`` (:class:`~kvguard.kernels.write_guard.WriteGuard`), exactly
as the main check does: a flagged request is aborted by the same verdict. A table row outside ``table``
flags its request without any load.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import I32, DirectLaunch, spec
from .write_guard import GUARD_NONE, GUARD_ONE, GUARD_SEGMENTS, WriteGuard, apply_guard, guard_writes

BLOCK = 64  # entries read per loop iteration of a program (a decode window of 128 tokens: two)


@triton.jit(do_not_specialize=["table_nrows", "verdict_stride", "window", "full_limit", "swa_limit", "scratch_slot",
                               "stamp"],
            do_not_specialize_on_alignment=["table_rows_ptr", "n_entries_ptr", "q_ptr", "verdict_ptr", "out_ptr",
                                            "out_starts_ptr", "out_lens_ptr", "flag_ptr"])
def _window_check_kernel(
    table_ptr, table_rows_ptr, n_entries_ptr, q_ptr, map_ptr, pair_ptr, pair_tag_ptr, tags_ptr, verdict_ptr,
    table_stride, table_nrows, verdict_stride, window, full_limit, swa_limit,
    out_ptr, out_starts_ptr, out_lens_ptr, scratch_slot, flag_ptr, stamp,
    PAGE_DIV: tl.constexpr, Q_PER_REQ: tl.constexpr, GUARD: tl.constexpr, FLAG: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(table_rows_ptr + b).to(tl.int64)
    n = tl.load(n_entries_ptr + b).to(tl.int64)
    if Q_PER_REQ:
        q = tl.load(q_ptr + b).to(tl.int64)
    else:
        q = n * 0 + 1
    row_ok = (row >= 0) & (row < table_nrows)
    lo = tl.maximum(n - window - q, 0)
    bad_acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(lo, n, BLOCK):
        j = s + tl.arange(0, BLOCK)
        live = (j < n) & row_ok
        full = tl.load(table_ptr + row * table_stride + j, mask=live, other=0).to(tl.int64)
        full_ok = (full >= 0) & (full < full_limit)
        f = tl.where(full_ok, full, 0)
        swa = tl.load(map_ptr + f, mask=live, other=0).to(tl.int64)
        want = tl.load(pair_ptr + f, mask=live, other=-1)
        want_tag = tl.load(pair_tag_ptr + f, mask=live, other=-1)
        swa_ok = (swa > 0) & (swa < swa_limit)
        tag = tl.load(tags_ptr + tl.where(swa_ok, swa // PAGE_DIV, 0), mask=live & swa_ok, other=-2)
        bad = live & ((full_ok == 0) | (swa_ok == 0) | (swa != want) | (tag != want_tag))
        bad_acc += bad.to(tl.int32)
    count = tl.sum(bad_acc, axis=0) + tl.where(row_ok, 0, 1).to(tl.int32)
    cell = verdict_ptr + b * verdict_stride
    tl.store(cell, tl.load(cell) + count)
    if FLAG:
        tl.store(flag_ptr, stamp, mask=count > 0)
    guard_writes(out_ptr, out_starts_ptr, out_lens_ptr, b, count, scratch_slot, GUARD, BLOCK)


def _validate(table, index_map, pair, pair_tag, tags, table_rows, n_entries, q, verdict, guard, flag):
    def fail(name, why):
        raise ValueError(f"window_check: {name} {why}")

    if table.dim() != 2 or table.dtype not in (torch.int32, torch.int64) or table.stride(1) != 1:
        fail("table", f"must be a 2-D int32/int64 tensor contiguous along dim 1, got {tuple(table.shape)} "
                      f"{table.dtype}")
    for name, t in (("index_map", index_map), ("pair", pair), ("pair_tag", pair_tag), ("tags", tags)):
        if t.dim() != 1 or t.dtype != torch.int64 or not t.is_contiguous():
            fail(name, f"must be a contiguous 1-D int64 tensor, got {tuple(t.shape)} {t.dtype}")
    if not index_map.numel() >= pair.numel() == pair_tag.numel():
        fail("pair/pair_tag", f"must have one entry per full slot ({pair.numel()}, {pair_tag.numel()}; the map has "
                              f"{index_map.numel()})")
    batch = table_rows.numel()
    for name, t in (("table_rows", table_rows), ("n_entries", n_entries)) + ((("q", q),) if q is not None else ()):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or t.numel() != batch:
            fail(name, f"must be a 1-D int32/int64 tensor of {batch} entries, got {tuple(t.shape)} {t.dtype}")
    if verdict.dim() != 2 or verdict.dtype != torch.int32 or verdict.shape[0] != batch or verdict.stride(1) != 1:
        fail("verdict", f"must be an int32 [{batch}, chunks] view contiguous along dim 1, got "
                        f"{tuple(verdict.shape)} {verdict.dtype}")
    if flag is not None and (flag.dtype != torch.int64 or flag.numel() < 1):
        fail("flag", f"must be an int64 tensor of at least one cell, got {flag.dtype}")
    if guard is not None and guard.tail:
        fail("guard", "with tail is the tag check's own (give this check the step's slots, or segments)")
    if guard is not None and guard.starts is None and guard.slots.numel() != batch:
        fail("guard.slots", f"has {guard.slots.numel()} slots for {batch} batch entries")
    devices = {t.device for t in (table, index_map, pair, pair_tag, tags, table_rows, n_entries, verdict)}
    if len(devices) != 1:
        fail("tensors", f"must share one device, got {sorted(map(str, devices))}")


class WindowCheck:
    """The window check bound to one token table, index map, pairing and SWA tag array (what a server launches
    every step, after its main check, into the main check's verdict). ``reference``: run :func:`window_check_ref`."""

    def __init__(self, table, index_map, pair, pair_tag, tags, *, page_div: int, window: int, swa_limit: int,
                 scratch_slot: int = 0, reference: bool = False):
        assert window >= 0 and page_div >= 1, f"window {window}, page_div {page_div}"
        self.table, self.index_map, self.pair, self.pair_tag, self.tags = table, index_map, pair, pair_tag, tags
        self.page_div, self.window, self.swa_limit, self.scratch_slot = page_div, window, swa_limit, scratch_slot
        self.reference = reference
        self.kernel = DirectLaunch(_window_check_kernel, table.device)
        self._seen: set = set()
        self._raw: dict = {}  # key -> (compiled kernel, argument template): the direct launch of a seen variant

    def __call__(self, table_rows, n_entries, verdict, *, q=None, guard: WriteGuard | None = None,
                 flag=None, stamp: int = 1) -> None:
        """``table_rows`` [B], ``n_entries`` [B] (entries the step's rows hold, its new tokens included), ``verdict``
        int32 [B, chunks] (the main check's, added to in column 0), ``q`` [B] the step's new tokens per request
        (None: one each, a decode step)."""
        mode = GUARD_NONE if guard is None else GUARD_ONE if guard.starts is None else GUARD_SEGMENTS
        key = (mode, flag is not None, q is not None, spec(table_rows), spec(n_entries), spec(verdict),
               None if q is None else spec(q), None if guard is None else spec(guard.slots), 0 < stamp < I32)
        if key not in self._seen:
            _validate(self.table, self.index_map, self.pair, self.pair_tag, self.tags, table_rows, n_entries, q,
                      verdict, guard, flag)
            self._seen.add(key)
        batch = table_rows.numel()
        if batch == 0:
            return
        if self.reference:
            window_check_ref(self.table, self.index_map, self.pair, self.pair_tag, self.tags, table_rows, n_entries,
                             verdict, page_div=self.page_div, window=self.window, swa_limit=self.swa_limit, q=q,
                             guard=guard, flag=flag, stamp=stamp)
            return
        slots = verdict if guard is None else guard.slots
        starts = verdict if mode != GUARD_SEGMENTS else guard.starts
        lens = verdict if mode != GUARD_SEGMENTS else guard.lens
        fast = self._raw.get(key)
        if fast is not None and not self.kernel.hooked():
            # NOTE: a seen variant on CUDA: the template's fixed arguments, this step's pointers (no JIT binding)
            args = fast[1].copy()
            args[1], args[2], args[3] = table_rows.data_ptr(), n_entries.data_ptr(), (n_entries if q is None
                                                                                       else q).data_ptr()
            args[8], args[11], args[15] = verdict.data_ptr(), verdict.stride(0), slots.data_ptr()
            args[16], args[17], args[18] = starts.data_ptr(), lens.data_ptr(), 0 if guard is None else guard.scratch
            args[19], args[20] = (verdict if flag is None else flag).data_ptr(), stamp
            self.kernel.run(fast[0], (batch, 1, 1), args)
            return
        args = (self.table, table_rows, n_entries, n_entries if q is None else q, self.index_map, self.pair,
                self.pair_tag, self.tags, verdict, self.table.stride(0), self.table.shape[0], verdict.stride(0),
                self.window, self.pair.numel(), self.swa_limit, slots, starts, lens,
                0 if guard is None else guard.scratch, verdict if flag is None else flag, stamp)
        constexprs = dict(PAGE_DIV=self.page_div, Q_PER_REQ=q is not None, GUARD=mode, FLAG=flag is not None,
                          BLOCK=BLOCK)
        self.kernel((batch,), key, args, constexprs)
        compiled = self.kernel.kernels.get(key) if self.kernel.direct else None
        if compiled is not None:
            self._raw[key] = (compiled, [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
                              + list(constexprs.values()))


    def warm_up(self) -> None:
        """Compile (or find) every variant a server launches, with nothing live: row indices and lengths int32 or
        int64, write slots int32 or int64, one slot per request (a decode step) or segments with their new tokens
        (an extend), the host flag set. Changes nothing (zero lengths read no entry; the verdict is a scratch one)."""
        if self.reference:
            return
        dev = self.table.device
        flag = torch.zeros(1, dtype=torch.int64, pin_memory=dev.type == "cuda")
        verdict = torch.zeros((1, 1), dtype=torch.int32, device=dev)
        for index_dtype in (torch.int32, torch.int64):
            for n_dtype in (torch.int32, torch.int64):
                for slot_dtype in (torch.int32, torch.int64):
                    rows = torch.zeros(1, dtype=index_dtype, device=dev)
                    n = torch.zeros(1, dtype=n_dtype, device=dev)
                    slots = torch.zeros(1, dtype=slot_dtype, device=dev)
                    lens = torch.zeros(1, dtype=torch.int64, device=dev)
                    self(rows, n, verdict, guard=WriteGuard(slots, scratch=self.scratch_slot), flag=flag)
                    self(rows, n, verdict, q=lens, guard=WriteGuard(slots, lens, lens, scratch=self.scratch_slot),
                         flag=flag)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def window_check_ref(table, index_map, pair, pair_tag, tags, table_rows, n_entries, verdict, *, page_div: int,
                     window: int, swa_limit: int, q=None, guard: WriteGuard | None = None, flag=None,
                     stamp: int = 1) -> torch.Tensor:
    """Torch reference of :class:`WindowCheck` (same arguments; adds to ``verdict[:, 0]``, sets the flag, guards
    the writes). Returns the per-request counts it added (int32 [B])."""
    _validate(table, index_map, pair, pair_tag, tags, table_rows, n_entries, q, verdict, guard, flag)
    batch, dev = table_rows.numel(), table.device
    if batch == 0:
        return torch.zeros(0, dtype=torch.int32, device=dev)
    rows, n = table_rows.long(), n_entries.long()
    qs = torch.ones_like(n) if q is None else q.long()
    row_ok = (rows >= 0) & (rows < table.shape[0])
    lo = (n - window - qs).clamp(min=0)
    width = max(int((n - lo).max()), 1)
    j = lo[:, None] + torch.arange(width, device=dev)[None, :]  # [B, W]
    live = (j < n[:, None]) & row_ok[:, None]
    full = table.long()[rows.where(row_ok, 0)[:, None], j.clamp(max=table.shape[1] - 1)]
    full_ok = (full >= 0) & (full < pair.numel())
    f = full.where(full_ok, 0)
    swa, want, want_tag = index_map[f], pair[f], pair_tag[f]
    swa_ok = (swa > 0) & (swa < swa_limit)
    tag = tags[torch.div(swa.where(swa_ok, 0), page_div, rounding_mode="floor")].where(swa_ok, -2)
    bad = live & (~full_ok | ~swa_ok | (swa != want) | (tag != want_tag))
    count = (bad.sum(1) + (~row_ok).long()).to(torch.int32)
    verdict[:, 0] += count
    if guard is not None:
        apply_guard(guard, count > 0)
    if flag is not None and bool((count > 0).any()):
        flag.view(-1)[0] = stamp
    return count
