"""kvguard's host time per scheduler iteration: the profiler the ``kvguard_bench`` SGLang plugin installs.

Active only with ``KVGUARD_BENCH_TIMING`` (see :func:`register_timing`); imported by
:mod:`faultlab.sglang_gpu.probes`, the plugin's entry point, in every scheduler process. SGLang is imported
inside the register function only.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

from faultlab.sglang_gpu import interleave
from faultlab.sglang_gpu.bias import calibrate
from faultlab.sglang_gpu.timers import INNER, WAITS, _inner_on, _time_alloc_wrappers, _time_methods
from faultlab.sglang_gpu.pyprofile import cprofiler, named, profiled
from faultlab.sglang_gpu.workload import pct

TIMING_ENV = "KVGUARD_BENCH_TIMING"  # path of the JSON file the profiler rewrites as it goes
# A file holding "on" or "off": with "off" kvguard's SGLang hooks are passed straight to SGLang's own code
# (the in-engine A/B of ``overhead --switch``: one engine instance, kvguard installed and its memory held in
# both modes). Re-read at most every SWITCH_PERIOD_S; the harness flips it only while the engine is idle and
# waits longer than that before the next run, so a run never spans two modes.
SWITCH_ENV = "KVGUARD_BENCH_SWITCH"
SWITCH_PERIOD_S = 0.5
IDLE_S = 0.5  # a gap between decode iterations longer than this is idle: it ends a window (one run)


# ------------------------------------------------------------------------------------------------
# Host-time profiler for kvguard's hooks (active only with TIMING_ENV)
# ------------------------------------------------------------------------------------------------
class _Prof:
    def __init__(self, path: str):
        self.path = path
        self.active = False  # inside a timed kvguard call (nested kvguard calls are not counted twice)
        self.acc = 0.0  # kvguard host seconds since the last decode iteration mark
        self.per_fn: dict[str, list] = {}  # name -> [calls, seconds]
        self.iters: list[float] = []  # kvguard host seconds per decode iteration
        self.steps: list[float] = []  # wall seconds between decode iterations (context)
        self.last_mark = None
        self.total_iters = 0
        self.batch: list[int] = []  # decode batch size per iteration (of the current window)
        self.windows: list[dict] = []  # one summary per busy stretch between idle gaps (one workload run)
        self._window_start = 0  # index into iters where the current window began
        self._fn_start: dict[str, list] = {}  # per_fn at the window's start
        self.wait_total = 0.0  # seconds in WAITS so far (subtracted from the hook that made them)
        self.wait_acc = 0.0  # seconds in WAITS since the last decode iteration mark
        self.waits: list[float] = []  # per decode iteration, beside iters
        # Python's garbage collections that ran inside kvguard's timed code (part of its time, not subtracted:
        # a collection runs where an allocation crosses the threshold, and collects SGLang's objects too)
        self.gc_acc = 0.0
        self.gcs: list[float] = []  # per decode iteration, beside iters
        # The profiler's own seconds inside what it charges, per timed call of each kind (faultlab.sglang_gpu.bias;
        # zero until calibrated), summed per iteration beside iters: host time is reported net of it too
        self.bias, self.bias_acc, self.biases = {"around": 0.0, "plain": 0.0}, 0.0, []
        self._gc_start = None
        self.switch_path = os.environ.get(SWITCH_ENV) or None
        self.cprofile = None  # the cProfile of faultlab.sglang_gpu.pyprofile, if any
        self._switch_on, self._switch_read = True, -1.0
        # overhead --interleave: the check on and off in alternate blocks of decode iterations (interleave.Schedule)
        spec = interleave.parse(os.environ.get(interleave.INTERLEAVE_ENV))
        self.schedule = interleave.Schedule(*spec) if spec else None
        self.labels: list[int] = []  # per decode iteration, beside iters: ON, OFF or SKIP (interleave only)
        self.blocks: list[int] = []  # per decode iteration: its block's number
        self._label = self._block = None  # the current iteration's

    def kvguard_on(self) -> bool:
        """The in-engine switch (SWITCH_ENV): True unless its file says "off" (always True without it)."""
        if self.schedule is not None:
            return self.schedule.mode == interleave.ON
        if self.switch_path is None:
            return True
        now = time.perf_counter()
        if now - self._switch_read > SWITCH_PERIOD_S:
            self._switch_read = now
            try:
                with open(self.switch_path) as f:
                    self._switch_on = f.read().strip() != "off"
            except OSError:
                self._switch_on = True
        return self._switch_on

    def timed(self, name: str, fn, around: bool = False, hook: bool = False, always: bool = False, off=None):
        """``fn`` timed. ``hook``: a kvguard hook the in-engine switch passes by when "off" (``off``, if given, runs
        in its place then, timed as ``<name>:off``); ``always``: one it runs then too, timed (bookkeeping that must
        go on in both modes)."""
        prof = self
        if name in WAITS:
            return self._timed_wait(name, fn)

        inner = name in INNER
        if inner and not _inner_on():
            return fn
        kind = "around" if around else "plain"

        def wrapper(*a, **k):
            if prof.active:
                if not inner:
                    return fn(*a, **k)
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:  # a part of a hook's time, reported beside it (not added again)
                    prof.count("inner:" + name, time.perf_counter() - t)
            run, charged = fn, name
            if hook and not always and not prof.kvguard_on():  # the in-engine "off" mode: SGLang's own code only
                if off is None:
                    return a[0](*a[1:], **k) if around else None
                run, charged = off, name + ":off"  # (its bookkeeping half, counted to the off iteration)
            sub = [0.0]  # seconds spent in SGLang's own code inside an AROUND hook: not kvguard's

            def call_original(*oa, **ok):
                prof.active = False
                t1 = time.perf_counter()
                try:
                    return a[0](*oa, **ok)
                finally:
                    sub[0] += time.perf_counter() - t1
                    prof.active = True

            prof.active = True
            waited = prof.wait_total
            t = time.perf_counter()
            try:
                if around:
                    return run(call_original, *a[1:], **k)
                return run(*a, **k)
            finally:
                prof.active = False
                prof.charge(charged, time.perf_counter() - t - sub[0] - (prof.wait_total - waited), kind)

        return named(wrapper, fn, name)

    def on_gc(self, phase: str, info: dict) -> None:
        """``gc.callbacks``: the time of each collection that started inside kvguard's timed code."""
        if phase == "start":
            self._gc_start = time.perf_counter() if self.active else None
        elif self._gc_start is not None:
            self.gc_acc += time.perf_counter() - self._gc_start
            self._gc_start = None

    def charge(self, name: str, seconds: float, kind: str = "plain") -> None:
        """``seconds`` of kvguard's own host time in ``name``: counted to it and to this decode iteration (with the
        profiler's own share of it, by the timed call's ``kind``: :func:`faultlab.sglang_gpu.bias.calibrate`)."""
        self.acc += seconds
        self.bias_acc += self.bias[kind]
        self.count(name, seconds)

    def count(self, name: str, seconds: float) -> None:
        rec = self.per_fn.setdefault(name, [0, 0.0])
        rec[0] += 1
        rec[1] += seconds

    def _timed_wait(self, name: str, fn):
        """A wait kvguard makes in SGLang's place (WAITS): timed on its own, never counted as kvguard's work."""
        prof = self

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                prof.wait_total += dt
                prof.wait_acc += dt
                prof.count(name, dt)

        return named(wrapper, fn, name)

    def mark_iteration(self, batch_size: int = 0) -> None:
        """One decode iteration (the alloc_for_decode hook). Gaps over IDLE_S (idle) are not counted."""
        now = time.perf_counter()
        idle = self.last_mark is None or now - self.last_mark > IDLE_S
        if not idle:
            if self.schedule is not None:
                self.labels.append(self._label)
                self.blocks.append(self._block)
            self.iters.append(self.acc)
            self.biases.append(self.bias_acc)
            self.waits.append(self.wait_acc)
            self.gcs.append(self.gc_acc)
            self.steps.append(now - self.last_mark)
            self.batch.append(batch_size)
        else:
            # The engine was idle (between workloads): close the window, write the file now, where no
            # request waits on it.
            self._close_window()
            self.dump()
        self.acc, self.wait_acc, self.gc_acc, self.bias_acc, self.last_mark = 0.0, 0.0, 0.0, 0.0, now
        self.total_iters += 1
        if self.schedule is not None:  # the mode of the iteration that starts now
            self._label, self._block = self.schedule.step(), self.schedule.index

    def _close_window(self) -> None:
        it, w0, extra = self.iters[self._window_start:], self._window_start, {}
        net = [x - b for x, b in zip(it, self.biases[w0:])]  # less the profiler's own share (calibrate)
        if self.schedule is not None and it:  # kvguard's host time is the on iterations'; every iteration kept
            (it, net), extra = interleave.window(self.labels[w0:], self.blocks[w0:], self.batch, self.steps[w0:], it,
                                                 net)
        if it:
            fn = {k: [c - self._fn_start.get(k, [0, 0.0])[0], t - self._fn_start.get(k, [0, 0.0])[1]]
                  for k, (c, t) in self.per_fn.items()}
            self.windows.append({
                "iterations": len(it), "batch_p50": pct(self.batch, 50), "batch_max": max(self.batch),
                "kvguard_us_per_iter_p50": 1e6 * pct(it, 50), "kvguard_us_per_iter_p99": 1e6 * pct(it, 99),
                "kvguard_net_us_per_iter_p50": 1e6 * pct(net, 50), "kvguard_net_us_per_iter_p99": 1e6 * pct(net, 99),
                "sglang_wait_us_per_iter_p50": 1e6 * pct(self.waits[self._window_start:], 50),
                "gc_in_kvguard_us_per_iter_mean": 1e6 * sum(self.gcs[self._window_start:]) / len(it),
                "gc_in_kvguard_us_per_iter_p99": 1e6 * pct(self.gcs[self._window_start:], 99),
                "step_ms_p50": 1e3 * pct(self.steps[self._window_start:], 50),
                "per_function_us_per_call": {k: {"calls": c, "us_per_call": 1e6 * t / c}
                                             for k, (c, t) in sorted(fn.items()) if c}, **extra})
        self._window_start = len(self.iters)
        self.batch = []
        self._fn_start = {k: list(v) for k, v in self.per_fn.items()}

    def final(self) -> None:
        """At exit: the last run's window too."""
        self._close_window()
        self.dump()

    def dump(self) -> None:
        if not self.per_fn or not self.total_iters:
            return  # a process that never decoded (the engine's own process, the detokenizer): leave the file alone
        it = self.iters
        data = {"iterations": len(it),
                "kvguard_us_per_iter_mean": 1e6 * sum(it) / len(it) if it else None,
                "kvguard_us_per_iter_p50": 1e6 * pct(it, 50) if it else None,
                "kvguard_us_per_iter_p99": 1e6 * pct(it, 99) if it else None,
                "step_ms_p50": 1e3 * pct(self.steps, 50) if self.steps else None,
                "profiler_bias_us_per_call": {k: 1e6 * v for k, v in self.bias.items()},
                "per_function_us_per_call": {k: {"calls": c, "us_per_call": 1e6 * s / c, "total_s": s}
                                             for k, (c, s) in sorted(self.per_fn.items())},
                "windows": self.windows, "pid": os.getpid(), "guards": _guard_stats()}
        if self.cprofile is not None:
            self.cprofile.write()
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.path)


