"""Every path that frees a running request's KV takes kvguard's safe release (SGLang 0.5.23).

SGLang frees a request's pages as its ``req_to_token`` row names them (``mem_cache.common.release_kv_cache``). For a
request kvguard aborted that row is what is broken; for a running request SGLang releases between steps, the row
was last checked a step before. Such releases free only what the request legitimately holds
(:meth:`ReleaseSide.releasing`, the part of :class:`kvguard.sglang.follow.PoolFollower` that releases), and a row that
is not the request's own is never read or freed (:meth:`ReleaseSide.release_stale`).

SGLang releases running requests between steps on three paths, all through ``schedule_batch.release_req`` (hooked
here, :func:`around_release_req`): its retraction when the KV pool runs out (``ScheduleBatch.retract_decode``),
``Scheduler.pause_generation(mode="retract")`` (``retract_all``, per /pause_generation call at runtime) and priority
preemption (``PrefillAdder.preempt_to_schedule``, ``enable_priority_scheduling``: ``ScheduleBatch.release_req``).

Only functions of this subpackage import SGLang, and only when they run.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from ..tags import UNSET

log = logging.getLogger("kvguard.sglang")


class ReleaseSide:
    """:class:`kvguard.sglang.follow.PoolFollower`'s safe release: only the pages a request still legitimately holds
    go back (the allocator's free entry points pass through :meth:`_filter`: kvguard.sglang.pool_wraps)."""

    def legit_pages(self, req) -> list[int]:
        """Pages the request may give back: recorded for it past the tree's part, tags unchanged.

        Never read from its ``req_to_token`` row (that row is what is broken). A page freed or handed to
        somebody else since it was recorded carries another tag and is left alone.
        """
        ps, row = self.page_size, req.kv.req_pool_idx
        if row is None:
            return []
        gens = getattr(self.req_to_token_pool, "req_generation", None)
        if gens is not None and getattr(req, "kvguard_row_generation", int(gens[row])) != int(gens[row]):
            return []  # the row belongs to a newer request now: nothing in it is ours to free
        first = int(req.kv.cache_protected_len) // ps
        end = -(-int(req.kv.kv_allocated_len) // ps)
        if end <= first:
            return []
        return sorted(set(self.tracker.held_pages(int(row), first, end).tolist()))

    @contextlib.contextmanager
    def releasing(self, req):
        """While SGLang releases an aborted request: free exactly the pages it still legitimately holds.

        Frees naming other pages (its broken entries: another request's page, a tree page, a page
        already freed, a slot off the pool) are dropped; its legitimate pages that the broken row no
        longer names are freed afterwards, so SGLang's pool accounting ends as after a clean finish.
        """
        if self._holds is not None:  # already inside (kvguard's abort calls the hooked release)
            yield
            return
        self._holds = self.legit_pages(req)
        try:
            yield
            left = self._holds
        finally:
            self._holds = None
        if left:
            ids = torch.tensor(left, dtype=torch.int64, device=self.device)
            self._raw["free_page_ids"](ids)

    def release_stale(self, req, tree_cache) -> None:
        """Release a request whose row SGLang gave to another request while it still ran (stale row).

        Its row is the new owner's now: it is neither read nor freed. What the request still holds (its
        pages as recorded when the row was released, tags unchanged, past the tree's part; its tree lock)
        goes back, so SGLang's pool accounting ends as after a clean finish.
        """
        ps, row = self.page_size, req.kv.req_pool_idx
        key = (int(row), getattr(req, "kvguard_row_generation", -1)) if row is not None else None
        pages, tags = self._released.pop(key, (None, None)) if key is not None else (None, None)
        ids = set()
        if pages is not None:
            first, end = int(req.kv.cache_protected_len) // ps, -(-int(req.kv.kv_allocated_len) // ps)
            pages, tags = pages[first:end], tags[first:end]
            held = (tags != UNSET) & (self.tracker.current_tags(pages).to(tags.device) == tags)
            ids |= set(pages[held].tolist())
        extra = req.__dict__.pop("kvguard_extra_pages", [])  # pages it got after its row was taken
        if extra:
            extra_pages = torch.tensor([p for p, _ in extra], dtype=torch.int64)
            now = self.tracker.current_tags(extra_pages).cpu().tolist()
            ids |= {p for (p, t), n in zip(extra, now) if t == n}
        if ids:
            self._raw["free_page_ids"](torch.tensor(sorted(ids), dtype=torch.int64, device=self.device))
        if tree_cache is not None and getattr(req, "lock", None) is not None:
            tree_cache.unlock(req.lock)
            req.lock = None
        req.kv.req_pool_idx = None  # the row stays with its new owner
        req.kv.mark_kv_released()

    def _filter(self, ids: torch.Tensor, unit: int, slots: bool = False) -> torch.Tensor:
        """Pass ``ids`` (slots or page ids; ``unit`` slots per id) through, or keep only held pages."""
        if self._holds is None or ids.numel() == 0:
            return ids
        pages = sorted(set((ids.long() // unit).tolist())) if unit > 1 else sorted(set(ids.long().tolist()))
        keep = [p for p in pages if p in self._holds]
        self._holds = [p for p in self._holds if p not in keep]
        kept = torch.tensor(keep, dtype=ids.dtype, device=ids.device)
        return kept * unit if slots else kept


def row_cause(guard, req) -> tuple[str, str]:
    """Why ``req``'s row is not its own as kvguard knows it: (the violation's reason, what happened to the row)."""
    row = req.kv.req_pool_idx
    gens = getattr(guard.req_to_token_pool, "req_generation", None)
    if row is not None and gens is not None and \
            req.__dict__.get("kvguard_row_generation", int(gens[row])) != int(gens[row]):
        return "stale_row", "was reallocated to another request (stale row)"
    if req.__dict__.get("kvguard_row") is None:
        return "unknown_row", "was never recorded by kvguard (a path kvguard does not follow handed it out)"
    return "unknown_row", "was released while the request still ran (kvguard no longer follows it)"


def owns_row(guard, req) -> bool:
    """kvguard follows ``req``'s row as the request's own: recorded for it, not released since (``known``), not given
    to another request since (SGLang's row generation). What :meth:`PoolFollower.stale_flags` tells per batch,
    for one request."""
    row = req.kv.req_pool_idx
    if row is None or req.__dict__.get("kvguard_row") != int(row) or not bool(guard.known[int(row)]):
        return False
    gens = getattr(guard.req_to_token_pool, "req_generation", None)
    return gens is None or req.__dict__.get("kvguard_row_generation", int(gens[row])) == int(gens[row])


def safe_release(guard, original, req, tree_cache, *args, **kwargs):
    """SGLang's ``release_kv_cache(req, tree_cache, ...)`` (``original``) for a request kvguard aborted or one SGLang
    releases between steps: only the pages it legitimately holds go back; a row that is not its own (another
    request's now, or one kvguard no longer follows) is neither read nor freed."""
    if not req.kv.holds_kv:  # nothing in the KV pools (SGLang's own early return)
        return original(req, tree_cache, *args, **kwargs)
    if req.__dict__.get("kvguard_stale") or not owns_row(guard, req):
        if not req.__dict__.get("kvguard_aborted"):
            # Released between steps (retraction, pause, preemption) with a row that is not its own: counted, and
            # released without touching the row. SGLang recomputes a retracted request from its tokens.
            log.error("%s; released without touching that row", guard.stale_message(req, "released"))
        return guard.release_stale(req, tree_cache)
    with guard.releasing(req):
        return original(req, tree_cache, *args, **kwargs)


def around_release_req(original, *args, **kwargs):
    """``schedule_batch.release_req``: SGLang releases a running request between steps (retraction, pause, preemption).

    NOTE: each of these releases the request through its req_to_token row, unchecked since the step before. A row
    broken since would free pages other requests still map and keep its own (measured on the CPU, swapped
    entries: one page leaked, and SGLang's strict idle check stopped the server). While SGLang releases it, the
    release is the safe one (:func:`safe_release`, through the hooked release_kv_cache): for an intact row, the
    pages its row names (one device read per released request, only when SGLang releases one). The request is
    recomputed from its tokens when readmitted (alloc_for_extend records it again); what its broken row named is
    caught at the owners' next check."""
    guard = getattr(kwargs.get("token_to_kv_pool_allocator"), "_kvguard", None)  # (release_req: keyword-only)
    if guard is None:
        return original(*args, **kwargs)
    was, guard.retracting = guard.retracting, True
    try:
        return original(*args, **kwargs)
    finally:
        guard.retracting = was
