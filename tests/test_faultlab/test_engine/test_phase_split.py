"""Phase split (BF16 prefill pool -> decode pool over a guarded KV transfer) on the tiny model."""
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from faultlab.chaos import runner as chaos
from faultlab.chaos.runner import checking_tracker, run_case
from faultlab.chaos.cli import _load_classes
from faultlab.engine.engine import ConfigError, Engine, EngineConfig
from faultlab.engine.factory import make_engine
from faultlab.engine.phase_split import PhaseSplitEngine
from faultlab.oracle import Oracle
from faultlab.chaos.scenario import ScenarioError, fault_classes, load, parse
from kvguard.transfer import guard_slots
from workloads import random_requests

SCENARIO = Path(__file__).resolve().parents[3] / "scenarios" / "phase_split.toml"
TINY = EngineConfig(model="tiny", kv_dtype="fp8", weight_dtype="int4", page_size=16, num_pages=48, max_running=4)
SPLIT = replace(TINY, phase_split=True, prefill_kv_dtype="bf16")


def _outputs(config, requests, forced=None):
    """Greedy outputs; with ``forced`` (rid -> tokens) feed those tokens and record each step's argmax."""
    engine = make_engine(config)
    argmax = {}
    if forced is not None:
        def sample(request, logits):
            argmax.setdefault(request.rid, []).append(int(torch.argmax(logits)))
            return forced[request.rid][len(request.output)]

        engine._sample = sample
    for r in requests:
        engine.add_request(r)
    engine.run()
    assert all(r.status == "finished" for r in requests)
    return {r.rid: list(r.output) for r in requests}, argmax


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("lag", [1, 2])
def test_phase_split_output_equals_single_pool(dtype, lag):
    """Same dtype on both pools: the transfer copies bits, so greedy outputs are identical."""
    single, _ = _outputs(replace(TINY, kv_dtype=dtype), random_requests(8, seed=11, max_new=(4, 16)))
    split, _ = _outputs(replace(SPLIT, kv_dtype=dtype, prefill_kv_dtype=dtype, transfer_lag=lag),
                        random_requests(8, seed=11, max_new=(4, 16)))
    assert split == single


def test_fp8_decode_top1_agreement_with_single_pool(capsys):
    """BF16 prefill -> FP8 decode vs FP8 single pool, teacher-forced on the single-pool greedy tokens."""
    single, _ = _outputs(TINY, random_requests(8, seed=12, max_new=(4, 16)))
    _, argmax = _outputs(SPLIT, random_requests(8, seed=12, max_new=(4, 16)), forced=single)
    pairs = [(a, b) for rid in single for a, b in zip(argmax[rid], single[rid])]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    with capsys.disabled():
        print(f"\n[phase split] tiny, BF16 prefill -> FP8 decode vs FP8 single pool: top-1 agreement "
              f"{agreement:.3f} over {len(pairs)} positions")
    assert agreement >= 0.8


def test_engine_dispatch_and_config():
    assert type(make_engine(TINY)) is Engine
    assert isinstance(make_engine(SPLIT), PhaseSplitEngine)
    with pytest.raises(ConfigError, match="make_engine"):  # no silent class swap
        Engine(SPLIT)
    with pytest.raises(ConfigError, match="transfer_lag"):
        EngineConfig(phase_split=True, transfer_lag=0)
    with pytest.raises(ConfigError, match="prefill_kv_dtype"):
        EngineConfig(prefill_kv_dtype="int8")


def test_guard_verdict_per_transfer_and_scratch_redirect():
    tracker = checking_tracker()
    tracker.attach(num_pages=9, num_rows=2, max_entries=4, device="cpu", page_size=4)
    a, b = torch.tensor([1, 2]), torch.tensor([3])
    tracker.on_alloc(torch.tensor([1, 2, 3]))
    tickets = [tracker.transfer_issue(a), tracker.transfer_issue(b)]
    tracker.on_free(torch.tensor([2]))
    tracker.on_alloc(torch.tensor([2]))  # page 2 changed hands while `a` was in flight
    ok = tracker.transfer_land(tickets)
    assert ok.tolist() == [False, True]
    slots = torch.tensor([4, 9, 12])  # a: page 1 offset 0, page 2 offset 1; b: page 3 offset 0
    assert guard_slots(slots, torch.tensor([0, 0, 1]), ok, 4).tolist() == [0, 1, 12]
    err = tracker.transfer_violation(tickets[0], "rA")
    assert err.page == 2 and err.reason == "transfer_target_changed" and err.logical_position == 4


