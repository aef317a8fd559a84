"""NoopTracker, make_tracker/settings, and TagTracker end to end on both backends (torch, Triton interpreter).

Each test drives the tracker the way an engine does (on_alloc -> record -> validate -> resolve), with its
own Prometheus registry, and checks the violations it reports field by field.
"""
import os
import random

import pytest
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from kvguard import (KVGuardViolation, NoopTracker, SettingsError, TagTable, TagTracker,
                     TrackerConfig, make_tracker)
from kvguard.tags import UNSET

NUM_PAGES = 64  # usable pages 1..63, page 0 scratch
WIDTH = 8  # max pages per request slot
ROWS = 6
BACKENDS = ["torch", "triton"]


# -- helpers ---------------------------------------------------------------------------------------------
class Engine:
    """A minimal engine around a tracker: a free list, request slots and a batch-packed page table."""

    def __init__(self, tracker, page_size: int = 1):
        self.tracker = tracker
        self.page_size = page_size
        self.free = list(range(NUM_PAGES - 1, 0, -1))  # pop() hands out 1, 2, 3, ...
        self.pages: dict[str, list[int]] = {}  # request id -> pages as handed out
        self.row: dict[str, int] = {}
        tracker.attach(num_pages=NUM_PAGES, num_rows=ROWS, max_entries=WIDTH, device="cpu",
                       page_size=page_size)

    def alloc(self, count: int) -> list[int]:
        pages = [self.free.pop() for _ in range(count)]
        self.tracker.on_alloc(torch.tensor(pages))
        return pages

    def release_pages(self, pages: list[int]) -> None:
        self.tracker.on_free(torch.tensor(pages))
        self.free.extend(pages)

    def admit(self, rid: str, count: int) -> list[int]:
        row = min(set(range(ROWS)) - set(self.row.values()))
        pages = self.alloc(count)
        self.pages[rid], self.row[rid] = list(pages), row
        self.tracker.record(row, 0, torch.tensor(pages))
        return pages

    def extend(self, rid: str, count: int) -> None:
        pages = self.alloc(count)
        self.tracker.record(self.row[rid], len(self.pages[rid]), torch.tensor(pages))
        self.pages[rid] += pages

    def finish(self, rid: str) -> None:
        self.tracker.drop(self.row.pop(rid))
        self.release_pages(self.pages.pop(rid))

    def step(self, edits=None):
        """Validate every live request on a freshly packed table; return (violations, table, source)."""
        rids = list(self.pages)
        source = torch.zeros((len(rids), WIDTH), dtype=torch.int32)
        for b, rid in enumerate(rids):
            source[b, :len(self.pages[rid])] = torch.tensor(self.pages[rid], dtype=torch.int32)
        for (rid, j), page in (edits or {}).items():
            source[rids.index(rid), j] = page
        table = source.clone()
        rows = torch.tensor([self.row[r] for r in rids])
        n_entries = torch.tensor([len(self.pages[r]) for r in rids], dtype=torch.int32)
        check = self.tracker.validate(table, rows, n_entries, max_entries=WIDTH, source=source,
                                      entries_hint=int(n_entries.sum()))
        verdict_host = None if check is None else check.verdict.cpu()
        return self.tracker.resolve(check, verdict_host, rids), table, source


def tag_of(tracker, page: int) -> int:
    return int(tracker.tags.tags[page])


def checked_tracker(backend: str, registry=None, **config) -> TagTracker:
    return TagTracker(TrackerConfig(mode="check", backend=backend, **config),
                      registry or CollectorRegistry())


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def engine(backend, registry):
    return Engine(checked_tracker(backend, registry))


def only(violations) -> KVGuardViolation:
    assert len(violations) == 1, violations
    return violations[0]


# -- NoopTracker -----------------------------------------------------------------------------------------
def test_noop_tracker_does_nothing():
    tracker = NoopTracker()
    pages = torch.tensor([1, 2])
    assert tracker.attach(num_pages=8, num_rows=2, max_entries=4, device="cpu") is None
    assert tracker.on_alloc(pages) is None and tracker.on_free(pages) is None
    assert tracker.record(0, 0, pages) is None and tracker.drop(0) is None
    assert tracker.record_many(torch.tensor([0]), torch.tensor([0]), pages[:1]) is None
    table = torch.tensor([[-5, 999]], dtype=torch.int32)
    before = table.clone()
    check = tracker.validate(table, torch.tensor([0]), torch.tensor([2]), max_entries=2)
    assert check is None
    assert tracker.resolve(check, None, ["r"]) == []
    assert tracker.resolve(check, torch.ones(1, 1, dtype=torch.int32), ["r"]) == []
    assert torch.equal(table, before)
    assert vars(tracker) == {} and tracker.enabled is False


