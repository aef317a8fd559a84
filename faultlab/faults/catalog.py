"""The fault catalog: bookkeeping bugs, registered by name.

Each fault is a small class with ``where`` (the structure it strikes), ``corrupts`` (what goes wrong),
``detectable`` (should the tag tracker catch it) and ``why``. ``apply(engine, rng, ctx)`` performs the
corruption through the same structures a buggy engine would touch, and returns a description of what
it did, or None when the engine offers no opportunity right now (the injector then retries later).

Faults run at the engine's ``after_schedule`` point: pages for the step are allocated and mapped, the
validation has not run yet.
"""
import random
from dataclasses import dataclass

import torch

FAULTS: dict[str, type["Fault"]] = {}
# Parts of the registry: `all` and `faultlab matrix` draw from one (a scenario's [faults].suite).
# "catalog": the faults built from first principles (this module); "real_bugs": published KV-cache
# bugs replayed mechanism for mechanism (faults/real_bugs.py).
SUITES = ("catalog", "real_bugs")


class UnknownFault(ValueError):
    """A fault name that is not registered; the message lists the valid ones."""


def register(cls):
    FAULTS[cls.name] = cls
    return cls


def get_fault(name: str) -> "Fault":
    if name not in FAULTS:
        raise UnknownFault(f"unknown fault {name!r}; valid faults: {', '.join(sorted(FAULTS))}")
    return FAULTS[name]()


@dataclass
class Context:
    kind: str  # "prefill" | "decode"
    requests: list  # the requests of the forward about to run
    grants: list  # (request, first, pages, previous) granted since the last fault point


class Fault:
    name = ""
    where = ""
    corrupts = ""
    detectable = True
    why = ""
    requires: str | None = None  # a feature the engine must have (None: always available)
    suite = "catalog"  # the part of the registry it belongs to (SUITES)

    def apply(self, engine, rng: random.Random, ctx: Context) -> dict | None:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"fault": self.name, "where": self.where, "corrupts": self.corrupts,
                "detectable": self.detectable, "why": self.why, "requires": self.requires, "suite": self.suite}


# -- helpers ---------------------------------------------------------------------------------------
def _owned(request) -> range:
    """Logical pages the request owns (not shared from the prefix cache)."""
    return range(request.n_shared, request.n_pages)


def _with_owned(requests) -> list:
    return [r for r in requests if r.status == "running" and r.row is not None and len(_owned(r)) > 0]


def _pick_entry(engine, rng, requests):
    candidates = [r for r in requests if r.status == "running" and r.row is not None and r.n_pages > 0]
    if not candidates:
        return None
    request = rng.choice(candidates)
    return request, rng.randrange(request.n_pages)


def _set_entry(engine, request, j: int, page: int) -> dict:
    old = int(engine.table[request.row, j])
    engine.table[request.row, j] = page
    return {"request": request.rid, "logical_page": j, "old_page": old, "new_page": page}


# -- allocator faults ------------------------------------------------------------------------------
@register
class DoubleFree(Fault):
    name = "double_free"
    where = "page allocator free()"
    corrupts = "a page already in the free list is freed again, so two later allocations share it"
    why = "the second owner's allocation bumps the page's tag; the first owner's expected tag is stale"

    def apply(self, engine, rng, ctx):
        free = engine.allocator.free_pages
        if free.numel() == 0:
            return None
        page = int(free[rng.randrange(min(2, free.numel()))])
        engine.allocator.free(torch.tensor([page]))
        return {"page": page}


@register
class PrematureFree(Fault):
    name = "premature_free"
    where = "request release path"
    corrupts = "a page is freed while its request still maps it, then reallocated to another request"
    why = "tags bump on free: the owner's next check fails even before the page is reused"

    def apply(self, engine, rng, ctx):
        candidates = _with_owned(ctx.requests)
        if not candidates:
            return None
        request = rng.choice(candidates)
        j = rng.choice(list(_owned(request)))
        page = int(engine.table[request.row, j])
        engine.allocator.free(torch.tensor([page]))
        return {"request": request.rid, "logical_page": j, "page": page}


@register
class Leak(Fault):
    name = "leak"
    where = "page allocator alloc()"
    corrupts = "pages are allocated and never freed nor mapped (lost capacity, no wrong data)"
    detectable = False
    why = "not corruption: no request reads a wrong page; caught by accounting (free+owned+cached != total)"

    def apply(self, engine, rng, ctx):
        n = min(2, engine.allocator.available())
        if n == 0:
            return None
        return {"pages": engine.allocator.alloc(n).tolist()}