def _strike_in_flight(tracker):
    """Step once (prefills in flight), hand the first request's target pages to an outsider, step again.

    Returns (receiver, others, outsider pages' bytes before, after, the second step's events).
    """
    engine = make_engine(SPLIT, tracker=tracker)
    reqs = random_requests(3, seed=5, shared=0.0, max_new=(4, 16))
    for r in reqs:
        engine.add_request(r)
    engine.step()
    receiver = reqs[0]
    pages = engine.in_flight[receiver.rid].pages
    engine.allocator.free(pages)  # released while the transfer is in flight ...
    taken = engine.allocator.alloc(pages.numel())  # ... and handed to someone else
    assert taken.tolist() == pages.tolist(), "LIFO: the next allocation takes them"
    before = engine.kv.k[0][taken].clone()
    events = engine.step()
    return engine, receiver, reqs[1:], before, engine.kv.k[0][taken].clone(), events


def test_guard_discards_a_transfer_into_reallocated_pages():
    engine, receiver, others, before, after, events = _strike_in_flight(checking_tracker())
    assert receiver.status == "aborted" and "transfer_target_changed" in receiver.error
    assert [e.rid for e in events if e.kind == "abort"] == [receiver.rid]
    assert len(receiver.output) == 1, "only the prefill-side token was streamed"
    assert torch.equal(before.view(torch.uint8), after.view(torch.uint8)), "the new owner's pages untouched"
    engine.run()
    assert all(r.status == "finished" for r in others)


def test_noop_tracker_lets_the_stray_transfer_land():
    _, receiver, _, before, after, _ = _strike_in_flight(None)
    assert receiver.status == "running"
    assert not torch.equal(before.view(torch.uint8), after.view(torch.uint8)), "the stale KV landed"


@pytest.fixture(scope="module")
def scenario():
    return load(SCENARIO)


def test_fault_matrix_row_passes(scenario):
    """transfer_into_reallocated: tracker on = receivers aborted, 0 corrupted tokens, new owners intact;
    tracker off = the new owners read the stale transfer (the oracle counts corrupted tokens)."""
    totals = {"on": [0, 0, 0], "off": [0, 0, 0]}
    for seed in (0, 1):
        base = run_case(scenario, None, seed, False)
        for on in (False, True):
            res = run_case(scenario, "transfer_into_reallocated", seed, on, baseline=base)
            assert res.injected == 1 and res.false_positives == 0 and res.nonvictim_mismatches == 0
            takers = res.injections[0]["takers"]
            row = totals["on" if on else "off"]
            row[0] += res.victims
            row[1] += res.victims_aborted
            row[2] += res.corrupted_tokens_returned
            if on:
                assert all(res.outputs[t]["tokens"] == base.outputs[t]["tokens"] for t in takers)
    assert totals["on"][0] > 0 and totals["on"][0] == totals["on"][1] and totals["on"][2] == 0
    assert totals["off"][0] > totals["on"][0] and totals["off"][2] > 0


def test_oracle_flags_the_new_owner_with_the_tracker_off(scenario, monkeypatch):
    oracle = Oracle()
    monkeypatch.setattr(chaos, "Oracle", lambda: oracle)
    res = run_case(scenario, "transfer_into_reallocated", 1, False)
    reasons = oracle.report.reasons
    receiver, takers = res.injections[0]["request"], res.injections[0]["takers"]
    assert reasons[receiver] == "transfer_revoked"
    assert any(reasons.get(t) == "foreign_data" for t in takers), "the new owner read the stale transfer"


def test_phase_split_fault_only_where_the_engine_splits(scenario):
    assert "transfer_into_reallocated" in fault_classes(replace(scenario, faults=replace(scenario.faults,
                                                                                          classes=("all",))))
    args = Namespace(faults=None)
    assert "transfer_into_reallocated" in _load_classes(args, scenario, True)
    single = parse({"name": "x", "faults": {"classes": ["all"]}})
    assert "transfer_into_reallocated" not in fault_classes(single)
    assert "transfer_into_reallocated" not in _load_classes(args, single, True)
    with pytest.raises(ScenarioError, match="phase_split = true"):
        parse({"name": "x", "faults": {"classes": ["transfer_into_reallocated"]}})
