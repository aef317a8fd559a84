"""What the FP8 cache's opt-in layouts cost in a CUDA-graphed decode step (H200): the Hadamard K
rotation (`rotate_k`) and the KV residual for each request's first 16 and last 128 tokens (`residual`).

    python bench/layout_cost.py --variants rotated --out bench/results/rotation_cost.json
    python bench/layout_cost.py --variants residual --out bench/results/residual_cost.json

Same method as faultlab/gpu/bench.py: one DecodeState per variant (FP8 KV, plain twice for an A/A, no
tracker), each step captured as a CUDA graph, graphs replayed interleaved in rotating order, CUDA-event
times; medians and p99 per variant, and each layout's cost in % of the plain step.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from faultlab.chaos.runner import checking_tracker
from faultlab.engine.config import get_preset
from faultlab.engine.model import LlamaModel
from faultlab.engine.weights import random_weights
from faultlab.gpu.step import DecodeState
from faultlab.gpu.timing import capture, interleaved, pct


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--pairs", type=int, default=200)
    p.add_argument("--variants", nargs="+", default=["rotated", "residual"], choices=("rotated", "residual"))
    p.add_argument("--out", default=None, help="a JSON file")
    args = p.parse_args()
    dev = torch.device("cuda")
    config = get_preset(args.model)
    model = LlamaModel(config, random_weights(config, seed=0, weight_dtype="int4", group_size=128, device=dev),
                       backend="triton")
    rows = []
    for batch in args.batches:
        options = {"plain": {}, "plain2": {}, "rotated": {"rotate_k": True}, "residual": {"residual": True}}
        states = {name: DecodeState(model, batch, args.ctx, 16, "fp8", dev, "triton", **options[name])
                  for name in ("plain", "plain2", *args.variants)}
        graphs = {n: capture(lambda s=s: s.step(model, checking_tracker(on=False))) for n, s in states.items()}
        t = interleaved({n: g for n, (g, _) in graphs.items()}, args.pairs)
        med = {n: statistics.median(v) * 1e3 for n, v in t.items()}
        p99 = {n: pct(v, 99) * 1e3 for n, v in t.items()}
        row = {"batch": batch, "ctx": args.ctx, "step_ms_median": med, "step_ms_p99": p99,
               "aa_pct_median": 100 * (med["plain2"] / med["plain"] - 1)}
        for name in args.variants:
            row[f"{name}_pct_median"] = 100 * (med[name] / med["plain"] - 1)
            row[f"{name}_pct_p99"] = 100 * (p99[name] / p99["plain"] - 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del states, graphs
        torch.cuda.empty_cache()
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                                   "model": args.model, "rows": rows}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