@register
class UntrackedRealloc(Fault):
    name = "untracked_realloc"
    where = "an allocation path that bypasses the allocator (and so the tag bump)"
    corrupts = "a live page of one request is handed to another without a tag change"
    detectable = False
    why = "by design: the new owner records the page's current tag, which the old owner also expects"

    def apply(self, engine, rng, ctx):
        owners = _with_owned(engine.running)
        takers = [g for g in ctx.grants if g[0].status == "running"]
        if not owners or not takers:
            return None
        taker, first, pages, _ = rng.choice(takers)
        victims = [r for r in owners if r is not taker]
        if not victims:
            return None
        victim = rng.choice(victims)
        page = int(engine.table[victim.row, rng.choice(list(_owned(victim)))])
        j = first + len(pages) - 1
        engine.table[taker.row, j] = page
        engine.tracker.record(taker.row, j, torch.tensor([page]))  # the buggy path records, no bump
        engine.emit("on_grant", request=taker, first=j, pages=[page], previous=[pages[-1]], step=engine.step_id)
        return {"from": victim.rid, "to": taker.rid, "page": page}


# -- page-table faults -----------------------------------------------------------------------------
@register
class StaleRow(Fault):
    name = "stale_row"
    where = "decode growth: the row write of a newly allocated page"
    corrupts = "the row keeps the stale entry left by its previous occupant instead of the new page"
    why = "the stale page's tag is not the tag recorded for the new page"

    def apply(self, engine, rng, ctx):
        return _restore_previous(engine, rng, [g for g in ctx.grants if g[1] > 0])


@register
class RowReuseWithoutReset(Fault):
    name = "row_reuse_without_reset"
    where = "prefill: a reused request slot"
    corrupts = "a new request in a reused row is left with the previous occupant's entries"
    why = "the old entries' pages carry tags from their own (re)allocations, not the recorded ones"

    def apply(self, engine, rng, ctx):
        return _restore_previous(engine, rng, [g for g in ctx.grants if g[1] == 0])


def _restore_previous(engine, rng, grants):
    options = [(r, first + k, prev) for r, first, pages, previous in grants if r.status == "running"
               for k, prev in enumerate(previous) if prev != pages[k] and 0 < prev <= engine.num_pages]
    if not options:
        return None
    request, j, prev = rng.choice(options)
    return _set_entry(engine, request, j, prev)


@register
class SwappedEntries(Fault):
    name = "swapped_entries"
    where = "page table"
    corrupts = "two requests' entries are exchanged"
    why = "each entry now names a page whose tag the other request recorded"

    def apply(self, engine, rng, ctx):
        live = [r for r in engine.running if r.row is not None and r.n_pages > 0]
        if len(live) < 2:
            return None
        a, b = rng.sample(live, 2)
        ja, jb = rng.randrange(a.n_pages), rng.randrange(b.n_pages)
        pa, pb = int(engine.table[a.row, ja]), int(engine.table[b.row, jb])
        if pa == pb:
            return None  # a shared prefix page: swapping changes nothing
        engine.table[a.row, ja], engine.table[b.row, jb] = pb, pa
        return {"a": a.rid, "b": b.rid, "pages": [pa, pb]}


class EntryFault(Fault):
    """A fault that rewrites one live page-table entry of a request about to run."""

    where = "page table"

    def apply(self, engine, rng, ctx):
        picked = _pick_entry(engine, rng, ctx.requests)
        if picked is None:
            return None
        request, j = picked
        return _set_entry(engine, request, j, self.new_page(engine, rng, int(engine.table[request.row, j])))

    def new_page(self, engine, rng, page: int) -> int:
        raise NotImplementedError


@register
class IndexShift(EntryFault):
    name = "index_shift"
    corrupts = "an entry is off by one page id"
    why = "the neighbouring page carries its own, different tag (or is out of range)"

    def new_page(self, engine, rng, page):
        return page + rng.choice((-1, 1))


@register
class BitflipEntry(EntryFault):
    name = "bitflip_entry"
    corrupts = "one bit of one entry flips"
    why = "the flipped id names another page (other tag) or leaves the pool (bounds check)"

    def new_page(self, engine, rng, page):
        # NOTE: only flips that stay inside the KV allocation (pool + guard pages): on this CPU engine a
        # wilder id would crash the tracker-off run instead of reading the wrong data a GPU would read.
        limit = engine.num_pages + engine.kv.guard_pages
        bits = [b for b in range(limit.bit_length() + 1) if (page ^ (1 << b)) <= limit]
        return page ^ (1 << rng.choice(bits))


@register
class OutOfRangeEntry(EntryFault):
    name = "out_of_range_entry"
    corrupts = "an entry holds a page id >= the pool size, or a negative one"
    why = "bounds check; quarantine keeps the attention kernel inside the pool"

    def new_page(self, engine, rng, page):
        guard = max(1, engine.kv.guard_pages)
        return engine.num_pages + 1 + rng.randrange(guard) if rng.random() < 0.5 else -1 - rng.randrange(guard)


# -- prefix-cache faults ---------------------------------------------------------------------------
def _deepest_locked(engine):
    """Locked nodes none of whose children is locked (the end of some running request's prefix)."""
    return [n for n in engine.cache.nodes() if n.lock_ref > 0 and not any(c.lock_ref for c in n.children.values())]


