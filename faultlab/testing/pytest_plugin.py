"""faultlab's pytest plugin. Opt-in: ``pytest_plugins = ["faultlab.testing.pytest_plugin"]`` in a conftest.py (or
``pytest -p faultlab.testing.pytest_plugin``); installing kvguard registers nothing in anyone's pytest runs.

What it adds to the runs of a project that turns it on:

- ``--faultlab-seed=N|last|random`` (group ``faultlab``): one seed per session, printed in the run
  header. ``random`` (the default) draws a fresh one; ``last`` reuses the previous session's seed
  (stored in the pytest cache, or in ``<rootdir>/.faultlab-seed`` when the cache plugin is off). The
  seed is stored only once a test uses faultlab: a project that never does gets no file.
- fixtures: ``faultlab_seed``, ``kv_engine`` (factory), ``kv_tracker``, ``kv_injector`` (factory),
  ``kvfault`` and ``chaos_runner`` (factory).
- the marker ``@pytest.mark.kvfault(name, seed=None, trigger="step", step=3, count=1, require_strike=True)``:
  engines built by ``kv_engine`` and runs of ``chaos_runner`` in that test run with the fault injected,
  with the marker's seed (default: the session's). A test whose fault never struck fails (unless
  ``require_strike=False``); bad arguments fail the test before it runs (read and checked in
  faultlab/testing/marker.py).
- a failed test that used faultlab gets a ``faultlab`` report section: fault, seed, strikes, victims and
  the command that reproduces it.

This module stays light: torch and faultlab.engine are imported only inside fixtures and hooks that
need them, so a pytest run that never touches faultlab pays nothing for the plugin.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from faultlab.chaos.limits import SEED_MAX, check_number
from faultlab.testing.marker import (MARKER_DOC, KVFault, check_count, check_seed, make_trigger, marker_fault,
                                    require_hostable)

SEED_OPTION = "--faultlab-seed"
SEED_CACHE_KEY = "faultlab/seed"
SEED_FILE = ".faultlab-seed"
_SEED_KEY = pytest.StashKey[int]()
_SEED_NOTE_KEY = pytest.StashKey[str]()
_STORED_KEY = pytest.StashKey[bool]()
_FAULT_KEY = pytest.StashKey["KVFault"]()
_RUNS_KEY = pytest.StashKey[list]()
_FIXTURES = {"faultlab_seed", "kv_engine", "kv_injector", "kvfault", "chaos_runner", "kv_tracker"}


# -- options and the session seed ------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("faultlab", "faultlab fault injection")
    group.addoption(SEED_OPTION, action="store", default="random", dest="faultlab_seed",
                    metavar="N|last|random",
                    help="seed of faultlab's fixtures and faults: an integer, 'last' (the previous "
                         "session's seed) or 'random' (default: a fresh seed, printed in the header)")


def _parse_seed(value: str) -> int | str:
    """An int seed, or the words ``last`` / ``random``; anything else is a usage error."""
    value = str(value).strip().lower()
    if value in ("last", "random"):
        return value
    try:
        seed = int(value)
    except ValueError:
        raise pytest.UsageError(f"{SEED_OPTION}={value!r} is not valid; use an integer, 'last' or 'random'")
    return check_number(SEED_OPTION, seed, 0, SEED_MAX, pytest.UsageError)


def _seed_file(config: pytest.Config) -> Path:
    return Path(config.rootpath) / SEED_FILE


def _load_last_seed(config: pytest.Config) -> int | None:
    """The previous session's seed: the pytest cache if it is on, else the seed file."""
    cache = getattr(config, "cache", None)
    if cache is not None:
        seed = cache.get(SEED_CACHE_KEY, None)
        if isinstance(seed, int):
            return seed
    try:
        return int(_seed_file(config).read_text().strip())
    except (OSError, ValueError):
        return None


def _store_seed(config: pytest.Config, seed: int) -> None:
    """Remember ``seed`` for ``--faultlab-seed=last`` (best effort: a read-only tree is fine)."""
    cache = getattr(config, "cache", None)
    if cache is not None:
        cache.set(SEED_CACHE_KEY, seed)
        return
    try:
        _seed_file(config).write_text(f"{seed}\n")
    except OSError:
        pass


