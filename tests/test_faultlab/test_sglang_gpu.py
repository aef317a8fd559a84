"""The host-side logic of bench/sglang_h200.py (no GPU, no SGLang engine): the A/B statistics, the fault
episode judge, the hook profiler's accounting, the plugin entry points it declares, and the TP summary."""
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


lib = _load("sglang_h200_lib")
h200 = _load("sglang_h200")


def _run(mode, throughput, itl=0.01, ttft=0.5):
    return {"mode": mode, "throughput": throughput, "itl_p50": itl, "itl_p99": 2 * itl, "ttft_p99": ttft}


def test_compare_ratios_and_aa_split():
    runs = [_run("off", 100.0), _run("check", 99.0), _run("check", 98.0), _run("off", 104.0),
            _run("off", 102.0), _run("check", 97.0)]
    out = lib.compare(runs)
    assert out["n_off"] == 3 and out["n_check"] == 3
    assert out["throughput_ratio"] == pytest.approx(98.0 / 102.0)
    # A/A: off runs 1, 3, ... (104) over off runs 0, 2, ... (median of 100 and 102)
    assert out["aa_throughput_ratio"] == pytest.approx(104.0 / 101.0)
    assert out["aa_throughput_range"] == pytest.approx((104.0 - 100.0) / 102.0)
    assert out["itl_p99_ratio"] == pytest.approx(1.0)


def test_summarize_counts_aborts_and_tokens():
    recs = [{"gaps": [0.01, 0.03], "ttft": 0.2, "tokens": 3, "error": None, "finish": {"type": "length"}},
            {"gaps": [0.02], "ttft": 0.4, "tokens": 2, "error": None, "finish": {"type": "abort"}}]
    s = lib.summarize(recs, wall=1.0)
    assert s["output_tokens"] == 5 and s["throughput"] == 5.0
    assert s["errors"] == 1
    assert s["itl_p50"] == pytest.approx(0.02)
    assert s["ttft_p99"] == pytest.approx(0.4 - 0.01 * 0.2, rel=1e-3)


def _episode(label, fault, victims, requests):
    return {"label": label, "fault": fault, "seed": 0, "armed": True, "victims": victims,
            "idle_check": {"balanced": True}, "seconds": 1.0,
            "requests": [{"rid": f"{label}-{k}", "output_ids": ids, "error": err} for k, ids, err in requests]}


def test_judge_counts_victims_mismatches_and_false_aborts():
    clean = _episode("clean0", None, [], [("a0", [1, 2], None), ("a1", [3, 4], None), ("b0", [5, 6], None)])
    fault = _episode("swap0", "swapped_entries", ["swap0-a0"],
                     [("a0", None, "kvguard: aborted"), ("a1", [3, 9], None), ("b0", None, "boom")])
    rows = h200.judge({"episodes": [clean, fault]})
    assert rows[0]["non_victim_mismatches"] == 0 and rows[0]["false_aborts"] == 0
    r = rows[1]
    assert (r["victims"], r["victims_aborted"], r["non_victim_mismatches"], r["false_aborts"]) == (1, 1, 1, 1)


def test_profiler_charges_around_hooks_only_their_own_time(tmp_path):
    prof = lib._Prof(str(tmp_path / "t.json"))

    def original(x):
        time.sleep(0.03)
        return x + 1

    def around_hook(orig, x):
        time.sleep(0.005)
        return orig(x) * 2

    def inner():
        time.sleep(0.002)

    def outer():
        inner_t()
        time.sleep(0.002)

    hook = prof.timed("hook:around", around_hook, around=True)
    inner_t = prof.timed("inner", inner)
    outer_t = prof.timed("outer", outer)
    assert hook(original, 1) == 4
    own = prof.per_fn["hook:around"][1]
    assert 0.004 < own < 0.025, own  # the 30 ms of the original are not kvguard's
    outer_t()
    assert "inner" not in prof.per_fn  # nested kvguard calls are counted once, in the outer one
    assert prof.per_fn["outer"][1] >= 0.004
    prof.mark_iteration()
    prof.dump()
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["per_function_us_per_call"]["hook:around"]["calls"] == 1


def test_entry_points_declared_for_sglang_are_discoverable(tmp_path):
    eps = lib.project_plugin_entry_points(str(BENCH.parent / "pyproject.toml"))
    assert eps["kvguard"] == "kvguard.sglang:register"
    lib.write_dist_info(str(tmp_path), "kvguard_bench", {"kvguard_bench": "sglang_h200_lib:register_bench"})
    found = [ep for dist in importlib.metadata.distributions(path=[str(tmp_path)])
             for ep in dist.entry_points if ep.group == lib.PLUGIN_GROUP]
    assert [(ep.name, ep.value) for ep in found] == [("kvguard_bench", "sglang_h200_lib:register_bench")]


def test_tp_summary_checks_every_rank_aborted_exactly_the_victims(tmp_path):
    def lines(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    lines("faults_tp2_rank1_inject.jsonl", [
        {"event": "armed", "label": "swap0", "fault": "swapped_entries"},
        {"event": "inject", "label": "swap0", "victims": ["swap0-a0", "swap0-a1"], "pid": 7},
        {"event": "armed", "label": "idx0", "fault": "index_shift"},
        {"event": "inject", "label": "idx0", "victims": ["idx0-a2"], "pid": 7}])
    lines("faults_tp2_rank1_check_ps16_0_aborts.jsonl", [
        {"rank": 0, "rid": "swap0-a0"}, {"rank": 0, "rid": "swap0-a1"}, {"rank": 1, "rid": "swap0-a0"},
        {"rank": 1, "rid": "swap0-a1"}, {"rank": 1, "rid": "idx0-a2"}])  # rank 0 missed idx0-a2
    out = h200.tp2_summary(str(tmp_path))
    agree = {r["label"]: r["every_rank_aborted_exactly_the_victims"] for r in out["rank_agreement"]}
    assert agree == {"swap0": True, "idx0": False}
