"""What kvguard does with SGLang's radix tree: the tags of the pages the tree publishes, and the gate before it.

A request's KV enters the tree at ``tree.checkpoint(req, up_to=...)`` (SGLang 0.5.23's ``RadixCache`` and
``UnifiedRadixCache``): between two chunks of a chunked prefill (``Scheduler.stash_chunked_request``), after a
request's prefill, and when a finished request is released with ``checkpoint=True``. The tree takes the request's
row where it did not have the key yet, and repoints the row to its own pages where it did. A later request that
matches the prefix maps the tree's pages in its own row, and kvguard checks it against the tag the tree adopted
each page with (:meth:`RadixTags.prefix_tags`). So the tree must only ever publish what kvguard verified:

- **the publish gate** (:meth:`RadixTags.checkpoint`): the overlap scheduler stashes the chunked request into the
  tree before it reads the verdict of the chunk it just launched. That chunk's check is waited for there (the
  check alone, not the forward after it: a wait paid at chunk boundaries only), and a chunk it flagged (whose
  writes went to the padding slot: its pages were never written) is not published;
- **adoption** (:meth:`RadixTags.adopt`): the tree adopts a page the row took from the request with the tag the
  request expects for it, where the row names the page kvguard recorded for the request; a page the tree took
  from the row against kvguard's record is poisoned; a page the tree already had keeps the tag it was adopted
  with. A tree page never adopted (UNSET) or poisoned (:data:`POISONED`) fails every match;
- **late flags** (:meth:`RadixTags.late_flags`): under the overlap scheduler a finishing request is released into
  the tree while the check of the step after its last one (launched before the release) is unread. When that
  check flags it, the guard counts the violation and the pages the request published are poisoned.

NOTE: a request flagged while it still runs (aborted, or discarded at its prefill) keeps the chunks it published
before: each was published after a clean verdict on everything it had written, and matched against kvguard's
record when the tree took it; poisoning them would abort the requests that share that prefix, which the fault
did not touch.
NOTE (what per-page tags cannot tell): a poisoned page that the tree later takes from another request's row, and
adopts there, carries that adoption's tag again. Where a broken row made the tree hold one page under two keys,
a match of the first key then passes again once the page is adopted under the second; the tree's structure is
broken (evicting either node frees the page under the other), which the violation counted at the flag reports
and kvguard does not repair.

Only this subpackage imports SGLang, and this module does not.
"""
from __future__ import annotations

import logging

import torch

from ..tags import UNSET

log = logging.getLogger("kvguard.sglang")

POISONED = -2  # a tree tag no page ever carries (tags are >= 0, UNSET is -1): every later match of the page fails
UNREAD = "kvguard_unread"  # on a chunked request: the check of its last chunk, until the tree's checkpoint reads it
PUBLISHED = "kvguard_published"  # on a request: [(pages, taken)] of each checkpoint (what the tree took: taken)