def _resolve_seed(config: pytest.Config) -> tuple[int, str]:
    """(seed, how it was chosen) for this session."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and "faultlab_seed" in workerinput:  # pytest-xdist worker
        return int(workerinput["faultlab_seed"]), "from the xdist controller"
    wanted = _parse_seed(config.getoption("faultlab_seed"))
    if isinstance(wanted, int):
        return wanted, f"{SEED_OPTION}={wanted}"
    if wanted == "last":
        last = _load_last_seed(config)
        if last is not None:
            return last, f"{SEED_OPTION}=last"
        return random.SystemRandom().randint(0, SEED_MAX), "no previous seed found, drew a fresh one"
    return random.SystemRandom().randint(0, SEED_MAX), "random"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_DOC)
    seed, note = _resolve_seed(config)
    config.stash[_SEED_KEY] = seed
    config.stash[_SEED_NOTE_KEY] = note


def _used_seed(config: pytest.Config) -> int:
    """The session seed, remembered for ``--faultlab-seed=last`` the first time a test uses faultlab."""
    seed = config.stash[_SEED_KEY]
    if not config.stash.get(_STORED_KEY, False):
        config.stash[_STORED_KEY] = True
        _store_seed(config, seed)
    return seed


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist: every worker uses the controller's seed."""
    node.workerinput["faultlab_seed"] = node.config.stash[_SEED_KEY]


def session_seed(config: pytest.Config) -> int:
    """The seed of this pytest session."""
    return config.stash[_SEED_KEY]


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.stash[_SEED_KEY]
    return f"faultlab: seed={seed} ({config.stash[_SEED_NOTE_KEY]}; rerun with {SEED_OPTION}={seed})"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """A failed test that used faultlab names its fault, seed, strikes and victims, and how to rerun it."""
    report = yield
    uses = _FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("kvfault")
    if report.failed and uses:
        report.sections.append(("faultlab", failure_note(item)))
    return report


def failure_note(item: pytest.Item) -> str:
    """The ``faultlab`` report section of a failed test."""
    seed = item.config.stash[_SEED_KEY]
    lines = []
    fault = item.stash.get(_FAULT_KEY, None)
    if fault is not None:
        lines.append(f"fault={fault.name} seed={fault.seed} trigger={fault.trigger} count={fault.count}")
        lines.append(f"strikes={fault.injected or 'none'}")
    for run in item.stash.get(_RUNS_KEY, []):
        lines.append(f"chaos_runner: fault={run.fault} seed={run.seed} tracker={run.tracker} "
                     f"injected={run.injected} victims={run.victims} victims_aborted={run.victims_aborted} "
                     f"false_positives={run.false_positives} corrupted_tokens_returned="
                     f"{run.corrupted_tokens_returned} nonvictim_mismatches={run.nonvictim_mismatches}")
    lines.append(f"seed={seed}; reproduce with: pytest {item.nodeid!r} {SEED_OPTION}={seed}")
    return "\n".join(lines)


# -- the kvfault marker (faultlab/testing/marker.py) ----------------------------------------------
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Validate a kvfault marker before the test runs, whether or not it uses the fixtures."""
    if item.get_closest_marker("kvfault") is not None:
        marker_fault(item, _used_seed(item.config))


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture
def faultlab_seed(request: pytest.FixtureRequest) -> int:
    """This session's seed (``--faultlab-seed``)."""
    return _used_seed(request.config)


@pytest.fixture
def kv_tracker():
    """A fresh TagTracker (mode=check) with its own CollectorRegistry (no cross-test counter bleed)."""
    from faultlab.chaos.runner import checking_tracker

    return checking_tracker()


@pytest.fixture
def kvfault(request: pytest.FixtureRequest, faultlab_seed: int):
    """The test's ``@pytest.mark.kvfault`` as a :class:`KVFault` (None when the test has no marker).

    At teardown, a marked test whose engines got injectors but saw no strike fails
    (``require_strike=False`` allows it).
    """
    fault = marker_fault(request.node, faultlab_seed)
    if fault is not None:
        request.node.stash[_FAULT_KEY] = fault
    yield fault
    if fault is not None and fault.require_strike and fault.injectors and not fault.injected:
        pytest.fail(f"kvfault {fault.name!r} never struck (seed={fault.seed}, trigger={fault.trigger}): the "
                    f"test tested nothing; give the engine work past the trigger, or require_strike=False",
                    pytrace=False)


def _tracker_for(tracker):
    """``True``: a checking tracker; ``False``/``None``: the no-op one; else the tracker instance given."""
    from faultlab.chaos.runner import checking_tracker

    if tracker is True or tracker is False or tracker is None:
        return checking_tracker(on=bool(tracker))
    return tracker


def build_engine(model: str = "tiny", tracker=True, observers=(), **overrides):
    """An Engine for ``model`` with a TagTracker (``tracker=True``), a NoopTracker (False) or the
    given tracker; ``overrides`` are EngineConfig fields."""
    from faultlab.engine.options import EngineConfig
    from faultlab.engine.factory import make_engine

    return make_engine(EngineConfig(model=model, **overrides), tracker=_tracker_for(tracker),
                       observers=list(observers))


