"""``overhead --interleave B``: kvguard's per-step check on and off in alternate blocks of decode steps, in one run.

Why: two runs of the same mode drift by 1-4% on the H200 with the overlap scheduler off (ITL p50 8.46-9.21 ms
across runs of one engine), which is more than the 0.5% to resolve. Within one run, neighbouring decode steps
share the host's state, the GPU's clocks and the requests' lengths, so steps of the two modes taken in alternate
blocks differ only by the mode.

The schedule (:class:`Schedule`): blocks of ``B`` decode iterations, in pairs whose order (on, off) or (off, on)
is drawn from a seeded generator, so neither mode sits on a fixed phase of the page boundary (a request starts a
page every ``page_size`` steps) or of anything else periodic. The first step of every block is left out (the
overlap scheduler's in-flight batch straddles the switch).

What the "off" steps leave out is kvguard's per-step check: the stale-row test (``_reqs_finishing_inflight``), the
arming of the check (the ``alloc_for_decode`` hook runs only its bookkeeping half,
``kvguard.sglang.batches.record_alloc_for_decode``) and the verdict's read (``process_batch_result_decode``); see
:data:`CHECK_HOOKS`. Everything that keeps kvguard's record of the pages true goes on in both modes, since
requests live across the switch: the allocation records and tag bumps, the extend hooks, the graph replay's epoch
count (its captured check then checks no rows). Its host time is measured in both modes, so the off steps' host
time is what the ratios do not contain.

An "iteration" is the profiler's (:mod:`faultlab.sglang_gpu.profiler`): from one decode step's
``alloc_for_decode`` hook to the next; with every request in the batch decoding, its length is the batch's
inter-token latency, and its inverse the batch's throughput. The first iteration of each run (it holds the run's
start) and of each block are left out.

Stdlib only: imported by the profiler in every scheduler process.
"""
from __future__ import annotations

import math
import random

from faultlab.sglang_gpu.workload import pct

INTERLEAVE_ENV = "KVGUARD_BENCH_INTERLEAVE"  # "B:SEED": block length in decode iterations, schedule seed
# kvguard's hooks an "off" step passes straight to SGLang (the per-step check); all others run in both modes
CHECK_HOOKS = ("Scheduler._reqs_finishing_inflight", ".alloc_for_decode", "process_batch_result_decode")
ON, OFF, SKIP = 1, 0, -1  # an iteration's label: check on, check off, left out (a block's first step)
MIN_BLOCK = 2  # decode iterations per block at least: its first is left out


def parse(text: str | None) -> tuple[int, int] | None:
    """``"B:SEED"`` (or ``"B"``, seed 0) -> (B, SEED); None for no interleave. ValueError names what is wrong."""
    if not text:
        return None
    block, _, seed = text.partition(":")
    b, s = int(block), int(seed or 0)
    if b < MIN_BLOCK:
        raise ValueError(f"{INTERLEAVE_ENV}: a block needs at least {MIN_BLOCK} decode iterations (its first is left "
                         f"out), got {b}")
    return b, s


class Schedule:
    """Which mode each decode iteration runs in: blocks of ``block`` iterations, pairs in a seeded random order."""

    def __init__(self, block: int, seed: int):
        self.block, self._rng = block, random.Random(seed)
        self._pair: list[int] = []
        self._left = 0  # iterations left in the current block
        self.mode = ON
        self.index = -1  # the current block's number (pairs of blocks: 2k and 2k + 1)

    def step(self) -> int:
        """Advance one decode iteration: its label (ON, OFF, or SKIP for a block's first); ``mode`` is its mode."""
        if self._left == 0:
            if not self._pair:
                self._pair = [ON, OFF] if self._rng.random() < 0.5 else [OFF, ON]
            self.mode, self._left = self._pair.pop(0), self.block - 1
            self.index += 1
            return SKIP
        self._left -= 1
        return self.mode


