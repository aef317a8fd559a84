"""The engine's bookkeeping on the tiny random model: invariants, abort, admission, tracker wiring."""
from collections import Counter

import pytest
from faultlab.engine.engine import ConfigError, Engine, EngineConfig
from faultlab.engine.requests import Request
from faultlab.chaos.runner import checking_tracker
from kvguard import NoopTracker
from workloads import clean_outputs, random_requests

TINY = EngineConfig(model="tiny", kv_dtype="fp8", weight_dtype="int4", page_size=16, num_pages=48, max_running=6)


class InvariantChecker:
    """After every step: no page owned twice except through sharing; free + owned + cached == total;
    no negative lock count; no free page mapped by a running request."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, engine, step):
        self.steps += 1
        owners = Counter()
        for r in engine.running:
            if r.row is not None:
                owners.update(engine.table[r.row, r.n_shared:r.n_pages].tolist())
        cached = engine.cache.pages()
        assert all(c == 1 for c in owners.values()), f"page owned twice: {owners.most_common(2)}"
        assert not set(owners) & set(cached), "a request owns a page the cache owns"
        free = engine.allocator.free_pages.tolist()
        assert len(free) == len(set(free)), "duplicate in the free list"
        assert not set(free) & (set(owners) | set(cached)), "a free page is in use"
        acct = engine.accounting()
        assert acct["balanced"], acct
        assert all(n.lock_ref >= 0 for n in engine.cache.nodes())


@pytest.mark.parametrize("tracker", [False, True])
def test_fault_free_run_keeps_invariants_and_never_aborts(tracker):
    checker = InvariantChecker()
    engine = Engine(TINY, tracker=checking_tracker() if tracker else None, observers=[checker])
    for r in random_requests(12, seed=1):
        engine.add_request(r)
    events = engine.run()
    assert checker.steps > 0
    assert not [e for e in events if e.kind == "abort"]
    assert all(r.status == "finished" for r in engine.done) and len(engine.done) == 12
    assert engine.cache.num_pages > 0, "the prefix cache was used"
    assert engine.accounting() == {**engine.accounting(), "free": engine.num_pages - engine.cache.num_pages}


def test_prefix_cache_shares_pages_between_requests():
    engine = Engine(TINY, tracker=checking_tracker())
    first = Request("a", list(range(3, 40)), 4)
    engine.add_request(first)
    engine.run()
    second = Request("b", list(range(3, 40)) + [7, 8], 4)
    engine.add_request(second)
    engine.step()
    assert second.n_shared == 2, "two full 16-token pages come from the cache"
    engine.run()
    assert second.status == "finished"


def test_outputs_do_not_depend_on_batch_or_cache():
    """batch_invariant: a request's greedy output is the same alone or in a crowd."""
    alone = {}
    for r in random_requests(6, seed=3):
        engine = Engine(TINY)
        engine.add_request(r)
        engine.run()
        alone[r.rid] = r.output
    engine = Engine(TINY)
    crowd = random_requests(6, seed=3)
    for r in crowd:
        engine.add_request(r)
    engine.run()
    assert {r.rid: r.output for r in crowd} == alone


def test_abort_releases_exactly_its_pages():
    engine = Engine(TINY, tracker=checking_tracker())
    reqs = random_requests(4, seed=5, shared=0.0)
    for r in reqs:
        engine.add_request(r)
    engine.step()
    engine.step()
    victim = reqs[1]
    owned = engine.table[victim.row, victim.n_shared:victim.n_pages].tolist()
    free_before = engine.allocator.available()
    others = {r.rid: engine.table[r.row, :r.n_pages].tolist() for r in reqs if r is not victim}
    event = engine.abort(victim, "client went away")
    assert event.kind == "abort" and victim.status == "aborted" and victim.row is None
    assert engine.allocator.available() == free_before + len(owned)
    assert set(engine.allocator.free_pages[:len(owned)].tolist()) == set(owned)
    assert {r.rid: engine.table[r.row, :r.n_pages].tolist() for r in reqs if r is not victim} == others
    engine.run()
    assert all(r.status == "finished" for r in reqs if r is not victim)


def test_tracker_aborts_only_the_remapped_request_before_streaming():
    engine = Engine(TINY, tracker=checking_tracker())
    reqs = random_requests(3, seed=7, shared=0.0)
    for r in reqs:
        engine.add_request(r)
    engine.step()
    victim, other = reqs[0], reqs[1]
    engine.table[victim.row, 0] = engine.table[other.row, 0]  # remap onto another request's page
    tokens_before = len(victim.output)
    events = engine.step()
    aborts = [e for e in events if e.kind == "abort"]
    assert [e.rid for e in aborts] == [victim.rid]
    assert "position 0" in aborts[0].message and "expected tag" in aborts[0].message
    assert len(victim.output) == tokens_before, "no token of the flagged step was streamed"
    assert not [e for e in events if e.kind == "token" and e.rid == victim.rid]
    engine.run()
    assert other.status == "finished"


def test_fp8_admits_about_twice_the_tokens_of_bf16():
    budget = dict(model="tiny", weight_dtype="int4", page_size=16, kv_budget_mb=0.25, max_running=64)
    fp8 = Engine(EngineConfig(kv_dtype="fp8", **budget))
    bf16 = Engine(EngineConfig(kv_dtype="bf16", **budget))
    assert 1.9 <= fp8.num_pages / bf16.num_pages <= 2.1
    admitted = {}
    for name, engine in (("fp8", fp8), ("bf16", bf16)):
        for i in range(64):
            engine.add_request(Request(f"{name}{i}", [5] * 40 + [i + 3], 23))  # 4 pages each
        engine.step()
        admitted[name] = len(engine.running)
    assert 1.8 <= admitted["fp8"] / admitted["bf16"] <= 2.2, admitted


def test_bad_config_names_the_field():
    with pytest.raises(ConfigError, match="kv_dtype.*fp8"):
        EngineConfig(kv_dtype="int8")
    with pytest.raises(ConfigError, match="page_size"):
        EngineConfig(page_size=8)


def test_noop_tracker_is_the_default():
    assert isinstance(Engine(TINY).tracker, NoopTracker)


def test_rotated_k_cache_runs_the_engine_without_aborts():
    """engine.kv_rotate_k: the decode cache stores Hadamard-rotated K; a tracked fault-free run finishes
    every request, and greedy outputs match the plain FP8 layout for most requests (both are FP8)."""
    import dataclasses

    outputs = []
    for rotate in (False, True):
        engine = Engine(dataclasses.replace(TINY, kv_rotate_k=rotate), tracker=checking_tracker())
        assert engine.kv.rotate_k is rotate
        outputs.append(clean_outputs(engine, random_requests(8, seed=2)))
        assert len(engine.done) == 8
    assert sum(outputs[0][k] == outputs[1][k] for k in outputs[0]) >= 4
