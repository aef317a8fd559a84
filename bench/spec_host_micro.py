"""kvguard's host work per speculative verify step (EAGLE chain 3/1/4), hook by hook, on SGLang's rig: CPU or GPU.

The spec path as a server runs it (kvguard.sglang.spec), without the model: real SGLang 0.5.23 pools, tree,
requests and ScheduleBatch (faultlab.sglang_live.rig, on ``--device``), the reserve SGLang's
``eagle_prepare_for_decode`` computes (``page_aligned_decode_alloc_lens``, a reserve of 8 per step; the lengths
made as SGLang makes them: host int32, copied to the device non-blocking), SGLang's own ``alloc_for_spec_decode``,
and each of kvguard's per-step hooks called the way SGLang's HookRegistry calls it, timed by the ``kvguard_bench``
profiler's own timer (an AROUND hook is charged only its own time). Each step accepts 1-4 tokens per request at
random (what verify commits). The model's forwards are the one thing not run.

    python bench/spec_host_micro.py [--device cuda] [--batch 1,64] [--steps 1000] [--page-size 16] [--repeat 3]
                                    [--thrash MB] [--inner]

Prints µs per step (median and p99) for each hook and their sum, the reserve hook split by whether the step
allocated, the lowest of ``--repeat`` runs; ``--inner``: the profiler's inner timers too (µs per call, mean; they
add ~1 µs to each hook they are in). A live server's figures (``python -m faultlab.sglang_gpu overhead``) are the
ones that count: this loop keeps kvguard's working set warm between its hooks unless ``--thrash`` walks a buffer.
"""
from __future__ import annotations

import os
import random
import sys
import time
import types

from kvguard_host_micro import (_pct, batch_sizes, between_hooks, init_one_rank, parser, sglang_original, step_hooks,
                                table)  # (bench/, beside this script)

RESERVE = 8  # SGLang's get_alloc_reserve_per_decode() for 3 steps, top-k 1, 4 draft tokens: 2 x 4


_PROF: list = []


def _profiler():
    """The profiler of this process, its per-function counts cleared: kvguard's allocation wrapper, its entries, its
    wait (not charged) and, with --inner, the inner timers, wrapped once (a second wrap would time them twice)."""
    from faultlab.sglang_gpu import profiler, timers

    if not _PROF:
        prof = profiler._Prof(os.devnull)
        timers._time_alloc_wrappers(prof)
        timers._time_methods(prof)
        _PROF.append(prof)
    _PROF[0].per_fn.clear()
    return _PROF[0]


