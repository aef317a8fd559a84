"""kvguard's per-step host path on the GPU, piece by piece: what one decode step costs the scheduler's thread.

Run on the H200 (after ``source bench/sglang_h200_setup.sh``): ``python3 bench/host_path_h200.py --out DIR``.
Prints a table and writes ``DIR/host_path.json``. For each batch size (8192-token rows, page 16, SGLang's
table shape) it times, in microseconds of host time per call (median and p99 of ``--calls`` calls, the GPU
synchronised every 32 calls and that wait left out):

- ``check_before``: the check as the guard launched it up to now (``TagTracker.validate``: the JIT launch,
  a new verdict tensor, a pinned copy of it, an event);
- ``check_now``: the per-step path of a decode batch (``BoundCheck``: the direct launch into the ring's
  buffer with the host flag, no event), and ``check_general`` the same through ``CheckLaunch`` (extend
  batches, attention TP);
- ``record_before`` / ``record_now``: a decode step that starts a page for every request (``on_alloc`` then
  ``record_decode``; now one launch that bumps and records);
- the pieces: an event record, a torch.empty, the lengths' max and sum;

and the GPU time of one check and of one record launch (CUDA events over 200 launches), and of the check as
SGLang's decode graphs carry it (``gpu_graph_check_us``: a CUDA graph holding only
:class:`kvguard.kernels.graph_check.GraphCheck`'s two nodes, replayed 200 times; every replay verified
counted and clean), to set against the 69 us per decode step of the fork's fused mode at TP8.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from kvguard.kernels.graph_check import GraphCheck
from kvguard.kernels.tag_check import BoundCheck, WriteGuard
from kvguard.settings import TrackerConfig
from kvguard.sglang.guard import VerdictRing
from kvguard.tracker import TagTracker


def host_us(fn, calls: int, sync_every: int = 32) -> dict:
    times = []
    for i in range(calls):
        if i % sync_every == 0:
            torch.cuda.synchronize()
        t = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t) / 1e3)
    torch.cuda.synchronize()
    times = times[calls // 10:]  # warm
    return {"p50": float(np.percentile(times, 50)), "p99": float(np.percentile(times, 99)), "n": len(times)}


def gpu_us(fn, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def graph_check_us(table, tracker, rows, seq, slots, ps: int, cap: int, reps: int = 200) -> float:
    """GPU microseconds per replay of a CUDA graph that holds only the captured decode check (on static copies of
    the batch, as SGLang's graph buffers are); checks that every replay ran, was counted and found nothing."""
    g = GraphCheck(table, tracker.tags.tags, tracker.expected, page_div=ps, batch_cap=cap)
    static = rows.clone(), seq.clone(), slots.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and warm up outside the capture, as SGLang's capture does
            g.launch(*static, rows.numel())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.launch(*static, rows.numel())
    g.reset()
    g.set_owner(rows)
    us = gpu_us(graph.replay, reps)
    torch.cuda.synchronize()
    for _ in range(reps + 1):
        epoch = g.next()
    assert int(g.epoch) == reps + 1 and not g.flagged(epoch), "the captured check did not run clean once per replay"
    assert torch.equal(static[2], slots), "a clean captured check rewrote a write slot"
    return us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ps, rows_n = 16, 1025
    width = args.seq + 1024
    per_row = width // ps
    batches = [int(b) for b in args.batches.split(",")]
    num_pages = (max(batches) + 2) * per_row + 16
    table = torch.zeros(rows_n, width, dtype=torch.int32, device=dev)
    tracker = TagTracker(TrackerConfig(mode="check", quarantine=False))
    tracker.attach(num_pages=num_pages, num_rows=rows_n, max_entries=per_row, device=dev, page_size=ps)
    launch = tracker.launcher(table, page_div=ps, per_token=True)
    tracker.warm_up(table, page_div=ps, per_token=True, launch=launch)
    ring = VerdictRing(launch, dev)
    ring.self_test(tracker, 0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "seq": args.seq, "page_size": ps, "rows": []}
    for B in batches:
        rows = torch.arange(1, B + 1, device=dev)
        pages = torch.arange(1, 1 + B * per_row, device=dev).view(B, per_row)
        table[1:B + 1] = (pages.repeat_interleave(ps, 1) * ps + torch.arange(width, device=dev) % ps).int()
        for b in range(B):
            tracker.record(b + 1, 0, pages[b])
        seq = torch.full((B,), args.seq, dtype=torch.int64, device=dev)
        seq_cpu = seq.cpu()
        slots = (pages[:, args.seq // ps] * ps).contiguous()
        pinned = {}
        events = [torch.cuda.Event() for _ in range(8)]

        def check_before():
            guard = WriteGuard(slots.clone() if False else slots, scratch=0)
            check = tracker.validate(table, rows, seq, max_entries=args.seq, table_rows=rows, page_div=ps,
                                     per_token=True, entries_hint=B * args.seq, guard=guard)
            key = tuple(check.verdict.shape)
            host = pinned.get(key)
            if host is None:
                host = pinned[key] = torch.empty(key, dtype=torch.int32, pin_memory=True)
            host.copy_(check.verdict, non_blocking=True)
            events[0].record()

        ring.reserve(B, width)
        bound = BoundCheck(launch, rows, rows, ring.buffers(), ring.flag_cells, scratch_slot=0, n_dtype=seq.dtype,
                           slot_dtype=slots.dtype)

        def check_now():  # what SGLangGuard.launch does on a decode step
            lens = seq_cpu.numpy()
            max_entries, total = int(lens.max()), int(lens.sum())
            slot, stamp = ring.next()
            with tracker.lock:
                bound(slot, rows, seq, slots, max_entries, stamp)
            tracker.count_check(total)

        def check_general():  # the same check through CheckLaunch (extend batches, attention TP)
            lens = seq_cpu.numpy()
            max_entries, total = int(lens.max()), int(lens.sum())
            slot, stamp = ring.next()
            tracker.check(launch, rows, seq, table_rows=rows, max_entries=max_entries,
                          verdict=ring.verdict(slot, B, max_entries), flag=ring.flag_cells[slot], stamp=stamp,
                          guard=WriteGuard(slots, scratch=0), entries_hint=total)

        pos = torch.full((B,), args.seq, dtype=torch.int64, device=dev)  # every request starts a page
        new_pages = pages[:, args.seq // ps].contiguous()

        def record_before():
            fresh = tracker.on_alloc(new_pages)
            tracker.record_decode(rows, pos, slots, fresh=fresh)

        def record_now():
            tracker.record_decode(rows, pos, slots, alloc=new_pages)

        lens_np = seq_cpu.numpy()
        row = {"batch": B}
        for name, fn in (("check_before", check_before), ("check_now", check_now), ("check_general", check_general),
                         ("sync_stream", lambda: torch.cuda.current_stream(dev).synchronize()), ("record_before", record_before),
                         ("record_now", record_now), ("event_record", lambda: events[1].record()),
                         ("torch_empty", lambda: torch.empty(B * 36, dtype=torch.int32, device=dev)),
                         ("lens_max_sum", lambda: (int(lens_np.max()), int(lens_np.sum()))),
                         ("lens_tolist", lambda: seq_cpu.tolist())):
            row[name] = host_us(fn, args.calls)
        # verify the steady state really was clean and the check really ran
        torch.cuda.synchronize()
        assert not any(ring.flagged(s, ring.stamp) for s in range(8)), "a clean check flagged"
        row["gpu_check_us"] = gpu_us(lambda: launch(rows, rows, seq, max_entries=args.seq,
                                                    verdict=ring.verdict(0, B, args.seq), guard=WriteGuard(slots)))
        row["gpu_record_us"] = gpu_us(record_now)
        row["gpu_graph_check_us"] = graph_check_us(table, tracker, rows, seq, slots, ps, max(batches))
        row["direct_launches"] = launch.kernel.direct_launches
        results["rows"].append(row)
        print(f"B={B:4d} " + " ".join(f"{k}={v['p50']:.1f}/{v['p99']:.1f}" for k, v in row.items()
                                       if isinstance(v, dict))
              + f" gpu_check={row['gpu_check_us']:.1f}us gpu_record={row['gpu_record_us']:.1f}us"
              + f" gpu_graph_check={row['gpu_graph_check_us']:.1f}us", flush=True)
        table[1:B + 1] = 0
        for b in range(B):
            tracker.drop(b + 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_path.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
