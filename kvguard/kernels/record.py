"""Recording one decode step's new pages in one launch: the expectations of every request that crossed
into a new page.

A decode step writes one token per request at position ``pos[b]`` into slot ``slots[b]``. A request whose
position starts a page (``pos % page_size == 0``) was just given a new page by the step's allocation, in
batch order: the k-th such request got the allocation's k-th page and its fresh tag ``fresh[k]``. Its row
must now expect that tag (and page) at logical page ``pos // page_size``. Every other request keeps its
expectation untouched (a continuation slot is never re-read from the table: that would launder a swapped
or freed entry).

``skip[b]`` leaves a request out (its row belongs to a newer owner); it still counts in the allocation
order. Without ``fresh`` the page's current tag is recorded. Rows or columns outside ``expected`` are
not written: the check then finds nothing recorded there and flags the request.

One launch replaces ~20 small torch ops (mask, cumsum, gathers, two index_puts) that each cost a kernel
on the stream between two CUDA-graph replays: at concurrency 1 those gaps were the visible overhead.
"""
import torch
import triton
import triton.language as tl

from .launch import I32, DirectLaunch, spec

BLOCK = 128  # one program loops over the batch in chunks of BLOCK, carrying the allocation count


_PER_STEP = ["rows_ptr", "pos_ptr", "slots_ptr", "fresh_ptr", "skip_ptr", "alloc_ptr", "batch", "n_fresh", "base"]


# NOTE: the per-step tensors and integers are never specialized on (value or alignment): one variant per dtype
# set serves every step (see kvguard.kernels.tag_check).
@triton.jit(do_not_specialize=["n_rows", "width", "page_size", "exp_stride", "pages_stride"] + _PER_STEP,
            do_not_specialize_on_alignment=_PER_STEP)
def _record_decode_kernel(
    expected_ptr, expected_pages_ptr, rows_ptr, pos_ptr, slots_ptr, fresh_ptr, skip_ptr, tags_ptr,
    batch, n_fresh, n_rows, width, page_size, exp_stride, pages_stride, alloc_ptr, base,
    HAS_FRESH: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_ALLOC: tl.constexpr, BLOCK: tl.constexpr,
):
    if HAS_ALLOC:
        # The step's allocation bumps here, in the same launch: slot i of the allocation gets tag base + i and
        # its page keeps the largest of its slots' tags (a page handed out twice keeps only the later one).
        for start in range(0, n_fresh, BLOCK):
            i = start + tl.arange(0, BLOCK)
            page = tl.load(alloc_ptr + i, mask=i < n_fresh, other=0).to(tl.int64)
            tl.atomic_max(tags_ptr + page, base + i, mask=i < n_fresh)
    carry = 0  # pages handed out to earlier chunks of the batch
    for start in range(0, batch, BLOCK):
        b = start + tl.arange(0, BLOCK)
        inside = b < batch
        pos = tl.load(pos_ptr + b, mask=inside, other=1).to(tl.int64)
        new = inside & ((pos % page_size) == 0)
        k = carry + tl.cumsum(new.to(tl.int32), axis=0) - 1  # this request's index in the allocation
        carry += tl.sum(new.to(tl.int32), axis=0)
        slot = tl.load(slots_ptr + b, mask=new, other=0).to(tl.int64)
        page = slot // page_size
        if HAS_ALLOC:
            tag = base + tl.minimum(tl.maximum(k, 0), n_fresh - 1).to(tl.int64)
        elif HAS_FRESH:
            k = tl.minimum(tl.maximum(k, 0), n_fresh - 1)
            tag = tl.load(fresh_ptr + k, mask=new, other=-1)
        else:
            tag = tl.load(tags_ptr + page, mask=new, other=-1)
        if HAS_SKIP:
            new = new & (tl.load(skip_ptr + b, mask=inside, other=0) == 0)
        row = tl.load(rows_ptr + b, mask=new, other=-1).to(tl.int64)
        col = pos // page_size
        ok = new & (row >= 0) & (row < n_rows) & (col < width)
        tl.store(expected_ptr + row * exp_stride + col, tag, mask=ok)
        tl.store(expected_pages_ptr + row * pages_stride + col, page.to(tl.int32), mask=ok)


