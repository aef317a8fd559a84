"""Which FP8 KV layout can reach 99% top-1 agreement with a BF16 KV cache on SmolLM2? A sweep.

    python bench/kv_layouts.py --positions 2000 --out bench/results/kv_layouts.json

Rows "fp8", "fp8 + Hadamard K" and "fp8 + KV residual" run the real FP8 cache (`faultlab eval-kv`,
`--rotate-k`, `--kv-residual`; the residual's capacity counts its pages: each request keeps
`ResidualLayout.max_tokens` (160) tokens' worth of FP8 residual bytes). The other rows are *simulations*: the test cache is float32 and every K/V vector is
rounded through the layout's formats on its way in (`fp8(x)` = e4m3 round trip at scale 1, which for
e4m3 equals any per-layer scale: its precision is relative), so they measure accuracy only, not
speed. `capacity` is tokens per byte relative to BF16 (2.0 = the write-up's "about 2x") at
`--capacity-context` tokens: a layout that keeps S + W tokens of each request in BF16 stores
2T / (T + S + W) times the tokens of BF16. "Last W tokens" are the W tokens just before the query's
chunk (a per-request BF16 window that tokens leave as they age, as KIVI keeps its residual).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from faultlab.engine import evalkv
from faultlab.engine.kvcache import PagedKVCache, ResidualLayout, hadamard


def fp8(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.bfloat16).float()


def rotated_fp8(x: torch.Tensor) -> torch.Tensor:
    h = hadamard(x.shape[-1])
    return fp8(x.float() @ h) @ h


# name -> (K rounding, V rounding, first S tokens in BF16, last W tokens before the query in BF16)
SIMULATED = {
    "fp8 K, bf16 V (sim)": (fp8, bf16, 0, 0),
    "bf16 K, fp8 V (sim)": (bf16, fp8, 0, 0),
    "fp8 + Hadamard K, first 16 tokens in bf16 (sim)": (rotated_fp8, fp8, 16, 0),
    "fp8, last 128 tokens in bf16 (sim)": (fp8, fp8, 0, 128),
    "fp8 + Hadamard K, first 16 + last 128 tokens in bf16 (sim)": (rotated_fp8, fp8, 16, 128),
}


def capacity(name: str, context: int) -> float:
    """Tokens per byte relative to BF16 at `context` tokens: 2T / (T + tokens kept in BF16)."""
    k_round, v_round, sink, recent = SIMULATED[name]
    if bf16 in (k_round, v_round):
        return 4 / 3
    return 2 * context / (context + sink + recent)


def simulated(name: str, n_positions: int, window: int, page_size: int = 16) -> dict:
    """eval_kv with a float32 test cache that holds the layout's rounded K/V.

    The sink and recent tokens: every stored token also keeps a BF16 copy, and when a chunk reads its
    prefix back (`gather`, the path eval_kv's chunked prefill uses), the first S and the last W tokens
    come from the copies. (eval_kv never decodes, so `decode_attention` needs no patch.)
    """
    round_k, round_v, sink, recent = SIMULATED[name]
    store, gather, copies = PagedKVCache.store, PagedKVCache.gather, {}

    def rounding_store(self, layer, k, v, slots, res_slots=None):
        if self.dtype == "fp32":  # the test cache
            n_slots = self.k[layer].shape[0] * self.page_size
            ck, cv = copies.setdefault((id(self), layer), (torch.zeros(n_slots, *k.shape[1:]),
                                                            torch.zeros(n_slots, *k.shape[1:])))
            ck[slots], cv[slots] = bf16(k), bf16(v)
            k, v = round_k(k), round_v(v)
        return store(self, layer, k, v, slots, res_slots)

    def exact_gather(self, layer, page_row, n_tokens, **residual):
        k, v = gather(self, layer, page_row, n_tokens, **residual)
        if self.dtype == "fp32" and (sink or recent):
            ck, cv = copies[(id(self), layer)]
            pages = page_row[:-(-n_tokens // self.page_size)].long()
            slots = (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()[:n_tokens]
            keep = torch.zeros(n_tokens, dtype=torch.bool)
            keep[:sink] = True
            keep[max(0, n_tokens - recent):] = True
            k = torch.where(keep[:, None, None], ck[slots], k)
            v = torch.where(keep[:, None, None], cv[slots], v)
        return k, v

    PagedKVCache.store, PagedKVCache.gather = rounding_store, exact_gather
    try:
        return evalkv.eval_kv(n_positions=n_positions, ref_kv="bf16", test_kv="fp32", page_size=page_size,
                              window=window)
    finally:
        PagedKVCache.store, PagedKVCache.gather = store, gather


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", type=int, default=2000)
    p.add_argument("--window", type=int, default=512, help="eval_kv's window: tokens of context per text window")
    p.add_argument("--capacity-context", type=int, default=8192, help="context at which capacity is stated")
    p.add_argument("--out", default="bench/results/kv_layouts.json")
    args = p.parse_args()
    n, w = args.positions, args.window
    torch.set_num_threads(2)
    rows = []
    layout = ResidualLayout.of(1, 16)  # the engine's default: first 16, last 128 tokens (+ the open page)
    runs = [("fp8 (per-layer scale)", 2.0, lambda: evalkv.eval_kv(n_positions=n, rotate_k=False, window=w)),
            ("fp8 + Hadamard K (opt-in)", 2.0, lambda: evalkv.eval_kv(n_positions=n, rotate_k=True, window=w)),
            ("fp8 + KV residual, first 16 + last 128 tokens (engine.kv_residual)",
             2 * args.capacity_context / (args.capacity_context + layout.max_tokens),
             lambda: evalkv.eval_kv(n_positions=n, residual=True, window=w)),
            ("bf16 vs fp32 (noise floor)", 1.0,
             lambda: evalkv.eval_kv(n_positions=n, ref_kv="fp32", test_kv="bf16", window=w))]
    runs += [(name, capacity(name, args.capacity_context), lambda name=name: simulated(name, n, w))
             for name in SIMULATED]
    print(f"eval window {w} tokens; capacity at {args.capacity_context} tokens of context")
    print(f"{'layout':68s} {'capacity':>8s} {'top-1':>7s} {'mean KL':>9s} {'ppl':>7s} {'s':>4s}", flush=True)
    for name, cap, run in runs:
        t = time.time()
        r = run()
        rows.append({"layout": name, "capacity_vs_bf16": round(cap, 3), **r})
        print(f"{name:68s} {cap:8.2f} {r['top1_agreement']:7.3f} {r['mean_kl']:9.5f} {r['ppl_test']:7.3f} "
              f"{time.time() - t:4.0f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "eval_window": w,
                                          "capacity_context": args.capacity_context, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
