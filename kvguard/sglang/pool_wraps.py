"""The wrappers kvguard puts on the *instances* of one SGLang 0.5.23 pool set (never on their classes).

:class:`PoolWraps` is the part of :class:`kvguard.sglang.follow.PoolFollower` that wraps them:

- the allocator's ``alloc`` / ``alloc_extend`` / ``alloc_decode`` (bump the pages handed out) and its
  release path (bump the pages given back);
- the allocator's ``free`` / ``free_page_ids`` entry points, which pass through unchanged except while an
  aborted request is being released (:meth:`kvguard.sglang.release.ReleaseSide.releasing`): then only pages that
  request still legitimately holds reach the free list;
- the tree's ``checkpoint`` (the tree adopts a request's pages, or repoints its row to the tree's copy),
  behind a gate while a verdict on the request is unread (:mod:`kvguard.sglang.radix`);
- the row pool's ``alloc`` / ``alloc_rows`` (a row changing hands: ``rows_version``) and ``free_rows`` (a released
  row's expectations are dropped).
"""
from __future__ import annotations

import functools
import operator
from typing import Callable


def bump_on_release(allocator, bump: Callable) -> None:
    """A paged allocator's ``_release_page_ids`` (where its pages go back to the free list) wrapped so that each
    release's page ids are bumped (``bump(ids)``) before they are free: the KV allocator's tags, and the SWA
    sub-allocator's (kvguard.sglang.swa)."""
    release = allocator._release_page_ids

    def _release_page_ids(*page_ids):
        for ids in page_ids:
            bump(ids)
        return release(*page_ids)

    allocator._release_page_ids = _release_page_ids


