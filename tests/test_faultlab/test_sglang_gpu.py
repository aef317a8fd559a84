"""The host-side logic of the SGLang GPU harness (faultlab.sglang_gpu; no GPU, no SGLang engine): the A/B
statistics, the fault episode judge, the hook profiler's accounting, the plugin entry points it declares,
the TP summary, the report from the committed raw files, and the re-execution that puts the entry points'
folder on PYTHONPATH (never an edit of sys.path)."""
import ast
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faultlab.sglang_gpu import cli, common, faults, overhead, probes, profiler, report, timers, workers, workload

REPO = Path(__file__).resolve().parents[2]


def _run(mode, throughput, itl=0.01, ttft=0.5):
    return {"mode": mode, "throughput": throughput, "itl_p50": itl, "itl_p99": 2 * itl, "ttft_p99": ttft}


def test_compare_ratios_and_aa_split():
    runs = [_run("off", 100.0), _run("check", 99.0), _run("check", 98.0), _run("off", 104.0),
            _run("off", 102.0), _run("check", 97.0)]
    out = workload.compare(runs)
    assert out["n_off"] == 3 and out["n_check"] == 3
    assert out["throughput_ratio"] == pytest.approx(98.0 / 102.0)
    # A/A: off runs 1, 3, ... (104) over off runs 0, 2, ... (median of 100 and 102)
    assert out["aa_throughput_ratio"] == pytest.approx(104.0 / 101.0)
    assert out["aa_throughput_range"] == pytest.approx((104.0 - 100.0) / 102.0)
    assert out["itl_p99_ratio"] == pytest.approx(1.0)


def test_summarize_counts_aborts_and_tokens():
    recs = [{"gaps": [0.01, 0.03], "ttft": 0.2, "tokens": 3, "error": None, "finish": {"type": "length"}},
            {"gaps": [0.02], "ttft": 0.4, "tokens": 2, "error": None, "finish": {"type": "abort"}}]
    s = workload.summarize(recs, wall=1.0)
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
    rows = faults.judge({"episodes": [clean, fault]})
    assert rows[0]["non_victim_mismatches"] == 0 and rows[0]["false_aborts"] == 0
    r = rows[1]
    assert (r["victims"], r["victims_aborted"], r["non_victim_mismatches"], r["false_aborts"]) == (1, 1, 1, 1)


def test_judge_compares_a_fault_with_its_twin_control_and_counts_shared_rows():
    clean = _episode("clean0", None, [], [("a0", [1, 2, 3], None), ("b1", [5, 6, 7], None)])
    twin = _episode("sglang1", "sglang_abort", ["sglang1-a0"], [("a0", None, "faultlab: control"),
                                                                  ("b1", [5, 6, 8], None)])
    stale = _episode("stale_1", "stale_row", ["stale_1-a0"], [("a0", None, "kvguard: stale row"),
                                                               ("b1", [5, 6, 9], None)])
    twin["seed"] = stale["seed"] = 1
    events = [{"event": "shared_row", "label": "stale_1", "rids": ["stale_1-a0", "stale_1-b1"]}]
    rows = {r["label"]: r for r in faults.judge({"episodes": [clean, twin, stale], "events": events})}
    assert rows["sglang1"]["non_victim_mismatches"] == 1 and "twin" not in rows["sglang1"]
    s = rows["stale_1"]
    assert (s["twin"], s["twin_mismatches"], s["twin_victims_same"]) == ("sglang1", 1, True)
    assert (s["non_victim_mismatches"], s["shared_row_steps"], rows["sglang1"]["shared_row_steps"]) == (1, 1, 0)
    stale["requests"][1]["output_ids"] = [5, 6, 8]  # as the twin: the fault itself did nothing to b1
    assert faults.judge({"episodes": [clean, twin, stale]})[2]["twin_mismatches"] == 0


def test_profiler_charges_around_hooks_only_their_own_time(tmp_path):
    prof = profiler._Prof(str(tmp_path / "t.json"))

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
    eps = workers.project_plugin_entry_points(str(REPO / "pyproject.toml"))
    assert eps["kvguard"] == "kvguard.sglang:register"
    workers.write_dist_info(str(tmp_path), "kvguard_bench", common.PROBES_ENTRY_POINT)
    found = [ep for dist in importlib.metadata.distributions(path=[str(tmp_path)])
             for ep in dist.entry_points if ep.group == workers.PLUGIN_GROUP]
    assert [(ep.name, ep.value) for ep in found] == [("kvguard_bench", "faultlab.sglang_gpu.probes:register_bench")]
    assert found[0].load() is probes.register_bench  # what SGLang's loader imports in each scheduler


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
    out = report.tp2_summary(str(tmp_path))
    agree = {r["label"]: r["every_rank_aborted_exactly_the_victims"] for r in out["rank_agreement"]}
    assert agree == {"swap0": True, "idx0": False}


