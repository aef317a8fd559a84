"""What kvguard follows in one SGLang 0.5.23 pool set: who holds which page, with which tag.

:class:`PoolFollower` wraps methods of the *instances* that ``build_kv_cache`` returned (draft workers'
pools and every other allocator in the process stay untouched): the allocator's alloc and release paths, its
free entry points, the tree's ``checkpoint`` and the row pool's alloc and ``free_rows``
(:class:`kvguard.sglang.pool_wraps.PoolWraps`). It records each request's row as SGLang hands out its pages
(here), tells which rows are no longer their requests' own (:meth:`PoolFollower.stale_flags`), and releases an
aborted request safely (:class:`kvguard.sglang.release.ReleaseSide`).

The check and the abort built on it are :class:`kvguard.sglang.guard.SGLangGuard`.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..settings import TrackerConfig
from ..tags import UNSET
from ..tracker import TagTracker
from .pool_wraps import DeferredBump, PoolWraps
from .radix import RadixTags
from .release import ReleaseSide

log = logging.getLogger("kvguard.sglang")


@dataclass(frozen=True, eq=False)
class BatchRows:
    """One batch composition's rows as kvguard recorded them (see PoolFollower.batch_rows)."""

    reqs: list  # the batch's request list object this was built for
    snapshot: list  # a copy of its requests, made once (what every check of this composition names: Pending.reqs)
    n: int
    version: int  # PoolFollower.known_version at build time
    owner: torch.Tensor  # int64 [B] host, -1: not recorded
    owner_dev: torch.Tensor  # the same on the pools' device, clamped at 0 (an unknown row's request: stale_flags)
    known: torch.Tensor  # bool [B] host: kvguard follows the entry's row
    all_known: bool
    unknown_dev: torch.Tensor | None  # ~known on the pools' device (None when all are known)


