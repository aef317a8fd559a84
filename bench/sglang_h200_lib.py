"""Helpers for bench/sglang_h200.py: engine worker processes, the streamed workload, statistics, and a
host-time profiler for kvguard's hooks (an SGLang plugin of its own, loaded by SGLang's loader).

Why one worker process per engine (each holding one in-process ``sglang.Engine``), not several Engines
in the harness process: ``Engine.shutdown()`` kills *every* child of the calling process
(``kill_process_tree(os.getpid(), include_parent=False)``), SGLang keeps per-process globals (server
args, plugin loading happens once per process), and kvguard is switched by ``KVGUARD_MODE``, read by
SGLang's plugin loader in the scheduler process that the Engine spawns. A worker per engine gives each
engine its own environment and its own clean shutdown, while all engines stay alive at once so the
off / check / off runs can be interleaved on one GPU (only one engine runs a workload at a time).

Nothing here imports SGLang at module level: the scheduler process imports this module through the
``kvguard_bench`` entry point only to run :func:`register_timing`.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time
import traceback

PLUGIN_GROUP = "sglang.srt.plugins"
TIMING_ENV = "KVGUARD_BENCH_TIMING"  # path of the JSON file the profiler rewrites as it goes


# ------------------------------------------------------------------------------------------------
# Entry points: SGLang finds plugins through installed distributions (importlib.metadata)
# ------------------------------------------------------------------------------------------------
def project_plugin_entry_points(pyproject: str) -> dict[str, str]:
    """The project's own ``sglang.srt.plugins`` entry points, read from pyproject.toml (written once)."""
    import tomllib

    with open(pyproject, "rb") as f:
        data = tomllib.load(f)
    return dict(data["project"]["entry-points"][PLUGIN_GROUP])


def write_dist_info(folder: str, dist: str, entry_points: dict[str, str], version: str = "0.1.0") -> str:
    """A minimal ``<dist>-<version>.dist-info`` under ``folder`` declaring ``entry_points``."""
    d = os.path.join(folder, f"{dist}-{version}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        f.write(f"[{PLUGIN_GROUP}]\n")
        for name, value in entry_points.items():
            f.write(f"{name} = {value}\n")
    return d


# ------------------------------------------------------------------------------------------------
# The worker: one sglang.Engine in its own process, driven over a Pipe
# ------------------------------------------------------------------------------------------------
def worker_main(conn, env: dict, engine_kwargs: dict) -> None:
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        import sglang

        t0 = time.perf_counter()
        engine = sglang.Engine(**engine_kwargs)
        start_s = time.perf_counter() - t0
        conn.send(("ready", {"start_s": start_s, **server_info(engine)}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "run":
                conn.send(("ok", run_workload(engine, **arg)))
            elif cmd == "info":
                conn.send(("ok", server_info(engine)))
            elif cmd == "stop":
                engine.shutdown()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def server_info(engine) -> dict:
    info = engine.get_server_info()
    keep = ("max_total_num_tokens", "max_req_input_len", "kv_cache_dtype", "page_size", "tp_size",
            "quantization", "attention_backend", "mem_fraction_static", "version", "disable_cuda_graph")
    out = {k: info.get(k) for k in keep if k in info}
    states = info.get("internal_states") or []
    if states and isinstance(states[0], dict):
        keep_state = ("last_gen_throughput", "decode_cuda_graph_memory_gb", "max_running_requests",
                      "chunked_prefill_size", "effective_max_running_requests_per_dp", "max_total_tokens")
        out["internal_state"] = {k: states[0][k] for k in keep_state if k in states[0]}
    return out


class Worker:
    """Harness-side handle of one engine worker."""

    def __init__(self, name: str, env: dict, engine_kwargs: dict):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, env, engine_kwargs), name=f"engine-{name}")
        self.proc.start()
        self.info = None

    def wait_ready(self, timeout: float) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine {self.name} did not start within {timeout:.0f} s")
        status, payload = self.conn.recv()
        if status != "ready":
            raise RuntimeError(f"engine {self.name} failed to start:\n{payload}")
        self.info = payload
        return payload

    def call(self, cmd: str, arg=None, timeout: float = 600):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine {self.name}: {cmd} took over {timeout:.0f} s")
        status, payload = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {self.name}: {cmd} failed:\n{payload}")
        return payload

    def run(self, **workload) -> dict:
        return self.call("run", workload, timeout=workload.get("timeout", 600))

    def stop(self, timeout: float = 90, graceful: bool = True) -> None:
        try:
            if graceful and self.proc.is_alive() and self.info is not None:
                self.call("stop", timeout=timeout)
        except Exception as e:  # noqa: BLE001 - report and make sure the process goes
            print(f"[{self.name}] stop: {e}", file=sys.stderr)
        self.proc.join(10 if graceful and self.info is not None else 0.1)
        kill_tree(self.proc.pid)
        self.proc.join(5)


def kill_tree(pid: int) -> None:
    """Kill a worker and every process below it (the engine's scheduler holds the GPU memory)."""
    try:
        import psutil

        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except Exception:  # noqa: BLE001 - already gone
        return
    for p in procs:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass


# ------------------------------------------------------------------------------------------------
# The workload: n requests submitted at once, streamed, greedy, ignore_eos
# ------------------------------------------------------------------------------------------------
def make_prompts(n: int, input_len: int, seed: int, vocab: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab - 100) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(100, vocab - 100) for _ in range(input_len - shared_prefix)]
            for _ in range(n)]