class PoolWraps:
    """:class:`kvguard.sglang.follow.PoolFollower`'s wrappers on SGLang's allocator, tree and row pool."""

    def _wrap_allocator(self) -> None:
        a, ps = self.allocator, self.page_size
        for name in ("alloc", "alloc_extend", "alloc_decode"):
            setattr(a, name, self._alloc_wrapper(getattr(a, name)))
        if self._paged:
            # NOTE: PagedTokenToKVPoolAllocator._release_page_ids is the one place where pages go back
            # to the free list in 0.5.23: free() (after its unique), free_page_ids(), free_segment()
            # (-> free_page_ids), free_group_end() (both its pending lists) and the need_sort staging
            # all end there. Bumping there counts each release once, and a free deferred by a free
            # group is bumped when the group ends, still before the next check.
            bump_on_release(a, lambda ids: self.tracker.on_free(ids))
            self._raw = {"free": a.free, "free_page_ids": a.free_page_ids}
            a.free = lambda free_index: self._raw["free"](self._filter(free_index, ps, slots=True))
            a.free_page_ids = lambda page_ids: self._raw["free_page_ids"](self._filter(page_ids, 1))
        else:
            # TokenToKVPoolAllocator (page_size 1): free() releases at once, or queues into an open
            # free group whose free_group_end() calls free() again with no group open (bumped then).
            # free_page_ids() calls free().
            free = a.free

            def _free_unfiltered(free_index):
                if a.free_group is None and free_index.numel() > 0:
                    self.tracker.on_free(free_index)
                return free(free_index)

            self._raw = {"free": _free_unfiltered, "free_page_ids": _free_unfiltered}
            a.free = lambda free_index: _free_unfiltered(self._filter(free_index, 1))

    def _staged_of(self) -> Callable[[], int]:
        """The allocator's count of pages staged for release (freed, not yet in free_pages), as a plain function
        (chosen once: it runs twice per allocation)."""
        a = self.allocator
        if hasattr(a, "num_staged_pages"):
            return functools.partial(operator.attrgetter("num_staged_pages"), a)  # (C calls: no Python frame)
        return lambda: 0 if getattr(a, "release_pages", None) is None else len(a.release_pages)

    def _alloc_wrapper(self, original: Callable) -> Callable:
        a, ps, staged_now = self.allocator, self.page_size, self._staged_of()

        def alloc_wrapper(*args, **kwargs):
            before, staged = a.free_pages, staged_now()
            out = original(*args, **kwargs)
            if out is None:
                return out
            if not staged or staged_now() == staged:
                # NOTE: every allocation path of 0.5.23 hands out a prefix of free_pages (alloc takes
                # free_pages[:k]; alloc_extend / alloc_decode run their kernel, then drop
                # free_pages[:num_new_pages]). The new pages are exactly that prefix, known from two
                # lengths on the host: no device sync.
                taken = before.shape[0] - a.free_pages.shape[0]  # (not len(): a Python-level call per tensor)
                if taken == 0:  # the steady decode step: no request starts a page (no tensor op)
                    self._fresh = None
                    return out
                if self.defer_bump and self._pending_alloc is None:
                    # a decode step's pages: the first `taken` of the old free list, read there by the step's
                    # record launch (no slice: a tensor op per step)
                    self._pending_alloc, self._fresh = (before, taken), None
                    return out
                pages = before[:taken]
            else:
                # merge_and_sort_free ran inside the call (need_sort, PD): free_pages was rebuilt.
                pages = out[out % ps == 0] // ps
            # The tag each slot of this allocation got, in allocation order (a page handed out twice in
            # one call gets two tags; only the later holder's survives): recorded as each holder's
            # expectation, so the earlier holder of a duplicated page is caught.
            # NOTE: a decode step that starts no page hands out nothing: no tag bump (no device work). A decode
            # step's bump is left to the step's record launch (defer_bump), which gives the same tags.
            if self.defer_bump and pages.numel() and self._pending_alloc is None:
                self._pending_alloc, self._fresh = (pages, pages.numel()), None
            else:
                self._fresh = self.tracker.on_alloc(pages) if pages.numel() else None
            return out

        alloc_wrapper.__wrapped__ = original
        return alloc_wrapper

    def attach_tree(self, tree_cache) -> None:
        """Follow ``tree_cache`` too (a guard installed before SGLang built its tree: kvguard.sglang.plugin)."""
        self.tree_cache = tree_cache
        self._wrap_tree_cache()

    def _wrap_tree_cache(self) -> None:
        tree = self.tree_cache
        if tree is None or not hasattr(tree, "checkpoint"):
            return
        checkpoint = tree.checkpoint

        def _checkpoint(req, *args, **kwargs):
            return self.adopt(req, checkpoint, *args, **kwargs)

        tree.checkpoint = _checkpoint

    def _wrap_req_pool(self) -> None:
        pool = self.req_to_token_pool
        for name in ("alloc", "alloc_rows"):  # every path that bumps SGLang's row generation (PD's pool: alloc)
            if callable(getattr(pool, name, None)):
                setattr(pool, name, self._rows_wrapper(getattr(pool, name)))
        if not hasattr(pool, "free_rows"):
            return
        free_rows = pool.free_rows

        gens = getattr(pool, "req_generation", None)

        def _free_rows(indices):
            for row in indices:
                row = int(row)
                if gens is not None:
                    self._released[(row, int(gens[row]))] = self.tracker.expectation(row, 0, self.max_pages)
                    while len(self._released) > 2 * self.num_rows:  # bounded: the oldest go first
                        self._released.pop(next(iter(self._released)))
                self.drop(row)
            return free_rows(indices)

        pool.free_rows = _free_rows

    def _rows_wrapper(self, original: Callable) -> Callable:
        def rows_wrapper(*args, **kwargs):
            self.rows_version += 1  # before and after: a row handed out mid-call is never missed
            try:
                return original(*args, **kwargs)
            finally:
                self.rows_version += 1

        rows_wrapper.__wrapped__ = original
        return rows_wrapper

    def deferred_bump(self) -> "DeferredBump":
        """``with follower.deferred_bump():`` around SGLang's allocation of a step that a record launch follows."""
        return self._deferred

    def flush_alloc(self) -> None:
        """Bump a deferred decode allocation now (its record launch did not run, or needs the tags on the host)."""
        pending, self._pending_alloc = self._pending_alloc, None
        if pending is not None:
            self._fresh = self.tracker.on_alloc(pending[0][:pending[1]])


class DeferredBump:
    """While SGLang allocates a step's pages (decode, a spec step's reserve): the pages are bumped by the step's record
    launch (``defer_bump``: one launch for both, unless a page history notes each bump where it happens); pages handed
    out and not recorded by the end (an error in between) are bumped then. One per follower, reused every step."""

    __slots__ = ("follower",)

    def __init__(self, follower):
        self.follower = follower

    def __enter__(self):
        f = self.follower
        f.defer_bump = f.bump_in_record
        return f

    def __exit__(self, *exc) -> bool:
        f = self.follower
        f.defer_bump = False
        if f._pending_alloc is not None:
            f.flush_alloc()
        return False
