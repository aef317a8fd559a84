"""The engine's own decode loop with and without CUDA graphs (H200), A/B interleaved step by step.

    python bench/engine_graphs.py --out bench/results          # llama3-8b INT4 weights, FP8 KV, B 1/16/64
    python bench/engine_graphs.py --model tiny --batches 1 4   # a quick look

For each batch size B two engines run side by side on one GPU (same model object, same requests): one
decodes eagerly, one through ``cuda_graphs``. Both have the kvguard tracker on. After every request is
admitted and prefilled, the script alternates one ``Engine.step()`` of each (A, B, A, B, ...) and times
each step on the host (a step ends with its one host sync, so the wall time is the step's time).
Reports median and p99 step time and decode tokens/s per variant, and the speed-up.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from faultlab.chaos.runner import checking_tracker
from faultlab.engine.engine import Engine, EngineConfig
from faultlab.engine.config import get_preset
from faultlab.engine.kvcache import token_bytes
from faultlab.engine.requests import Request
from faultlab.gpu.timing import pct


def make_engine(args, batch: int, graphs: bool) -> Engine:
    mc = get_preset(args.model)
    tokens = batch * (args.prompt + args.steps + args.warmup + 8 + 2 * args.page_size)
    budget_mb = (tokens * token_bytes(mc.n_layers, mc.n_kv_heads, mc.head_dim, "fp8") + (6 << 20)) / 2**20 * 1.1
    config = EngineConfig(model=args.model, kv_dtype="fp8", weight_dtype="int4", page_size=args.page_size,
                          kv_budget_mb=budget_mb, max_running=batch, max_context=args.prompt + args.steps + 64,
                          backend="triton", device="cuda", batch_invariant=False, prefix_cache=False,
                          cuda_graphs=graphs, seed=0)
    engine = Engine(config, tracker=checking_tracker())
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(3, min(1000, mc.vocab), (args.prompt,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", prompt, args.steps + args.warmup + 4))
    return engine


def run_batch(args, batch: int) -> dict:
    engines = {"eager": make_engine(args, batch, False), "graphs": make_engine(args, batch, True)}
    for e in engines.values():  # admit + prefill everything, then warm up (graphs get captured here)
        while len(e.running) < batch or any(len(r.output) == 0 for r in e.running):
            e.step()
        for _ in range(args.warmup):
            e.step()
    times = {n: [] for n in engines}
    for i in range(args.steps):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for name in order:
            e = engines[name]
            assert len(e.running) == batch, f"{name}: {len(e.running)} running, want {batch}"
            t = time.perf_counter()
            e.step()
            times[name].append(time.perf_counter() - t)
    row = {"batch": batch}
    for name, ts in times.items():
        med = statistics.median(ts)
        row[name] = {"median_ms": med * 1e3, "p99_ms": pct(ts, 99) * 1e3, "tok_s": batch / med, "steps": len(ts)}
    row["speedup"] = row["eager"]["median_ms"] / row["graphs"]["median_ms"]
    row["buckets_captured"] = len(engines["graphs"].graphs.buckets)
    same = sum(a.output == b.output for a, b in zip(engines["eager"].running, engines["graphs"].running))
    row["identical_outputs"] = f"{same}/{batch}"
    engines.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    print(f"{'B':>4} {'eager ms':>9} {'p99':>7} {'graphs ms':>9} {'p99':>7} {'speedup':>7} {'tok/s graphs':>12}")
    for b in args.batches:
        r = run_batch(args, b)
        rows.append(r)
        print(f"{b:4d} {r['eager']['median_ms']:9.2f} {r['eager']['p99_ms']:7.2f} {r['graphs']['median_ms']:9.2f} "
              f"{r['graphs']['p99_ms']:7.2f} {r['speedup']:7.2f} {r['graphs']['tok_s']:12.1f}  "
              f"identical {r['identical_outputs']}", flush=True)
    if args.out:
        out = Path(args.out) / "engine_graphs.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                                   "model": args.model, "rows": rows}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
