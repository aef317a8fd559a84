"""Diagnosis only: cProfile inside kvguard's ``prepare_for_decode`` hook (the ``kvguard_bench`` profiler's option).

With ``KVGUARD_BENCH_CPROFILE`` set to a path, cProfile runs inside every CPROFILE_EVERY-th call of that hook (an
AFTER hook: none of SGLang's own code inside) and its stats (text) are written beside that path. It slows the calls
it profiles: the run's p50 host time still stands, its p99 does not.
"""
from __future__ import annotations

import os

CPROFILE_ENV = "KVGUARD_BENCH_CPROFILE"
CPROFILE_EVERY = 8


def cprofiler():
    """The cProfile of CPROFILE_ENV (None without it); its stats are written at exit."""
    path = os.environ.get(CPROFILE_ENV)
    if not path:
        return None
    import atexit
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()

    def write():
        if not profiler.getstats():
            return
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(60)
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(60)
        with open(f"{path}.{os.getpid()}.txt", "w") as f:
            f.write(out.getvalue())

    atexit.register(write)
    profiler.write = write  # also at each idle gap (the profiler's dump): a killed scheduler keeps its stats
    return profiler


def profiled(profiler, hook):
    calls = [0]

    def wrapper(*a, **k):
        calls[0] += 1
        if calls[0] % CPROFILE_EVERY:
            return hook(*a, **k)
        profiler.enable()
        try:
            return hook(*a, **k)
        finally:
            profiler.disable()

    return named(wrapper, hook, getattr(hook, "__name__", "hook"))


def named(wrapper, fn, name: str):
    """``wrapper`` as ``fn`` to whoever inspects it (kvguard's self-check follows ``__wrapped__``)."""
    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", name)
    wrapper.__module__ = getattr(fn, "__module__", None)
    return wrapper
