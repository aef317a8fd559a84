"""kvguard's steady-state host work per decode step, hook by hook, on the CPU (a developer's loop, no GPU).

The decode graph path as a GPU server runs it (kvguard.sglang.batches, .graphs), without the model: real SGLang 0.5.23
pools, tree, requests and ScheduleBatch (faultlab.sglang_live.rig), SGLang's own decode allocation, and each
of kvguard's per-step hooks called the way SGLang's HookRegistry calls it. Each hook is timed by the
``kvguard_bench`` profiler's own timer (faultlab.sglang_gpu.profiler: an AROUND hook is charged only its own
time). The captured check's replay is the one thing not run (there is no graph on the CPU): its result cell is
written as the device writes it, so the verdict read takes its steady-state branch.

    python bench/kvguard_host_micro.py [--batch 1,64] [--steps 2000] [--page-size 16] [--repeat 3] [--stagger] [--thrash MB]

Prints µs per step (median over steps, and p99) for each hook and their sum, the lowest of ``--repeat`` runs
(a shared CPU's noise only ever adds time). The H200 figures
(``python -m faultlab.sglang_gpu overhead``) are the ones that count: this host is not that one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def _empty_hook(original, *args, **kwargs):
    return original(*args, **kwargs)


def init_one_rank() -> None:
    """One intra-op thread (steadier figures), and torch.distributed as one rank: SGLang initialises it in every
    scheduler, one rank included, and kvguard's hooks look the attention-TP group up once
    (kvguard.sglang.runtime._attn_tp), as on a server, not on every step."""
    import torch

    torch.set_num_threads(1)
    if not torch.distributed.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def between_hooks(thrash_mb: int = 0):
    """SGLang's own code between two hooks: not timed, not kvguard's. With ``thrash_mb`` it walks a buffer of that
    many MB (every cache line), as SGLang's own work between kvguard's hooks evicts kvguard's working set on a
    server; else nothing."""
    if not thrash_mb:
        return lambda *a, **k: None
    import numpy as np

    buf = np.zeros(thrash_mb * 2**20 // 8)

    def walk(*a, **k):
        buf[::8] += 1.0

    return walk


def sglang_original(fn):
    """SGLang's own function under the hooks HookRegistry put on it (what a hook's ``original`` is)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def step_hooks(prof, **hooks) -> dict:
    """kvguard's per-step AROUND hooks, each timed by ``prof`` as the profiler times it on a server: the stale-row
    abort before the step (kvguard.sglang.stale), ``hooks`` (name: hook) in order, the verdict's read, and the floor
    (an AROUND hook that only calls SGLang's code, timed the same way: the profiler's own share and a hook's call, as
    cold as the others; not kvguard's, not in the sum)."""
    from kvguard.sglang import batches, stale

    timed = {"reqs_finishing_inflight": prof.timed("reqs_finishing_inflight", stale.around_reqs_finishing_inflight,
                                                   around=True)}
    timed.update({name: prof.timed(name, hook, around=True) for name, hook in hooks.items()})
    timed["process_batch_result_decode"] = prof.timed("process_batch_result_decode",
                                                      batches._around_process_batch_result_decode, around=True)
    timed["empty_hook"] = prof.timed("empty_hook", _empty_hook, around=True)
    return timed


class _Runner:
    """SGLang's decode graph runner as kvguard's replay hook reads it (its model runner's allocator)."""


