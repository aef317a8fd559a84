"""The faultlab pytest plugin, tested from the outside with pytester (in-process runs: fast)."""
import re

import pytest
# NOTE: pytester's in-process runs drop every module first imported inside them; torch cannot be
# imported twice in one process (it crashes), so everything the inner runs use is imported here first.
import torch  # noqa: F401

import triton  # noqa: F401  (the inner runs' engines and trackers import it)

import faultlab.engine.engine  # noqa: F401
import faultlab.faults.injector  # noqa: F401
import kvguard  # noqa: F401
import kvguard.kernels.tag_check  # noqa: F401

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _uses_faultlab(pytester):
    """Each inner project turns the plugin on the documented way (it is opt-in: no pytest11 entry point)."""
    pytester.makeconftest('pytest_plugins = ["faultlab.testing.pytest_plugin"]\n')

SEED_TEST = """
def test_seed(faultlab_seed):
    assert isinstance(faultlab_seed, int)
    print("SEED=%d" % faultlab_seed)
"""

# A tiny engine: fp32 weights (no INT4 path), FP8 KV, a small pool, whole-prompt prefill (fast);
# three 18-token prompts (two pages each: one fully written, one growing).
ENGINE_HELPERS = """
from faultlab.engine.requests import Request

def small_engine(kv_engine, **kw):
    return kv_engine(weight_dtype="fp32", kv_dtype="fp8", num_pages=24, max_running=4,
                     batch_invariant=False, **kw)

def run_three(engine):
    for i in range(3):
        engine.add_request(Request(f"r{i}", [3 + (7 * i + t) % 50 for t in range(18)], 4))
    return engine.run(max_steps=40)
"""

SCENARIO = {"workload": {"requests": 3, "prompt_len": [4, 8], "output_len": [2, 4], "concurrency": 3,
                         "shared_prefix_fraction": 0.0},
            "engine": {"weight_dtype": "fp32", "num_pages": 24}}


@pytest.fixture(scope="module")
def engine_modules():
    """Warm up: run a tiny engine with a TagTracker to completion once in this process, so that every
    module the inner runs import lazily (engine, kernels, triton) is already loaded (see the NOTE
    above) and the tiny model is in the engine's model cache."""
    from faultlab.engine.requests import Request
    from faultlab.testing.pytest_plugin import build_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add sync overhead (10x on a busy machine)
    engine = build_engine(weight_dtype="fp32", kv_dtype="fp8", num_pages=8)
    engine.add_request(Request("warmup", [3, 4, 5], 2))
    engine.run(max_steps=10)
    import faultlab.chaos.runner  # noqa: F401

    yield
    torch.set_num_threads(threads)


def header_seed(result) -> int:
    match = re.search(r"faultlab: seed=(\d+)", result.stdout.str())
    assert match, result.stdout.str()
    return int(match.group(1))


# -- the seed --------------------------------------------------------------------------------------
def test_header_prints_a_random_seed(pytester):
    pytester.makepyfile(SEED_TEST)
    result = pytester.runpytest("-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["faultlab: seed=* (random; rerun with --faultlab-seed=*)"])
    assert f"SEED={header_seed(result)}" in result.stdout.str()


def test_explicit_seed_is_honoured(pytester):
    pytester.makepyfile(SEED_TEST.replace("isinstance(faultlab_seed, int)", "faultlab_seed == 123"))
    result = pytester.runpytest("--faultlab-seed=123")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["faultlab: seed=123 (--faultlab-seed=123; rerun with --faultlab-seed=123)"])


@pytest.mark.parametrize("cache", [True, False], ids=["pytest-cache", "seed-file"])
def test_last_reuses_the_previous_seed(pytester, cache):
    pytester.makepyfile(SEED_TEST)
    extra = [] if cache else ["-p", "no:cacheprovider"]
    first = header_seed(pytester.runpytest(*extra))  # a random seed, remembered
    result = pytester.runpytest("--faultlab-seed=last", "-s", *extra)
    result.assert_outcomes(passed=1)
    assert header_seed(result) == first and f"SEED={first}" in result.stdout.str()
    assert (pytester.path / ".faultlab-seed").is_file() is not cache
    assert header_seed(pytester.runpytest("--faultlab-seed=123", *extra)) == 123
    assert header_seed(pytester.runpytest("--faultlab-seed=last", *extra)) == 123


