"""Where the KV residual's decode cost goes on a GPU: the attention and store kernels alone (H200).

    python bench/residual_kernels.py --out bench/results/residual_kernels.json

llama3-8b attention shapes (H=32, Hkv=8, D=128, page 16), bf16 q, FP8 K/V at context 8192 on scattered
pages. Attention variants: plain; "residual" as the engine calls it (the default layout's table, first
page and last 9 pages, with res_bounds and res_max_tokens); "residual_no_bounds" (the same table, no
res_bounds: every token goes through the residual programs); "residual_empty_stretches" (res_bounds
with empty ends but no res_max_tokens: the residual launch's default spread over the whole table).
Store: one token per request, with and without residual slots. triton.testing.do_bench medians (us),
variants interleaved over rounds. These are eager launches, so at batch 1 the host's launch time shows
in them; bench/layout_cost.py measures the whole decode step under CUDA graphs.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

from faultlab.engine.kvcache import ResidualLayout
from faultlab.engine.kernels.kv_store import store_kv
from faultlab.engine.kernels.paged_attention import paged_decode_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev, ps, h, hkv, d = torch.device("cuda"), 16, 32, 8, 128
    rows = []
    for batch in args.batches:
        width = -(-(args.ctx + 1) // ps)
        n_pages = batch * width + 1
        gen = torch.Generator(device="cpu").manual_seed(0)
        k_cache = torch.randint(0, 120, (n_pages, ps, hkv, d), dtype=torch.uint8).to(dev).view(torch.float8_e4m3fn)
        v_cache = torch.randint(0, 120, (n_pages, ps, hkv, d), dtype=torch.uint8).to(dev).view(torch.float8_e4m3fn)
        table = (torch.randperm(n_pages - 1, generator=gen)[:batch * width] + 1).view(batch, width).int().to(dev)
        seq = torch.full((batch,), args.ctx + 1, dtype=torch.int32, device=dev)
        layout = ResidualLayout.of(batch, ps)
        k_res = torch.randint(0, 120, (layout.num_pages, ps, hkv, d), dtype=torch.uint8).to(dev).view(torch.float8_e4m3fn)
        v_res = k_res.clone()
        rws = torch.arange(batch, device=dev)
        zero = torch.zeros(batch, dtype=torch.long, device=dev)
        res_table = layout.table(rws, width, seq.long(), zero)
        bounds = layout.bounds(seq.long(), zero)
        empty = torch.stack([torch.zeros_like(seq), seq + ps], 1).int()
        q = torch.randn(batch, h, d, device=dev, dtype=torch.bfloat16)
        res = {"k_res": k_res, "v_res": v_res, "res_table": res_table}
        attn = {
            "plain": lambda: paged_decode_attention(q, k_cache, v_cache, table, seq, d ** -0.5),
            "residual": lambda: paged_decode_attention(q, k_cache, v_cache, table, seq, d ** -0.5, **res,
                                                       res_bounds=bounds, res_max_tokens=layout.max_tokens),
            "residual_no_bounds": lambda: paged_decode_attention(q, k_cache, v_cache, table, seq, d ** -0.5, **res),
            "residual_empty_stretches": lambda: paged_decode_attention(q, k_cache, v_cache, table, seq, d ** -0.5,
                                                                       **res, res_bounds=empty),
        }
        k = torch.randn(batch, hkv, d, device=dev, dtype=torch.bfloat16)
        slots = table[:, -1].long() * ps
        res_slots = layout.write_slots(rws, seq.long() - 1, seq.long(), zero)
        store = {
            "store_plain": lambda: store_kv(k, k, k_cache, v_cache, slots),
            "store_residual": lambda: store_kv(k, k, k_cache, v_cache, slots, k_res=k_res, v_res=v_res,
                                               res_slots=res_slots),
        }
        times = {n: [] for n in (*attn, *store)}
        for _ in range(args.rounds):
            for n, fn in (*attn.items(), *store.items()):
                times[n].append(triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3)
        row = {"batch": batch, "ctx": args.ctx, "us_median": {n: statistics.median(v) for n, v in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv),
                                              "device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