# -- the report, the CLI, the process start ---------------------------------------------------------------
RESULTS = REPO / "bench" / "results"


def test_report_regenerates_the_committed_results_from_the_raw_files(tmp_path):
    """``report`` with its defaults (raw files in bench/results/sglang_h200_raw/) rebuilds exactly the
    committed summaries the README and docs/sglang.md quote."""
    assert cli.main(["report", "--results", str(tmp_path)]) == 0
    for name in ("sglang_h200.json", "sglang_h200_tp2.json"):
        made = json.loads((tmp_path / name).read_text())
        committed = json.loads((RESULTS / name).read_text())
        assert made == committed, name
    assert (tmp_path / "sglang_h200.png").stat().st_size > 10_000


def test_cli_keeps_the_subcommands_and_defaults_the_results_were_made_with():
    ap = cli.build_parser()
    over = ap.parse_args(["overhead", "--out", "x"])
    assert (over.reps, over.input_len, over.output_len, over.page_size, over.kv_dtype, over.name) == (
        "1:3,8:3,64:2", 8192, 1000, 16, None, "overhead.json")
    assert common.parse_reps(over.reps) == {1: 3, 8: 3, 64: 2}
    assert over.warmup_tokens == 8 < overhead.MIN_WINDOW  # a warm-up run is never one of the measured windows
    for bad in ("-1", str(overhead.MIN_WINDOW), "x"):
        with pytest.raises(SystemExit) as exc:
            ap.parse_args(["overhead", "--out", "x", "--warmup-tokens", bad])
        assert exc.value.code == 2
    f = ap.parse_args(["faults", "--out", "x"])
    assert f.classes.split(",") == ["swapped_entries", "index_shift", "in_page_entry", "out_of_range_entry",
                                    "premature_free", "double_free", "stale_row", "sglang_abort"]
    assert (f.seeds, f.off_seeds, f.page_sizes, f.name) == (4, 2, [16, 1], "faults.json")
    e = ap.parse_args(["extras", "--out", "x"])
    assert (e.kv_dtypes, e.weights, e.name) == ("fp8_e4m3,bf16", "int4_gptq,bf16", "extras.json")
    pd = ap.parse_args(["pd", "--out", "x"])
    assert (pd.backend, pd.reps, pd.input_len, pd.output_len, pd.mem_fractions, pd.name) == (
        "nixl", "1:2,64:2", 8192, 1000, "0.26,0.36,0.56", "pd.json")
    for bad in ("0.3,0.4", "0.3,0.4,1.2", "a,b,c"):
        with pytest.raises(SystemExit) as exc:
            ap.parse_args(["pd", "--out", "x", "--mem-fractions", bad])
        assert exc.value.code == 2
    r = ap.parse_args(["report"])
    assert [Path(x) for x in r.raw] == [RESULTS / "sglang_h200_raw" / d for d in ("dec01b", "dec01", "nov30")]
    assert Path(r.results) == RESULTS
    with pytest.raises(SystemExit):
        ap.parse_args(["overhead"])  # --out is required


SETUP = """
import sys
from types import SimpleNamespace
from faultlab.sglang_gpu import common
common.setup_env(SimpleNamespace(cpu=True, tp=1, argv={argv!r}))
print("RETURNED", common.EP_DIR in sys.path)
"""


def _setup_env_in_child(tmp_path, pythonpath: list[str], **env):
    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    argv = ["report", "--raw", str(raw), "--results", str(tmp_path)]
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", common.REEXEC_ENV)}
    child_env.update(env, PYTHONPATH=os.pathsep.join(pythonpath))
    return subprocess.run([sys.executable, "-c", SETUP.format(argv=argv)], cwd=tmp_path, env=child_env,
                          capture_output=True, text=True, timeout=120)


