"""A Hypothesis state machine: a reference paged allocator with prefix sharing, corrupted on purpose.

The machine keeps its own ground truth, independent of the tracker: per page a generation that moves on
every allocation and every free, and per request the (page, generation) pairs it was given plus the
page-table row the engine would read. A request is broken iff one of its live entries differs from the
page it was given, or one of its pages changed generation (was freed, possibly reallocated) since it got
it. After every step, validating all live requests must flag exactly the broken ones: no misses and no
false aborts.
"""
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,
                                 rule)
from prometheus_client import CollectorRegistry

from kvguard import TagTracker, TrackerConfig

NUM_PAGES = 20  # pool size; page 0 is scratch, usable pages 1..19 (small: pages get reused a lot)
ROWS = 6  # request slots
WIDTH = 6  # max pages per request

# any page id other than a valid one is fair game for a remap, including out-of-range and negative
PAGE_IDS = st.one_of(st.integers(0, NUM_PAGES - 1), st.integers(NUM_PAGES, 2**31 - 1),
                     st.integers(-(2**31), -1), st.sampled_from([NUM_PAGES, -1]))


@dataclass
class Request:
    """What the allocator gave a request, and the page-table row the engine reads for it."""

    row: int
    given: list = field(default_factory=list)  # [(page, generation when given)]
    table: list = field(default_factory=list)  # the engine's row: page ids, possibly corrupted