class RadixTags:
    """The tag each page carried when the radix tree adopted it, and the gate before the tree publishes a request.

    Owned by one :class:`kvguard.sglang.follow.PoolFollower` (``follower.radix``): its pools, tracker and, for the
    gate, its guard's verdict ring.
    """

    def __init__(self, follower):
        self.follower = follower
        # The tag each page carried when the radix tree adopted it (UNSET: never adopted; POISONED). A request that
        # matches a tree prefix expects these tags, never a page's current tag: a tree page freed while the tree
        # still references it is then caught for every later match, and so is one the tree never adopted.
        self.tags = torch.full((follower.num_pages + 1,), UNSET, dtype=torch.int64, device=follower.device)

    def prefix_tags(self, pages: torch.Tensor) -> torch.Tensor:
        """What a request matching these tree pages expects: the tag the tree adopted each with (UNSET or POISONED,
        which no page carries, where it adopted none: the match fails its check)."""
        return self.tags[pages]

    # -- the tree's checkpoint -------------------------------------------------------------------------
    def checkpoint(self, req, original, *args, **kwargs):
        """SGLang's ``tree.checkpoint(req, ...)`` (``original``) behind the publish gate, then the adoption."""
        if not self.publishable(req):
            # NOTE: what SGLang does for a request barred from the tree (skip_radix_cache_insert), for this call:
            # its KV stays its own (released with it, or published by a later checkpoint after a clean verdict);
            # checkpoint_kv_cache moves req.prefix_len on as for any stash, so the next chunk resumes after this one.
            return None
        old = req.kv.cache_protected_len
        before = self._row_slots(req, old, kwargs.get("up_to"))
        result = original(req, *args, **kwargs)
        self.adopt(req, old, before)
        return result

    def _row_slots(self, req, old_protected: int, up_to: int | None) -> torch.Tensor | None:
        """A copy of the row's first slot of each page the checkpoint may publish (device, no sync)."""
        row, ps = req.kv.req_pool_idx, self.follower.page_size
        if row is None:
            return None
        table = self.follower.req_to_token_pool.req_to_token
        end = table.shape[1] if up_to is None else int(up_to)
        return table[int(row), old_protected // ps * ps:end:ps].clone()

    def adopt(self, req, old_protected: int, before: torch.Tensor | None) -> None:
        """After ``tree.checkpoint()``: the tree holds the request's row up to its new protected length.

        NOTE: checkpoint() inserts the request's KV into the tree and repoints its row [old protected, new
        protected) to the tree's copy where the tree already had the key (the request's duplicates are freed, i.e.
        bumped). Where the row still holds the slot it held before (``before``), the tree took the row's page:
        adopted with the request's expected tag where it is the page kvguard recorded for the request (never the
        page's current tag, which could launder a page freed in between), poisoned otherwise (the row was broken
        after its last check: a later match must not read that page as this prefix). Where the row was repointed,
        the request now expects the tree's tag.
        """
        f, ps = self.follower, self.follower.page_size
        row, new = req.kv.req_pool_idx, req.kv.cache_protected_len
        if row is None or new <= old_protected or before is None:
            return
        row, first, last = int(row), old_protected // ps, -(-new // ps)
        slots = f.req_to_token_pool.req_to_token[row, first * ps:new:ps]
        pages = slots.long() // ps
        assert before.numel() >= pages.numel(), f"checkpoint published {pages.numel()} pages past up_to"
        taken = before[:pages.numel()] == slots
        mine, mine_tags = f.tracker.expectation(row, first, last)
        adopted = taken & (pages == mine) & (mine_tags != UNSET)
        tags = self.tags
        tags[pages] = torch.where(adopted, mine_tags, tags[pages])  # no boolean index: no sync
        self._poison(pages, taken & ~adopted)
        f.tracker.record(row, first, pages, tags=torch.where(adopted, mine_tags, self.prefix_tags(pages)))
        req.__dict__.setdefault(PUBLISHED, []).append((pages, taken))

    def _poison(self, pages: torch.Tensor, where: torch.Tensor) -> None:
        """POISONED for ``pages`` where ``where`` (a page listed twice: poisoned if either says so; no sync)."""
        tags = self.tags
        tags.scatter_reduce_(0, pages, torch.where(where, POISONED, tags[pages]), reduce="amin")

    # -- the publish gate ------------------------------------------------------------------------------
    def unread(self, batch) -> None:
        """An extend batch's check was just launched (its ``_kvguard``): its chunked request, which the overlap
        scheduler stashes into the tree before this verdict is read, waits for it at that checkpoint. On CUDA an
        event after the check (and the ranks' agreement) is what it waits for."""
        req = getattr(batch, "chunked_req", None)
        pending = batch.__dict__.get("_kvguard")
        if req is None or pending is None or not any(r is req for r in pending.reqs):
            return
        if self.follower.on_cuda and pending.ready is None:
            assert pending.slot >= 0, "an extend batch's check is launched at its prepare_for_extend"
            pending.ready = self.follower._ring.record(pending.slot)
        setattr(req, UNREAD, pending)

    def publishable(self, req) -> bool:
        """The request may be published: no check of a chunk of it is unread, or that check did not flag it.

        NOTE: read the first time the request is checkpointed after its chunk was launched (SGLang's stash of the
        chunked request, one step later); the check ran before that chunk's forward, so it is long done: the event
        costs no wait behind the forward. Where the check flagged anything, which requests it flagged is read (a
        device read, only then). With attention TP the ranks' agreed verdict decides, so every rank's tree stays
        the same.
        """
        pending = req.__dict__.pop(UNREAD, None)
        if pending is None:
            return True
        if pending.ready is not None:
            pending.ready.synchronize()
        guard, i = self.follower, next(k for k, r in enumerate(pending.reqs) if r is req)
        if pending.agreed is not None:
            return not bool(pending.agreed.reshape(len(pending.reqs), -1)[i].any())
        if pending.stale[i]:
            return False
        if not guard._ring.flagged(pending.slot, pending.stamp):
            return True
        return not bool(guard.check_of(pending).verdict.reshape(len(pending.reqs), -1)[i].any())

    # -- late flags ------------------------------------------------------------------------------------
    def late_flags(self, reqs: list) -> None:
        """Requests a check flagged after they finished (their violation is counted by the caller, explained from
        the row as it is now, released: its reason is mostly "unrecorded"): every page the tree took from their
        rows fails every later match."""
        for req in reqs:
            published = req.__dict__.pop(PUBLISHED, [])
            for pages, taken in published:
                self._poison(pages, taken)
            log.error("kvguard: request %s was flagged by a check whose verdict was read after it finished; the "
                      "%d radix-tree checkpoint(s) it made are poisoned (a later prefix match of them is flagged)",
                      req.rid, len(published))
