"""Bad input to every CLI command and scenario field: exit 2, one message naming the field, the value and
what is allowed, before any work and with nothing written. Runs that test nothing fail (exit 1)."""
import functools
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from faultlab.chaos.cli import main
from faultlab.chaos.report import _atomic, failures
from faultlab.chaos.scenario import Expectations, parse
from faultlab.chaos.validate import UsageError, check_output_dir, check_output_file

SMOKE = Path(__file__).resolve().parents[2] / "scenarios" / "smoke.toml"
# a tiny, fast scenario: 3 short requests on the tiny model
TINY = """name = "tiny"
[workload]
requests = 3
prompt_len = [4, 8]
output_len = [3, 5]
concurrency = 3
shared_prefix_fraction = 0.0
[engine]
weight_dtype = "fp32"
num_pages = 24
[faults]
classes = ["premature_free"]
seeds = 1
step = [1, 1]
"""


def smollm2_or_skip() -> None:
    from faultlab.engine.gguf_loader import gguf_path

    try:
        gguf_path()
    except ValueError as err:
        pytest.skip(f"smollm2 is not installed: {err}")


def write(tmp_path, text: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def edit(section: str, line: str) -> str:
    """TINY with ``line`` added to (or replacing a key of) ``[section]``."""
    key = line.split("=")[0].strip()
    lines, out, current = TINY.splitlines(), [], None
    for text in lines:
        if text.startswith("["):
            current = text.strip("[]")
        if current == section and text.split("=")[0].strip() == key:
            continue
        out.append(text)
        if text == f"[{section}]":
            out.append(line)
    return "\n".join(out) + "\n"


def bad_input(capsys, tmp_path, argv, *needles) -> str:
    """Run argv: exit 2, the message names every needle, and no file appeared in tmp_path."""
    before = set(tmp_path.rglob("*"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("faultlab: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert set(tmp_path.rglob("*")) == before, "bad input must write nothing"
    return err


@pytest.mark.parametrize("section, line, needles", [
    ("workload", "requests = 1000000000000", ["[workload].requests", "1000000000000", "1..10000"]),
    ("workload", "concurrency = 100000000", ["[workload].concurrency", "1..1024"]),
    ("workload", "prompt_len = [4, \"8\"]", ["[workload].prompt_len[1]", "'8'", "integer"]),
    ("workload", "output_len = [true, 5]", ["[workload].output_len[0]", "True"]),
    ("workload", "temperature = nan", ["[workload].temperature", "nan", "0.0..100.0"]),
    ("workload", "temperature = inf", ["[workload].temperature", "inf"]),
    ("workload", "output_len = [3, 5000]", ["requests of up to", "do not fit", "context"]),
    ("engine", "num_pages = 100000000000", ["[engine].num_pages", "100000000000"]),
    ("engine", "num_pages = 2000000000", ["[engine].num_pages = 2000000000", "too large for this machine",
                                          "holds at most"]),
    ("workload", "output_len = [3, 500]", ["up to 508 tokens", "do not fit", "pool 24 pages of 16"]),
    ("engine", "kv_budget_mb = 1e12", ["[engine].kv_budget_mb = 1000000000000.0", "out of range"]),
    ("engine", "model = \"llama9\"", ["[engine].model = 'llama9'", "tiny"]),
    ("engine", "device = \"tpu\"", ["[engine].device = 'tpu'", "cpu", "cuda"]),
    ("engine", "seed = 99999999999", ["[engine].seed", "99999999999"]),
    ("faults", "classes = [\"premature_free\", 3]", ["[faults].classes", "list of strings"]),
    ("faults", "classes = [\"all\", \"leak\"]", ["[faults].classes", "'all' (alone)"]),
    ("faults", "classes = [\"leak\", \"leak\"]", ["more than once"]),
    ("faults", "classes = [\"transfer_into_reallocated\"]", ["[engine] phase_split = true"]),
    ("faults", "classes = [\"rank_divergent_entry\"]", ["faultlab.chaos.tp_run"]),
    ("faults", "seeds = 0", ["[faults].seeds = 0", "1..1000000"]),
    ("faults", "seeds = -3", ["[faults].seeds = -3"]),
    ("faults", "count = 0", ["[faults].count = 0"]),
    ("faults", "p = 1.5", ["[faults].p = 1.5", "0.0..1.0"]),
    ("faults", "step = [-1, 2]", ["[faults].step[0] = -1"]),
    ("faults", "first_seed = 99999999999", ["[faults].first_seed"]),
    ("faults", "trigger = \"often\"", ["[faults].trigger = 'often'", "step"]),
    ("expect", "max_false_positives = -1", ["[expect].max_false_positives = -1", "0..1000000000"]),
    ("expect", "all_detectable_caught = 1", ["[expect].all_detectable_caught = 1", "true or false"]),
])
def test_bad_scenario_field_exits_2_before_any_work(section, line, needles, tmp_path, capsys):
    text = edit(section, line) if f"[{section}]" in TINY else TINY + f"[{section}]\n{line}\n"
    path = write(tmp_path, text)
    bad_input(capsys, tmp_path, ["run", str(path), "--json", str(tmp_path / "out" / "r.json")], *needles)


def test_cuda_device_without_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    path = write(tmp_path, edit("engine", 'device = "cuda"'))
    bad_input(capsys, tmp_path, ["run", str(path)], "[engine].device = 'cuda' is not available", "0 CUDA")


def test_unreadable_scenario_files(tmp_path, capsys):
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b'name = "\xff\xfe"\n')
    bad_input(capsys, tmp_path, ["run", str(binary)], "not UTF-8")
    bad_input(capsys, tmp_path, ["run", str(tmp_path)], "is a directory")
    bad_input(capsys, tmp_path, ["run", str(write(tmp_path, 'name = ""\n', "empty.toml"))], "'name' = ''")


@pytest.mark.parametrize("flags, needles", [
    (["--seeds", "-3"], ["--seeds = -3", "1..1000000"]),
    (["--seeds", "0"], ["--seeds = 0"]),
    (["--first-seed", "-1"], ["--first-seed = -1"]),
    (["--first-seed", "4294967295", "--seeds", "2"], ["--first-seed + --seeds", "4294967295"]),
    (["--jobs", "1000"], ["--jobs = 1000", f"0..{os.cpu_count()}"]),
    (["--jobs", "-1"], ["--jobs = -1"]),
    (["--faults", "nope"], ["--faults has unknown fault(s) ['nope']", "double_free"]),
    (["--faults", "leak,,double_free"], ["--faults 'leak,,double_free'", "comma-separated"]),
    (["--faults", "transfer_into_reallocated"], ["--faults ['transfer_into_reallocated']", "phase_split = true"]),
    (["--faults", "rank_divergent_entry"], ["faultlab.chaos.tp_run"]),
    (["--plot", "p.png"], ["--plot 'p.png' needs --json"]),
])
def test_bad_run_flags_exit_2(flags, needles, tmp_path, capsys):
    path = write(tmp_path, TINY)
    for command in ("run", "matrix"):
        bad_input(capsys, tmp_path, [command, str(path), *flags], *needles)


def test_output_paths_are_checked_before_the_run(tmp_path, capsys):
    path = write(tmp_path, TINY)
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "file").write_text("x")
    run = ["run", str(path), "--json"]
    bad_input(capsys, tmp_path, run + [str(tmp_path / "dir.json")], "--json", "not a directory")
    bad_input(capsys, tmp_path, run + [str(tmp_path / "file" / "r.json")], "is a file, not a folder")
    bad_input(capsys, tmp_path, run + [str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.txt")],
              "--plot", "'.png'")
    bad_input(capsys, tmp_path, run + [str(tmp_path / "r.png")], "is the --json path")
    bad_input(capsys, tmp_path, ["faults", "--json", str(tmp_path / "dir.json")], "--json")
    bad_input(capsys, tmp_path, ["soak", str(path), "--json", str(tmp_path / "file" / "s.json")], "is a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_folder(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    bad_input(capsys, tmp_path, ["run", str(write(tmp_path, TINY)), "--json", str(locked / "r.json")],
              "not writable")


def test_soak_bad_seeds(tmp_path, capsys):
    path = write(tmp_path, TINY)
    bad_input(capsys, tmp_path, ["soak", str(path), "--seeds", "-1"], "--seeds = -1")
    bad_input(capsys, tmp_path, ["soak", str(path), "--seeds", "0"], "--seeds = 0")


@pytest.mark.parametrize("argv, needles", [
    (["generate", "hi", "--max-tokens", "0"], ["--max-tokens = 0"]),
    (["generate", "hi", "--max-tokens", "100000"], ["--max-tokens = 100000"]),
    (["generate", "hi", "--model", "tiny"], ["--model 'tiny'", "smollm2"]),
    (["generate", "  "], ["prompt"]),
    (["generate", "hi", "--kv-residual", "--kv-dtype", "bf16"], ["engine.kv_residual", "kv_dtype 'bf16'"]),
    (["eval-kv", "--positions", "0"], ["--positions = 0"]),
    (["eval-kv", "--window", "10"], ["--window = 10"]),
    (["eval-kv", "--prompt", "600"], ["--prompt = 600", "0..511"]),
    (["eval-kv", "--residual-sink", "4"], ["without --kv-residual"]),
    (["eval-kv", "--positions", "70000", "--window", "40"], ["tokens of text", "at most 80000"]),
    (["eval-kv", "--model", "tiny"], ["--model 'tiny'"]),
    (["demo", "--fault", "nope"], ["unknown fault 'nope'"]),
    (["demo", "--fault", "transfer_into_reallocated"], ["--fault 'transfer_into_reallocated'", "phase_split"]),
    (["demo", "--max-tokens", "0"], ["--max-tokens = 0", "1..256"]),
])
def test_bad_model_command_arguments(argv, needles, tmp_path, capsys):
    smollm2_or_skip()
    bad_input(capsys, tmp_path, argv + (["--json", str(tmp_path / "e.json")] if argv[0] == "eval-kv" else []),
              *needles)


def test_output_folders_of_demo_and_eval_kv(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    bad_input(capsys, tmp_path, ["demo", "--out", str(tmp_path / "file")], "--out", "give a folder")
    bad_input(capsys, tmp_path, ["eval-kv", "--json", str(tmp_path)], "--json")


# -- every output option of every command: refused before any work ------------------------------------
PROC = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


@pytest.fixture
def no_work(monkeypatch):
    """The work behind every command replaced by a failure: a bad path let through by the checks fails
    the test instead of starting a run. Imports happen here, so a case times its checks alone."""
    import faultlab.chaos.cli as cli
    import faultlab.chaos.demo as demo
    import faultlab.engine.evalkv as evalkv
    import faultlab.faults.catalog as catalog
    import faultlab.gpu.bench as gpubench
    import faultlab.chaos.soak as soak
    from faultlab.sglang_gpu import cli as gpu_cli
    from faultlab.sglang_live import pd_sweep, sweep

    def work(*args, **kwargs):
        raise AssertionError("a bad output path reached the work")

    for module, name in ((cli, "_run_cases"), (soak, "run_soak"), (demo, "run_demo"), (catalog, "catalog"),
                         (gpubench, "main"), *((gpu_cli, f"cmd_{c}") for c in
                                               ("overhead", "faults", "extras", "report", "fault_engine"))):
        monkeypatch.setattr(module, name, work)
    monkeypatch.setattr(evalkv, "eval_kv", functools.wraps(evalkv.eval_kv)(work))  # its signature is read
    monkeypatch.setattr(sweep, "tempfile", SimpleNamespace(mkdtemp=work))  # the sweep's first write
    monkeypatch.setattr(pd_sweep, "tempfile", SimpleNamespace(mkdtemp=work))
    monkeypatch.setattr(pd_sweep, "run_pair", work)
    return {"faultlab": main, "sweep": sweep.main, "pd_sweep": pd_sweep.main, "sglang_gpu": gpu_cli.main}


def bad_paths(tmp_path, kind: str, suffix: str = ".json") -> list[str]:
    """Paths no command may accept for a ``kind`` ("file" or "folder") output: on /proc (files cannot be
    made there, though os.access says root may write), under a regular file, and the other kind."""
    (tmp_path / "file").write_text("x")
    if kind == "folder":
        return ["/proc/nope", "/proc", str(tmp_path / "file" / "sub"), str(tmp_path / "file")]
    (tmp_path / f"dir{suffix}").mkdir()
    return [f"/proc/nope/out{suffix}", f"/proc/out{suffix}", str(tmp_path / "file" / f"out{suffix}"),
            str(tmp_path / f"dir{suffix}")]


def refused(capsys, tmp_path, run, argv, flag: str) -> str:
    """``run(argv)``: exit 2 within a second, one line naming ``flag``, nothing written in tmp_path."""
    before = set(tmp_path.rglob("*"))
    started = time.perf_counter()
    code = run(argv)
    elapsed = time.perf_counter() - started
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert err.count("\n") == 1 and flag in err, (flag, err)
    assert set(tmp_path.rglob("*")) == before, "bad input must write nothing"
    assert not os.path.exists("/proc/nope")
    assert elapsed < 1.0, f"{argv}: {elapsed:.2f} s: the check must come before any work"
    return err


# (program, argv with {bad} for the path, the flag the message names, "file" or "folder", file suffix)
OUTPUTS = [
    ("faultlab", ["run", "{tiny}", "--json", "{bad}"], "--json", "file", ".json"),
    ("faultlab", ["matrix", "{tiny}", "--json", "{bad}"], "--json", "file", ".json"),
    ("faultlab", ["run", "{tiny}", "--json", "{tmp}/r.json", "--plot", "{bad}"], "--plot", "file", ".png"),
    ("faultlab", ["matrix", "{tiny}", "--json", "{tmp}/r.json", "--plot", "{bad}"], "--plot", "file", ".png"),
    ("faultlab", ["soak", "{tiny}", "--json", "{bad}"], "--json", "file", ".json"),
    ("faultlab", ["faults", "--json", "{bad}"], "--json", "file", ".json"),
    ("faultlab", ["eval-kv", "--json", "{bad}"], "--json", "file", ".json"),
    ("faultlab", ["demo", "--out", "{bad}"], "--out", "folder", ""),
    ("faultlab", ["bench", "--out", "{bad}", "--dry-run"], "--out", "folder", ""),
    ("sweep", ["--out", "{bad}"], "--out", "file", ".json"),
    ("pd_sweep", ["--out", "{bad}"], "--out", "file", ".json"),
    ("sglang_gpu", ["overhead", "--out", "{bad}", "--cpu"], "--out", "folder", ""),
    ("sglang_gpu", ["extras", "--out", "{bad}", "--cpu"], "--out", "folder", ""),
    ("sglang_gpu", ["faults", "--out", "{bad}", "--cpu"], "--out", "folder", ""),
    ("sglang_gpu", ["pd", "--out", "{bad}", "--cpu"], "--out", "folder", ""),
    ("sglang_gpu", ["fault-engine", "--out", "{bad}", "--spec", "s.json", "--result", "{tmp}/r.json"], "--out",
     "folder", ""),
    ("sglang_gpu", ["fault-engine", "--out", "{tmp}", "--spec", "s.json", "--result", "{bad}"], "--result",
     "file", ".json"),
    ("sglang_gpu", ["report", "--results", "{bad}"], "--results", "folder", ""),
]


@PROC
@pytest.mark.parametrize("program, argv, flag, kind, suffix", OUTPUTS,
                         ids=[f"{o[0]}-{o[1][0]}-{o[2]}" for o in OUTPUTS])
def test_every_output_option_is_refused_before_any_work(program, argv, flag, kind, suffix, no_work, tmp_path,
                                                         capsys):
    tiny = write(tmp_path, TINY)
    for bad in bad_paths(tmp_path, kind, suffix):
        args = [a.format(bad=bad, tiny=tiny, tmp=tmp_path) for a in argv]
        err = refused(capsys, tmp_path, no_work[program], args, flag)
        assert repr(bad) in err, (bad, err)


@pytest.mark.parametrize("program, argv, flag", [
    ("sweep", ["--seeds", "3-1"], "--seeds"), ("pd_sweep", ["--seeds", "x"], "--seeds"),
    ("pd_sweep", ["--backends", "mooncake,mori"], "--backends"), ("pd_sweep", ["--backends", ","], "--backends"),
    ("pd_sweep", ["--port", "80"], "--port"), ("pd_sweep", ["--port", "59000"], "--port")])
def test_sweeps_refuse_bad_seeds_backends_and_ports_before_any_work(program, argv, flag, no_work, tmp_path, capsys):
    code = no_work[program](argv + ["--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and flag in err, (code, err)
    assert list(tmp_path.iterdir()) == [], "bad input must write nothing"


@PROC
def test_the_default_plot_beside_the_json_is_checked(no_work, tmp_path, capsys):
    """No --plot: the plot goes beside --json (its name with .png), and that path is checked too."""
    (tmp_path / "r.png").mkdir()
    argv = ["run", str(write(tmp_path, TINY)), "--json", str(tmp_path / "r.json")]
    assert "--plot (default: the --json path with .png)" in refused(capsys, tmp_path, main, argv, "--plot")
    argv[-1] = "/proc/nope/out.json"
    refused(capsys, tmp_path, main, argv, "--json")


@PROC
def test_files_inside_output_folders_are_checked(no_work, tmp_path, capsys):
    """demo's report.json in --out, the SGLang harness's --name in --out: a folder of that name, a path."""
    (tmp_path / "report.json").mkdir()
    refused(capsys, tmp_path, main, ["demo", "--out", str(tmp_path)], "--out")
    gpu = no_work["sglang_gpu"]
    (tmp_path / "faults.json").mkdir()
    refused(capsys, tmp_path, gpu, ["faults", "--out", str(tmp_path), "--cpu"], "--name")
    for name in ("sub/x.json", "..", ""):
        refused(capsys, tmp_path, gpu, ["overhead", "--out", str(tmp_path / "o"), "--name", name], "--name")


def test_output_checks_create_nothing(tmp_path):
    """A path in folders yet to be made passes where the command makes them (they are not made by the
    check, and its probe file is gone); where the command does not make them, it is refused."""
    deep = tmp_path / "a" / "b" / "r.json"
    assert check_output_file("--json", deep) == deep
    assert check_output_dir("--out", tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="does not exist"):
        check_output_file("--out", deep, make_folder=False)
    with pytest.raises(UsageError, match="does not exist"):
        check_output_dir("--results", tmp_path / "a", make_folder=False)
    assert check_output_file("--out", tmp_path / "r.json", make_folder=False) == tmp_path / "r.json"


# -- runs that test nothing fail ---------------------------------------------------------------------
def test_fault_that_never_strikes_fails(tmp_path, capsys):
    path = write(tmp_path, edit("faults", "step = [5000, 5000]"))
    out = tmp_path / "r.json"
    for tracker in ("off", "on"):
        assert main(["run", str(path), "--tracker", tracker, "--no-compare", "--jobs", "1", "--json", str(out)]) == 1
        text = capsys.readouterr().out
        assert "premature_free never struck in 1 case(s)" in text and "FAILED: premature_free" in text
        report = json.loads(out.read_text())
        assert report["failed"] == ["premature_free"] and report["classes"][0]["injected"] == 0


def test_struck_and_caught_passes(tmp_path, capsys):
    path = write(tmp_path, TINY)
    out = tmp_path / "r.json"
    assert main(["run", str(path), "--jobs", "1", "--json", str(out)]) == 0
    rows = {r["tracker"]: r for r in json.loads(out.read_text())["classes"]}
    assert rows["on"]["injected"] == rows["off"]["injected"] == 1
    assert rows["on"]["victims_aborted"] == rows["on"]["victims"] >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png", "s.toml"], "no temp file left"


# -- [expect] is enforced ------------------------------------------------------------------------------
def row(**over) -> dict:
    base = {"fault": "premature_free", "detectable": True, "tracker": "on", "cases": 2, "injected": 2,
            "victims": 2, "victims_aborted": 2, "false_positives": 0, "corrupted_tokens_returned": 0,
            "nonvictim_mismatches": 0}
    return base | over


def test_expectations_are_enforced():
    assert failures(row()) == []
    assert "false positive" in failures(row(false_positives=1))[0]
    assert failures(row(false_positives=1), Expectations(max_false_positives=1)) == []
    assert "corrupted token" in failures(row(corrupted_tokens_returned=3))[0]
    assert failures(row(corrupted_tokens_returned=3), Expectations(max_corrupted_tokens_with_tracker=3)) == []
    assert "1 of 2 victims not aborted" in failures(row(victims_aborted=1))[0]
    assert failures(row(victims_aborted=1), Expectations(all_detectable_caught=False)) == []
    assert "harmed no request" in failures(row(victims=0, victims_aborted=0))[0]
    assert "never struck" in failures(row(injected=0, victims=0, victims_aborted=0))[0]
    assert "never struck" in failures(row(tracker="off", injected=0))[0]
    assert failures(row(tracker="off", victims_aborted=0, corrupted_tokens_returned=9)) == []
    assert failures(row(detectable=False, corrupted_tokens_returned=9)) == [], "undetectable: by design"
    assert "non-victim" in failures(row(nonvictim_mismatches=1), Expectations(all_detectable_caught=False))[0]


def test_expect_section_reaches_the_verdict(tmp_path):
    lenient = parse({"name": "x", "expect": {"max_false_positives": 5, "all_detectable_caught": False}})
    assert lenient.expect == Expectations(all_detectable_caught=False, max_false_positives=5)


def test_a_failed_write_leaves_no_temp_file(tmp_path):
    target = tmp_path / "r.json"
    with pytest.raises(ZeroDivisionError):
        _atomic(target, lambda tmp: Path(tmp).write_text("half") and 1 / 0)
    assert list(tmp_path.iterdir()) == []