def test_noop_engine_step_reports_nothing():
    eng = Engine(NoopTracker())
    eng.admit("a", 3)
    violations, table, source = eng.step({("a", 0): 10_000})
    assert violations == [] and torch.equal(table, source)


# -- make_tracker / settings -----------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("KVGUARD_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_make_tracker_from_config(registry):
    assert type(make_tracker(TrackerConfig())) is NoopTracker
    assert type(make_tracker(TrackerConfig(mode="off", backend="triton"))) is NoopTracker
    tracker = make_tracker(TrackerConfig(mode="check", backend="torch", quarantine=False), registry)
    assert type(tracker) is TagTracker
    assert tracker.config.backend == "torch" and tracker.config.quarantine is False


def test_make_tracker_from_env(clean_env, registry):
    assert type(make_tracker(registry=registry)) is NoopTracker  # default: off
    clean_env.setenv("KVGUARD_MODE", "off")
    assert type(make_tracker(registry=registry)) is NoopTracker
    clean_env.setenv("KVGUARD_MODE", " Check ")
    clean_env.setenv("KVGUARD_BACKEND", "TORCH")
    clean_env.setenv("KVGUARD_QUARANTINE", "no")
    clean_env.setenv("KVGUARD_LOG_VIOLATIONS", "0")
    tracker = make_tracker(registry=registry)
    assert type(tracker) is TagTracker
    assert tracker.config == TrackerConfig(mode="check", backend="torch", quarantine=False,
                                           log_violations=False)


def test_explicit_config_wins_over_env(clean_env, registry):
    clean_env.setenv("KVGUARD_MODE", "check")
    assert type(make_tracker(TrackerConfig(mode="off"), registry)) is NoopTracker


@pytest.mark.parametrize("key,value,choices", [
    ("KVGUARD_MODE", "on", ["off", "check"]),
    ("KVGUARD_MODE", "", ["off", "check"]),
    ("KVGUARD_BACKEND", "cuda", ["auto", "triton", "torch"]),
    ("KVGUARD_QUARANTINE", "maybe", ["1/0", "true/false", "yes/no", "on/off"]),
])
def test_invalid_env_lists_valid_choices(clean_env, key, value, choices):
    clean_env.setenv(key, value)
    with pytest.raises(SettingsError) as err:
        make_tracker(registry=CollectorRegistry())
    message = str(err.value)
    field = key.removeprefix("KVGUARD_").lower()
    assert (key in message) or (f"{field}=" in message and "KVGUARD_" in message)
    assert all(choice in message for choice in choices)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("field,value,choices", [
    ("mode", "enabled", ["off", "check"]),
    ("backend", "cuda", ["auto", "triton", "torch"]),
])
def test_invalid_config_lists_valid_choices(field, value, choices):
    with pytest.raises(SettingsError) as err:
        TrackerConfig(**{field: value})
    assert field in str(err.value) and all(choice in str(err.value) for choice in choices)


def test_backend_selection():
    for backend, want in (("torch", False), ("triton", True), ("auto", False)):  # auto: triton on CUDA only
        tracker = checked_tracker(backend)
        tracker.attach(num_pages=4, num_rows=1, max_entries=2, device="cpu")
        assert tracker.use_triton is want


def test_unattached_tracker_raises():
    with pytest.raises(RuntimeError, match="attach"):
        checked_tracker("torch").on_alloc(torch.tensor([1]))


def test_record_beyond_row_width_raises(engine):
    with pytest.raises(ValueError, match="row width"):
        engine.tracker.record(0, WIDTH - 1, torch.tensor([1, 2]))