def run_workload(engine, *, n: int, input_len: int, output_len: int, seed: int, vocab: int,
                 tag: str = "r", shared_prefix: int = 0, keep_ids: bool = False, timeout: float = 600) -> dict:
    """Submit ``n`` requests at once and stream them; per request: TTFT, chunk gaps, tokens, finish."""
    import asyncio

    prompts = make_prompts(n, input_len, seed, vocab, shared_prefix)
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}

    async def one(i: int, t0: float) -> dict:
        rec = {"rid": f"{tag}-{i}", "gaps": [], "tokens": 0, "ttft": None, "finish": None, "error": None}
        last_t, last_n, ids = None, 0, []
        try:
            gen = await engine.async_generate(input_ids=prompts[i], sampling_params=params, stream=True,
                                              rid=rec["rid"])
            async for chunk in gen:
                now = time.perf_counter()
                meta = chunk.get("meta_info", {})
                ntok = int(meta.get("completion_tokens", last_n))
                out_ids = chunk.get("output_ids")
                if out_ids is not None:
                    ids = list(out_ids) if len(out_ids) >= ntok else ids + list(out_ids)
                if ntok > last_n:
                    if last_t is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["gaps"].append((now - last_t) / (ntok - last_n))
                    last_t, last_n = now, ntok
                fin = meta.get("finish_reason")
                if fin is not None:
                    rec["finish"] = fin if isinstance(fin, dict) else {"type": str(fin)}
        except Exception as e:  # noqa: BLE001 - an error the client sees is a result here
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["end"] = time.perf_counter() - t0
        rec["tokens"] = last_n
        if keep_ids:
            rec["output_ids"] = ids
        return rec

    async def main() -> list[dict]:
        t0 = time.perf_counter()
        return await asyncio.wait_for(asyncio.gather(*(one(i, t0) for i in range(n))), timeout)

    t_wall = time.perf_counter()
    recs = engine.loop.run_until_complete(main())
    wall = time.perf_counter() - t_wall
    return {"n": n, "input_len": input_len, "output_len": output_len, "seed": seed, "wall_s": wall,
            "requests": recs, **summarize(recs, wall)}