def _evict_subtree(engine, node) -> dict:
    """Evict ``node`` and its (unlocked) descendants, deepest first, freeing their pages."""
    order, stack = [], [node]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    pages = [engine.cache.remove(n) for n in reversed(order)]
    engine.allocator.free(torch.tensor(pages, dtype=torch.int64))
    return {"page": node.page, "pages_freed": pages, "lock_ref": node.lock_ref}


@register
class EvictInUse(Fault):
    name = "evict_in_use"
    where = "prefix cache eviction"
    corrupts = "eviction ignores lock_ref and frees the page of a node a running request still holds"
    why = "tags bump on the free; every sharer's expected tag is stale"

    def apply(self, engine, rng, ctx):
        nodes = _deepest_locked(engine)
        return _evict_subtree(engine, rng.choice(nodes)) if nodes else None


@register
class RefcountUnderflow(Fault):
    name = "refcount_underflow"
    where = "prefix cache lock/unlock"
    corrupts = "a shared prefix node's lock count drops to zero while a sharer uses it; eviction frees it"
    why = "the free bumps the page's tag; the remaining sharers' expected tags are stale"

    def apply(self, engine, rng, ctx):
        nodes = _deepest_locked(engine)
        if not nodes:
            return None
        node = rng.choice(nodes)
        node.lock_ref = 0  # unlocked once too often: the node looks evictable
        return {"lock_ref_zeroed": True, **_evict_subtree(engine, node)}


# -- data-path faults ------------------------------------------------------------------------------
@register
class StrayWrite(Fault):
    name = "stray_write"
    where = "KV store: a write slot"
    corrupts = "one request's new K/V lands in a live, correctly mapped page of another request"
    detectable = False
    why = "tags describe mappings, not contents: every mapping is still right"
    mode = "write"

    def apply(self, engine, rng, ctx):
        return {"armed": True}  # the injector redirects a slot at the next write


@register
class TransferIntoReallocated(Fault):
    name = "transfer_into_reallocated"
    where = "prefill->decode KV transfer"
    corrupts = "a transfer lands in pages that were freed and reallocated while it was in flight"
    why = "the transfer guard compares the target pages' tags at issue and at landing"
    requires = "phase_split"

    def apply(self, engine, rng, ctx):
        """Release an in-flight transfer's target pages without cancelling it; this step's growth takes them.

        The bug: an abort/retract path frees the receiving request's decode pages and forgets its
        transfer. The free list is LIFO, so the decode growth of this very step hands the pages to a
        request that writes its next token there; the stale transfer lands at the start of a later step,
        over that token, before the new owner reads it.
        """
        picked = _in_flight_pick(engine, rng, ctx)
        if picked is None:
            return None  # no transfer with a step to go, or no growth to take the pages: retry later
        transfer, takers = picked
        engine.allocator.free(transfer.pages)
        return {"request": transfer.request.rid, "pages": transfer.pages.tolist(), "lands": transfer.land_step,
                "takers": [r.rid for r in takers]}


@register
class RankDivergentEntry(Fault):
    name = "rank_divergent_entry"
    where = "page table of one tensor-parallel rank"
    corrupts = "one rank's copy of a page-table entry names another page; the other ranks' copies stay right"
    why = ("that rank's shard check fails; the verdict all-reduce (MAX) makes every rank abort the "
           "request, so the ranks keep running the same batches")
    requires = "tp"

    def apply(self, engine, rng, ctx):
        """Every rank draws the same choices (same seed); only the chosen rank writes the entry."""
        picked = _pick_entry(engine, rng, ctx.requests)
        if picked is None or engine.num_pages < 2:
            return None
        request, j = picked
        target = rng.randrange(getattr(engine, "tp_world", 1))
        old = int(engine.table[request.row, j])
        page = 1 + (old - 1 + rng.randrange(1, engine.num_pages)) % engine.num_pages  # any other pool page
        if getattr(engine, "tp_rank", 0) == target:
            engine.table[request.row, j] = page
        return {"rank": target, "request": request.rid, "logical_page": j, "old_page": old, "new_page": page}


def _in_flight_pick(engine, rng, ctx):
    """(an in-flight transfer with a step still to go, the requests growing into new pages now), or None."""
    in_flight = getattr(engine, "in_flight", None)
    if ctx.kind != "transfer" or not in_flight:
        return None
    receivers = [t for t in in_flight.values() if t.land_step > engine.step_id and t.request.status == "running"]
    takers = _growing_now(engine)
    if not receivers or not takers:
        return None
    return rng.choice(receivers), takers


def _growing_now(engine) -> list:
    """Requests whose decode this step starts a new page (so `_grow` allocates for them) and that still
    decode after this step (so they read that page again)."""
    in_flight, ps = engine.in_flight, engine.page_size
    return [r for r in engine.running if r.status == "running" and r.row is not None
            and (r.rid not in in_flight or in_flight[r.rid].land_step <= engine.step_id)
            and r.kv_len // ps >= r.n_pages and len(r.output) + 1 < r.max_new_tokens]


def catalog() -> list[dict]:
    """Every registered fault, described."""
    return [FAULTS[name]().describe() for name in FAULTS]
