"""The profiler's own share of the host time it charges kvguard: measured once per scheduler process.

Every timed call (:meth:`faultlab.sglang_gpu.profiler._Prof.timed`) reads the clock and keeps its books inside the
interval it charges, so a hook's charged time holds a little of the profiler too. :func:`calibrate` measures that
share per kind of timed call; the profiler sums it per decode iteration, and reports each iteration's host time
both as charged and less that sum ("net").

Stdlib only: imported by the profiler in every scheduler process.
"""
from __future__ import annotations

import math
import time


def calibrate(prof, calls: int = 2000, rounds: int = 5) -> dict:
    """The profiler's own seconds per timed call, by kind: a hook that only calls SGLang's code (``around``) or
    returns (``plain``), timed as every hook is, less the same hook called bare; each of the two the lowest of
    ``rounds`` rounds of ``calls`` (a shared host's noise only adds, to either: the lowest of their differences
    would take a round whose bare loop was slowed and err low, to 0). Sets ``prof.bias``; leaves no count behind.

    Measured warm, in a loop: inside a real step the profiler's code runs colder, so the net figures err high
    (they keep some of the profiler's time), never low."""
    def around_hook(original, *a, **k):
        return original(*a, **k)

    def plain_hook(*a, **k):
        return None

    def original(*a, **k):
        return None

    out = {}
    for kind, hook, args in (("around", around_hook, (original, 1)), ("plain", plain_hook, (1,))):
        timed = prof.timed("calibrate", hook, around=kind == "around")
        bare = charged = math.inf
        for _ in range(rounds):
            prof.per_fn.pop("calibrate", None)
            t = time.perf_counter()
            for _ in range(calls):
                hook(*args)
            bare = min(bare, (time.perf_counter() - t) / calls)
            for _ in range(calls):
                timed(*args)
            charged = min(charged, prof.per_fn["calibrate"][1] / calls)
        out[kind] = max(0.0, charged - bare)
    prof.per_fn.pop("calibrate", None)
    prof.acc = prof.bias_acc = 0.0
    prof.bias = out
    return out