# -- TagTracker: what it catches -------------------------------------------------------------------------
def test_healthy_requests_pass(engine, registry):
    engine.admit("a", 3)
    engine.admit("b", 5)
    engine.extend("a", 2)
    engine.finish("b")
    engine.admit("c", 8)  # reuses b's slot and pages: new tags, nothing stale
    violations, table, source = engine.step()
    assert violations == [] and torch.equal(table, source)
    assert registry.get_sample_value("kvguard_checks_total") == 1
    assert registry.get_sample_value("kvguard_entries_checked_total") == 13


def test_remap_is_caught(engine, registry):
    engine.admit("a", 4)
    b_pages = engine.admit("b", 3)
    a_pages = engine.pages["a"]
    want_tag = tag_of(engine.tracker, a_pages[2])
    violations, table, source = engine.step({("a", 2): b_pages[1]})
    err = only(violations)
    assert isinstance(err, KVGuardViolation) and isinstance(err, RuntimeError)
    assert (err.request_id, err.logical_position, err.page) == ("a", 2, b_pages[1])
    assert (err.expected_tag, err.found_tag) == (want_tag, tag_of(engine.tracker, b_pages[1]))
    assert err.reason == "tag_mismatch" and err.bad_entries == 1 and err.row == engine.row["a"]
    assert "request a" in str(err) and f"page {b_pages[1]}" in str(err)
    # quarantine: exactly that entry now reads the scratch page; the engine's source is untouched
    diff = (table != source).nonzero().tolist()
    assert diff == [[0, 2]] and int(table[0, 2]) == 0
    assert registry.get_sample_value("kvguard_violations_total", {"reason": "tag_mismatch"}) == 1


def test_logical_position_uses_page_size(backend):
    eng = Engine(checked_tracker(backend), page_size=16)
    eng.admit("a", 5)
    err = only(eng.step({("a", 3): 60})[0])
    assert err.logical_position == 3 * 16 and err.page == 60


def test_reuse_of_freed_page_by_another_request(engine):
    engine.admit("a", 3)
    stale = engine.pages["a"][1]
    old_tag = tag_of(engine.tracker, stale)
    # the allocator wrongly takes `stale` back while a still maps it, then hands it to b
    engine.release_pages([stale])  # pushed on top of the free list: b gets it next
    engine.admit("b", 1)
    assert engine.pages["b"] == [stale]
    err = only(engine.step()[0])
    assert (err.request_id, err.logical_position, err.page) == ("a", 1, stale)
    assert err.expected_tag == old_tag and err.found_tag == tag_of(engine.tracker, stale) != old_tag


def test_premature_free_caught_before_reuse(engine):
    engine.admit("a", 3)
    engine.admit("b", 2)
    page = engine.pages["a"][0]
    old_tag = tag_of(engine.tracker, page)
    engine.release_pages([page])  # tags bump on free: a is stale at once
    assert tag_of(engine.tracker, page) != old_tag
    err = only(engine.step()[0])
    assert (err.request_id, err.page, err.expected_tag) == ("a", page, old_tag)
    assert err.found_tag == tag_of(engine.tracker, page)


@pytest.mark.parametrize("bad_page", [NUM_PAGES, NUM_PAGES + 1, 2**31 - 1, -1, -NUM_PAGES, -(2**31)])
def test_out_of_range_and_negative(engine, registry, bad_page):
    engine.admit("a", 2)
    engine.admit("b", 6)
    want_tag = tag_of(engine.tracker, engine.pages["b"][5])
    violations, table, source = engine.step({("b", 5): bad_page})
    err = only(violations)
    assert (err.request_id, err.logical_position, err.page) == ("b", 5, bad_page)
    assert err.expected_tag == want_tag and err.found_tag is None and err.reason == "out_of_range"
    assert int(table[1, 5]) == 0 and int(source[1, 5]) == bad_page
    assert registry.get_sample_value("kvguard_violations_total", {"reason": "out_of_range"}) == 1


def test_unrecorded_entry(engine):
    engine.admit("a", 2)
    extra = engine.alloc(1)  # allocated but never recorded for a
    engine.pages["a"] += extra
    err = only(engine.step()[0])
    assert err.reason == "unrecorded" and err.expected_tag == UNSET and err.logical_position == 2


