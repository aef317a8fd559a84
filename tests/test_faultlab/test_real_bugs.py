"""Real bugs, replayed (scenarios/real_bugs.toml, faultlab/faults/real_bugs.py): published KV-cache bugs on
the PD decode side over SGLang 0.5.23's pools, judged by the oracle with the tracker off and on."""
from pathlib import Path

import pytest
import torch

from faultlab.chaos.runner import checking_tracker, run_case
from faultlab.engine.factory import make_engine
from faultlab.engine.requests import Request
from faultlab.faults.catalog import FAULTS
from faultlab.oracle import Oracle
from faultlab.chaos.scenario import ScenarioError, available_faults, load, parse

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "real_bugs.toml"
REAL = [n for n, c in FAULTS.items() if c.suite == "real_bugs"]
CONTROLS = ["leak_unrecorded_len", "fp8_scales_lost_on_wake"]
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def scenario():
    return load(SCENARIO)


@pytest.fixture(scope="module")
def baselines(scenario):
    return {seed: run_case(scenario, None, seed, False) for seed in SEEDS}


@pytest.fixture(scope="module")
def cases(scenario, baselines):
    """(fault, seed, tracker) -> CaseResult, every replay in two seeds."""
    return {(f, s, t): run_case(scenario, f, s, t == "on", baseline=baselines[s])
            for f in REAL for s in SEEDS for t in ("off", "on")}


def test_every_replay_names_its_source_mechanism_and_host(scenario):
    assert len(REAL) == 12 and set(scenario.faults.classes) == set(REAL)
    for name in REAL:
        d = FAULTS[name]().describe()
        assert d["suite"] == "real_bugs" and d["requires"] == "phase_split"
        assert all(d[k] for k in ("source", "maintainers", "host", "why")), name
    assert scenario.engine.memory == "sglang" and scenario.engine.phase_split


def test_matrix_draws_from_the_scenario_suite_only(scenario):
    assert available_faults(scenario.engine, scenario.faults.suite) == REAL
    catalog = available_faults(scenario.engine)
    assert "transfer_into_reallocated" in catalog and not set(REAL) & set(catalog)


def test_unknown_suite_is_refused_naming_the_field():
    with pytest.raises(ScenarioError, match=r"\[faults\]\.suite.*'real_bug'.*real_bugs"):
        parse({"name": "x", "faults": {"suite": "real_bug"}})


@pytest.mark.parametrize("fault", [n for n in REAL if FAULTS[n].detectable])
def test_caught_replays_abort_every_victim_before_a_corrupted_token(fault, cases):
    victims = corrupted_off = 0
    for seed in SEEDS:
        off, on = cases[(fault, seed, "off")], cases[(fault, seed, "on")]
        assert on.injected == off.injected, "the same seed strikes the same way"
        assert on.victims_aborted == on.victims, on.to_json()
        assert on.false_positives == 0 and on.corrupted_tokens_returned == 0, on.to_json()
        assert on.nonvictim_mismatches == 0 and off.nonvictim_mismatches == 0
        victims += on.victims
        corrupted_off += off.corrupted_tokens_returned
    assert victims > 0 and corrupted_off > 0, f"{fault}: no victim in {SEEDS}: the replay did not strike"


def test_alloc_extend_alias_is_the_stated_limit(cases):
    """An alias made without an alloc or a free: both rows' records hold, so kvguard cannot see it."""
    for seed in SEEDS:
        on = cases[("alloc_extend_alias", seed, "on")]
        assert on.injected == 1 and on.false_positives == 0 and on.nonvictim_mismatches == 0
    assert sum(cases[("alloc_extend_alias", s, "on")].corrupted_tokens_returned for s in SEEDS) > 0


def test_overlap_row_free_discards_the_stale_read(cases):
    """The finished request's in-flight read corrupts no token (its result is discarded), on or off."""
    for seed in SEEDS:
        for t in ("off", "on"):
            case = cases[("overlap_row_free", seed, t)]
            assert case.victims == 0 and case.corrupted_tokens_returned == 0 and case.nonvictim_mismatches == 0
    assert any(cases[("overlap_row_free", s, "on")].injections for s in SEEDS)


@pytest.mark.parametrize("fault", CONTROLS)
def test_controls_raise_nothing(fault, cases):
    for seed in SEEDS:
        on = cases[(fault, seed, "on")]
        assert on.injected == 1 and on.victims_aborted == 0 and on.false_positives == 0, on.to_json()
        assert on.nonvictim_mismatches == 0


def test_leak_control_is_seen_by_accounting(cases):
    assert all(cases[("leak_unrecorded_len", s, "on")].sglang_checks["accounting_at_idle"] is not None for s in SEEDS)
    assert all(cases[("leak_unrecorded_len", s, t)].victims == 0 for s in SEEDS for t in ("off", "on"))


def test_fp8_scales_lost_corrupts_output_with_nothing_to_flag(cases):
    for seed in SEEDS:
        on = cases[("fp8_scales_lost_on_wake", seed, "on")]
        assert on.victims > 0 and on.corrupted_tokens_returned > 0


def test_pd_abort_late_write_never_reaches_the_new_owner(cases):
    """Off: the late write corrupts the pages' new owner; on: the guard discards it (only the aborted
    request, whose transfer it was, is counted, as caught)."""
    struck = [s for s in SEEDS if cases[("pd_abort_mid_transfer", s, "off")].injected]
    assert struck
    for seed in struck:
        off, on = cases[("pd_abort_mid_transfer", seed, "off")], cases[("pd_abort_mid_transfer", seed, "on")]
        assert off.victims >= 2 and off.corrupted_tokens_returned > 0
        assert on.victims == on.victims_aborted == 1 and on.corrupted_tokens_returned == 0


def _hit_after_free(scenario, guarded: bool):
    """A prefix is published, its page freed under the tree and handed out again, then hit: the hit's check."""
    engine = make_engine(scenario.engine, tracker=checking_tracker(), observers=[Oracle()])
    if not guarded:
        engine.cache.tagger = None
    ps = engine.page_size
    prompt = list(range(3, 3 + 2 * ps + 4))
    engine.add_request(Request("a", prompt, 2))
    engine.run()
    node = engine.cache.match(prompt, max_pages=2)[0]
    engine.allocator.free(torch.tensor([node.page]))  # a release path frees it under the tree
    engine.add_request(Request("b", list(range(200, 200 + ps)), 4))  # takes the page (LIFO) and writes it
    engine.add_request(Request("c", prompt, 4))  # hits the prefix
    engine.run()
    return {r.rid: r.status for r in engine.done}


def test_hit_guard_catches_a_prefix_freed_under_the_tree(scenario):
    assert _hit_after_free(scenario, guarded=True)["c"] == "aborted"
    assert _hit_after_free(scenario, guarded=False)["c"] == "finished", "without it the hit records the new tag"


def test_all_in_a_real_bugs_scenario_selects_the_replays():
    from faultlab.chaos.scenario import fault_classes

    scenario = load(Path(__file__).resolve().parents[2] / "scenarios" / "real_bugs.toml")
    everything = parse({"name": "x", "engine": {**{k: getattr(scenario.engine, k) for k in
                                                   ("phase_split", "memory", "prefill_kv_dtype")}},
                        "faults": {"classes": ["all"], "suite": "real_bugs"}})
    chosen = fault_classes(everything)
    assert chosen and all(FAULTS[c].suite == "real_bugs" for c in chosen)
    assert set(fault_classes(scenario)) <= set(chosen)