# ------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------
def pct(values, q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    v = sorted(values)
    if not v:
        return math.nan
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def median(values) -> float:
    return pct(values, 50)


def summarize(recs: list[dict], wall: float) -> dict:
    gaps = [g for r in recs for g in r["gaps"]]
    ttfts = [r["ttft"] for r in recs if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in recs)
    return {"output_tokens": tokens, "throughput": tokens / wall if wall > 0 else math.nan,
            "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99), "itl_mean": sum(gaps) / len(gaps) if gaps else math.nan,
            "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99), "ttft_max": max(ttfts) if ttfts else math.nan,
            "errors": sum(1 for r in recs if r["error"] or (r["finish"] or {}).get("type") == "abort")}


METRICS = ("throughput", "itl_p50", "itl_p99", "ttft_p99")


def compare(runs: list[dict]) -> dict:
    """Ratios check/off of the per-run medians, and the A/A ratios of the off runs against each other.

    ``runs``: dicts with ``mode`` ('off' | 'check') and the summary metrics, in execution order. The A/A
    ratio splits the off runs into two interleaved halves (runs 1, 3, 5 ... against 0, 2, 4 ...) and
    divides their medians; ``aa_range`` is (max - min) / median over all off runs, per metric.
    """
    off = [r for r in runs if r["mode"] == "off"]
    chk = [r for r in runs if r["mode"] == "check"]
    out = {"n_off": len(off), "n_check": len(chk)}
    for m in METRICS:
        mo, mc = median([r[m] for r in off]), median([r[m] for r in chk])
        out[f"{m}_off"], out[f"{m}_check"] = mo, mc
        out[f"{m}_ratio"] = mc / mo if mo else math.nan
        a, b = [r[m] for r in off[0::2]], [r[m] for r in off[1::2]]
        out[f"aa_{m}_ratio"] = median(b) / median(a) if a and b and median(a) else math.nan
        vals = [r[m] for r in off]
        out[f"aa_{m}_range"] = (max(vals) - min(vals)) / mo if len(vals) > 1 and mo else math.nan
        cv = [r[m] for r in chk]
        out[f"check_{m}_range"] = (max(cv) - min(cv)) / mc if len(cv) > 1 and mc else math.nan
    return out


# ------------------------------------------------------------------------------------------------
# Host-time profiler for kvguard's hooks (entry point ``kvguard_bench``; active only with TIMING_ENV)
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

    def timed(self, name: str, fn, around: bool = False):
        prof = self

        def wrapper(*a, **k):
            if prof.active:
                return fn(*a, **k)
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
            t = time.perf_counter()
            try:
                if around:
                    return fn(call_original, *a[1:], **k)
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t - sub[0]
                prof.active = False
                prof.acc += dt
                rec = prof.per_fn.setdefault(name, [0, 0.0])
                rec[0] += 1
                rec[1] += dt

        wrapper.__wrapped__ = fn
        wrapper.__name__ = getattr(fn, "__name__", name)
        wrapper.__module__ = getattr(fn, "__module__", None)
        return wrapper

    def mark_iteration(self) -> None:
        """One decode iteration (the prepare_for_decode hook). Gaps over 0.5 s (idle) are not counted."""
        now = time.perf_counter()
        idle = self.last_mark is None or now - self.last_mark > 0.5
        if not idle:
            self.iters.append(self.acc)
            self.steps.append(now - self.last_mark)
        else:
            # The engine was idle (between workloads): write the file now, where no request waits on it.
            self.dump()
        self.acc, self.last_mark = 0.0, now
        self.total_iters += 1

    def dump(self) -> None:
        if not self.per_fn:
            return  # a process where kvguard never ran (the worker, the detokenizer): leave the file alone
        it = self.iters
        data = {"iterations": len(it),
                "kvguard_us_per_iter_mean": 1e6 * sum(it) / len(it) if it else None,
                "kvguard_us_per_iter_p50": 1e6 * pct(it, 50) if it else None,
                "kvguard_us_per_iter_p99": 1e6 * pct(it, 99) if it else None,
                "step_ms_p50": 1e3 * pct(self.steps, 50) if self.steps else None,
                "per_function_us_per_call": {k: {"calls": c, "us_per_call": 1e6 * s / c, "total_s": s}
                                             for k, (c, s) in sorted(self.per_fn.items())},
                "pid": os.getpid()}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.path)


_PROF: _Prof | None = None


