"""What every strike of faultlab's SGLang plugin reads of SGLang's requests and pools (a request's row and written
length, the page size and count), how it frees slots to the head of a free list, and its ``inject`` log line.
torch is imported inside the functions that need it.
"""
from __future__ import annotations

from .plan import Entry
from .runtime import log


def _page_size(batch) -> int:
    return int(batch.token_to_kv_pool_allocator.page_size)


def _num_pages(allocator) -> int:
    ps = int(allocator.page_size)
    return int(getattr(allocator, "num_pages", allocator.size // ps))


def _row(req) -> int:
    return int(req.kv.req_pool_idx)


def _seq_len(req) -> int:
    """Entries of the request's row that are written (before this step's prepare_for_decode)."""
    return int(req.kv.kv_committed_len)


def _written_pages(req, ps: int) -> int:
    return -(-_seq_len(req) // ps)


def _log_inject(entry: Entry, victims: list, **fields) -> None:
    log("inject", fault=entry.fault, seed=entry.seed, label=entry.label, step=entry.step,
        victims=[str(r.rid) for r in victims], **fields)


def _free_to_head(allocator, slots) -> None:
    """Free slots through SGLang's allocator.free, leaving their page(s) at the head of the free list."""
    import torch

    ps = int(allocator.page_size)
    allocator.free(slots)
    if ps == 1:  # TokenToKVPoolAllocator appends; a paged allocator prepends already
        free = allocator.free_pages
        n = slots.numel()
        allocator.free_pages = torch.cat((free[-n:], free[:-n]))