class PoolFollower(PoolWraps, ReleaseSide):
    """The bookkeeping of one SGLang scheduler's pools: tags, expectations, safe release."""

    def __init__(self, req_to_token_pool, allocator, tree_cache, config: TrackerConfig, registry=None):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = ps = int(allocator.page_size)
        self.num_pages = int(getattr(allocator, "num_pages", allocator.size // ps))
        table = req_to_token_pool.req_to_token
        self.num_rows = table.shape[0]
        self.device = table.device
        self.on_cuda = self.device.type == "cuda"  # (read every step: a device's .type is not a plain attribute)
        # NOTE: quarantine is off. SGLang's req_to_token is a token-level table that the attention
        # backends, the radix tree and the PD transfer all read; rewriting entries would corrupt their
        # view. A bad entry aborts its request instead, and its write slot is redirected (the check's write guard).
        self.tracker = TagTracker(replace(config, mode="check", quarantine=False), registry)
        self.max_pages = math.ceil(table.shape[1] / ps)
        self.tracker.attach(num_pages=self.num_pages + 1, num_rows=self.num_rows, max_entries=self.max_pages,
                            device=self.device, page_size=ps)
        self.radix = RadixTags(self)  # the tags the radix tree adopted its pages with, its publish gate
        # Rows whose expectations kvguard recorded itself (host side, no sync to read). A request in a batch whose
        # row is not known is a violation (stale_flags): aborted, never run with its entries unchecked.
        self.known = torch.zeros(self.num_rows, dtype=torch.bool)
        self.known_version = 0  # bumped on every change of `known` (what a batch's cached rows depend on)
        self._paged = hasattr(allocator, "_release_page_ids")
        self._holds: list[int] | None = None  # pages the request being released may free (releasing())
        self.retracting = False  # inside SGLang's release_req (kvguard.sglang.release): safe releases only
        self._fresh: torch.Tensor | None = None  # tags of the last allocation's slots, allocation order
        # While SGLang allocates a decode step (defer_bump, set around that one call): its pages are bumped by
        # the step's record launch (pending_alloc), not by a launch of their own; flush_alloc() if not recorded.
        self.defer_bump = False
        # (and only without a page history, which notes each bump where it happens)
        self.bump_in_record = self.tracker.history is None
        # (tensor, n): the step's new pages are its first n entries (the old free list: no slice per step)
        self._pending_alloc: tuple[torch.Tensor, int] | None = None
        self._deferred = DeferredBump(self)  # (deferred_bump(): the context around such an allocation)
        self.rows_built = 0  # BatchRows built (once per batch composition; a benchmark reads it)
        self.rows_version = 0  # bumped on every row allocation (what a batch's cached staleness depends on)
        # What each released row held, keyed by (row, SGLang's row generation): a request whose row was
        # taken from it (stale row) still holds these pages and lock, and gives them back on abort.
        self._released: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._raw: dict[str, Callable] = {}  # the allocator's unwrapped free entry points
        self._wrap_allocator()
        self._wrap_tree_cache()
        self._wrap_req_pool()

    # -- recording ---------------------------------------------------------------------------------
    def drop(self, row: int) -> None:
        self.tracker.drop(row)
        self.known[row] = False
        self.known_version += 1

    def _prefix_tags(self, pages: torch.Tensor) -> torch.Tensor:
        """What a request matching these tree pages expects: the tag the tree adopted each with (RadixTags)."""
        return self.radix.prefix_tags(pages)

    def adopt(self, req, checkpoint: Callable, *args, **kwargs):
        """SGLang's ``tree.checkpoint(req, ...)``: behind the publish gate, then the tree adopts what it took
        (:meth:`kvguard.sglang.radix.RadixTags.checkpoint`)."""
        return self.radix.checkpoint(req, checkpoint, *args, **kwargs)

    def record_extend(self, batch, out_cache_loc, rows_cpu, held: list[bool]) -> None:
        """After alloc_for_extend: each request's row maps prefix pages + the pages just allocated."""
        ps, table = self.page_size, self.req_to_token_pool.req_to_token
        offset, k = 0, 0
        fresh = self._fresh_for(sum(max(0, -(-n // ps) - -(-p // ps)) for n, p in
                                    zip(batch.seq_lens_cpu.tolist(), batch.prefix_lens)))
        seq_lens = batch.seq_lens_cpu.tolist()
        gens = getattr(self.req_to_token_pool, "req_generation", None)
        for i, (row, prefix_len, seq_len) in enumerate(zip(rows_cpu.tolist(), batch.prefix_lens, seq_lens)):
            first_new = -(-prefix_len // ps)
            if not held[i]:
                # SGLang's own row-reuse tag (ReqToTokenPool.req_generation, bumped in alloc_rows): a
                # request that is still scheduled after its row went to somebody else is stale.
                if gens is not None:
                    batch.reqs[i].kvguard_row_generation = int(gens[row])
                # A fresh row: its prefix pages are the tree's match (alloc_for_extend has just written
                # them into the row; on GPU by a Triton kernel, hence read back here). It expects the tags
                # the tree adopted them with.
                self.tracker.drop(row)
                if first_new > 0:
                    pages = table[row, 0:first_new * ps:ps].long() // ps
                    self.tracker.record(row, 0, pages, tags=self._prefix_tags(pages))
            # else: the row already held KV (chunked prefill, session): its prefix entries were
            # recorded when they were allocated and must NOT be refreshed from the table.
            last = -(-seq_len // ps)
            if last > first_new:
                idx = offset + torch.arange(first_new, last, device=out_cache_loc.device) * ps - prefix_len
                tags = None if fresh is None else fresh[k:k + last - first_new]
                self.tracker.record(row, first_new, out_cache_loc[idx].long() // ps, tags=tags)
                k += last - first_new
            offset += seq_len - prefix_len
            self.known[row] = True
            self.known_version += 1
            batch.reqs[i].kvguard_row = row

    def record_prealloc(self, req, kv_loc, prefix_len: int, total_prefix_len: int) -> None:
        """PD decode, after ``DecodePreallocQueue._pre_alloc``: the row maps the decode tree's prefix pages,
        then the pages just allocated as the transfer's destination.

        The destination's (pages, tags) are the request's transfer ticket (``req.kvguard_transfer``): what
        the writer stamps after its KV lands (:meth:`stamp`). A late write from this transfer into pages
        reallocated since stamps tags their new owners do not expect, and the next check fails.
        """
        ps, row = self.page_size, int(req.kv.req_pool_idx)
        assert prefix_len == total_prefix_len, "a HiCache gap in a PD prealloc (hierarchical_cache is refused)"
        assert total_prefix_len % ps == 0, f"PD prealloc prefix {total_prefix_len} is not page-aligned"
        gens = getattr(self.req_to_token_pool, "req_generation", None)
        if gens is not None:
            req.kvguard_row_generation = int(gens[row])
        self.tracker.drop(row)
        first = total_prefix_len // ps
        if first:
            pages = self.req_to_token_pool.req_to_token[row, 0:total_prefix_len:ps].long() // ps
            self.tracker.record(row, 0, pages, tags=self._prefix_tags(pages))
        pages = kv_loc[::ps].long() // ps
        tags = self._fresh_for(pages.numel())
        self.tracker.record(row, first, pages, tags=tags)
        req.kvguard_transfer = self.tracker.transfer_issue(pages, row=row, first=first)
        self.known[row] = True
        self.known_version += 1
        req.kvguard_row = row

    def stamp(self, ticket) -> None:
        """The transfer writer, after its KV landed in ``ticket.pages``: stamp the tags it was handed.

        A current transfer stamps the tags its pages carry (nothing changes); a late one, from a transfer
        whose pages were freed and handed out since, stamps old tags over the new owners' (device, no sync).
        """
        self.tracker.transfer_stamp(ticket)

    def record_decode(self, batch, out_cache_loc, stale: list[bool]) -> None:
        """After alloc_for_decode (one token per request): record the entries that got a new page.

        ``stale``: per request, its row belongs to a newer request (:meth:`stale`); SGLang wrote its slot
        into the padding row, and nothing is recorded for it in the row it no longer owns.
        """
        ps = self.page_size
        pos = batch.seq_lens  # the position being written (seq_lens is incremented afterwards)
        # Continuation slots (pos % ps != 0) stay in an already-recorded page: keep that expectation,
        # never refresh it from the table (that would launder a swapped or freed entry). One launch, no
        # sync (kvguard.kernels.record), which also bumps the step's new pages (alloc).
        any_stale = True in stale
        if any_stale:
            self.flush_alloc()  # the rare path below reads the new pages' tags on the host
        pending, self._pending_alloc = self._pending_alloc, None
        alloc, n_alloc = pending if pending is not None else (None, None)
        fresh = self._fresh if alloc is None and self._fresh is not None and self._fresh.numel() else None
        skip = None
        if any_stale:
            # Rare: a request decoding on a row that now belongs to another request. A new page it got is
            # its own: given back when it is aborted (at this step's verdict).
            new = (pos % ps == 0).tolist()
            k = -1
            for i, s in enumerate(stale):
                k += new[i]
                if s and new[i]:
                    tag = int(fresh[min(k, fresh.numel() - 1)]) if fresh is not None else \
                        int(self.tracker.current_tags(out_cache_loc[i:i + 1] // ps))
                    batch.reqs[i].__dict__.setdefault("kvguard_extra_pages", []).append(
                        (int(out_cache_loc[i]) // ps, tag))
            skip = self.to_device(stale, torch.bool)
        if fresh is None and skip is None and alloc is None:
            return  # no request starts a page this step (no page was handed out): nothing to record
        # The k-th request that needs a new page got the allocation's k-th page (batch order): one launch.
        rows = self.batch_rows(batch)
        if not rows.all_known:
            unknown = rows.unknown_dev
            skip = unknown if skip is None else skip | unknown
        self.tracker.record_decode(rows.owner_dev, pos, out_cache_loc, fresh=fresh, skip=skip, alloc=alloc,
                                   n_alloc=n_alloc)

    def to_device(self, values, dtype) -> torch.Tensor:
        """A small host list on the pools' device without waiting for the stream (pinned, async copy).

        NOTE: a copy from pageable memory synchronises the stream first, i.e. waits for the forward in
        flight; the caching host allocator's pinned blocks are reused only once their copy is done.
        """
        host = torch.tensor(values, dtype=dtype)
        if not self.on_cuda:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def owner_rows(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each batch entry's row as kvguard recorded it for that request (host, and on the pools' device).

        NOTE: identity comes from kvguard's own record (set where SGLang gave the request its row), never
        from the batch's device row indices: a clobbered index buffer makes the forward read another
        request's row, and checking that row against its own expectations would pass. Expectations are
        looked up by these rows, the table is read at the batch's rows (what attention reads). -1: a
        request kvguard never recorded (its row is not ``known``: a violation, :meth:`stale_flags`).
        """
        # NOTE: built once per batch composition (SGLang replaces batch.reqs on filter_batch and extends it on
        # merge_batch, so the list object and its length tell), not once per step.
        rows = self.batch_rows(batch)
        return rows.owner, rows.owner_dev

    def batch_rows(self, batch) -> "BatchRows":
        """The batch's owner rows (:meth:`owner_rows`) and which of them kvguard follows, cached on the batch
        for as long as its requests and ``known`` stay the same (the steady state: no host tensor op)."""
        reqs = batch.reqs
        cached = batch.__dict__.get("_kvguard_rows")
        if cached is not None and cached.reqs is reqs and cached.n == len(reqs) \
                and cached.version == self.known_version:
            return cached
        self.rows_built += 1
        owner = torch.tensor([req.__dict__.get("kvguard_row", -1) for req in reqs], dtype=torch.int64)
        clamped = owner.clamp(min=0)
        known = (owner >= 0) & self.known[clamped]
        device = clamped.to(self.device) if not self.on_cuda else \
            clamped.pin_memory().to(self.device, non_blocking=True)
        all_known = bool(known.all())
        unknown = None if all_known else self.to_device((~known).tolist(), torch.bool)
        rows = BatchRows(reqs, list(reqs), len(reqs), self.known_version, owner, device, known, all_known, unknown)
        batch._kvguard_rows = rows
        return rows

    def stale(self, batch) -> list[bool]:
        """Per request (host, no sync): its row was given to a newer request (SGLang's row generation)."""
        return self.stale_flags(batch)[0]

    def stale_flags(self, batch) -> tuple[list[bool], bool]:
        """:meth:`stale`, and whether any request is stale.

        Stale: the row the batch runs the request on is not its own as far as kvguard knows. SGLang gave it to a
        newer request (its row generation moved), or kvguard no longer follows it (``known`` is False: released
        under the request, or never recorded for it). Either way nothing in that row may be read or written for
        the request: it is aborted before its step is prepared (:mod:`kvguard.sglang.stale`), its write slot is
        redirected, the verdict flags it, and it is released without touching the row
        (:mod:`kvguard.sglang.release`).

        NOTE: a row changes hands only through the row pool's alloc (wrapped: rows_version) and kvguard's
        ``known`` only in record / drop (known_version), so the answer is cached on the batch for as long as its
        requests, the row pool and ``known`` stay the same (the steady state).
        NOTE (legitimate unknown rows): a request finished and released by the last result stays in the running
        batch until SGLang's filter_batch drops it, before any step is prepared; the stale abort skips finished
        requests, and the verdict ignores them. No path the registry checks puts a request with a row kvguard did
        not record into a batch: every row is recorded where SGLang hands it out (alloc_for_extend, PD's
        _pre_alloc), before any batch carries it.
        """
        reqs = batch.reqs
        cached = batch.__dict__.get("_kvguard_stale_of")
        if cached is not None and cached[0] is reqs and cached[1] == len(reqs) and cached[2] == self.rows_version \
                and cached[3] == self.known_version:
            return cached[4]
        owner = torch.tensor([req.__dict__.get("kvguard_row", -1) for req in reqs], dtype=torch.int64)
        stale = ((owner < 0) | ~self.known[owner.clamp(min=0)]).tolist()  # kvguard does not follow the row
        gens = getattr(self.req_to_token_pool, "req_generation", None)
        if gens is not None:
            rows = batch.req_pool_indices_cpu
            if rows is None:
                rows = torch.tensor([req.kv.req_pool_idx for req in reqs], dtype=torch.int64)
            now = gens[rows.long()].tolist()
            stale = [lost or getattr(req, "kvguard_row_generation", g) != g for req, g, lost in zip(reqs, now, stale)]
        flags = (stale, True in stale)
        batch._kvguard_stale_of = (reqs, len(reqs), self.rows_version, self.known_version, flags)
        return flags

    def _fresh_for(self, count: int) -> torch.Tensor | None:
        """The last allocation's slot tags, if it handed out exactly ``count`` pages.

        NOTE (fail closed): otherwise kvguard cannot tell which tag each new page of the rows got, and a page's
        *current* tag would pass a page handed out twice (only its later holder's tag survives). The rows'
        new entries then expect nothing (UNSET), which the check flags: the requests are aborted, never served
        on a guess. Logged every time it happens, with both counts."""
        fresh = self._fresh
        if fresh is not None and fresh.numel() == count:
            return fresh
        if not count:
            return None
        log.error("kvguard: an allocation handed out %d pages where the rows took %d; their requests' new "
                  "entries expect nothing and are flagged", 0 if fresh is None else fresh.numel(), count)
        return torch.full((count,), UNSET, dtype=torch.int64, device=self.device)