def test_missing_entry_point_folder_reexecutes_the_harness_once(tmp_path):
    """Without the folder on PYTHONPATH at start, setup_env re-executes ``python -m faultlab.sglang_gpu``
    with the same arguments (here: a report of empty raw folders) instead of editing sys.path."""
    proc = _setup_env_in_child(tmp_path, [str(REPO)])
    assert proc.returncode == 0, proc.stderr
    assert "re-executing with PYTHONPATH=" in proc.stdout and "RETURNED" not in proc.stdout
    made = json.loads((tmp_path / "sglang_h200.json").read_text())  # the re-executed command ran
    assert made["rows"] == [] and made["faults"] == []
    assert (Path(common.EP_DIR) / "kvguard_bench-0.1.0.dist-info" / "entry_points.txt").exists()


def test_entry_point_folder_on_pythonpath_means_no_reexecution(tmp_path):
    proc = _setup_env_in_child(tmp_path, [str(REPO), common.EP_DIR])
    assert proc.returncode == 0, proc.stderr
    assert "RETURNED True" in proc.stdout and "re-executing" not in proc.stdout
    assert not (tmp_path / "sglang_h200.json").exists()


def test_reexecution_happens_at_most_once(tmp_path):
    proc = _setup_env_in_child(tmp_path, [str(REPO)], **{common.REEXEC_ENV: "1"})
    assert proc.returncode != 0 and "not on sys.path after re-executing" in proc.stderr
    assert "RETURNED" not in proc.stdout and not (tmp_path / "sglang_h200.json").exists()


def _sys_path_edits(path: Path) -> list[int]:
    """Lines that change sys.path (a call of one of its mutating methods, or an assignment to it)."""
    def is_sys_path(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value)
                and node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear")):
            lines.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AugAssign)) and any(
                is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets):
            lines.append(node.lineno)
    return sorted(lines)


HARNESS_FILES = sorted((REPO / "bench").glob("*.py")) + sorted((REPO / "faultlab" / "sglang_gpu").glob("*.py"))