_PROF: _Prof | None = None


def _guard_stats() -> list:
    """What each guard of this process built: batch compositions seen, bound launches, direct launches, and the
    checks its decode graphs ran (epochs counted since the capture)."""
    try:
        from kvguard.sglang.plugin import guards
    except ImportError:
        return []
    out = []
    for g in guards():
        ring = g._ring
        out.append({"rows_built": g.rows_built, "bindings": ring.bindings if ring else 0,
                    "direct_launches": ring.launch.kernel.direct_launches if ring else 0,
                    "checks": g.tracker.checks_launched, "deferred": g.defer,
                    "graph_epochs": g.graph.host_epoch if g.graph is not None else None,
                    "graph_runners_covered": sum(bool(v) for v in g.graph_runners.values())})
    return out


def register_timing() -> None:
    """SGLang plugin (``kvguard_bench``): time kvguard's hooks and its guard's methods in this process.

    Does nothing unless ``KVGUARD_BENCH_TIMING`` names an output file. Wraps every hook a module of ``kvguard``
    registers with SGLang's HookRegistry (whichever plugin loads first; AROUND hooks charged only their own time),
    the allocator wrappers, and the methods of :data:`ENTRIES` and :data:`WAITS` (:data:`INNER` too with
    ``KVGUARD_BENCH_INNER=1``). Each decode iteration is marked at the ``alloc_for_decode`` hook.
    """
    global _PROF
    path = os.environ.get(TIMING_ENV)
    if not path or _PROF is not None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    prof = _PROF = _Prof(path)
    bias = calibrate(prof)
    import atexit

    atexit.register(prof.final)
    gc.callbacks.append(prof.on_gc)
    profiler = prof.cprofile = cprofiler()

    def wrap_hook(target: str, hook, hook_type):
        name = "hook:" + target.rsplit(".", 1)[-1]
        decode = target.endswith(".alloc_for_decode")  # where a decode step starts (kvguard arms its check there)
        spec = target.endswith(".alloc_for_spec_decode")  # where a spec (verify) step starts
        if profiler is not None and (decode or spec or target.endswith(".forward_batch_generation")):
            hook = profiled(profiler, hook)
        # The replay's epoch count (kvguard.sglang.runners) goes on in the "off" mode: the graphs' captured check
        # runs in both modes (on no rows when nothing is armed), and the host must keep counting it.
        off = None
        if prof.schedule is not None:  # interleave: only the per-step check is off in an off iteration
            always = not target.endswith(interleave.CHECK_HOOKS)
            if decode:  # the allocation's bookkeeping goes on, the check is not armed
                from kvguard.sglang.batches import record_alloc_for_decode as off
        else:
            always = target.endswith("DecodeCudaGraphRunner.execute")
        timed = prof.timed(name, hook, around=(hook_type == HookType.AROUND), hook=True, always=always, off=off)
        if decode or spec:
            def marked(*a, **k):
                if prof.schedule is not None or prof.kvguard_on():  # an "off" run of the switch is not an iteration
                    prof.mark_iteration(len(k["reqs"]) if spec else len(a[1].reqs))  # (original, batch, ...)
                return timed(*a, **k)
            marked.__module__ = timed.__module__
            marked.__wrapped__ = timed  # kvguard's self-check follows the chain to its hook
            return marked
        return timed

    def is_kvguard(hook) -> bool:
        return str(getattr(hook, "__module__", "") or "").startswith("kvguard")

    for target, hooks in HookRegistry._hooks.items():
        for i, (ht, h, src) in enumerate(hooks):
            if is_kvguard(h):
                hooks[i] = (ht, wrap_hook(target, h, ht), src)
    original_register = HookRegistry.register.__func__

    def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
        if is_kvguard(hook):
            hook = wrap_hook(target, hook, hook_type)
        return original_register(cls, target, hook, hook_type, source=source)

    HookRegistry.register = classmethod(register)

    _time_methods(prof)
    _time_alloc_wrappers(prof)
    print(f"kvguard_bench: timing kvguard's hooks into {path} (the profiler's own share per timed call: "
          f"{1e6 * bias['around']:.2f} us around, {1e6 * bias['plain']:.2f} us plain)", file=sys.stderr)
