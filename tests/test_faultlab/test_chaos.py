"""Faults under load, judged by the oracle: caught with the tracker on, visible with it off."""
import json
from pathlib import Path

import pytest

from faultlab.chaos.runner import run_case
from faultlab.chaos.cli import main
from faultlab.faults.catalog import FAULTS, UnknownFault, get_fault
from faultlab.chaos.scenario import ScenarioError, load, parse

SMOKE = Path(__file__).resolve().parents[2] / "scenarios" / "smoke.toml"
DETECTABLE = [n for n, c in FAULTS.items() if c.detectable and c.requires is None]


@pytest.fixture(scope="module")
def scenario():
    return load(SMOKE)


@pytest.fixture(scope="module")
def baselines(scenario):
    return {seed: run_case(scenario, None, seed, False) for seed in (0, 1)}


@pytest.mark.parametrize("fault", DETECTABLE)
def test_detectable_fault_is_caught_before_any_corrupted_token(fault, scenario, baselines):
    victims = 0
    for seed in (0, 1):
        off = run_case(scenario, fault, seed, False, baseline=baselines[seed])
        on = run_case(scenario, fault, seed, True, baseline=baselines[seed])
        assert on.injected == off.injected <= 1, "the same seed strikes the same way"
        assert on.victims_aborted == on.victims, on.to_json()
        assert on.false_positives == 0 and on.corrupted_tokens_returned == 0
        assert on.nonvictim_mismatches == 0 and off.nonvictim_mismatches == 0
        if off.victims:  # tracker off: nothing aborts a victim, so each one ends with corrupted tokens
            assert off.victims_aborted == 0 and off.corrupted_tokens_returned > 0, off.to_json()
        victims += on.victims
    assert victims > 0, f"{fault}: no victim in two seeds: the fault did not strike"


@pytest.mark.parametrize("fault", ["stray_write", "untracked_realloc"])
def test_undetectable_faults_document_the_limit(fault, scenario, baselines):
    on = run_case(scenario, fault, 0, True, baseline=baselines[0])
    assert not get_fault(fault).detectable
    assert on.victims > 0 and on.corrupted_tokens_returned > 0, "tags cannot see this class"
    assert on.false_positives == 0


def test_leak_is_caught_by_accounting_not_by_tags(scenario, baselines):
    on = run_case(scenario, "leak", 0, True, baseline=baselines[0])
    assert on.victims == 0 and on.false_positives == 0 and on.nonvictim_mismatches == 0
    assert on.sglang_checks["accounting_at_idle"] is not None


def test_unknown_fault_lists_the_valid_ones():
    with pytest.raises(UnknownFault, match="double_free"):
        get_fault("tripple_free")


@pytest.mark.parametrize("bad, match", [
    ({"name": "x", "faults": {"classes": ["nope"]}}, r"\[faults\].classes.*valid"),
    ({"name": "x", "engine": {"kv_dtype": "int3"}}, r"\[engine\].*kv_dtype.*fp8"),
    ({"name": "x", "workload": {"prompt_len": [9, 3]}}, r"\[workload\].prompt_len.*range"),
    ({"name": "x", "workload": {"arival": "burst"}}, r"unknown key.*arival.*valid keys"),
    ({"engine": {}}, r"'name'"),
])
def test_malformed_scenarios_name_the_field(bad, match):
    with pytest.raises(ScenarioError, match=match):
        parse(bad)


def test_cli_bad_scenario_exits_2_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\n[faults]\nclasses = ["double_free", "nope"]\n')
    out = tmp_path / "report.json"
    assert main(["run", str(bad), "--json", str(out)]) == 2
    assert "nope" in capsys.readouterr().err and not out.exists()
    assert main(["run", str(tmp_path / "missing.toml"), "--json", str(out)]) == 2
    assert not out.exists()


def test_cli_run_writes_report_and_plot(tmp_path):
    out = tmp_path / "r.json"
    code = main(["run", str(SMOKE), "--faults", "swapped_entries", "--seeds", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    rows = {r["tracker"]: r for r in report["classes"]}
    assert code == 0 and rows["on"]["victims"] == rows["on"]["victims_aborted"] > 0
    assert set(rows["on"]) >= {"fault", "detectable", "tracker", "injected", "victims", "victims_aborted",
                               "false_positives", "corrupted_tokens_returned", "median_detection_latency_steps"}
    assert out.with_suffix(".png").stat().st_size > 1000
