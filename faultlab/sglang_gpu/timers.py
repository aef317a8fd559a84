"""What the profiler (:mod:`faultlab.sglang_gpu.profiler`) times besides kvguard's hooks: kvguard's methods that
SGLang's code reaches outside a hook, its waits, the optional inner timers, and the allocator's wrappers.

Stdlib only at import: kvguard is imported inside the functions.
"""
from __future__ import annotations

import os
import time

from faultlab.sglang_gpu.pyprofile import named

# kvguard's methods that only wait, in SGLang's place, for what SGLang waits for next anyway (the forward's
# sampled ids): reported on their own ("sglang_wait"), not as kvguard's host time.
WAITS = {"SGLangGuard.wait_forward"}
# kvguard's methods that SGLang's own code reaches outside a hook, through the wrappers kvguard puts on its pools'
# instances (kvguard.sglang.follow: a release's tag bump, a free's filter, a row's drop, the tree's checkpoint) or
# calls itself (the capture head hook, a PD writer's stamp): timed as calls of their own. Every other method of
# kvguard runs inside a timed hook or alloc wrapper and is counted there; it is not wrapped (a wrapper would add
# the profiler's own call frame to kvguard's time on every step).
ENTRIES = {"TagTracker.on_free", "PoolFollower._filter", "TagTracker.expectation", "PoolFollower.drop",
           "PoolFollower.adopt", "SGLangGuard.capture_head", "PoolFollower.stamp"}
# Parts of the per-step hooks timed inside them ("inner:<name>" in the file, already part of the hook's time),
# only with INNER_ENV=1: each timer adds ~1 us to the hook it is in, so a headline run goes without them.
INNER_ENV = "KVGUARD_BENCH_INNER"
INNER = {"SGLangGuard.launch", "PoolFollower.batch_rows", "PoolFollower.stale_flags",
         "TagTracker.count_check", "SGLangGuard.resolve", "PoolFollower.record_decode", "SGLangGuard.stale_aborts",
         "BoundCheck.__call__", "VerdictRing.next", "VerdictRing.agree", "SGLangGuard.fire", "SGLangGuard._arm",
         # the spec step's parts (kvguard.sglang.spec's module functions: looked up there on every call)
         "spec._allocated", "spec.record_reserve", "spec.record", "spec.arm", "spec.fire", "TagTracker.record_reserve",
         "PoolFollower.flush_alloc", "VerdictRing.record_event", "DirectLaunch.run", "DirectLaunch.__call__",
         "SGLangGuard.bound"}
# where INNER's, ENTRIES' and WAITS' names are defined: a class (its method wrapped where the class or a part of it
# defines it) or a module (its function replaced in the module)
CLASSES = {"SGLangGuard": "kvguard.sglang.guard", "VerdictRing": "kvguard.sglang.verdict_ring",
           "PoolFollower": "kvguard.sglang.follow", "TagTracker": "kvguard.tracker",
           "BoundCheck": "kvguard.kernels.tag_check", "DirectLaunch": "kvguard.kernels.launch"}
MODULES = {"spec": "kvguard.sglang.spec"}

def _inner_on() -> bool:
    return os.environ.get(INNER_ENV, "0") not in ("", "0")


def _time_alloc_wrappers(prof) -> None:
    """Time kvguard's wrapper on the allocator's alloc calls (SGLang's code calls it, not a hook): its own time is
    kvguard's, the allocation it wraps is not."""
    from kvguard.sglang.follow import PoolFollower

    make = getattr(PoolFollower._alloc_wrapper, "__wrapped__", PoolFollower._alloc_wrapper)
    name = "PoolFollower.alloc_wrapper"

    def _alloc_wrapper(self, original):
        inside = [0.0]  # seconds in SGLang's allocation so far (not kvguard's)

        def allocation(*a, **k):
            prof.active = False  # kvguard code it reaches (an eviction's release) is timed on its own
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                inside[0] += time.perf_counter() - t
                prof.active = True

        inner = make(self, allocation)

        def alloc_wrapper(*a, **k):
            if prof.active:  # inside kvguard's own timed code: counted there
                return inner(*a, **k)
            before = inside[0]
            prof.active = True
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                prof.active = False
                prof.charge(name, time.perf_counter() - t - (inside[0] - before), "around")

        alloc_wrapper.__wrapped__ = original
        return alloc_wrapper

    PoolFollower._alloc_wrapper = named(_alloc_wrapper, make, "_alloc_wrapper")


def _time_methods(prof) -> list[str]:
    """Wrap the methods of kvguard named in ENTRIES and WAITS (INNER too, with INNER_ENV): the names wrapped.
    Raises for a name that is not a method of its class (a renamed method is never left untimed)."""
    import importlib

    wrap = ENTRIES | WAITS | (INNER if _inner_on() else set())
    done = []
    for name in sorted(wrap):
        owner_name, attr = name.split(".")
        if owner_name in MODULES:
            owner = importlib.import_module(MODULES[owner_name])
            value = getattr(owner, attr, None)
            if not callable(value):
                raise AttributeError(f"kvguard_bench: {name} is not a function of {owner.__name__}")
        else:
            cls = getattr(importlib.import_module(CLASSES[owner_name]), owner_name)
            # wrapped where it is defined: the class, or a part it is made of (e.g. SGLangGuard.resolve:
            # kvguard.sglang.verdicts.VerdictSide, PoolFollower._filter: kvguard.sglang.release.ReleaseSide)
            owner = next((c for c in cls.__mro__ if attr in vars(c)), cls)
            value = owner.__dict__.get(attr)
            if not callable(value) or isinstance(value, (staticmethod, classmethod, type)):
                raise AttributeError(f"kvguard_bench: {name} is not a method of {owner_name}")
        setattr(owner, attr, prof.timed(name, value))
        done.append(name)
    return done
