"""GPU benchmark of the kvguard kernels at production shapes; prints a table and writes JSON.

    python bench/bench_kernels.py --out bench/results/kernels.json

Each case is timed with ``triton.testing.do_bench`` (median of its runs) and checked once against
the op's torch reference (relative error). Bandwidth counts the bytes each kernel must move at least
(weights, KV read, inputs/outputs written), so it compares directly with the GPU's HBM bandwidth.

Cases:
- ``int4``: W4A16 GEMV/GEMM ``[M, K] x [N, K]^T`` for (N, K) = (4096, 4096), (14336, 4096), M = 1, 8,
  64, group sizes 32 and 128, against a bf16 ``torch.matmul`` with the same shapes.
- ``attention``: paged decode attention, 32 query heads over 8 KV heads x 128, page size 16, context
  8192 in shuffled pages, batch 1, 8, 64, bf16 vs fp8 KV cache (bf16 q).
- ``store``: store_kv of T new tokens (8 KV heads x 128, bf16) into bf16 and fp8 caches.
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

from kvguard.kernels.int4_gemm import int4_linear, int4_linear_ref, quantize_int4
from kvguard.kernels.kv_store import store_kv, store_kv_ref
from kvguard.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from kvguard.kernels.testing import rel_error

FP8 = torch.float8_e4m3fn
SUITES = ("int4", "attention", "store")


def _time_ms(fn, rep_ms: int) -> float:
    """Median milliseconds of ``fn()`` over ``rep_ms`` of runs (do_bench clears L2 before each)."""
    median, _, _ = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return float(median)


def _row(op: str, params: dict, ms: float, n_bytes: float, flops: float = 0.0,
         err: float | None = None) -> dict:
    return dict(op=op, **params, ms=ms, gbps=n_bytes / ms / 1e6, tflops=flops / ms / 1e9 if flops else None,
                bytes=n_bytes, rel_error=err)


def bench_int4(device, rep_ms: int, quick: bool) -> list[dict]:
    """INT4 GEMV/GEMM (N, K) x M x G against a bf16 matmul of the same shape."""
    rows = []
    shapes = [(4096, 4096)] if quick else [(4096, 4096), (14336, 4096)]
    for n, k in shapes:
        w = torch.randn((n, k), device=device) * 0.02
        w_bf16 = w.to(torch.bfloat16)
        for group_size in (32, 128):
            qweight, scales, mins = quantize_int4(w, group_size)
            w_bytes = qweight.numel() + 2 * scales.numel() * 2
            for m in (1, 8, 64):
                x = torch.randn((m, k), device=device, dtype=torch.bfloat16)
                io_bytes = (m * k + m * n) * 2
                err = rel_error(int4_linear(x, qweight, scales, mins, group_size),
                                int4_linear_ref(x, qweight, scales, mins, group_size))
                ms = _time_ms(lambda: int4_linear(x, qweight, scales, mins, group_size), rep_ms)
                params = dict(m=m, n=n, k=k, group_size=group_size, dtype="bfloat16")
                rows.append(_row("int4_linear", params, ms, w_bytes + io_bytes, 2.0 * m * n * k, err))
                if group_size == 32:
                    ms = _time_ms(lambda: torch.matmul(x, w_bf16.T), rep_ms)
                    params = dict(m=m, n=n, k=k, group_size=None, dtype="bfloat16")
                    rows.append(_row("torch_bf16_matmul", params, ms, n * k * 2 + io_bytes, 2.0 * m * n * k))
    return rows


def _attention_case(batch, context, page_size, n_heads, n_kv, head_dim, cache_dtype, device):
    pages_per_seq = context // page_size
    n_pages = batch * pages_per_seq + 1  # page 0 is scratch
    shape = (n_pages, page_size, n_kv, head_dim)
    k_cache = torch.randn(shape, device=device).to(cache_dtype)
    v_cache = torch.randn(shape, device=device).to(cache_dtype)
    block_table = (torch.randperm(n_pages - 1, device=device)[: batch * pages_per_seq] + 1)
    block_table = block_table.view(batch, pages_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn((batch, n_heads, head_dim), device=device, dtype=torch.bfloat16)
    return q, k_cache, v_cache, block_table, seq_lens


def bench_attention(device, rep_ms: int, quick: bool) -> list[dict]:
    """Paged decode attention, bf16 vs fp8 cache, context 8192, batch 1/8/64."""
    rows = []
    n_heads, n_kv, head_dim, page_size, context = 32, 8, 128, 16, 8192
    for batch in ((1, 8) if quick else (1, 8, 64)):
        for cache_dtype in (torch.bfloat16, FP8):
            case = _attention_case(batch, context, page_size, n_heads, n_kv, head_dim, cache_dtype, device)
            scale = head_dim ** -0.5
            err = rel_error(paged_decode_attention(*case, scale, 0.5, 0.5),
                            paged_decode_attention_ref(*case, scale, 0.5, 0.5))
            ms = _time_ms(lambda: paged_decode_attention(*case, scale, 0.5, 0.5), rep_ms)
            kv_bytes = 2 * batch * context * n_kv * head_dim * case[1].element_size()
            io_bytes = 2 * batch * n_heads * head_dim * 2 + case[3].numel() * 4
            params = dict(batch=batch, context=context, page_size=page_size, n_heads=n_heads, n_kv_heads=n_kv,
                          head_dim=head_dim, cache_dtype=str(cache_dtype).removeprefix("torch."))
            rows.append(_row("paged_decode_attention", params, ms, kv_bytes + io_bytes,
                             4.0 * batch * n_heads * context * head_dim, err))
    return rows


def bench_store(device, rep_ms: int, quick: bool) -> list[dict]:
    """store_kv of T tokens into bf16 / fp8 caches (slots scattered over the pool)."""
    rows = []
    n_kv, head_dim, page_size, n_pages = 8, 128, 16, 8192
    for n_tokens in ((1, 4096) if quick else (1, 64, 4096)):
        for cache_dtype in (torch.bfloat16, FP8):
            k = torch.randn((n_tokens, n_kv, head_dim), device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            shape = (n_pages, page_size, n_kv, head_dim)
            k_cache = torch.zeros(shape, device=device, dtype=cache_dtype)
            v_cache = torch.zeros_like(k_cache)
            slots = torch.randperm(n_pages * page_size, device=device)[:n_tokens].to(torch.int32)
            store_kv(k, v, k_cache, v_cache, slots, 0.5, 0.5)
            k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
            store_kv_ref(k, v, k_ref, v_ref, slots, 0.5, 0.5)
            exact = bool(torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
                         and torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8)))
            ms = _time_ms(lambda: store_kv(k, v, k_cache, v_cache, slots, 0.5, 0.5), rep_ms)
            n_bytes = 2 * n_tokens * n_kv * head_dim * (2 + k_cache.element_size()) + n_tokens * 4
            params = dict(tokens=n_tokens, n_kv_heads=n_kv, head_dim=head_dim,
                          cache_dtype=str(cache_dtype).removeprefix("torch."), bit_exact=exact)
            rows.append(_row("store_kv", params, ms, n_bytes, 0.0, 0.0 if exact else float("nan")))
    return rows


def _print(rows: list[dict]) -> None:
    skip = {"op", "ms", "gbps", "tflops", "bytes", "rel_error"}
    for r in rows:
        params = " ".join(f"{k}={v}" for k, v in r.items() if k not in skip and v is not None)
        tflops = f"{r['tflops']:8.2f} TFLOP/s" if r["tflops"] else " " * 16
        err = f"rel_err={r['rel_error']:.2e}" if r["rel_error"] is not None else ""
        print(f"{r['op']:<24} {params:<78} {r['ms'] * 1e3:9.1f} us {r['gbps']:8.1f} GB/s {tflops} {err}",
              flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON to this path")
    parser.add_argument("--only", choices=SUITES, action="append", help="run only this suite (repeatable)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms (default 100)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; this benchmark needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    runners = {"int4": bench_int4, "attention": bench_attention, "store": bench_store}
    rows = []
    started = time.time()
    for suite in args.only or SUITES:
        suite_rows = runners[suite](device, args.rep, args.quick)
        _print(suite_rows)
        rows += suite_rows
    report = dict(
        device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), seconds=round(time.time() - started, 1), results=rows,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
