"""What the FP8 cache's Hadamard K rotation costs in a CUDA-graphed decode step (H200).

    python bench/rotation_cost.py --out bench/results          # llama3-8b INT4, FP8 KV, ctx 8192, B 1/16/64

Same method as faultlab/gpubench.py: one DecodeState per variant (FP8 KV with and without the
rotation, no tracker), each step captured as a CUDA graph, graphs replayed interleaved in rotating
order, CUDA-event times; medians and p99 per variant, and the rotation's cost in % of the step.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from faultlab.engine.config import get_preset  # noqa: E402
from faultlab.engine.model import LlamaModel  # noqa: E402
from faultlab.engine.weights import random_weights  # noqa: E402
from faultlab.gpubench import DecodeState, capture, interleaved, pct  # noqa: E402
from kvguard import NoopTracker  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--pairs", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    config = get_preset(args.model)
    model = LlamaModel(config, random_weights(config, seed=0, weight_dtype="int4", group_size=128, device=dev),
                       backend="triton")
    rows = []
    for batch in args.batches:
        states = {name: DecodeState(model, batch, args.ctx, 16, "fp8", dev, "triton", rotate_k=rot)
                  for name, rot in (("plain", False), ("plain2", False), ("rotated", True))}
        graphs = {n: capture(lambda s=s: s.step(model, NoopTracker())) for n, s in states.items()}
        t = interleaved({n: g for n, (g, _) in graphs.items()}, args.pairs)
        med = {n: statistics.median(v) * 1e3 for n, v in t.items()}
        p99 = {n: pct(v, 99) * 1e3 for n, v in t.items()}
        row = {"batch": batch, "ctx": args.ctx, "step_ms_median": med, "step_ms_p99": p99,
               "rotation_pct_median": 100 * (med["rotated"] / med["plain"] - 1),
               "aa_pct_median": 100 * (med["plain2"] / med["plain"] - 1),
               "rotation_pct_p99": 100 * (p99["rotated"] / p99["plain"] - 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del states, graphs
        torch.cuda.empty_cache()
    if args.out:
        out = Path(args.out) / "rotation_cost.json"
        out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                                   "model": args.model, "rows": rows}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