def run(batch_size: int, steps: int, page_size: int, device: str, thrash_mb: int = 0, seed: int = 0) -> dict:
    import torch
    from sglang.srt.mem_cache import allocation
    from sglang.srt.mem_cache.allocation_sizing import page_aligned_decode_alloc_lens
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from faultlab.sglang_live.rig import Rig, apply_check_hooks
    from kvguard.sglang import spec

    init_one_rank()
    apply_check_hooks()
    spec._REFUSAL[:] = [None]  # this process's spec configuration: checked (EAGLE 3/1/4)
    context = 64 + 4 * steps + 2 * page_size + 2 * RESERVE
    prof = _profiler()
    rig = Rig(page_size, num_tokens=(batch_size + 1) * context + 4 * page_size, rows=batch_size + 2,
              context=context, device=device)
    guard = rig.install()
    guard.warm_up()
    batch = rig.to_decode(*[rig.prefill(48 + i * 7 % page_size) for i in range(batch_size)])
    batch.forward_mode = ForwardMode.DECODE
    cuda = device.startswith("cuda")
    worker = types.SimpleNamespace()
    scheduler = types.SimpleNamespace(tree_cache=rig.tree, output_streamer=types.SimpleNamespace(stream_output=None))
    alloc_original = sglang_original(allocation.alloc_for_spec_decode)
    timed = step_hooks(prof, alloc_for_spec_decode=spec.around_alloc_for_spec_decode,
                       spec_forward=spec.around_spec_forward)
    names = list(timed) + ["PoolFollower.alloc_wrapper"]
    per_step = {n: [] for n in names}
    allocated: list[bool] = []
    noop = between_hooks(thrash_mb)
    rng = random.Random(seed)
    inner_start = None
    for step in range(steps):
        if step == steps // 10:
            inner_start = {k: list(v) for k, v in prof.per_fn.items()}
        before = {n: prof.per_fn.get(n, [0, 0.0])[1] for n in names}
        timed["reqs_finishing_inflight"](noop, scheduler, batch)
        cur, nxt, needed = page_aligned_decode_alloc_lens(batch.reqs, reserve=RESERVE, page_size=page_size)
        cur_cpu = torch.tensor(cur, dtype=torch.int32)
        nxt_cpu = torch.tensor(nxt, dtype=torch.int32)
        noop()
        timed["alloc_for_spec_decode"](alloc_original, rig.tree, rig.req_to_token_pool, reqs=batch.reqs,
                                       req_pool_indices=batch.req_pool_indices,
                                       cur_kv_lens=cur_cpu.to(device, non_blocking=True), cur_kv_lens_cpu=cur_cpu,
                                       nxt_kv_lens=nxt_cpu.to(device, non_blocking=True), nxt_kv_lens_cpu=nxt_cpu,
                                       num_needed_tokens=needed, batch=batch)
        allocated.append(needed > 0)
        noop()
        timed["spec_forward"](noop, worker, batch)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        result = types.SimpleNamespace(copy_done=done, next_token_ids=torch.zeros(len(batch.reqs), dtype=torch.int64))
        noop()
        timed["process_batch_result_decode"](noop, scheduler, batch, result)
        noop()
        timed["empty_hook"](noop, scheduler, batch, result)
        accepted = [rng.randint(1, 4) for _ in batch.reqs]  # what verify commits
        for req, n in zip(batch.reqs, accepted):
            req.kv.kv_committed_len += n
            req.output_ids.extend([7] * n)
        add = torch.tensor(accepted, dtype=batch.seq_lens_cpu.dtype)
        batch.seq_lens_cpu = batch.seq_lens_cpu + add
        batch.seq_lens = batch.seq_lens + add.to(batch.seq_lens.device)
        for n in names:
            per_step[n].append(prof.per_fn.get(n, [0, 0.0])[1] - before[n])
    if cuda:
        torch.cuda.synchronize()
    warm = steps // 10  # the first steps build the batch's cached rows and bound launch
    out = {n: (1e6 * _pct(v[warm:], 50), 1e6 * _pct(v[warm:], 99)) for n, v in per_step.items()}
    for label, want in (("alloc_for_spec_decode[allocating]", True), ("alloc_for_spec_decode[not]", False)):
        xs = [x for x, a in zip(per_step["alloc_for_spec_decode"][warm:], allocated[warm:]) if a == want]
        out[label] = (1e6 * _pct(xs, 50), 1e6 * _pct(xs, 99))
    totals = [sum(per_step[n][i] for n in names if n != "empty_hook") for i in range(warm, steps)]
    out["sum"] = (1e6 * _pct(totals, 50), 1e6 * _pct(totals, 99))
    out["steps allocating (%)"] = (100.0 * sum(allocated[warm:]) / max(1, steps - warm), float("nan"))
    for k, (c, t) in sorted(prof.per_fn.items()):
        if k.startswith("inner:"):
            c0, t0 = inner_start.get(k, [0, 0.0]) if inner_start else (0, 0.0)
            if c - c0:
                out[f"{k} (mean/call, calls/step)"] = (1e6 * (t - t0) / (c - c0), (c - c0) / (steps - warm))
    return out


def main(argv=None) -> int:
    p = parser(steps=1000)
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    p.add_argument("--inner", action="store_true", help="the profiler's inner timers too (KVGUARD_BENCH_INNER=1)")
    a = p.parse_args(argv)
    sizes = batch_sizes(a, "spec_host_micro")
    if sizes is None:
        return 2
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if a.inner:
        os.environ["KVGUARD_BENCH_INNER"] = "1"
    table(sizes, lambda b: [run(b, a.steps, a.page_size, a.device, a.thrash, seed=i) for i in range(a.repeat)], 58)
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