def window(labels: list, blocks: list, batch: list, steps: list, host_s: list, net_s: list) -> tuple[tuple, dict]:
    """One run's iterations as the profiler keeps them: ((kvguard's host seconds of its on iterations, the same
    less the profiler's own share), the per-iteration record :func:`compare` reads)."""
    on = [x for x, label in zip(host_s, labels) if label == ON] or [math.nan]
    on_net = [x for x, label in zip(net_s, labels) if label == ON] or [math.nan]
    return (on, on_net), {"interleave": {"labels": labels, "blocks": blocks, "batch": list(batch),
                                         "steps_s": [round(x, 7) for x in steps],
                                         "host_us": [round(1e6 * x, 2) for x in host_s],
                                         "host_net_us": [round(1e6 * x, 2) for x in net_s]}}


def compare(windows: list[dict], concurrency: int) -> dict:
    """Ratios check/off from the labelled iterations of ``windows`` (the profiler's, one per run) at one batch size.

    Iterations whose decode batch is not ``concurrency`` (a run's ramp up and down) are left out. Ratios:
    ITL p50 and p99 of the on steps over the off steps', throughput as the off steps' mean length over the on
    steps'. The A/A splits the off steps by block (alternate off blocks against each other), per metric;
    ``host_*``: kvguard's host time per iteration in each mode (the off steps': what the ratios do not contain);
    ``step_delta_us_*``: the on steps' length less the off steps' (p50 and mean).
    """
    on, off, off_halves, host, net = [], [], ([], []), {ON: [], OFF: []}, {ON: [], OFF: []}
    for w in windows:
        il = w.get("interleave")
        # (host_net_us: from the profiler's calibration on; an earlier file has none, and no net figures)
        rows = zip(*(il.get(k) or [math.nan] * len(il["labels"])
                     for k in ("labels", "blocks", "steps_s", "host_us", "batch", "host_net_us"))) if il else ()
        for i, (label, block, step, us, bs, net_us) in enumerate(rows):
            if bs != concurrency or label == SKIP or i == 0:  # (the first holds the run's start)
                continue
            (on if label == ON else off).append(step)
            if label == OFF:
                off_halves[(block // 2) % 2].append(step)  # each pair of blocks holds one off block: alternate pairs
            host[label].append(us)
            net[label].append(net_us)
    out = {"n_on": len(on), "n_off": len(off)}
    if not on or not off:
        return out
    a, b = off_halves
    out.update({
        "itl_p50_on_ms": 1e3 * pct(on, 50), "itl_p50_off_ms": 1e3 * pct(off, 50),
        # what a step of the on mode costs beyond one of the off mode: kvguard's per-step check, host and GPU,
        # with the cache misses it causes, and the profiler's timers on the three check hooks (~1 us each), which the off mode passes by
        "step_delta_us_p50": 1e6 * (pct(on, 50) - pct(off, 50)),
        "step_delta_us_mean": 1e6 * (sum(on) / len(on) - sum(off) / len(off)),
        "throughput_ratio": (sum(off) / len(off)) / (sum(on) / len(on)),
        "itl_p50_ratio": pct(on, 50) / pct(off, 50), "itl_p99_ratio": pct(on, 99) / pct(off, 99),
        "itl_mean_ratio": (sum(on) / len(on)) / (sum(off) / len(off)),
        "aa_throughput_ratio": (sum(a) / len(a)) / (sum(b) / len(b)) if a and b else math.nan,
        "aa_itl_p50_ratio": pct(b, 50) / pct(a, 50) if a and b else math.nan,
        "aa_itl_p99_ratio": pct(b, 99) / pct(a, 99) if a and b else math.nan,
        "host_us_p50": pct(host[ON], 50), "host_us_p99": pct(host[ON], 99),
        "host_off_us_p50": pct(host[OFF], 50), "host_off_us_p99": pct(host[OFF], 99),
        # the same less the profiler's own share of each timed call (its calibration): NaN for a file without it
        "host_net_us_p50": pct(net[ON], 50), "host_net_us_p99": pct(net[ON], 99),
        "host_off_net_us_p50": pct(net[OFF], 50),
    })
    return out