def test_last_without_history_draws_a_fresh_seed(pytester):
    pytester.makepyfile(SEED_TEST)
    result = pytester.runpytest("--faultlab-seed=last", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["faultlab: seed=* (no previous seed found, drew a fresh one;*"])


def test_bad_seed_is_a_usage_error(pytester):
    pytester.makepyfile(SEED_TEST)
    result = pytester.runpytest("--faultlab-seed=banana")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--faultlab-seed='banana' is not valid; use an integer, 'last' or 'random'*"])


def test_failure_report_names_the_seed(pytester):
    pytester.makepyfile("def test_fails(faultlab_seed):\n    assert False\n")
    result = pytester.runpytest("--faultlab-seed=77")
    result.assert_outcomes(failed=1)
    command = "pytest 'test_failure_report_names_the_seed.py::test_fails' --faultlab-seed=77"
    result.stdout.fnmatch_lines(["*faultlab*", f"seed=77; reproduce with: {command}"])


# -- fixtures --------------------------------------------------------------------------------------
def test_fixtures_are_listed(pytester):
    result = pytester.runpytest("--fixtures")
    for name in ("faultlab_seed", "kv_engine", "kv_tracker", "kv_injector", "kvfault", "chaos_runner"):
        result.stdout.fnmatch_lines([f"{name}*"])