@pytest.fixture
def kv_engine(kvfault: KVFault | None):
    """Factory: ``kv_engine(model="tiny", tracker=True, inject=True, observers=(), **overrides)``.

    Returns an Engine with a TagTracker (``tracker=True``), a NoopTracker (``False``) or the tracker
    given. Under ``@pytest.mark.kvfault`` each engine gets a fresh Injector for that fault (first among
    its observers) unless ``inject=False``; the strikes are in ``kvfault.injected``. ``"smollm2"`` builds
    the real model engine (skipped when its GGUF package is not installed).
    """
    def make(model: str = "tiny", tracker=True, inject: bool = True, observers=(), **overrides):
        from faultlab.engine.options import EngineConfig

        observers = list(observers)
        if inject and kvfault is not None:
            require_hostable(kvfault.name, EngineConfig(model=model, **overrides))
            observers.insert(0, kvfault.injector())
        if model == "smollm2":
            _require_smollm2()
        return build_engine(model, tracker, observers, **overrides)

    return make


def _require_smollm2() -> None:
    from faultlab.engine.gguf_loader import gguf_path

    try:
        gguf_path()
    except ValueError as err:
        pytest.skip(f"smollm2 is not available: {err}")


@pytest.fixture
def kv_injector(faultlab_seed: int):
    """Factory: ``kv_injector(fault, trigger="step", seed=None, count=1, step=3, event=..., p=...)``.

    Returns an Injector (seed defaults to the session seed); pass it to ``kv_engine(observers=[...])``.
    An unknown fault name raises ``UnknownFault`` listing the valid names; a bad seed, count or trigger
    raises ValueError naming it.
    """
    def make(fault: str, trigger="step", seed: int | None = None, count: int = 1, **trigger_kwargs):
        from faultlab.faults.injector import Injector

        seed = faultlab_seed if seed is None else check_seed(seed)
        return Injector(fault, make_trigger(trigger, **trigger_kwargs), check_count(count), seed)

    return make


_FROM_MARKER = object()


def load_scenario(scenario):
    """A Scenario from a Scenario, a TOML path, or a dict (parsed like a TOML file)."""
    from faultlab.chaos import scenario as sc

    if isinstance(scenario, sc.Scenario):
        return scenario
    if isinstance(scenario, dict):
        return sc.parse({"name": "pytest", **scenario})
    return sc.load(scenario)


@pytest.fixture
def chaos_runner(request: pytest.FixtureRequest, faultlab_seed: int, kvfault: KVFault | None):
    """Factory: ``chaos_runner(scenario, fault=<marker>, seed=None, tracker=True, baseline=False,
    trigger=None, count=None, require_strike=None)`` -> CaseResult.

    ``scenario`` is a Scenario, a TOML path or a dict. ``fault`` defaults to the test's kvfault marker
    (with its seed, trigger and count), else no fault. ``seed`` defaults to the marker's seed, else the
    session's. ``baseline=True`` first runs the fault-free case of the same seed, so non-victims' outputs
    are compared token for token (``nonvictim_mismatches``). A fault that never strikes fails the test
    (``require_strike``: default the marker's, else True).
    """
    runs = request.node.stash.setdefault(_RUNS_KEY, [])

    def run(scenario, fault=_FROM_MARKER, seed: int | None = None, tracker: bool = True,
            baseline: bool = False, trigger=None, count: int | None = None, require_strike: bool | None = None):
        from faultlab.chaos.runner import run_case
        from faultlab.chaos.scenario import check_classes

        scenario = load_scenario(scenario)
        if fault is _FROM_MARKER:
            fault = kvfault.name if kvfault is not None else None
            if kvfault is not None:
                trigger, count = trigger or kvfault.trigger, count or kvfault.count
                seed = kvfault.seed if seed is None else seed
        seed = faultlab_seed if seed is None else seed
        if require_strike is None:
            require_strike = kvfault.require_strike if kvfault is not None else True
        if fault is not None:
            check_classes([fault], scenario.engine, where="chaos_runner fault")  # unknown/unhostable: error
        if isinstance(trigger, str):
            trigger = make_trigger(trigger)
        base = run_case(scenario, None, seed, tracker) if baseline else None
        result = run_case(scenario, fault, seed, tracker, baseline=base, trigger=trigger, count=count)
        runs.append(result)
        if fault is not None and require_strike and not result.injected:
            pytest.fail(f"chaos_runner: fault {fault!r} never struck (seed={seed}); the run tested nothing "
                        f"(require_strike=False allows it)", pytrace=False)
        return result

    return run