@pytest.mark.parametrize("path", HARNESS_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_sys_path_edits_in_bench_or_the_harness(path):
    assert _sys_path_edits(path) == [], f"{path.name} edits sys.path"


def test_sys_path_edit_scan_sees_edits(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nsys.path.insert(0, 'x')\nsys.path += ['y']\nsys.path[:0] = ['z']\nok = 'x' in sys.path\n")
    assert _sys_path_edits(probe) == [2, 3, 4]


def test_harness_modules_stay_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (REPO / "faultlab" / "sglang_gpu").glob("*.py")}
    assert sizes and max(sizes.values()) < 400, sizes


def test_sglang_and_matplotlib_are_imported_inside_functions_only():
    """The scheduler imports probes.py through the entry point, the report runs without SGLang: no module of
    the harness imports sglang, torch or matplotlib at module level."""
    for path in (REPO / "faultlab" / "sglang_gpu").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not [n for n in names if n.split(".")[0] in ("sglang", "torch", "matplotlib")], path.name


def test_profiler_windows_split_runs_at_idle_gaps_and_rows_pick_their_concurrency(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: clock[0])
    prof = profiler._Prof(str(tmp_path / "t.json"))
    for size, us, steps in ((1, 20e-6, 5), (64, 90e-6, 12)):
        clock[0] += 10.0  # idle before each run
        for _ in range(steps):
            prof.mark_iteration(size)
            prof.acc = us
            prof.per_fn.setdefault("hook:x", [0, 0.0])[0] += 1
            clock[0] += 0.01
    clock[0] += 10.0
    prof.mark_iteration(1)  # the next run closes the last window
    assert [(w["batch_max"], w["iterations"]) for w in prof.windows] == [(1, 4), (64, 11)]
    assert prof.windows[1]["kvguard_us_per_iter_p50"] == pytest.approx(90)
    from faultlab.sglang_gpu.overhead import attach_host_time

    result = {"host_timing": {"windows": prof.windows}, "rows": [{"concurrency": 64}, {"concurrency": 8}]}
    attach_host_time(result)
    assert result["rows"][0]["host_us_p50"] == pytest.approx(90) and result["rows"][0]["host_windows"] == 1
    assert result["rows"][1]["host_us_p50"] is None


def test_profiler_times_the_alloc_wrapper_without_the_allocation_it_wraps(tmp_path, monkeypatch, make_rig):
    import torch

    from kvguard.sglang.follow import PoolFollower

    monkeypatch.setattr(PoolFollower, "_alloc_wrapper", PoolFollower._alloc_wrapper)  # restored after the test
    prof = profiler._Prof(str(tmp_path / "t.json"))
    timers._time_alloc_wrappers(prof)
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    alloc = rig.allocator.alloc_decode.__wrapped__  # SGLang's own, under kvguard's wrapper

    def slow_alloc(*a, **k):
        time.sleep(0.03)
        return alloc(*a, **k)

    batch = rig.prefill(16, 17)  # alloc_extend: one timed call per allocation
    calls, seconds = prof.per_fn["PoolFollower.alloc_wrapper"]
    assert calls >= 1 and all(req.kv.req_pool_idx is not None for req in batch.reqs)
    wrapped = rig.guard._alloc_wrapper(slow_alloc)  # a wrapper made now is timed the same way
    before = prof.per_fn["PoolFollower.alloc_wrapper"][1]
    # SGLang's decode allocation of two requests at lengths 16 and 17 (each row's last slot is its last_loc)
    lens = torch.tensor([16, 17], dtype=torch.int64)
    last = torch.stack([rig.row(req)[int(n) - 1] for req, n in zip(batch.reqs, lens)])
    out = wrapped(lens + 1, lens + 1, last)
    assert out is not None and out.numel() == 2
    own = prof.per_fn["PoolFollower.alloc_wrapper"][1] - before
    assert 0 <= own < 0.02, own  # the 30 ms inside SGLang's allocation are not kvguard's


def test_profiler_counts_only_collections_that_start_inside_kvguard(tmp_path):
    prof = profiler._Prof(str(tmp_path / "t.json"))
    prof.on_gc("start", {})
    time.sleep(0.002)
    prof.on_gc("stop", {})
    assert prof.gc_acc == 0.0  # SGLang's own code was running
    prof.active = True
    prof.on_gc("start", {})
    time.sleep(0.002)
    prof.on_gc("stop", {})
    assert prof.gc_acc >= 0.002


def test_profiler_wraps_only_its_declared_methods_and_every_one_exists(tmp_path, monkeypatch):
    from kvguard.sglang.follow import PoolFollower
    from kvguard.sglang.guard import SGLangGuard
    from kvguard.tracker import TagTracker

    monkeypatch.delenv(timers.INNER_ENV, raising=False)
    for cls in (SGLangGuard, PoolFollower, TagTracker):  # every method put back after the test (its parts' too)
        for part in cls.__mro__[:-1]:
            for attr, value in list(vars(part).items()):
                if callable(value):
                    monkeypatch.setattr(part, attr, value)
    resolve, launch = SGLangGuard.resolve, SGLangGuard.launch
    prof = profiler._Prof(str(tmp_path / "t.json"))
    done = timers._time_methods(prof)
    assert set(done) == timers.ENTRIES | timers.WAITS
    assert SGLangGuard.resolve is resolve and SGLangGuard.launch is launch  # run inside hooks: not wrapped
    assert TagTracker.on_free.__wrapped__ is not None and PoolFollower.adopt.__wrapped__ is not None
    monkeypatch.setattr(timers, "ENTRIES", {"TagTracker.no_such_method"})
    with pytest.raises(AttributeError, match="no_such_method"):
        timers._time_methods(prof)


def test_profiler_entries_hold_every_method_sglang_reaches_outside_a_hook(monkeypatch, make_rig):
    """What the profiler leaves unwrapped is counted inside a timed hook or alloc wrapper: a kvguard method that
    SGLang's own code reaches with no kvguard hook on the stack must be one it times on its own (ENTRIES)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from kvguard.sglang import plugin
    from kvguard.sglang.follow import PoolFollower
    from kvguard.sglang.guard import SGLangGuard, VerdictRing
    from kvguard.tracker import TagTracker

    rig = make_rig(4, rows=8)
    rig.install(registry=rig.registry)
    classes = {c.__name__: c for c in (SGLangGuard, PoolFollower, TagTracker, VerdictRing)}
    timed_codes = {fn.__code__ for fn, _ in plugin.hooks().values()} | {rig.allocator.alloc.__code__} | {
        getattr(classes[name.split(".")[0]], name.split(".")[1]).__code__ for name in timers.ENTRIES}
    reached = set()

    def spy(name, fn):
        def wrapper(*a, **k):
            frame, from_sglang = sys._getframe(1), False
            while frame is not None and frame.f_code not in timed_codes:
                from_sglang |= frame.f_globals.get("__name__", "").startswith("sglang")
                frame = frame.f_back
            if frame is None and from_sglang:
                reached.add(name)
            return fn(*a, **k)
        return wrapper

    def parts(cls):  # the class and the kvguard.sglang parts it is made of (VerdictSide, ReleaseSide, ...)
        for part in cls.__mro__:
            if part is not cls and (part in classes.values() or not part.__module__.startswith("kvguard.sglang.")):
                return
            yield part

    for cls in classes.values():
        for part in parts(cls):
            for attr, value in list(vars(part).items()):
                if callable(value) and not attr.startswith("__") and not isinstance(value, (staticmethod, classmethod)):
                    monkeypatch.setattr(part, attr, spy(f"{cls.__name__}.{attr}", value))
    tokens = list(range(100, 113))
    rig.publish(tokens)  # prefill, finish into the tree (checkpoint: the tree adopts its pages)
    batch = rig.running(9, 6)  # prefill, merge, a checked decode step
    for _ in range(3):
        rig.decode(batch)
        rig.sample(batch)
    for req in batch.reqs:
        rig.release(req)
    assert reached == set()  # the lifecycle above runs inside kvguard's hooks
    rig.tree.evict(EvictParams(num_tokens=10**6))  # SGLang's scheduler evicts the tree outside any hook
    assert reached and reached <= timers.ENTRIES, reached - timers.ENTRIES  # the release's bump, the free's filter


def test_interleave_schedule_pairs_each_on_block_with_an_off_block_in_a_seeded_order():
    from faultlab.sglang_gpu import interleave

    def trace(seed, n=4 * 200):
        s = interleave.Schedule(4, seed)
        return [(s.step(), s.mode, s.index) for _ in range(n)]

    t = trace(3)
    assert t == trace(3) and t != trace(4)
    assert [label for label, _, _ in t[::4]] == [interleave.SKIP] * 200  # a block's first step is left out
    modes = [mode for _, mode, _ in t[::4]]
    assert all(sorted(modes[i:i + 2]) == [interleave.OFF, interleave.ON] for i in range(0, 200, 2))
    assert 30 < sum(modes[0::2]) < 70  # which comes first in a pair is drawn, not fixed
    assert all(label in (interleave.SKIP, mode) for label, mode, _ in t)
    with pytest.raises(ValueError, match="at least 2"):
        interleave.parse("1:0")
    assert interleave.parse("8:5") == (8, 5) and interleave.parse("") is None


def test_interleave_compare_recovers_a_known_step_difference_and_a_flat_aa():
    """Steps of the on mode 0.4% longer than the off mode's, on a drift of 5% across the run: the ratios
    show the 0.4%, the A/A shows neither, and steps of another batch size are left out."""
    import random

    from faultlab.sglang_gpu import interleave

    rng, s = random.Random(0), interleave.Schedule(8, 1)
    rec = {k: [] for k in ("labels", "blocks", "steps_s", "host_us", "batch")}
    for i in range(8 * 400):
        label = s.step()
        base = 0.0085 * (1 + 0.05 * i / 3200) * (1 + 0.002 * rng.gauss(0, 1))
        step = base * (1.004 if s.mode == interleave.ON else 1.0)
        bs = 64 if i < 3100 else 3  # the run's ramp down
        for k, v in zip(rec, (label, s.index, step, 40.0 if s.mode == interleave.ON else 5.0, bs)):
            rec[k].append(v)
    out = interleave.compare([{"interleave": rec}], 64)
    assert out["n_on"] + out["n_off"] == sum(1 for i, (b, lab) in enumerate(zip(rec["batch"], rec["labels"]))
                                             if b == 64 and lab != interleave.SKIP and i > 0)
    assert out["itl_p50_ratio"] == pytest.approx(1.004, abs=0.0015)
    assert 1 / out["throughput_ratio"] == pytest.approx(1.004, abs=0.0015)
    assert out["aa_itl_p50_ratio"] == pytest.approx(1.0, abs=0.0015)
    assert (out["host_us_p50"], out["host_off_us_p50"]) == (40.0, 5.0)
    assert out["host_net_us_p50"] != out["host_net_us_p50"]  # NaN: a file from before the calibration has no net
    assert interleave.compare([{"interleave": rec}], 1) == {"n_on": 0, "n_off": 0}
    rec["host_net_us"] = [us - 3.0 for us in rec["host_us"]]
    out = interleave.compare([{"interleave": rec}], 64)
    assert (out["host_net_us_p50"], out["host_off_net_us_p50"]) == (37.0, 2.0)


def test_profiler_calibration_measures_its_own_share_and_reports_host_time_net_of_it(tmp_path):
    """calibrate measures what the profiler itself adds to a timed call, leaves no count behind, and each
    iteration's host time is reported both as charged and less that share (its timed calls times the share)."""
    from faultlab.sglang_gpu.bias import calibrate

    prof = profiler._Prof(str(tmp_path / "t.json"))
    bias = calibrate(prof, calls=300, rounds=2)
    assert bias["around"] > 0 and bias["plain"] > 0 and not prof.per_fn and prof.acc == 0.0
    hook = prof.timed("hook:process_batch_result_decode", lambda orig, b: orig(b), around=True, hook=True)
    entry = prof.timed("PoolFollower.drop", lambda row: row)
    for i in range(40):
        prof.mark_iteration(1)
        for _ in range(3):
            assert hook(lambda b: b + 1, i) == i + 1
        assert entry(i) == i
    prof.final()
    data = json.loads((tmp_path / "t.json").read_text())
    w = data["windows"][-1]
    share = 3 * bias["around"] + bias["plain"]  # every iteration made the same timed calls
    assert w["kvguard_net_us_per_iter_p50"] == pytest.approx(w["kvguard_us_per_iter_p50"] - 1e6 * share, abs=1e-6)
    assert data["profiler_bias_us_per_call"] == pytest.approx({k: 1e6 * v for k, v in bias.items()})


def test_profiler_interleave_turns_only_the_check_hooks_off_and_labels_every_iteration(tmp_path, monkeypatch):
    """An off iteration passes a check hook by (or runs its bookkeeping half, ``off``, in its place) and runs every
    other hook; each iteration is labelled with the mode it ran in."""
    from faultlab.sglang_gpu import interleave

    monkeypatch.setenv(interleave.INTERLEAVE_ENV, "3:2")
    prof = profiler._Prof(str(tmp_path / "t.json"))
    ran, dropped = [], []
    check = prof.timed("hook:update_running_batch", lambda orig, b: (ran.append("check"), orig(b))[1],
                       around=True, hook=True, always=False, off=lambda orig, b: (dropped.append(b), orig(b))[1])
    keep = prof.timed("hook:alloc_for_decode", lambda orig, b: (ran.append("keep"), orig(b))[1],
                      around=True, hook=True, always=True)
    modes = []
    for i in range(30):
        prof.mark_iteration(2)
        modes.append(prof.kvguard_on())
        ran.clear()
        assert check(lambda b: b + 1, i) == i + 1 and keep(lambda b: b, i) == i  # SGLang's code runs in both
        assert ran == (["check", "keep"] if modes[-1] else ["keep"])
        assert (i in dropped) == (not modes[-1])
    assert True in modes and False in modes
    assert prof.per_fn["hook:update_running_batch:off"][0] == modes.count(False)  # its stand-in, timed apart
    prof.final()
    w = json.loads((tmp_path / "t.json").read_text())["windows"][-1]["interleave"]
    assert len(w["labels"]) == 29 and set(w["labels"]) == {interleave.ON, interleave.OFF, interleave.SKIP}
    # iteration k (closed by mark k + 1) is labelled with the mode it ran in
    assert all(lab in (interleave.SKIP, int(m)) for lab, m in zip(w["labels"], modes))


def test_source_digest_names_the_code_not_the_checkout(tmp_path):
    """The run's source digest follows the Python sources of both packages (a change in either shows) and nothing
    else (a result file beside them does not)."""
    for rel in ("kvguard/a.py", "kvguard/sub/b.py", "faultlab/c.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    first = common.source_digest(str(tmp_path))
    (tmp_path / "kvguard" / "notes.json").write_text("{}")
    assert common.source_digest(str(tmp_path)) == first
    (tmp_path / "kvguard" / "sub" / "b.py").write_text("# changed\n")
    assert common.source_digest(str(tmp_path)) != first
    assert common.source_digest() == common.source_digest()  # this checkout: stable


def test_pd_roles_share_one_workload_and_differ_only_where_they_must(tmp_path):
    """faultlab.sglang_gpu pd: a prefill (check) and two decode servers (off, check) on one transfer backend and
    bootstrap port, each its own SGLang port and memory fraction; the pool holds SGLang's PD decode reserve."""
    from faultlab.sglang_gpu import pd

    a = cli.build_parser().parse_args(["pd", "--out", str(tmp_path), "--reps", "1:1,64:1", "--overrides",
                                       '{"disable_overlap_schedule": true}'])
    specs = pd._specs(a, "/m", 64, str(tmp_path / "t.json"))
    assert [(n, e["KVGUARD_MODE"]) for n, e, _ in specs] == [("prefill", "check"), ("off", "off"), ("check", "check")]
    kws = [kw for _, _, kw in specs]
    assert [kw["disaggregation_mode"] for kw in kws] == ["prefill", "decode", "decode"]
    assert {kw["disaggregation_transfer_backend"] for kw in kws} == {"nixl"}
    assert {kw["disaggregation_bootstrap_port"] for kw in kws} == {a.bootstrap_port}
    assert len({kw["port"] for kw in kws}) == 3 and a.bootstrap_port not in {kw["port"] for kw in kws}
    assert [kw["mem_fraction_static"] for kw in kws] == [0.26, 0.36, 0.56]
    assert [kw.get("disable_overlap_schedule", False) for kw in kws] == [False, True, True]  # --overrides: decode
    assert kws[1]["max_total_tokens"] >= 64 * (8192 + 1000 + pd.DECODE_RESERVE)
    assert "KVGUARD_BENCH_TIMING" in specs[2][1] and "KVGUARD_BENCH_TIMING" not in specs[1][1]
    one = pd._specs(a, "/m", 64, str(tmp_path / "t.json"), switch=str(tmp_path / "sw"))  # --switch: one decode server
    assert [(n, e["KVGUARD_MODE"]) for n, e, _ in one] == [("prefill", "check"), ("check", "check")]
    assert one[1][1]["KVGUARD_BENCH_SWITCH"] == str(tmp_path / "sw") and "KVGUARD_BENCH_SWITCH" not in one[0][1]
    assert [kw["mem_fraction_static"] for _, _, kw in one] == [0.26, 0.36]


def test_hicache_engines_take_the_overrides_and_count_spec_steps(tmp_path):
    """faultlab.sglang_gpu hicache: both engines get ``--overrides`` (HiCache with an EAGLE draft) as settings; a
    spec run in which kvguard checked no verify step tested nothing and fails."""
    from faultlab.sglang_gpu import hicache

    a = cli.build_parser().parse_args(["hicache", "--out", str(tmp_path), "--overrides",
                                       '{"speculative_algorithm": "EAGLE", "speculative_num_steps": 3}'])
    specs = hicache._specs(a, "/m", str(tmp_path / "t.json"))
    assert [(n, e["KVGUARD_MODE"]) for n, e, _ in specs] == [("off", "off"), ("check", "check")]
    for _, _, kw in specs:
        assert kw["speculative_algorithm"] == "EAGLE" and kw["speculative_num_steps"] == 3
        assert kw["enable_hierarchical_cache"] and kw["hicache_write_policy"] == "write_back"
    same = {"ids": [1, 2], "error": None, "finish": "length"}
    result = {"settings": specs[0][2], "engines": {n: {"rounds": [[[same]], [[same]]]} for n in ("off", "check")},
              "kvguard_hook_calls": {"hook:start_loading": 4, hicache.SPEC_HOOK: 0}}
    assert hicache._verdict(result).startswith("fail: speculative decoding asked for")
    result["kvguard_hook_calls"][hicache.SPEC_HOOK] = 12
    assert hicache._verdict(result) == "pass"
    result["kvguard_hook_calls"]["hook:start_loading"] = 0
    assert hicache._verdict(result).startswith("fail: no load-back")


def test_pd_tokens_equal_compares_the_first_runs_request_by_request():
    from faultlab.sglang_gpu.pd import _tokens_equal

    def run(mode, ids):
        return {"mode": mode, "requests": [{"rid": f"c2-{mode}-0-{i}", "output_ids": x} for i, x in enumerate(ids)]}

    assert _tokens_equal([run("off", [[1, 2], [3]]), run("check", [[1, 2], [4]])]) == "1/2"
    assert _tokens_equal([run("off", [[1]]), run("check", [None])]) == "0/1"  # an aborted request is not equal
    assert _tokens_equal([run("off", [[1]])]) == "-"