def test_marker_is_registered(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.kvfault(name, seed=None, trigger='step', step=3, count=1*"])


def test_tracker_and_injector_fixtures(pytester):
    pytester.makepyfile("""
        import pytest
        from kvguard import TagTracker
        from faultlab.faults.catalog import UnknownFault
        from faultlab.faults.injector import Injector, Trigger

        def test_tracker(kv_tracker):
            assert isinstance(kv_tracker, TagTracker) and kv_tracker.config.mode == "check"

        def test_trackers_do_not_share_counters(kv_tracker):
            from faultlab.chaos.runner import checking_tracker
            assert checking_tracker().metrics is not kv_tracker.metrics

        def test_injector(kv_injector, faultlab_seed):
            inj = kv_injector("double_free", trigger="event", event="free", count=2)
            assert isinstance(inj, Injector) and inj.trigger == Trigger(mode="event", event="free")
            assert inj.remaining == 2 and inj.fault.name == "double_free"
            assert kv_injector("leak", trigger=Trigger(step=5), seed=9).trigger.step == 5

        def test_injector_unknown(kv_injector):
            with pytest.raises(UnknownFault, match="valid faults: .*double_free"):
                kv_injector("no_such_fault")
            with pytest.raises(ValueError, match="seed = 'abc' is not valid"):
                kv_injector("leak", seed="abc")
            with pytest.raises(ValueError, match="count = 0 is out of range"):
                kv_injector("leak", count=0)

        def test_no_marker_no_fault(kvfault):
            assert kvfault is None
    """)
    pytester.runpytest().assert_outcomes(passed=5)


def test_kv_engine_builds_engines(pytester, engine_modules):
    pytester.makepyfile(ENGINE_HELPERS + """
from kvguard import NoopTracker, TagTracker

def test_engine(kv_engine):
    on, off = small_engine(kv_engine), small_engine(kv_engine, tracker=False)
    assert isinstance(on.tracker, TagTracker) and isinstance(off.tracker, NoopTracker)
    assert on.num_pages == 24 and on.config.model == "tiny" and not on.observers
    events = run_three(on)
    assert {e.rid for e in events if e.kind == "finish"} == {"r0", "r1", "r2"}
    assert on.accounting()["balanced"]
""")
    pytester.runpytest().assert_outcomes(passed=1)


# -- the kvfault marker ----------------------------------------------------------------------------
def test_kvfault_marker_injects_and_tracker_aborts(pytester, engine_modules):
    pytester.makepyfile(ENGINE_HELPERS + """
import pytest
from faultlab.faults.injector import Injector

@pytest.mark.kvfault("premature_free", step=2, seed=4)
def test_under_fault(kv_engine, kvfault):
    engine = small_engine(kv_engine)
    assert isinstance(engine.observers[0], Injector)
    events = run_three(engine)
    assert kvfault.name == "premature_free" and len(kvfault.injected) == 1
    victim = kvfault.injected[0]["request"]
    aborted = {e.rid for e in events if e.kind == "abort"}
    assert victim in aborted

@pytest.mark.kvfault("premature_free", step=2)
def test_opt_out(kv_engine, kvfault):
    engine = small_engine(kv_engine, inject=False)
    assert not engine.observers
    assert not [e for e in run_three(engine) if e.kind == "abort"] and not kvfault.injected
""")
    pytester.runpytest().assert_outcomes(passed=2)


def test_unknown_fault_fails_with_valid_names(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.kvfault("no_such_fault")
        def test_marked():
            pass

        @pytest.mark.kvfault("double_free", trigger="sometimes")
        def test_bad_trigger():
            pass

        @pytest.mark.kvfault()
        def test_no_name(kv_engine):
            pass
    """)
    result = pytester.runpytest()
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines([
        "*@pytest.mark.kvfault('no_such_fault'): unknown fault 'no_such_fault'; valid faults: *double_free*",
        "*@pytest.mark.kvfault('double_free'): trigger mode = 'sometimes' is not valid; choose one of *",
        "*@pytest.mark.kvfault needs one fault name*",
    ])


def test_chaos_runner(pytester, engine_modules):
    pytester.makepyfile(f"""
import pytest
from faultlab.chaos.runner import CaseResult

SCENARIO = {SCENARIO!r}

def test_fault_free(chaos_runner, faultlab_seed):
    result = chaos_runner(SCENARIO)
    assert isinstance(result, CaseResult) and result.fault is None and result.seed == faultlab_seed
    assert all(o["status"] == "finished" for o in result.outputs.values())

@pytest.mark.kvfault("premature_free", step=1)
def test_marker_fault(chaos_runner):
    result = chaos_runner(SCENARIO, baseline=True)
    assert result.fault == "premature_free" and result.injected == 1
    assert result.victims_aborted == result.victims >= 1 and result.nonvictim_mismatches == 0
""")
    pytester.runpytest("--faultlab-seed=5").assert_outcomes(passed=2)


# -- misuse (issue 15) -----------------------------------------------------------------------------
def test_no_seed_file_in_projects_without_faultlab(pytester):
    pytester.makepyfile("def test_plain():\n    assert 1 + 1 == 2\n")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert not (pytester.path / ".faultlab-seed").exists()
    pytester.makepyfile(SEED_TEST)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert (pytester.path / ".faultlab-seed").is_file(), "a project that uses faultlab keeps its seed"


def test_bad_marker_arguments_fail_cleanly(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.kvfault("double_free", seed="abc")
        def test_seed_text():
            pass

        @pytest.mark.kvfault("double_free", seed=2**40)
        def test_seed_huge():
            pass

        @pytest.mark.kvfault("double_free", count=0)
        def test_count_zero():
            pass

        @pytest.mark.kvfault("double_free", cuont=2)
        def test_typo():
            pass

        @pytest.mark.kvfault("double_free", p=float("nan"), trigger="prob")
        def test_nan_p():
            pass

        @pytest.mark.kvfault("double_free", require_strike="yes")
        def test_require_text():
            pass
    """)
    result = pytester.runpytest()
    result.assert_outcomes(errors=6)
    result.stdout.fnmatch_lines([
        "*@pytest.mark.kvfault('double_free'): seed = 'abc' is not valid; it must be an integer in 0..4294967295",
        "*@pytest.mark.kvfault('double_free'): seed = 1099511627776 is out of range*",
        "*@pytest.mark.kvfault('double_free'): count = 0 is out of range; it must be an integer in 1..1000",
        "*@pytest.mark.kvfault('double_free'): unknown argument(s) *cuont*; valid: *seed*require_strike*",
        "*@pytest.mark.kvfault('double_free'): trigger p = nan is out of range; it must be a number in 0.0..1.0",
        "*@pytest.mark.kvfault('double_free'): require_strike = 'yes' is not valid*",
    ])
    assert "Traceback" not in result.stdout.str() and "During handling" not in result.stdout.str()


def test_marker_seed_reaches_chaos_runner_and_strikes_are_required(pytester, engine_modules):
    pytester.makepyfile(f"""
import pytest

SCENARIO = {SCENARIO!r}

@pytest.mark.kvfault("premature_free", step=1, seed=11)
def test_marker_seed(chaos_runner, faultlab_seed):
    result = chaos_runner(SCENARIO)
    assert faultlab_seed == 5 and result.seed == 11 and result.injected == 1

@pytest.mark.kvfault("premature_free", step=500)
def test_never_struck(chaos_runner):
    chaos_runner(SCENARIO)

@pytest.mark.kvfault("premature_free", step=500, require_strike=False)
def test_never_struck_allowed(chaos_runner):
    assert chaos_runner(SCENARIO).injected == 0

@pytest.mark.kvfault("transfer_into_reallocated")
def test_unhostable_chaos(chaos_runner):
    chaos_runner(SCENARIO)

@pytest.mark.kvfault("transfer_into_reallocated")
def test_unhostable_engine(kv_engine):
    kv_engine(weight_dtype="fp32", num_pages=8)
""")
    result = pytester.runpytest("--faultlab-seed=5")
    result.assert_outcomes(passed=2, failed=3)
    result.stdout.fnmatch_lines([
        "*chaos_runner: fault 'premature_free' never struck (seed=5)*",
        "*transfer_into_reallocated*cannot strike in this engine*phase_split*",
        "*kvfault 'transfer_into_reallocated' cannot strike in this engine: it needs 'phase_split'*",
    ])


def test_kv_engine_fault_that_never_strikes_fails_at_teardown(pytester, engine_modules):
    pytester.makepyfile(ENGINE_HELPERS + """
import pytest

@pytest.mark.kvfault("premature_free", step=500)
def test_too_late(kv_engine):
    run_three(small_engine(kv_engine))
""")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*kvfault 'premature_free' never struck (seed=*, trigger=*): the test tested nothing*"])


def test_failure_report_names_fault_seed_victims_and_command(pytester, engine_modules):
    pytester.makepyfile(ENGINE_HELPERS + f"""
import pytest

SCENARIO = {SCENARIO!r}

@pytest.mark.kvfault("premature_free", step=2, seed=4)
def test_engine_fails(kv_engine, kvfault):
    run_three(small_engine(kv_engine))
    assert not kvfault.injected

@pytest.mark.kvfault("premature_free", step=1, seed=3)
def test_chaos_fails(chaos_runner):
    assert chaos_runner(SCENARIO).victims == 0
""")
    result = pytester.runpytest("--faultlab-seed=9")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*- faultlab -*",
        "fault=premature_free seed=4 trigger=Trigger(mode='step', step=2*",
        "strikes=[[]{'fault': 'premature_free', 'step': *",
        "seed=9; reproduce with: pytest '*::test_engine_fails' --faultlab-seed=9",
        "*- faultlab -*",
        "fault=premature_free seed=3 *",
        "chaos_runner: fault=premature_free seed=3 tracker=on injected=1 victims=* victims_aborted=*",
        "seed=9; reproduce with: pytest *::test_chaos_fails' --faultlab-seed=9",
    ])