def test_several_requests_several_entries(engine, registry):
    for rid, count in (("a", 3), ("b", 4), ("c", 2), ("d", 5)):
        engine.admit(rid, count)
    violations, _, _ = engine.step({("b", 0): -3, ("b", 3): engine.pages["a"][0], ("d", 4): 9999})
    assert [(v.request_id, v.bad_entries, v.logical_position) for v in violations] == [
        ("b", 2, 0), ("d", 1, 4)]
    assert registry.get_sample_value("kvguard_checks_total") == 1
    assert registry.get_sample_value("kvguard_violations_total", {"reason": "out_of_range"}) == 2
    engine.step()
    assert registry.get_sample_value("kvguard_checks_total") == 2


def test_dropped_row_reused_by_new_request(engine):
    engine.admit("a", 4)
    engine.finish("a")
    engine.admit("b", 2)  # same slot, shorter: a's leftover expectations must be gone
    assert engine.step()[0] == []


def test_dropped_row_expects_nothing(engine):
    """After drop, the slot expects nothing, even for pages that are still live (e.g. prefix cached)."""
    engine.admit("a", 3)
    row, pages = engine.row["a"], engine.pages["a"]
    engine.tracker.drop(row)
    table = torch.tensor([pages], dtype=torch.int32)
    check = engine.tracker.validate(table, torch.tensor([row]), torch.tensor([3]), max_entries=WIDTH,
                                    source=table.clone())
    err = only(engine.tracker.resolve(check, check.verdict.clone(), ["a"]))
    assert (err.reason, err.bad_entries, err.expected_tag) == ("unrecorded", 3, UNSET)


def test_record_many_decode_growth(engine):
    engine.admit("a", 2)
    engine.admit("b", 3)
    new = engine.alloc(2)
    rows = torch.tensor([engine.row["a"], engine.row["b"]])
    cols = torch.tensor([2, 3])
    engine.tracker.record_many(rows, cols, torch.tensor(new))
    engine.pages["a"].append(new[0])
    engine.pages["b"].append(new[1])
    assert engine.step()[0] == []
    err = only(engine.step({("b", 3): new[0]})[0])
    assert (err.request_id, err.logical_position) == ("b", 3)


def test_default_source_explains_the_original_entry(backend):
    """Without ``source`` the table is quarantined in place; the report still names the real page."""
    tracker = checked_tracker(backend)
    tracker.attach(num_pages=NUM_PAGES, num_rows=2, max_entries=4, device="cpu")
    pages = torch.tensor([5, 6, 7])
    tracker.on_alloc(pages)
    tracker.record(1, 0, pages)
    table = torch.tensor([[5, 6, 777, 0]], dtype=torch.int32)
    check = tracker.validate(table, torch.tensor([1]), torch.tensor([3]), max_entries=4)
    err = only(tracker.resolve(check, check.verdict.clone(), ["r1"]))
    assert (err.page, err.reason, err.found_tag, err.logical_position) == (777, "out_of_range", None, 2)
    assert table.tolist() == [[5, 6, 0, 0]]


def test_quarantine_off_leaves_table(backend):
    eng = Engine(checked_tracker(backend, quarantine=False))
    eng.admit("a", 3)
    violations, table, source = eng.step({("a", 1): 50})
    assert only(violations).page == 50 and torch.equal(table, source)


