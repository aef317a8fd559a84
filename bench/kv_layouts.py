"""Which FP8 KV layout can reach 99% top-1 agreement with a BF16 KV cache on SmolLM2? A sweep.

    python bench/kv_layouts.py --positions 2000 --out bench/results/kv_layouts.json

Rows "fp8" and "fp8 + Hadamard K" run the real FP8 cache (`faultlab eval-kv` without and with
`--rotate-k`). The other rows are *simulations*: the test cache is float32 and every K/V vector is
rounded through the layout's formats on its way in (`fp8(x)` = e4m3 round trip at scale 1, which for
e4m3 equals any per-layer scale: its precision is relative), so they measure accuracy only, not
speed. `capacity` is tokens per byte relative to BF16 (2.0 = the write-up's "about 2x").
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from faultlab import evalkv  # noqa: E402
from faultlab.engine.kvcache import PagedKVCache, hadamard  # noqa: E402


def fp8(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.bfloat16).float()


def rotated_fp8(x: torch.Tensor) -> torch.Tensor:
    h = hadamard(x.shape[-1])
    return fp8(x.float() @ h) @ h


# name -> (K rounding, V rounding, first tokens kept in BF16, capacity vs BF16)
SIMULATED = {
    "fp8 K, bf16 V (sim)": (fp8, bf16, 0, 4 / 3),
    "bf16 K, fp8 V (sim)": (bf16, fp8, 0, 4 / 3),
    "fp8 + Hadamard K, token 0 in bf16 (sim)": (rotated_fp8, fp8, 1, 2.0),
    "fp8 + Hadamard K, first 16 tokens in bf16 (sim)": (rotated_fp8, fp8, 16, 2.0),
}


def simulated(name: str, n_positions: int, page_size: int = 16) -> dict:
    round_k, round_v, keep, _ = SIMULATED[name]
    store = PagedKVCache.store

    def rounding_store(self, layer, k, v, slots):
        if self.dtype == "fp32":  # the test cache; eval_kv's pages start at 1, so token = slot - page_size
            exact = (slots < page_size + keep)[:, None, None]
            k = torch.where(exact, bf16(k), round_k(k))
            v = torch.where(exact, bf16(v), round_v(v))
        return store(self, layer, k, v, slots)

    PagedKVCache.store = rounding_store
    try:
        return evalkv.eval_kv(n_positions=n_positions, ref_kv="bf16", test_kv="fp32", page_size=page_size)
    finally:
        PagedKVCache.store = store


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", type=int, default=2000)
    p.add_argument("--out", default="bench/results/kv_layouts.json")
    args = p.parse_args()
    torch.set_num_threads(2)
    rows = []
    runs = [("fp8 (per-layer scale)", 2.0, lambda: evalkv.eval_kv(n_positions=args.positions, rotate_k=False)),
            ("fp8 + Hadamard K (opt-in)", 2.0, lambda: evalkv.eval_kv(n_positions=args.positions, rotate_k=True)),
            ("bf16 vs fp32 (noise floor)", 1.0,
             lambda: evalkv.eval_kv(n_positions=args.positions, ref_kv="fp32", test_kv="bf16"))]
    runs += [(name, spec[3], lambda name=name: simulated(name, args.positions)) for name, spec in SIMULATED.items()]
    print(f"{'layout':50s} {'capacity':>8s} {'top-1':>7s} {'mean KL':>9s} {'ppl':>7s} {'s':>4s}", flush=True)
    for name, capacity, run in runs:
        t = time.time()
        r = run()
        rows.append({"layout": name, "capacity_vs_bf16": round(capacity, 3), **r})
        print(f"{name:50s} {capacity:8.2f} {r['top1_agreement']:7.3f} {r['mean_kl']:9.5f} {r['ppl_test']:7.3f} "
              f"{time.time() - t:4.0f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