# -- the examples in docs/faultlab.md (linked from the README) run as written ---------------------------------
def readme_example(section: str) -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "faultlab.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return body.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_plugin_example(pytester, engine_modules):
    pytester.makepyfile(readme_example("pytest plugin"))
    pytester.runpytest().assert_outcomes(passed=1)


def test_readme_allocator_example_and_misuse(pytester):
    example = readme_example("Your own allocator under the Hypothesis machine")
    buggy = example.replace("        self.free_list[:0] = pages\n",
                            "        self.free_list[:0] = pages + pages[:1]  # a double free\n")
    assert buggy != example
    pytester.makepyfile(test_ok=example, test_buggy=buggy, test_misuse="""
import pytest
from faultlab.testing.strategies import AllocatorModel, allocator_machine

class NoFree:
    def alloc(self, n): return []
    def available(self): return 4

class Empty(NoFree):
    def free(self, pages): pass
    def available(self): return 0

def test_misuse():
    with pytest.raises(TypeError, match=r"NoFree lacks \\['free'\\]"):
        AllocatorModel(NoFree())
    with pytest.raises(ValueError, match=r"available\\(\\) = 0 on a fresh allocator"):
        AllocatorModel(Empty())
    with pytest.raises(TypeError, match="zero-argument callable"):
        allocator_machine(NoFree())
""")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*AllocatorInvariantError*"])