class TrackerMachine(RuleBasedStateMachine):
    """Reference allocator (free list + refcounts via owner sets) driving a TagTracker."""

    backend = "torch"

    def __init__(self):
        super().__init__()
        self.tracker = TagTracker(TrackerConfig(mode="check", backend=self.backend), CollectorRegistry())
        self.tracker.attach(num_pages=NUM_PAGES, num_rows=ROWS, max_entries=WIDTH, device="cpu")
        self.free = list(range(NUM_PAGES - 1, 0, -1))  # LIFO: a freed page is the next one handed out
        self.gen = [0] * NUM_PAGES
        self.owners: dict[int, set] = {p: set() for p in range(NUM_PAGES)}  # refcount = len(owners)
        self.requests: dict[int, Request] = {}
        self.next_id = 0

    # -- the reference allocator -------------------------------------------------------------------
    def _free_row(self) -> int:
        return min(set(range(ROWS)) - {r.row for r in self.requests.values()})

    def _take(self, rid: int, count: int) -> list[int]:
        """Hand ``count`` pages to ``rid`` (tracker: on_alloc)."""
        pages = [self.free.pop() for _ in range(count)]
        for p in pages:
            self.gen[p] += 1
            self.owners[p] = {rid}
        if pages:
            self.tracker.on_alloc(torch.tensor(pages))
        return pages

    def _give_back(self, pages: list[int]) -> None:
        """Return pages to the free list (tracker: on_free)."""
        for p in pages:
            self.gen[p] += 1
            self.owners[p] = set()
        self.free.extend(pages)
        if pages:
            self.tracker.on_free(torch.tensor(pages))

    def _grant(self, rid: int, pages: list[int]) -> None:
        """``rid`` now maps ``pages`` after its current ones (tracker: record)."""
        req = self.requests[rid]
        self.tracker.record(req.row, len(req.given), torch.tensor(pages))
        req.given += [(p, self.gen[p]) for p in pages]
        req.table += pages

    def _new_request(self) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.requests[rid] = Request(row=self._free_row())
        return rid

    def _holds(self, rid: int, page: int, gen: int) -> bool:
        return gen == self.gen[page] and rid in self.owners[page]

    def _broken(self, req: Request) -> bool:
        return any(entry != page or self.gen[page] != gen
                   for entry, (page, gen) in zip(req.table, req.given))

    def _pick(self, data, pred=lambda rid, req: True):
        return data.draw(st.sampled_from(sorted(r for r, q in self.requests.items() if pred(r, q))))

    # -- applicability (rules return early instead of using preconditions: Hypothesis gives up a
    # -- test case when too few rules are enabled) ---------------------------------------------
    def _has_row(self) -> bool:
        return len(self.requests) < ROWS

    def _can_share(self) -> bool:
        return self._has_row() and any(not self._broken(q) and q.given for q in self.requests.values())

    def _held(self) -> list[tuple[int, int]]:
        return [(rid, j) for rid, q in self.requests.items() for j, (p, g) in enumerate(q.given)
                if self._holds(rid, p, g)]

    # -- rules: normal operation -------------------------------------------------------------------
    @initialize(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3))
    def start(self, sizes):
        """A few running requests, so every rule is enabled from the first step."""
        for count in sizes:
            rid = self._new_request()
            self._grant(rid, self._take(rid, count))

    @rule(data=st.data())
    def allocate(self, data):
        if not (self._has_row() and self.free):
            return
        count = data.draw(st.integers(1, min(WIDTH, len(self.free))), label="pages")
        rid = self._new_request()
        self._grant(rid, self._take(rid, count))

    @rule(data=st.data())
    def extend(self, data):
        if not (self.free and any(len(q.given) < WIDTH for q in self.requests.values())):
            return
        rid = self._pick(data, lambda r, q: len(q.given) < WIDTH)
        room = WIDTH - len(self.requests[rid].given)
        count = data.draw(st.integers(1, min(room, len(self.free))), label="pages")
        self._grant(rid, self._take(rid, count))

    @rule(data=st.data())
    def share(self, data):
        """A new request maps a prefix of a healthy request's pages (prefix cache), plus own pages."""
        if not self._can_share():
            return
        donor = self._pick(data, lambda r, q: not self._broken(q) and q.given)
        prefix = [p for p, _ in self.requests[donor].given]
        prefix = prefix[:data.draw(st.integers(1, len(prefix)), label="prefix")]
        own = data.draw(st.integers(0, min(WIDTH - len(prefix), len(self.free))), label="own")
        rid = self._new_request()
        for p in prefix:
            self.owners[p].add(rid)
        self._grant(rid, prefix)
        if own:
            self._grant(rid, self._take(rid, own))

    @rule(data=st.data())
    def release(self, data):
        """Free a request: pages it still holds drop a reference; the last holder frees them."""
        if not self.requests:
            return
        rid = self._pick(data)
        req = self.requests.pop(rid)
        self.tracker.drop(req.row)
        last = []
        for p, g in req.given:
            if self._holds(rid, p, g):
                self.owners[p].discard(rid)
                if not self.owners[p]:
                    last.append(p)
        self._give_back(last)

    # -- rules: corruptions ------------------------------------------------------------------------
    @rule(data=st.data(), new_page=PAGE_IDS)
    def corrupt_remap(self, data, new_page):
        """One entry of a live request now names another page id (any, even out of range)."""
        if not any(q.table for q in self.requests.values()):
            return
        rid = self._pick(data, lambda r, q: q.table)
        req = self.requests[rid]
        j = data.draw(st.integers(0, len(req.table) - 1), label="entry")
        if new_page == req.table[j]:
            new_page += 1
        req.table[j] = new_page

    @rule(data=st.data(), reallocate=st.booleans())
    def corrupt_premature_free(self, data, reallocate):
        """Free a page live requests still map; optionally hand it at once to a new request."""
        if not self._held():
            return
        rid, j = data.draw(st.sampled_from(sorted(self._held())), label="victim")
        page = self.requests[rid].given[j][0]
        self._give_back([page])  # every holder (sharers too) is now stale
        if reallocate and self._has_row():
            extra = data.draw(st.integers(0, min(WIDTH - 1, len(self.free) - 1)), label="extra")
            thief = self._new_request()
            self._grant(thief, self._take(thief, 1 + extra))  # LIFO: gets `page` first
            assert self.requests[thief].given[0][0] == page

    # -- the invariant -----------------------------------------------------------------------------
    @invariant()
    def flags_exactly_the_broken_requests(self):
        rids = sorted(self.requests)
        if not rids:
            return
        table = torch.zeros((len(rids), WIDTH), dtype=torch.int32)
        for b, rid in enumerate(rids):
            entries = self.requests[rid].table
            table[b, :len(entries)] = torch.tensor(entries, dtype=torch.int32)
        source = table.clone()
        rows = torch.tensor([self.requests[r].row for r in rids])
        n_entries = torch.tensor([len(self.requests[r].table) for r in rids], dtype=torch.int32)
        check = self.tracker.validate(table, rows, n_entries, max_entries=WIDTH, source=source)
        found = self.tracker.resolve(check, check.verdict.cpu(), [str(r) for r in rids])
        flagged = {int(v.request_id) for v in found}
        broken = {r for r in rids if self._broken(self.requests[r])}
        assert flagged == broken, (flagged, broken)
        event(f"broken requests at a check: {min(len(broken), 2)}{'+' if len(broken) >= 2 else ''}")
        for v in found:
            self._check_report(self.requests[int(v.request_id)], v)

    def _check_report(self, req: Request, v) -> None:
        """The report names the first broken entry, its raw page id and the reason."""
        bad = [j for j, (entry, (page, gen)) in enumerate(zip(req.table, req.given))
               if entry != page or self.gen[page] != gen]
        j = bad[0]
        assert (v.logical_position, v.page, v.bad_entries) == (j, req.table[j], len(bad))
        in_range = 0 <= req.table[j] < NUM_PAGES
        assert v.reason == ("tag_mismatch" if in_range else "out_of_range")
        assert (v.found_tag is None) == (not in_range)


class TritonTrackerMachine(TrackerMachine):
    backend = "triton"


TrackerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow])
TritonTrackerMachine.TestCase.settings = settings(
    max_examples=4, stateful_step_count=12, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow])

TestTrackerStateMachine = TrackerMachine.TestCase
TestTritonTrackerStateMachine = TritonTrackerMachine.TestCase
