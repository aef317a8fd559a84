"""The pytest plugin's ``@pytest.mark.kvfault`` marker: its arguments, checked, as a :class:`KVFault`.

``@pytest.mark.kvfault(name, seed=None, trigger="step", step=3, count=1, event="alloc", p=0.1,
require_strike=True)``: engines built by ``kv_engine`` and runs of ``chaos_runner`` in that test run with
the fault injected (faultlab/testing/pytest_plugin.py holds the hooks and fixtures that read it). Numbers follow
the bounds of ``faultlab.chaos.limits`` (the scenario's and the CLI's), checked by the same ``check_number``.

Light, like the plugin: faultlab's fault modules are imported only when a marker is read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from faultlab.chaos.limits import COUNT_MAX, SEED_MAX, check_number

MARKER_KWARGS = ("name", "seed", "trigger", "step", "count", "event", "p", "require_strike")
MARKER_DOC = ("kvfault(name, seed=None, trigger='step', step=3, count=1, event='alloc', p=0.1, "
              "require_strike=True): engines built by kv_engine and runs of chaos_runner in this test run "
              "with this faultlab fault injected (seed defaults to the session's --faultlab-seed); the test "
              "fails if the fault never strikes")


@dataclass
class KVFault:
    """The fault a ``@pytest.mark.kvfault`` test runs under, and every injector built for it."""

    name: str
    seed: int
    trigger: object  # faultlab.faults.injector.Trigger
    count: int = 1
    require_strike: bool = True
    injectors: list = field(default_factory=list)

    def injector(self):
        """A fresh Injector for this fault (one per engine: injectors keep per-engine state)."""
        from faultlab.faults.injector import Injector

        injector = Injector(self.name, self.trigger, self.count, self.seed)
        self.injectors.append(injector)
        return injector

    @property
    def injected(self) -> list[dict]:
        """Every strike so far, over all engines of the test."""
        return [strike for inj in self.injectors for strike in inj.injected]


def make_trigger(trigger="step", *, step: int = 3, event: str = "alloc", p: float = 0.1):
    """A ``Trigger`` from a mode name (``step`` / ``event`` / ``prob``) or a ready Trigger."""
    from faultlab.faults.injector import Trigger

    if isinstance(trigger, Trigger):
        return trigger
    return Trigger(mode=trigger, step=step, event=event, p=p)


def check_seed(seed) -> int:
    """A fault's seed (ValueError naming it)."""
    return check_number("seed", seed, 0, SEED_MAX)


def check_count(count) -> int:
    """Strikes of one fault (ValueError naming it)."""
    return check_number("count", count, 1, COUNT_MAX)


def marker_fault(item: pytest.Item, default_seed: int) -> KVFault | None:
    """The item's kvfault marker as a KVFault; fails the test (no traceback) for any bad argument."""
    marker = item.get_closest_marker("kvfault")
    if marker is None:
        return None
    from faultlab.faults.catalog import get_fault

    kwargs = dict(marker.kwargs)
    name = marker.args[0] if marker.args else kwargs.pop("name", None)
    if not isinstance(name, str) or len(marker.args) > 1:
        pytest.fail("@pytest.mark.kvfault needs one fault name, then keyword arguments, e.g. "
                    "@pytest.mark.kvfault('double_free', step=2)", pytrace=False)
    try:
        unknown = sorted(set(kwargs) - set(MARKER_KWARGS))
        if unknown:
            raise ValueError(f"unknown argument(s) {unknown}; valid: {list(MARKER_KWARGS[1:])}")
        get_fault(name)
        seed = kwargs.pop("seed", None)
        seed = default_seed if seed is None else check_seed(seed)
        count = check_count(kwargs.pop("count", 1))
        require = kwargs.pop("require_strike", True)
        if not isinstance(require, bool):
            raise ValueError(f"require_strike = {require!r} is not valid; it must be True or False")
        trigger = make_trigger(kwargs.pop("trigger", "step"), **kwargs)
    except (ValueError, TypeError) as err:  # UnknownFault is a ValueError
        problem = str(err)
    else:
        return KVFault(name, seed, trigger, count, require)
    pytest.fail(f"@pytest.mark.kvfault({name!r}): {problem}", pytrace=False)  # outside `except`: no chain


def require_hostable(fault: str, engine_config) -> None:
    """Fail the test when ``engine_config`` cannot host ``fault`` (it would never strike)."""
    from faultlab.faults.catalog import FAULTS
    from faultlab.chaos.scenario import fault_available

    if not fault_available(FAULTS[fault], engine_config):
        pytest.fail(f"kvfault {fault!r} cannot strike in this engine: it needs {FAULTS[fault].requires!r} "
                    f"(see `faultlab faults`)", pytrace=False)