def _validate(expected, expected_pages, rows, pos, slots, fresh, skip, tags, page_size):
    def fail(name, why):
        raise ValueError(f"record_decode: {name} {why}")

    if expected.dim() != 2 or expected.dtype != torch.int64 or expected.stride(1) != 1:
        fail("expected", f"must be a 2-D int64 tensor contiguous along dim 1, got {expected.dtype}")
    if expected_pages.shape != expected.shape or expected_pages.dtype != torch.int32 or expected_pages.stride(1) != 1:
        fail("expected_pages", f"must be int32 {tuple(expected.shape)}, got {expected_pages.dtype} "
                               f"{tuple(expected_pages.shape)}")
    for name, t in (("rows", rows), ("pos", pos), ("slots", slots)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or t.numel() != rows.numel():
            fail(name, f"must be a 1-D int32/int64 tensor of {rows.numel()} entries, got {tuple(t.shape)} {t.dtype}")
    if fresh is not None and (fresh.dim() != 1 or fresh.dtype != torch.int64):
        fail("fresh", f"must be a 1-D int64 tensor, got {tuple(fresh.shape)} {fresh.dtype}")
    if skip is not None and (skip.dim() != 1 or skip.dtype != torch.bool or skip.numel() != rows.numel()):
        fail("skip", f"must be a 1-D bool tensor of {rows.numel()} entries")
    if tags.dim() != 1 or tags.dtype != torch.int64:
        fail("tags", f"must be a 1-D int64 tensor, got {tuple(tags.shape)} {tags.dtype}")
    if page_size < 1:
        fail("page_size", f"must be >= 1, got {page_size}")
    present = [t for t in (expected, expected_pages, rows, pos, slots, fresh, skip, tags) if t is not None]
    if len({t.device for t in present}) != 1:
        fail("tensors", f"must share one device, got {sorted({str(t.device) for t in present})}")


def record_decode(expected, expected_pages, rows, pos, slots, tags, *, page_size: int,
                  fresh: torch.Tensor | None = None, skip: torch.Tensor | None = None,
                  alloc: torch.Tensor | None = None, base: int = 0) -> None:
    """Record the new page of every request whose decode position starts a page (in place, no sync).

    Args:
        expected: int64 ``[R, P]`` tag each request slot expects at each logical page (written).
        expected_pages: int32 ``[R, P]`` the page recorded beside each expected tag (written).
        rows: ``[B]`` request slot (row of ``expected``) of each batch entry.
        pos: ``[B]`` the position each request writes this step (its length before the step).
        slots: ``[B]`` the KV slot each request writes this step (page = slot // page_size).
        tags: int64 ``[num_pages]`` current tags (recorded when neither ``fresh`` nor ``alloc`` is given).
        fresh: int64 ``[n]`` the tags the step's allocation gave its pages, in allocation order; the
            index is clamped into ``0..n-1``.
        skip: bool ``[B]``: leave these requests' expectations as they are (they still count in the
            allocation order).
        alloc: the step's allocation, not yet bumped: its pages ``[n]`` in allocation order. The same launch
            gives slot ``i`` the tag ``base + i`` (``tags`` keeps each page's largest) and records those
            tags as ``fresh`` would. Exclusive with ``fresh``.
    """
    DecodeRecorder(expected, expected_pages, tags, page_size=page_size)(rows, pos, slots, fresh=fresh, skip=skip,
                                                                         alloc=alloc, base=base)


class DecodeRecorder:
    """:func:`record_decode` bound to one expectation table and tag array (a server's per-step launch).

    On CUDA a call whose argument kinds were seen before (validated, compiled) hands its argument list straight
    to the compiled kernel: the table's pointers and sizes are read once, a step sets its own pointers and counts.
    Anything else (a new kind, tensors on another device, a launch hook set) goes through the full path."""

    def __init__(self, expected, expected_pages, tags, *, page_size: int, reference: bool = False):
        self.expected, self.expected_pages, self.tags, self.page_size = expected, expected_pages, tags, page_size
        self.reference = reference  # run record_decode_ref instead (a tracker's torch backend)
        self.kernel = DirectLaunch(_record_decode_kernel, expected.device)
        self._seen: set = set()
        self._compiled: dict = {}  # key -> the compiled variant, for the direct path
        # (the table's fixed arguments: expected, expected_pages, tags pointers; its rows, width, page size, strides)
        self._fixed = (expected.data_ptr(), expected_pages.data_ptr(), tags.data_ptr(), expected.shape[0],
                       expected.shape[1], page_size, expected.stride(0), expected_pages.stride(0))

    def __call__(self, rows, pos, slots, *, fresh=None, skip=None, alloc=None, n_alloc: int | None = None,
                 base: int = 0) -> None:
        """``alloc``'s first ``n_alloc`` entries (default: all) are the step's pages."""
        if alloc is not None and fresh is not None:
            raise ValueError("record_decode: give fresh or alloc, not both")
        if n_alloc is not None and not (alloc is not None and 0 <= n_alloc <= alloc.numel()):
            raise ValueError(f"record_decode: n_alloc={n_alloc} must lie in 0..alloc.numel() (an alloc given)")
        has_fresh = fresh is not None and fresh.numel() > 0
        n_fresh = fresh.numel() if has_fresh else 0 if alloc is None else alloc.numel() if n_alloc is None else n_alloc
        has_alloc = alloc is not None and n_fresh > 0
        has_skip = skip is not None
        batch = rows.numel()
        key = (has_fresh, has_skip, has_alloc, spec(rows), spec(pos), spec(slots),
               spec(fresh) if has_fresh else None, spec(skip) if has_skip else None,
               spec(alloc) if has_alloc else None, base < I32, batch < I32)
        kernel = self._compiled.get(key)
        if kernel is not None and batch == pos.numel() == slots.numel() and not self.kernel.hooked():
            e, p, t, n_rows, width, ps, e_stride, p_stride = self._fixed
            self.kernel.run(kernel, (1, 1, 1), [
                e, p, rows.data_ptr(), pos.data_ptr(), slots.data_ptr(), fresh.data_ptr() if has_fresh else t,
                skip.data_ptr() if has_skip else rows.data_ptr(), t, batch, n_fresh, n_rows, width, ps, e_stride,
                p_stride, alloc.data_ptr() if has_alloc else t, base, has_fresh, has_skip, has_alloc, BLOCK])
            return
        self._full(rows, pos, slots, fresh, skip, alloc if has_alloc else None, n_fresh, base, key)

    def _full(self, rows, pos, slots, fresh, skip, alloc, n_fresh: int, base: int, key: tuple) -> None:
        """The full path: tensors moved to the table's device, validated, launched through the JIT (or the
        reference); the compiled variant kept for the direct path."""
        expected, expected_pages, tags, ps = self.expected, self.expected_pages, self.tags, self.page_size
        dev = expected.device
        moved = [t if t is None or t.device == dev else t.to(dev) for t in (rows, pos, slots, fresh, skip, alloc)]
        if any(m is not t for m, t in zip(moved, (rows, pos, slots, fresh, skip, alloc))):
            rows, pos, slots, fresh, skip, alloc = moved
            key = None  # argument kinds that change on the way: never the direct path
        has_fresh, has_alloc = fresh is not None and fresh.numel() > 0, alloc is not None
        if key is None or key not in self._seen or not rows.numel() == pos.numel() == slots.numel():
            _validate(expected, expected_pages, rows, pos, slots, fresh, skip, tags, ps)
            if has_alloc and (alloc.dim() != 1 or alloc.dtype not in (torch.int32, torch.int64)
                              or alloc.device != tags.device):
                raise ValueError(f"record_decode: alloc must be a 1-D int32/int64 tensor on {tags.device}")
            if key is not None:
                self._seen.add(key)
        batch = rows.numel()
        if self.reference:
            if has_alloc:
                fresh = bump_ref(tags, alloc[:n_fresh], base)
            record_decode_ref(expected, expected_pages, rows, pos, slots, tags, page_size=ps, fresh=fresh, skip=skip)
            return
        if batch == 0 and not has_alloc:
            return
        launch_key = key if key is not None else (has_fresh, skip is not None, has_alloc, spec(rows), spec(pos),
                                                  spec(slots), spec(fresh) if has_fresh else None,
                                                  spec(skip) if skip is not None else None,
                                                  spec(alloc) if has_alloc else None, base < I32, batch < I32)
        self.kernel((1,), launch_key, (
            expected, expected_pages, rows, pos, slots, fresh if has_fresh else tags,
            skip if skip is not None else rows, tags, batch, n_fresh, expected.shape[0], expected.shape[1], ps,
            expected.stride(0), expected_pages.stride(0), alloc if has_alloc else tags, base,
        ), dict(HAS_FRESH=has_fresh, HAS_SKIP=skip is not None, HAS_ALLOC=has_alloc, BLOCK=BLOCK))
        compiled = self.kernel.kernels.get(launch_key) if key is not None else None
        if compiled is not None:
            self._compiled[key] = compiled


# A spec step's reserve (SGLang's ``alloc_for_spec_decode``): request ``b`` got the tokens ``[cur[b], nxt[b])``, their
# slots ``out[off_b:off_b + nxt[b] - cur[b]]`` (``off_b``: the tokens of the requests before it); each of its positions
# that starts a page got the allocation's next page (batch order, then position order). The same expectations as
# record_decode over one entry per reserved token, the entries made here from the device lengths (no host arrays).
_PER_RESERVE = ["rows_ptr", "cur_ptr", "nxt_ptr", "slots_ptr", "fresh_ptr", "alloc_ptr", "batch", "n_fresh", "n_out",
                "base"]


@triton.jit(do_not_specialize=["n_rows", "width", "page_size", "exp_stride", "pages_stride"] + _PER_RESERVE,
            do_not_specialize_on_alignment=_PER_RESERVE)
def _record_reserve_kernel(
    expected_ptr, expected_pages_ptr, rows_ptr, cur_ptr, nxt_ptr, slots_ptr, fresh_ptr, tags_ptr,
    batch, n_fresh, n_out, n_rows, width, page_size, exp_stride, pages_stride, alloc_ptr, base,
    HAS_FRESH: tl.constexpr, HAS_ALLOC: tl.constexpr, BLOCK: tl.constexpr,
):
    if HAS_ALLOC:  # the allocation's bump, as in _record_decode_kernel
        for start in range(0, n_fresh, BLOCK):
            i = start + tl.arange(0, BLOCK)
            page = tl.load(alloc_ptr + i, mask=i < n_fresh, other=0).to(tl.int64)
            tl.atomic_max(tags_ptr + page, base + i, mask=i < n_fresh)
    tokens = 0  # reserved tokens of earlier chunks of the batch
    pages = 0  # pages handed out to earlier chunks
    for start in range(0, batch, BLOCK):
        b = start + tl.arange(0, BLOCK)
        inside = b < batch
        cur = tl.load(cur_ptr + b, mask=inside, other=0).to(tl.int64)
        nxt = tl.load(nxt_ptr + b, mask=inside, other=0).to(tl.int64)
        n_tok = tl.maximum(nxt - cur, 0)
        first = (cur + page_size - 1) // page_size  # the request's first new logical page
        n_new = tl.where(inside, tl.maximum((nxt + page_size - 1) // page_size - first, 0), 0)
        off = tokens + tl.cumsum(n_tok, axis=0) - n_tok
        k0 = pages + tl.cumsum(n_new, axis=0) - n_new
        tokens += tl.sum(n_tok, axis=0).to(tl.int32)
        pages += tl.sum(n_new, axis=0).to(tl.int32)
        row = tl.load(rows_ptr + b, mask=inside, other=-1).to(tl.int64)
        for j in range(0, tl.max(n_new, axis=0)):
            col = first + j
            idx = off + col * page_size - cur  # the slot of the page's first position in the allocation's output
            live = (j < n_new) & (idx < n_out)
            page = tl.load(slots_ptr + idx, mask=live, other=0).to(tl.int64) // page_size
            k = k0 + j
            if HAS_ALLOC:
                tag = base + tl.minimum(k, n_fresh - 1)
            elif HAS_FRESH:
                tag = tl.load(fresh_ptr + tl.minimum(k, n_fresh - 1), mask=live, other=-1)
            else:
                tag = tl.load(tags_ptr + page, mask=live, other=-1)
            ok = live & (row >= 0) & (row < n_rows) & (col < width)
            tl.store(expected_ptr + row * exp_stride + col, tag, mask=ok)
            tl.store(expected_pages_ptr + row * pages_stride + col, page.to(tl.int32), mask=ok)


class ReserveRecorder:
    """A spec step's reserve recorded in one launch (``_record_reserve_kernel``), bound to one expectation table and
    tag array; :func:`record_reserve_ref` off Triton. Arguments as :meth:`DecodeRecorder.__call__`'s, with each
    request's reserved span ``[cur, nxt)`` (device lengths) in place of one position."""

    def __init__(self, expected, expected_pages, tags, *, page_size: int, reference: bool = False):
        self.expected, self.expected_pages, self.tags, self.page_size = expected, expected_pages, tags, page_size
        self.reference = reference
        self.kernel = DirectLaunch(_record_reserve_kernel, expected.device)
        self._seen: set = set()  # argument kinds validated once (as DecodeRecorder: no per-step validation)

    def __call__(self, rows, cur, nxt, slots, *, fresh=None, alloc=None, n_alloc: int | None = None,
                 base: int = 0) -> None:
        if alloc is not None and fresh is not None:
            raise ValueError("record_reserve: give fresh or alloc, not both")
        has_fresh = fresh is not None and fresh.numel() > 0
        n_fresh = fresh.numel() if has_fresh else 0 if alloc is None else alloc.numel() if n_alloc is None else n_alloc
        has_alloc = alloc is not None and n_fresh > 0
        key = (has_fresh, has_alloc, spec(rows), spec(cur), spec(nxt), spec(slots),
               spec(fresh) if has_fresh else None, spec(alloc) if has_alloc else None, base < I32)
        if key not in self._seen or not rows.numel() == cur.numel() == nxt.numel():
            self._validate(rows, cur, nxt, slots)
            self._seen.add(key)
        if self.reference:
            if has_alloc:
                fresh = bump_ref(self.tags, alloc[:n_fresh], base)
            record_reserve_ref(self.expected, self.expected_pages, rows, cur, nxt, slots, self.tags,
                               page_size=self.page_size, fresh=fresh)
            return
        e, p, t = self.expected, self.expected_pages, self.tags
        self.kernel((1,), key, (e, p, rows, cur, nxt, slots, fresh if has_fresh else t, t, rows.numel(), n_fresh,
                                slots.numel(), e.shape[0], e.shape[1], self.page_size, e.stride(0), p.stride(0),
                                alloc if has_alloc else t, base),
                    dict(HAS_FRESH=has_fresh, HAS_ALLOC=has_alloc, BLOCK=BLOCK))

    def _validate(self, rows, cur, nxt, slots) -> None:
        dev = self.expected.device
        for name, t in (("rows", rows), ("cur", cur), ("nxt", nxt), ("slots", slots)):
            if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or t.device != dev:
                raise ValueError(f"record_reserve: {name} must be a 1-D int32/int64 tensor on {dev}, got "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device}")
        if not rows.numel() == cur.numel() == nxt.numel():
            raise ValueError(f"record_reserve: rows, cur and nxt must have one entry per request "
                             f"({rows.numel()}, {cur.numel()}, {nxt.numel()})")


def record_reserve_ref(expected, expected_pages, rows, cur, nxt, slots, tags, *, page_size: int,
                       fresh: torch.Tensor | None = None) -> None:
    """Torch reference of a reserve's record: :func:`record_decode_ref` over one entry per reserved token (request
    ``b``'s positions ``cur[b]..nxt[b] - 1`` in order, their slots ``slots`` in batch order)."""
    cur, nxt = cur.long().cpu(), nxt.long().cpu()
    n_tok = (nxt - cur).clamp(min=0)
    total = int(n_tok.sum())
    if total == 0:
        return
    dev = expected.device
    entry_rows = torch.repeat_interleave(rows.long().cpu(), n_tok)
    pos = torch.arange(total) + torch.repeat_interleave(cur - (torch.cumsum(n_tok, 0) - n_tok), n_tok)
    take = min(total, slots.numel())  # (entries past the allocation's output record nothing)
    record_decode_ref(expected, expected_pages, entry_rows[:take].to(dev), pos[:take].to(dev), slots[:take], tags,
                      page_size=page_size, fresh=fresh)


def bump_ref(tags: torch.Tensor, pages: torch.Tensor, base: int) -> torch.Tensor:
    """Slot ``i`` of an allocation gets tag ``base + i``; each page keeps its largest (torch)."""
    fresh = torch.arange(base, base + pages.numel(), dtype=torch.int64, device=tags.device)
    if pages.numel():
        tags.scatter_reduce_(0, pages.to(tags.device, torch.int64), fresh, reduce="amax")
    return fresh


def record_decode_ref(expected, expected_pages, rows, pos, slots, tags, *, page_size: int,
                      fresh: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
    """Torch reference of :func:`record_decode` (same arguments, same writes)."""
    _validate(expected, expected_pages, rows, pos, slots, fresh, skip, tags, page_size)
    if rows.numel() == 0:
        return
    pos, slots, rows = pos.long(), slots.long(), rows.long()
    new = pos % page_size == 0
    pages = torch.div(slots, page_size, rounding_mode="floor")
    if fresh is not None and fresh.numel():
        k = (torch.cumsum(new.long(), 0) - 1).clamp(0, fresh.numel() - 1)
        tag = fresh[k]
    else:
        tag = tags[torch.where(new, pages, torch.zeros_like(pages))]
    if skip is not None:
        new = new & ~skip
    cols = torch.div(pos, page_size, rounding_mode="floor")
    ok = new & (rows >= 0) & (rows < expected.shape[0]) & (cols < expected.shape[1])
    r, c = rows[ok], cols[ok]
    expected[r, c] = tag[ok]
    expected_pages[r, c] = pages[ok].to(torch.int32)


@triton.jit(do_not_specialize=["pages_ptr", "fresh_ptr", "n", "base"],
            do_not_specialize_on_alignment=["pages_ptr", "fresh_ptr", "n", "base"])
def _bump_kernel(tags_ptr, pages_ptr, fresh_ptr, n, base, FRESH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    page = tl.load(pages_ptr + i, mask=live, other=0).to(tl.int64)
    tl.atomic_max(tags_ptr + page, base + i, mask=live)
    if FRESH:
        tl.store(fresh_ptr + i, base + i, mask=live)


class Bumper:
    """Tag bumps of one tag array in one launch: slot ``i`` of ``pages`` gets ``base + i``, each page keeps its
    largest (:func:`bump_ref`); the slots' tags are written to ``fresh`` when it is given."""

    def __init__(self, tags: torch.Tensor, *, reference: bool = False):
        self.tags, self.reference = tags, reference
        self.kernel = DirectLaunch(_bump_kernel, tags.device)

    def __call__(self, pages: torch.Tensor, base: int, fresh: torch.Tensor | None = None) -> None:
        n = pages.numel()
        if n == 0:
            return
        if self.reference:
            out = bump_ref(self.tags, pages, base)
            if fresh is not None:
                fresh.copy_(out)
            return
        if pages.device != self.tags.device:
            pages = pages.to(self.tags.device)
        key = (spec(pages), spec(fresh) if fresh is not None else None, n < I32, base + n < I32)
        self.kernel((triton.cdiv(n, BLOCK),), key, (self.tags, pages, self.tags if fresh is None else fresh, n, base),
                    dict(FRESH=fresh is not None, BLOCK=BLOCK))