def run(batch_size: int, steps: int, page_size: int, stagger: bool = False, thrash_mb: int = 0) -> dict:
    import torch
    from sglang.srt.mem_cache import allocation
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from faultlab.sglang_gpu import profiler, timers
    from faultlab.sglang_live.rig import Rig, apply_check_hooks
    from kvguard.sglang import batches, graphs

    init_one_rank()
    apply_check_hooks()
    context = 64 + steps + 2 * page_size
    prof = profiler._Prof(os.devnull)
    timers._time_alloc_wrappers(prof)  # before install: the allocator's wrappers are timed as on the H200
    rig = Rig(page_size, num_tokens=(batch_size + 1) * context + 4 * page_size, rows=batch_size + 2,
              context=context)
    guard = rig.install()
    guard.warm_up()
    # prefilled, one checked decode step: one length (every request starts a page on the same step), or staggered
    # lengths (requests start pages on different steps, as requests that arrived at different times do)
    batch = rig.running(*[48 + (i * 7 % page_size if stagger else 0) for i in range(batch_size)])
    if guard.enable_graph(batch_size) is None:
        raise SystemExit("the graph check's self-test failed on the CPU")
    runner = _Runner()
    runner.model_runner = types.SimpleNamespace(token_to_kv_pool_allocator=rig.allocator)
    guard.graph_runners = {runner: True}
    guard.defer = True
    scheduler = types.SimpleNamespace(tree_cache=rig.tree, output_streamer=types.SimpleNamespace(stream_output=None))
    processor = scheduler
    alloc_original = sglang_original(allocation.alloc_for_decode)
    timed = step_hooks(prof, alloc_for_decode=batches._around_alloc_for_decode,
                       graph_execute=graphs._around_graph_execute)
    names = list(timed) + ["PoolFollower.alloc_wrapper"]
    per_step = {n: [] for n in names}
    noop = between_hooks(thrash_mb)
    for step in range(steps):
        before = {n: prof.per_fn.get(n, [0, 0.0])[1] for n in names}
        timed["reqs_finishing_inflight"](noop, scheduler, batch)
        batch.forward_mode = ForwardMode.DECODE
        noop()
        batch.out_cache_loc = timed["alloc_for_decode"](alloc_original, batch, 1)
        for req in batch.reqs:
            req.decode_batch_idx += 1
        batch.seq_lens = batch.seq_lens + 1  # what the rest of SGLang's prepare_for_decode does
        batch.seq_lens_cpu = batch.seq_lens_cpu + 1
        batch.orig_seq_lens = batch.orig_seq_lens + 1
        fb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=len(batch.reqs))
        timed["graph_execute"](noop, runner, fb)
        pending = batch.__dict__.get("_kvguard")
        g = guard.graph
        slot = pending.epoch % len(g.words)
        g.words[slot] = 2 * (pending.epoch + 1)  # the result word the captured check's epoch node writes: clean
        result = types.SimpleNamespace(copy_done=None, next_token_ids=torch.zeros(len(batch.reqs), dtype=torch.int64))
        noop()
        timed["process_batch_result_decode"](noop, processor, batch, result)
        noop()
        timed["empty_hook"](noop, processor, batch, result)
        rig.sample(batch)
        for n in names:
            per_step[n].append(prof.per_fn.get(n, [0, 0.0])[1] - before[n])
    warm = steps // 10  # the first steps build the batch's cached rows
    out = {n: (1e6 * _pct(v[warm:], 50), 1e6 * _pct(v[warm:], 99)) for n, v in per_step.items()}
    totals = [sum(per_step[n][i] for n in names if n != "empty_hook") for i in range(warm, steps)]
    out["sum"] = (1e6 * _pct(totals, 50), 1e6 * _pct(totals, 99))
    return out


def main(argv=None) -> int:
    p = parser(steps=2000)
    p.add_argument("--stagger", action="store_true",
                   help="prompt lengths spread over a page (requests start pages on different steps)")
    a = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (the CPU's: no GPU here)
    sizes = batch_sizes(a, "kvguard_host_micro")
    if sizes is None:
        return 2
    table(sizes, lambda b: [run(b, a.steps, a.page_size, a.stagger, a.thrash) for _ in range(a.repeat)], 32)
    return 0


def parser(steps: int) -> argparse.ArgumentParser:
    """The options both micros take (this one's and bench/spec_host_micro.py's)."""
    p = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.split("\n")[0])
    p.add_argument("--batch", default="1,64", help="batch sizes, comma separated")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--thrash", type=int, default=0, metavar="MB",
                   help="walk a buffer of MB megabytes between the hooks (a server's own work evicting kvguard's)")
    return p


def batch_sizes(a, prog: str) -> list[int] | None:
    """The batch sizes of ``--batch``, or None (and the reason on stderr) when an option is out of range."""
    try:
        sizes = [int(x) for x in a.batch.split(",")]
        if not sizes or min(sizes) < 1 or a.steps < 20 or a.page_size < 1 or a.repeat < 1 or a.thrash < 0:
            raise ValueError
    except ValueError:
        print(f"{prog}: --batch must be positive integers, --steps >= 20, --page-size >= 1, --repeat >= 1, "
              f"--thrash >= 0", file=sys.stderr)
        return None
    return sizes


def table(sizes, runs_of, width: int) -> None:
    """Print one row per figure, one column per batch size: the lowest p50 of ``runs_of(size)``'s runs (each a dict
    of figure: (p50, p99); a shared CPU's noise only ever adds time), with its p99."""
    print(f"{'hook':{width}s}" + "".join(f" | batch {b:>4}: p50 / p99 µs" for b in sizes))
    results = []
    for b in sizes:
        runs = runs_of(b)
        results.append({name: min((r[name] for r in runs if name in r), key=lambda v: v[0])
                        for name in dict.fromkeys(k for r in runs for k in r)})
    for name in dict.fromkeys(k for r in results for k in r):
        print(f"{name:{width}s}" + "".join(f" | {r[name][0]:14.1f} / {r[name][1]:7.1f}" if name in r else " | -"
                                           for r in results))


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
