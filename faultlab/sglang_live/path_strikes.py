"""The strikes on the pools only some serving paths build (faultlab's SGLang plugin; the hooks that call them:
faultlab/sglang_live/strikes.py): the spec reserved region (SPEC_FAULTS), a sliding-window hybrid's full-to-SWA map
and SWA free list (SWA_FAULTS), and a mamba model's recurrent-state slots (MAMBA_FAULTS). What each class does and
who is a victim: faultlab/sglang_live/inject.py. torch is imported inside the functions that need it.
"""
from __future__ import annotations

from typing import Any

from .plan import Entry
from .runtime import log
from .strike_tools import _free_to_head, _log_inject, _page_size, _row, _seq_len


def _strike_swa(entry: Entry, batch) -> None:
    """A sliding-window hybrid: one full slot of the victim, inside the window its next decode step reads, gets its
    full→SWA entry cleared (0: SGLang's padding slot), pointed at another candidate's in-window SWA slot, or its SWA
    slot freed to the head of the SWA free list (the next SWA allocation reuses it). Victim: that request only (a
    request that receives the freed slot maps it correctly)."""
    import torch

    allocator = batch.token_to_kv_pool_allocator
    mapping = getattr(allocator, "full_to_swa_index_mapping", None)
    window = getattr(batch.tree_cache, "sliding_window_size", None)
    if mapping is None or not window:
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label, reason="not an SWA pool")
    rng, ps, table = entry.rng, _page_size(batch), batch.req_to_token_pool.req_to_token

    def in_window(req) -> int:
        # a position the next decode steps read through the map (the step writes _seq_len), in the window's newer
        # half: it stays in the window until the victim's abort lands (the overlap scheduler: a step or two later)
        n = _seq_len(req)
        return rng.randrange(max(0, n - window // 2), n)

    victim = rng.choice(entry.candidates)
    p = in_window(victim)
    full = int(table[_row(victim), p])
    old = int(mapping[full])
    info: dict[str, Any] = {"page_size": ps, "window": window, "entries": [[p, p + 1]], "full_slot": full}
    if entry.fault == "swa_cleared_entry":
        mapping[full] = 0
    elif entry.fault == "swa_foreign_entry":
        other = rng.choice([c for c in entry.candidates if c is not victim])
        theirs = int(mapping[int(table[_row(other), in_window(other)])])
        mapping[full] = theirs - theirs % ps + p % ps  # the other's SWA page, at the victim's in-page offset
        info["owner"] = str(other.rid)
    else:  # swa_freed_slot
        page = old // ps
        _free_to_head(allocator.swa_attn_allocator, torch.arange(page * ps, page * ps + ps, device=mapping.device))
    _log_inject(entry, [victim], rows=[_row(victim)], swa_slots=[old, int(mapping[full])], **info)


def _strike_spec(entry: Entry, batch) -> None:
    """A spec engine, between two spec steps: candidate A's reserved region ``[kv_committed_len, kv_allocated_len)``
    (what alloc_for_spec_decode reserved; this step's draft and verify forwards write and read there) is broken.

    ``spec_region_entry``: an entry of A's reserved region names a page another candidate B holds privately
    (B's committed KV past the radix tree's part). ``draft_slot_reused``: it names a slot of B's reserved region, so
    both requests' draft forwards address one draft-pool slot (and verify one target slot). ``rejected_page_freed``:
    A's last reserved slot (past any token verify can accept this step) is freed to the head of the free list while
    A's row still maps it; this step's allocation hands it out again. Victim: A (B is not: its row is intact)."""
    import torch

    if batch.spec_algorithm.is_none():
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label, reason="not a spec batch")
    rng, ps = entry.rng, _page_size(batch)
    table = batch.req_to_token_pool.req_to_token
    allocator = batch.token_to_kv_pool_allocator
    cands = [r for r in entry.candidates if not r.finished() and r.kv.req_pool_idx is not None]
    if len(cands) < 2:
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label, reason="fewer than two live")
    victim, other = rng.sample(cands, 2)
    row, lo, hi = _row(victim), int(victim.kv.kv_committed_len), int(victim.kv.kv_allocated_len)
    info: dict[str, Any] = {"page_size": ps, "reserved": [lo, hi], "other": str(other.rid)}
    if hi - lo < 2:
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label, reason="no reserved region")
    if entry.fault == "rejected_page_freed":
        p = hi - 1
        page = int(table[row, p]) // ps
        if page * ps < lo + 1 or any(int(table[row, q]) // ps != page for q in range(max(lo, page * ps), hi)):
            return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label, reason="page not reserved")
        _free_to_head(allocator, torch.arange(page * ps, page * ps + ps, device=table.device))
        return _log_inject(entry, [victim], rows=[row], pages=[page], entries=[[p, p + 1]], **info)
    p = rng.randrange(lo, hi)
    o_row = _row(other)
    if entry.fault == "spec_region_entry":
        first = -(-int(other.kv.cache_protected_len) // ps) * ps
        span = range(first, int(other.kv.kv_committed_len))
    else:  # draft_slot_reused
        span = range(int(other.kv.kv_committed_len), int(other.kv.kv_allocated_len))
    if not span:
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label, reason="nothing to point at")
    q = rng.choice(list(span))
    old, target = int(table[row, p]), int(table[o_row, q])
    table[row, p] = (target // ps) * ps + p % ps
    _log_inject(entry, [victim], rows=[row, o_row], pages=[old // ps, target // ps], entries=[[p, p + 1]],
                slots=[old, int(table[row, p])], **info)


# ------------------------------------------------------------------------------------------------
# Hybrid linear-attention / mamba models: the recurrent-state slots (HybridReqToTokenPool)
# ------------------------------------------------------------------------------------------------
def _state_slot(req) -> int:
    return int(req.kv.mamba_pool_idx)


def _not_spec(entry: Entry, batch) -> bool:
    """A spec_mamba_* fault on an engine without speculative decoding: logged as skipped (True)."""
    if entry.fault.startswith("spec_") and batch.spec_algorithm.is_none():
        log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label, reason="not a spec batch")
        return True
    return False


def _strike_state_index(entry: Entry, batch) -> None:
    """mamba_index_swap: candidate A's state index (``req_index_to_mamba_index_mapping[A's row]``, what the forward
    reads) names candidate B's slot; every Req keeps its own ``mamba_pool_idx``. Victim: A. spec_mamba_index_swap: the
    same, between two spec steps (the next step's verify would read and rewrite B's state, its commit scatter A's
    accepted state into B's slot)."""
    if _not_spec(entry, batch):
        return None
    pool = batch.req_to_token_pool
    cands = [r for r in entry.candidates if not r.finished() and r.kv.mamba_pool_idx is not None]
    if len(cands) < 2:
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                   reason="fewer than two candidates hold a state slot")
    victim, other = entry.rng.sample(cands, 2)
    row, old, new = _row(victim), _state_slot(victim), _state_slot(other)
    pool.req_index_to_mamba_index_mapping[row] = new
    _log_inject(entry, [victim], rows=[row], slots=[old, new], owner=str(other.rid))


def _strike_state_reuse(entry: Entry, batch) -> None:
    """mamba_slot_reuse, at a reuser's prefill (before SGLang allocates): candidate A's state slot is put at the
    head of the slot allocator's free list while A still holds it, so the reuser's allocation receives it. Victim:
    A (the reuser, its new holder, is not). spec_mamba_slot_reuse: the same on a spec engine (A between two spec
    steps; the reuser's prefill writes A's slot)."""
    import torch

    if _not_spec(entry, batch):
        return None
    allocator = batch.req_to_token_pool.mamba_allocator
    live = [r for r in entry.candidates if not r.finished() and r.kv.mamba_pool_idx is not None]
    if not live:
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                   reason="every candidate finished before a reuser arrived")
    victim = entry.rng.choice(live)
    slot = _state_slot(victim)
    free = allocator.free_slots
    allocator.free_slots = torch.cat((torch.tensor([slot], dtype=free.dtype, device=free.device), free))
    _log_inject(entry, [victim], rows=[_row(victim)], slots=[slot],
                reusers=[str(r.rid) for r in batch.reqs if entry.is_reuser(r)])