def test_token_level_table(backend, registry):
    """SGLang-style req_to_token: entry_step = page_div = page size, quarantine off for token tables."""
    page_size = 4
    tracker = checked_tracker(backend, registry)
    tracker.attach(num_pages=NUM_PAGES, num_rows=3, max_entries=WIDTH, device="cpu", page_size=page_size)
    req_to_token = torch.full((3, WIDTH * page_size), 12345, dtype=torch.int32)
    seq_lens = [9, 14]
    for row, seq_len in enumerate(seq_lens):
        pages = torch.arange(1 + 10 * row, 1 + 10 * row + -(-seq_len // page_size))
        tracker.on_alloc(pages)
        tracker.record(row, 0, pages)
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:seq_len]
        req_to_token[row, :seq_len] = slots.to(torch.int32)
    req_to_token[1, 8] = 40 * page_size + 2  # token 8 = entry 2 of row 1 now lies in page 40
    before = req_to_token.clone()
    rows = torch.tensor([0, 1])
    check = tracker.validate(req_to_token, rows, torch.tensor([3, 4]), max_entries=WIDTH,
                             table_rows=rows, entry_step=page_size, page_div=page_size)
    err = only(tracker.resolve(check, check.verdict.clone(), ["r0", "r1"]))
    assert (err.request_id, err.logical_position, err.page, err.reason) == ("r1", 8, 40, "tag_mismatch")
    assert torch.equal(req_to_token, before)  # never quarantined


# -- observability ---------------------------------------------------------------------------------------
def test_structlog_event_and_metrics(engine, registry):
    engine.admit("a", 2)
    engine.admit("b", 2)
    with capture_logs() as logs:
        violations = engine.step({("a", 1): 999})[0]
    err = only(violations)
    events = [e for e in logs if e["event"] == "kvguard.violation"]
    assert len(events) == 1
    event = events[0]
    assert event["log_level"] == "warning"
    for key in ("request_id", "row", "logical_position", "page", "expected_tag", "found_tag", "reason",
                "bad_entries"):
        assert event[key] == getattr(err, key)
    assert registry.get_sample_value("kvguard_violations_total", {"reason": "out_of_range"}) == 1
    assert registry.get_sample_value("kvguard_violations_total", {"reason": "tag_mismatch"}) == 0  # the series exists from the start
    engine.tracker.note_aborted(1)
    assert registry.get_sample_value("kvguard_requests_aborted_total") == 1


def test_log_violations_off(backend):
    eng = Engine(checked_tracker(backend, log_violations=False))
    eng.admit("a", 2)
    with capture_logs() as logs:
        assert len(eng.step({("a", 0): -1})[0]) == 1
    assert logs == []


def test_registries_are_separate():
    first, second = CollectorRegistry(), CollectorRegistry()
    for reg, steps in ((first, 2), (second, 3)):
        eng = Engine(checked_tracker("torch", reg))
        eng.admit("a", 1)
        for _ in range(steps):
            eng.step()
    assert first.get_sample_value("kvguard_checks_total") == 2
    assert second.get_sample_value("kvguard_checks_total") == 3


def test_fresh_registry_per_tracker_never_inherits_counts():
    """Registries come and go (one per test): each new one starts at zero and counts its own checks."""
    for _ in range(50):
        reg = CollectorRegistry()
        eng = Engine(checked_tracker("torch", reg))
        eng.admit("a", 1)
        eng.step()
        assert reg.get_sample_value("kvguard_checks_total") == 1
        del reg, eng


# -- tag uniqueness --------------------------------------------------------------------------------------
def test_tags_unique_across_pages_and_time():
    table = TagTable(97, "cpu")
    rng = random.Random(3)
    seen = set(table.tags.tolist())
    assert len(seen) == 97
    for _ in range(400):
        pages = torch.tensor([rng.randrange(97) for _ in range(rng.randrange(1, 20))])
        before = table.tags.clone()
        table.bump(pages)
        now = table.tags.tolist()
        assert len(set(now)) == 97  # no two pages share a tag
        touched = set(pages.tolist())
        changed = {p for p in range(97) if now[p] != int(before[p])}
        assert changed == touched  # every bumped page changed, no other page did
        new = {now[p] for p in touched}
        assert not new & seen  # no tag ever repeats over time
        seen |= new
        assert min(now) >= 0 and UNSET not in now
    assert table.bumps > 400


def test_tracker_tags_unique_under_alloc_free_churn(backend):
    tracker = checked_tracker(backend)
    tracker.attach(num_pages=33, num_rows=1, max_entries=1, device="cpu")
    rng = random.Random(4)
    history = set(tracker.tags.tags.tolist())
    for step in range(300):
        pages = torch.tensor(rng.sample(range(1, 33), rng.randrange(1, 8)))
        (tracker.on_alloc if step % 2 else tracker.on_free)(pages)
        tags = tracker.tags.tags.tolist()
        assert len(set(tags)) == 33
        new = {tags[p] for p in pages.tolist()}
        assert not new & history
        history |= new
    assert int(tracker.tags.tags[0]) == 0  # scratch page never bumped


# -- misuse and threads (issue 15) -----------------------------------------------------------------------
def attached(rows: int = 2, width: int = 4) -> TagTracker:
    tracker = checked_tracker("torch")
    tracker.attach(num_pages=NUM_PAGES, num_rows=rows, max_entries=width, device="cpu")
    return tracker


def test_concurrent_on_alloc_issues_unique_tags():
    import threading

    tracker, rounds, barrier = attached(), 3000, threading.Barrier(2)
    issued: dict[int, list[int]] = {0: [], 1: []}

    def worker(t: int) -> None:
        barrier.wait()
        for i in range(rounds):
            pages = torch.tensor([1 + (i + t) % (NUM_PAGES - 1), 1 + (i + 7 * t) % (NUM_PAGES - 1)])
            issued[t] += tracker.on_alloc(pages).tolist()  # this thread's own allocation

    threads = [threading.Thread(target=worker, args=(t,)) for t in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    every = issued[0] + issued[1]
    assert len(every) == 2 * 2 * rounds and len(set(every)) == len(every), "a tag was issued twice"
    assert tracker.tags.next_tag == NUM_PAGES + len(every)


@pytest.mark.parametrize("field,value", [("num_rows", 0), ("num_pages", 0), ("max_entries", -1),
                                         ("page_size", 0), ("num_rows", 2.5), ("num_rows", True)])
def test_attach_rejects_bad_sizes(field, value):
    sizes = {"num_pages": 8, "num_rows": 2, "max_entries": 4, "page_size": 1} | {field: value}
    with pytest.raises(ValueError, match=rf"attach: {field}={value!r} is not valid"):
        checked_tracker("torch").attach(device="cpu", **sizes)


@pytest.mark.parametrize("row", [-1, 2, True, "0", 1.0])
def test_row_outside_the_slots_is_rejected(row):
    tracker = attached()
    last_row = tracker.expected[1].clone()
    for call in (lambda: tracker.record(row, 0, torch.tensor([3])), lambda: tracker.drop(row),
                 lambda: tracker.held_pages(row, 0, 1)):
        with pytest.raises(ValueError, match=r"row=.* is not valid; rows are 0\.\.1"):
            call()
    assert torch.equal(tracker.expected[1], last_row), "row -1 must not write the last row"


def test_record_rejects_negative_first_bad_pages_and_tag_count():
    tracker = attached()
    with pytest.raises(ValueError, match="first=-1 is not valid"):
        tracker.record(0, -1, torch.tensor([3]))
    with pytest.raises(ValueError, match=r"page ids -1\.\.3 are outside the pool"):
        tracker.record(0, 0, torch.tensor([3, -1]))
    with pytest.raises(ValueError, match=rf"page ids 3\.\.{NUM_PAGES} are outside the pool"):
        tracker.on_alloc(torch.tensor([3, NUM_PAGES]))
    with pytest.raises(ValueError, match="1 tags for 2 pages"):
        tracker.record(0, 0, torch.tensor([3, 4]), torch.tensor([70]))
    with pytest.raises(ValueError, match=r"cols 4\.\.4 are outside 0\.\.3"):
        tracker.record_many(torch.tensor([0]), torch.tensor([4]), torch.tensor([3]))
    assert bool((tracker.expected == UNSET).all()) and tracker.tags.bumps == 0, "nothing was written"
    tracker.record(torch.tensor(1), 0, torch.tensor([3]))  # a 0-d integer tensor is a valid row
    assert int(tracker.expected[1, 0]) == tag_of(tracker, 3)


def test_resolve_empty_batch_and_mismatched_ids(backend):
    tracker = checked_tracker(backend)
    tracker.attach(num_pages=NUM_PAGES, num_rows=2, max_entries=4, device="cpu")
    table = torch.zeros((0, 4), dtype=torch.int32)
    check = tracker.validate(table, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                             max_entries=4)
    assert tracker.resolve(check, check.verdict.cpu(), []) == []
    pages = torch.tensor([5, 6])
    tracker.on_alloc(pages)
    tracker.record(0, 0, pages)
    tracker.record(1, 0, pages)  # row 1 expects tags the pages do not carry after the next bump
    tracker.on_free(pages[:1])
    table = torch.tensor([[5, 6, 0, 0], [5, 6, 0, 0]], dtype=torch.int32)
    check = tracker.validate(table, torch.tensor([0, 1]), torch.tensor([2, 2], dtype=torch.int32), max_entries=4)
    with pytest.raises(ValueError, match="1 request ids for a check of 2 batch entries"):
        tracker.resolve(check, check.verdict.cpu(), ["a"])
    assert {err.request_id for err in tracker.resolve(check, check.verdict.cpu(), ["a", "b"])} == {"a", "b"}


def test_record_many_where_keeps_the_other_expectations(backend):
    tracker = checked_tracker(backend)
    tracker.attach(num_pages=16, num_rows=2, max_entries=4, device="cpu")
    pages = torch.tensor([3, 5, 7])
    tracker.on_alloc(pages)
    tracker.record(0, 0, pages)
    before = tracker.expectation(0, 0, 3)
    tracker.on_alloc(torch.tensor([9, 11]))
    tracker.record_many(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.tensor([9, 11]),
                        where=torch.tensor([True, False]))
    pages_now, tags_now = tracker.expectation(0, 0, 3)
    assert pages_now.tolist() == [3, 9, 7]
    assert tags_now[0] == before[1][0] and tags_now[2] == before[1][2] and tags_now[1] == tag_of(tracker, 9)


def test_warm_up_compiles_without_side_effects():
    tracker = checked_tracker("triton")
    tracker.attach(num_pages=16, num_rows=3, max_entries=4, device="cpu", page_size=4)
    pages = torch.tensor([2, 6])
    tracker.on_alloc(pages)
    tracker.record(1, 0, pages)
    tags, expected = tracker.tags.tags.clone(), tracker.expected.clone()
    table = torch.randint(0, 64, (3, 16), dtype=torch.int32)
    saved = table.clone()
    tracker.warm_up(table, page_div=4, per_token=True)
    assert torch.equal(tracker.tags.tags, tags) and torch.equal(tracker.expected, expected)
    assert torch.equal(table, saved) and tracker.metrics.checks._value.get() == 0


# -- make_rank_tracker: make_tracker for one TP rank ---------------------------------------------------------
def test_make_rank_tracker(clean_env, registry):
    from kvguard.distributed import RankTracker, make_rank_tracker

    assert type(make_rank_tracker(TrackerConfig(mode="off"), registry, piggyback=True)) is NoopTracker
    assert type(make_rank_tracker(registry=registry)) is NoopTracker  # the environment's default: off
    clean_env.setenv("KVGUARD_MODE", "check")
    clean_env.setenv("KVGUARD_BACKEND", "torch")
    tracker = make_rank_tracker(registry=CollectorRegistry(), combine=False, piggyback=True)
    assert type(tracker) is RankTracker and tracker.config.backend == "torch"
    assert (tracker.group, tracker.combine, tracker.piggyback) == (None, False, True)
    group = object()  # only stored: the all-reduce happens in validate
    tracker = make_rank_tracker(TrackerConfig(mode="check"), registry, group=group)
    assert tracker.group is group and tracker.combine and not tracker.piggyback
    # a checking tracker of another class through make_tracker's one off/check decision
    assert type(make_tracker(TrackerConfig(mode="check"), CollectorRegistry(), checking=RankTracker)) is RankTracker


def test_per_step_checks_reach_the_counters_in_batches_and_at_flush():
    from kvguard.metrics import METRICS_EVERY

    registry = CollectorRegistry()
    tracker = TagTracker(TrackerConfig(mode="check"), registry)

    def counted():
        return (registry.get_sample_value("kvguard_checks_total"),
                registry.get_sample_value("kvguard_entries_checked_total"))

    for _ in range(METRICS_EVERY - 1):
        tracker.count_check(10)
    assert counted() == (0, 0) and tracker.checks_launched == METRICS_EVERY - 1  # not on the step's path yet
    tracker.count_check(10)
    assert counted() == (METRICS_EVERY, 10 * METRICS_EVERY)
    tracker.count_check(3)
    tracker.count_check()
    tracker.flush_metrics()
    tracker.flush_metrics()  # nothing left: counted once
    assert counted() == (METRICS_EVERY + 2, 10 * METRICS_EVERY + 3) and tracker.checks_launched == METRICS_EVERY + 2
    tracker.count_check()
    tracker.note_aborted(1)  # an abort's counters come with the checks before it
    assert counted()[0] == METRICS_EVERY + 3
