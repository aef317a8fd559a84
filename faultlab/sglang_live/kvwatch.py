"""A diagnostic of faultlab's SGLang plugin: did anything change a request's KV contents behind its back?

With ``FAULTLAB_SGLANG_KV_WATCH=1`` (rids containing ``FAULTLAB_SGLANG_KV_WATCH_RIDS``, default ``-b``:
the reusers of a driver's episodes), every decode step before SGLang prepares it, each watched request's
``req_to_token`` row is read with a fingerprint of every layer's K and V at those slots:

* ``kv_final``: the fingerprints (one per layer's K and V) of the positions that became final, so that
  the same request's KV can be compared across episodes (a fault episode, its twin control, the
  fault-free one) position by position;
* ``kv_changed``: a position already final holds other K/V bytes than a step before (a write into what
  the request owns, or its row repointed to other contents; kvguard by design does not look at
  contents). A row repointed to a copy of the same contents (the radix tree's de-duplication) is not a
  change;
* ``kv_not_written``: a slot allocated for the request at a decode step still holds the poison bytes
  (0x7F) written into it right after the allocation: that step's forward never wrote the request's K/V.

With the overlap scheduler a step is prepared while the previous one's forward may still run, so only
what is final is compared: positions written two steps ago or earlier, and a poisoned slot two steps
after it was allocated. It reads device tensors back every step (a sync) and poisons fresh slots: a
diagnostic, never on in a measured run. Lines carry the episode label (the rid up to its last ``-``).
torch is imported inside the functions.
"""
from __future__ import annotations

from .runtime import label_of, log


POISON = 0x7F  # every byte of a freshly allocated watched slot (NaN in fp8 e4m3)


class Watch:
    """Per watched rid: its row's slots and their fingerprints; the poisoned slots not yet checked."""

    rids_with = "-b"
    seen: dict = {}  # rid -> (slots list, fingerprints list)
    pending: list = []  # (step allocated, rid, position, slot, fingerprint of the poisoned slot)
    step = 0
    weights = None


def _buffers(pool):
    return [buf for pair in zip(pool.k_buffer, pool.v_buffer) for buf in pair]


def _fingerprints(pool, slots) -> list[list[int]]:
    """Per slot, one int64 per layer's K and per layer's V (a fixed random projection of the bytes: equal
    bytes, equal value; a changed byte changes it with overwhelming probability)."""
    import torch

    idx = torch.as_tensor(slots, dtype=torch.int64, device=pool.k_buffer[0].device)
    columns = []
    for buf in _buffers(pool):
        raw = buf[idx].contiguous().view(torch.uint8).reshape(len(slots), -1).to(torch.int64)
        if Watch.weights is None or Watch.weights.numel() != raw.shape[1]:
            gen = torch.Generator(device="cpu").manual_seed(1234)
            Watch.weights = torch.randint(1, 2**20, (raw.shape[1],), generator=gen).to(idx.device)
        columns.append((raw * Watch.weights).sum(dim=1))
    return torch.stack(columns, dim=1).tolist() if columns else [[] for _ in slots]


def before_prepare_for_decode(batch, *args, **kwargs):
    if batch.is_empty():
        return None
    Watch.step += 1
    pool = batch.token_to_kv_pool_allocator.get_kvcache()
    table = batch.req_to_token_pool.req_to_token
    due = [p for p in Watch.pending if p[0] <= Watch.step - 2]
    Watch.pending = [p for p in Watch.pending if p[0] > Watch.step - 2]
    for _, rid, pos, slot, poisoned in due:
        if _fingerprints(pool, [slot])[0] == poisoned:
            log("kv_not_written", label=label_of(rid), rid=rid, position=pos, slot=slot)
    for req in batch.reqs:
        rid = str(req.rid)
        if Watch.rids_with not in rid or req.kv.req_pool_idx is None:
            continue
        n = int(req.kv.kv_committed_len)
        slots = table[int(req.kv.req_pool_idx), :n].long().tolist()
        prints = _fingerprints(pool, slots)
        old = Watch.seen.get(rid)
        done = 0 if old is None else max(0, len(old[0]) - 1)
        if n - 1 > done:  # the newest position may still be being written
            log("kv_final", label=label_of(rid), rid=rid, first=done, prints=prints[done:n - 1])
        if old is not None:
            old_slots, old_prints = old
            changed = [p for p in range(min(len(old_slots), n) - 1) if old_prints[p] != prints[p]]
            if changed:
                log("kv_changed", label=label_of(rid), rid=rid, positions=changed[:16], count=len(changed),
                    slots=[[old_slots[p], slots[p]] for p in changed[:16]])
        Watch.seen[rid] = (slots, prints)
    return None


def after_alloc_for_decode(out_cache_loc, batch, token_per_req=1, *args, **kwargs):
    import torch

    if int(token_per_req) != 1:
        return None
    pool = batch.token_to_kv_pool_allocator.get_kvcache()
    slots = out_cache_loc.long().tolist()
    for i, req in enumerate(batch.reqs):
        rid = str(req.rid)
        if Watch.rids_with in rid:
            for buf in _buffers(pool):
                buf.view(torch.uint8)[slots[i]] = POISON
            Watch.pending.append((Watch.step, rid, int(batch.seq_lens_cpu[i]), slots[i],
                                  _fingerprints(pool, [slots[i]])[0]))
    return None