def register_timing() -> None:
    """SGLang plugin (``kvguard_bench``): time kvguard's hooks and its guard's methods in this process.

    Does nothing unless ``KVGUARD_BENCH_TIMING`` names an output file. Wraps (1) every hook a module of
    ``kvguard`` registers with SGLang's HookRegistry, whichever plugin loads first, and (2) the methods of
    kvguard's guard and tracker classes (reached from the allocator / tree / row-pool wrappers that run
    inside SGLang's own calls). AROUND hooks are charged only their own time, not the original's. Each
    decode iteration is marked at the ``prepare_for_decode`` hook. The timers add ~1 us per iteration.
    """
    global _PROF
    path = os.environ.get(TIMING_ENV)
    if not path or _PROF is not None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    prof = _PROF = _Prof(path)
    import atexit

    atexit.register(prof.dump)

    def wrap_hook(target: str, hook, hook_type):
        name = "hook:" + target.rsplit(".", 1)[-1]
        timed = prof.timed(name, hook, around=(hook_type == HookType.AROUND))
        if target.endswith(".prepare_for_decode"):
            def marked(*a, **k):
                prof.mark_iteration()
                return timed(*a, **k)
            marked.__module__ = timed.__module__
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

    import importlib

    classes = {}
    for module, name in (("kvguard.sglang.guard", "SGLangGuard"), ("kvguard.sglang.plugin", "SGLangGuard"),
                         ("kvguard.tracker", "TagTracker")):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
        if cls is not None:
            classes[id(cls)] = cls
    for cls in classes.values():
        for attr, value in list(vars(cls).items()):
            if callable(value) and not attr.startswith("__") and not isinstance(value, (staticmethod, classmethod, type)):
                setattr(cls, attr, prof.timed(f"{cls.__name__}.{attr}", value))
    print(f"kvguard_bench: timing kvguard's hooks into {path}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# Live-fault helpers for tensor parallelism (same entry point; active only with their variables)
# ------------------------------------------------------------------------------------------------
FAULT_RANK_ENV = "KVGUARD_BENCH_FAULT_RANK"  # only this TP rank runs faultlab's injector hooks
ABORT_LOG_ENV = "KVGUARD_BENCH_ABORT_LOG"  # JSON lines: every rank's kvguard aborts (rank, rid, message)


def _tp_rank() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def register_tp_probes() -> None:
    """Rank-local faults and a per-rank abort log, for the TP runs (no effect without the variables).

    * ``KVGUARD_BENCH_FAULT_RANK=r``: faultlab's injector hooks (module ``faultlab.sglang_live.inject``)
      run only in the scheduler of TP rank ``r``; on the other ranks they pass straight through, so the
      corruption is a divergence of one rank's page table from the others'.
    * ``KVGUARD_BENCH_ABORT_LOG=path``: every call of SGLang's ``prepare_abort`` whose message comes from
      kvguard is appended as a JSON line with the rank, so the run can show that every rank aborted the
      same requests (only rank 0's output reaches the client).
    """
    fault_rank = os.environ.get(FAULT_RANK_ENV)
    abort_log = os.environ.get(ABORT_LOG_ENV)
    if fault_rank not in (None, ""):
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        want = int(fault_rank)

        def gate(hook, hook_type):
            def gated(*a, **k):
                if _tp_rank() == want:
                    return hook(*a, **k)
                if hook_type == HookType.AROUND:
                    return a[0](*a[1:], **k)
                return None
            gated.__module__ = "kvguard_bench_gate"
            return gated

        def is_injector(hook) -> bool:
            return str(getattr(hook, "__module__", "") or "").startswith("faultlab.sglang_live")

        for target, hooks in HookRegistry._hooks.items():
            for i, (ht, h, src) in enumerate(hooks):
                if is_injector(h) and not target.endswith("load_model") and "invariant_checker" not in target:
                    hooks[i] = (ht, gate(h, ht), src)
        original_register = HookRegistry.register.__func__

        def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
            if is_injector(hook) and not target.endswith("load_model") and "invariant_checker" not in target:
                hook = gate(hook, hook_type)
            return original_register(cls, target, hook, hook_type, source=source)

        HookRegistry.register = classmethod(register)
    if abort_log:
        import sglang.srt.disaggregation.utils as du

        original = du.prepare_abort

        def prepare_abort(req, message, *a, **k):
            if "kvguard" in str(message):
                with open(abort_log, "a") as f:
                    f.write(json.dumps({"rank": _tp_rank(), "pid": os.getpid(), "rid": str(req.rid),
                                        "message": str(message)[:300], "time": time.time()}) + "\n")
            return original(req, message, *a, **k)

        du.prepare_abort = prepare_abort


def register_bench() -> None:
    """The ``kvguard_bench`` entry point: the profiler and the TP probes (each off without its variable)."""
    register_timing()
    register_tp_probes()
