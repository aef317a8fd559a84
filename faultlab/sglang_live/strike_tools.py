"""What every strike of faultlab's SGLang plugin reads of SGLang's requests and pools (a request's row and written
length, the page size and count) and of the process's ranks, how it frees slots to the head of a free list, and its
``inject`` log line. torch and SGLang are imported inside the functions that need them.
"""
from __future__ import annotations

import sys

from .plan import Entry
from .runtime import State, log


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


def here(entry: Entry) -> bool:
    """The entry arms in this scheduler process: it names no TP rank, or this process's (SGLang's TP rank, looked up
    once: the groups exist before the first batch)."""
    if entry.tp_rank is None:
        return True
    if State.tp_rank is None:
        from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

        State.tp_rank = get_tensor_model_parallel_rank()
    return entry.tp_rank == State.tp_rank


def ranks() -> dict:
    """This process's TP rank, its SGLang attention-TP group (global ranks) and the ranks kvguard's verdict agreement
    spans (``kvguard.sglang.runtime``'s looked-up group, read if kvguard is loaded: [] for one rank, None where it
    has not looked it up); {} without SGLang's groups (a rig)."""
    import torch.distributed as dist

    try:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group, get_tensor_model_parallel_rank

        out = {"tp_rank": get_tensor_model_parallel_rank(),
               "attn_tp_ranks": dist.get_process_group_ranks(get_attn_tp_group().cpu_group)}
    except Exception:  # no model-parallel groups in this process
        return {}
    kvguard = sys.modules.get("kvguard.sglang.runtime")
    group = kvguard._GROUP[0][0] if kvguard is not None and kvguard._GROUP else False
    out["kvguard_agrees_with"] = None if group is False else [] if group is None else \
        dist.get_process_group_ranks(group)
    return out
