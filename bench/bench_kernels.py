"""GPU benchmark of the kvguard kernels at production shapes; prints a table and writes JSON.

    python bench/bench_kernels.py --out bench/results/kernels.json

Each case is timed with ``triton.testing.do_bench`` (median of its runs) and checked once against
the op's torch reference (relative error). Bandwidth counts the bytes each kernel must move at least
(weights, KV read, inputs/outputs written), so it compares directly with the GPU's HBM bandwidth.

Cases:
- ``int4``: W4A16 GEMV/GEMM ``[M, K] x [N, K]^T`` for (N, K) = (4096, 4096), (14336, 4096), (4096, 14336),
  (128256, 4096), M = 1, 8, 64, group size 128, against a bf16 ``torch.matmul`` with the same shapes and
  the tl.dot path with its former tiles (``int4_linear_old``).
- ``attention``: paged decode attention, 32 query heads over 8 KV heads x 128, page size 16, context
  8192 in shuffled pages, batch 1, 8, 64, bf16 vs fp8 KV cache (bf16 q), and the former heads-in-MMA-rows
  kernel (``paged_decode_attention_old``).

``--sweep`` adds candidate tile configurations (ops ``int4_sweep``, ``attention_sweep``), each checked too.
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

from faultlab.engine.kernels.int4_gemm import int4_linear, int4_linear_ref, quantize_int4
from faultlab.engine.kernels.kv_store import store_kv, store_kv_ref
from faultlab.engine.kernels.paged_attention_ref import paged_decode_attention_ref
from faultlab.engine.kernels.testing import rel_error

FP8 = torch.float8_e4m3fn
SUITES = ("int4", "attention", "store")
INT4_M = None


GRAPH = False  # --graph: time launches replayed from a CUDA graph (no host launch overhead)
_FLUSH = {}


def _graph_ms(fn, launches: int = 20, replays: int = 5) -> float:
    """Milliseconds per ``fn()`` from a CUDA graph of ``launches`` x (L2 flush, fn) minus one of the flushes
    alone (best of ``replays``), so the launch overhead of Python and Triton is not counted."""
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush = _FLUSH["buf"]
    fn()
    torch.cuda.synchronize()

    def best(body):
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(launches):
                flush.zero_()
                body()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return min(times)

    return max(0.0, (best(fn) - best(lambda: None)) / launches)


def _time_ms(fn, rep_ms: int) -> float:
    """Median milliseconds of ``fn()`` over ``rep_ms`` of runs (do_bench clears L2 before each)."""
    if GRAPH:
        try:
            return _graph_ms(fn)
        except Exception as exc:  # capture failed: fall back to do_bench
            print(f"graph timing failed ({type(exc).__name__}: {str(exc)[:120]}); using do_bench", flush=True)
    median, _, _ = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return float(median)


def _row(op: str, params: dict, ms: float, n_bytes: float, flops: float = 0.0,
         err: float | None = None) -> dict:
    return dict(op=op, **params, ms=ms, gbps=n_bytes / ms / 1e6, tflops=flops / ms / 1e9 if flops else None,
                bytes=n_bytes, rel_error=err)


INT4_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]  # (N, K) of an 8B model
OLD_INT4 = {1: (16, 64, 256, 8), 8: (16, 64, 256, 8), 16: (16, 64, 256, 8), 64: (16, 128, 256, 8)}
GEMV_SWEEP = [(16, 256, 4), (32, 256, 8), (16, 128, 4), (32, 128, 4), (16, 128, 8), (64, 256, 8)]
DOT_SWEEP = [(16, 32, 128, 4), (64, 64, 128, 8), (64, 32, 128, 4), (32, 64, 128, 4)]
ATTN_SWEEP = [  # (mode, block_n, num_warps, num_stages)
    (0, 64, 8, 2), (1, 64, 8, 2), (1, 64, 4, 2), (1, 128, 8, 3), (1, 32, 4, 3), (2, 32, 8, 2), (2, 16, 4, 2)]


def _int4_case(rows, params, x, w, ref, rep_ms, w_bytes, io_bytes, flops, op, **kw):
    from faultlab.engine.kernels.int4_gemm import launch_int4_linear
    try:
        err = rel_error(launch_int4_linear(x, *w, **kw), ref)
        ms = _time_ms(lambda: launch_int4_linear(x, *w, **kw), rep_ms)
    except Exception as exc:  # a config that does not compile: report and go on
        print(f"{op} {params} {kw}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return
    rows.append(_row(op, dict(params, **{k: str(v) for k, v in kw.items() if k != "group_size"}), ms,
                     w_bytes + io_bytes, flops, err))


def bench_int4(device, rep_ms: int, quick: bool, sweep: bool = False) -> list[dict]:
    """INT4 GEMV/GEMM (N, K) x M, G = 128, against a bf16 matmul of the same shape.

    ``int4_linear_old``: the tl.dot path with the tiles used before the GEMV path (no split-K);
    with ``sweep``, also each candidate tile configuration (op ``int4_sweep``)."""
    rows = []
    shapes = INT4_SHAPES[:1] if quick else INT4_SHAPES
    group_size = 128
    for n, k in shapes:
        w = torch.randn((n, k), device=device) * 0.02
        w_bf16 = w.to(torch.bfloat16)
        qweight, scales, mins = quantize_int4(w, group_size)
        del w
        w_bytes = qweight.numel() + 2 * scales.numel() * 2
        wq = (qweight, scales, mins, group_size)
        for m in INT4_M or ((1, 8, 16, 64) if sweep else (1, 8, 64)):
            x = torch.randn((m, k), device=device, dtype=torch.bfloat16)
            ref = int4_linear_ref(x, *wq)
            io_bytes = (m * k + m * n) * 2
            params = dict(m=m, n=n, k=k, group_size=group_size, dtype="bfloat16")
            flops = 2.0 * m * n * k
            err = rel_error(int4_linear(x, *wq), ref)
            ms = _time_ms(lambda: int4_linear(x, *wq), rep_ms)
            rows.append(_row("int4_linear", params, ms, w_bytes + io_bytes, flops, err))
            bm, bn, bk, nw = OLD_INT4[m]
            _int4_case(rows, params, x, wq, ref, rep_ms, w_bytes, io_bytes, flops, "int4_linear_old",
                       path="dot", block_m=bm, block_n=bn, block_k=bk, num_warps=nw, split_k=1)
            if m <= 16:  # the tl.dot path with split-K, for comparison with the GEMV path
                _int4_case(rows, params, x, wq, ref, rep_ms, w_bytes, io_bytes, flops, "int4_linear_dot",
                           path="dot", block_m=16, block_n=32, block_k=128, num_warps=4)
            if sweep:
                if m <= 16:
                    for bn, bk, nw in GEMV_SWEEP:
                        _int4_case(rows, params, x, wq, ref, rep_ms, w_bytes, io_bytes, flops, "int4_sweep",
                                   path="gemv", block_n=bn, block_k=bk, num_warps=nw)
                    _int4_case(rows, params, x, wq, ref, rep_ms, w_bytes, io_bytes, flops, "int4_sweep",
                               path="gemv", target_programs=2048)
                    _int4_case(rows, params, x, wq, ref, rep_ms, w_bytes, io_bytes, flops, "int4_sweep",
                               path="gemv", target_programs=512)
                if m >= 8:
                    for bm, bn, bk, nw in DOT_SWEEP:
                        _int4_case(rows, params, x, wq, ref, rep_ms, w_bytes, io_bytes, flops, "int4_sweep",
                                   path="dot", block_m=bm, block_n=bn, block_k=bk, num_warps=nw)
            ms = _time_ms(lambda: torch.matmul(x, w_bf16.T), rep_ms)
            params = dict(m=m, n=n, k=k, group_size=None, dtype="bfloat16")
            rows.append(_row("torch_bf16_matmul", params, ms, n * k * 2 + io_bytes, flops))
        del w_bf16, qweight, scales, mins
        torch.cuda.empty_cache()
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


def bench_attention(device, rep_ms: int, quick: bool, sweep: bool = False) -> list[dict]:
    """Paged decode attention, bf16 vs fp8 cache, context 8192, batch 1/8/64.

    ``paged_decode_attention_old``: the heads-in-MMA-rows kernel with the settings used before;
    with ``sweep``, also each candidate (mode, block_n, num_warps, num_stages) (op ``attention_sweep``)."""
    from faultlab.engine.kernels.paged_attention import BLOCK_N, BLOCK_N_FP8, auto_splits, launch_paged_decode
    rows = []
    n_heads, n_kv, head_dim, page_size, context = 32, 8, 128, 16, 8192
    for batch in ((1, 8) if quick else (1, 8, 64)):
        for cache_dtype in (torch.bfloat16, FP8):
            case = _attention_case(batch, context, page_size, n_heads, n_kv, head_dim, cache_dtype, device)
            scale = head_dim ** -0.5
            ref = paged_decode_attention_ref(*case, scale, 0.5, 0.5)
            kv_bytes = 2 * batch * context * n_kv * head_dim * case[1].element_size()
            io_bytes = 2 * batch * n_heads * head_dim * 2 + case[3].numel() * 4
            params = dict(batch=batch, context=context, page_size=page_size, n_heads=n_heads, n_kv_heads=n_kv,
                          head_dim=head_dim, cache_dtype=str(cache_dtype).removeprefix("torch."))
            flops = 4.0 * batch * n_heads * context * head_dim
            splits = auto_splits(case[0], n_kv, context)
            old_n = BLOCK_N_FP8 if cache_dtype == FP8 and splits == 1 else BLOCK_N
            variants = [("paged_decode_attention", {}),
                        ("paged_decode_attention_old", dict(mode=0, block_n=old_n, num_warps=4, num_stages=3))]
            if sweep:
                variants += [("attention_sweep", dict(mode=a, block_n=bn, num_warps=nw, num_stages=ns))
                             for a, bn, nw, ns in ATTN_SWEEP]
                if batch == 64:
                    variants += [("attention_sweep", dict(mode=a, block_n=bn, num_warps=nw, num_stages=ns,
                                                          n_splits=2)) for a, bn, nw, ns in ATTN_SWEEP[1:3]]
            for op, kw in variants:
                try:
                    err = rel_error(launch_paged_decode(*case, scale, 0.5, 0.5, **kw), ref)
                    ms = _time_ms(lambda: launch_paged_decode(*case, scale, 0.5, 0.5, **kw), rep_ms)
                except Exception as exc:
                    print(f"{op} {params} {kw}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                rows.append(_row(op, dict(params, **{k: str(v) for k, v in kw.items()}), ms,
                                 kv_bytes + io_bytes, flops, err))
            del case
            torch.cuda.empty_cache()
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
    parser.add_argument("--sweep", action="store_true", help="also time candidate tile configurations")
    parser.add_argument("--graph", action="store_true",
                        help="time each op from a CUDA graph (L2 flushed between launches), not do_bench")
    parser.add_argument("--m", type=int, action="append", help="int4: only these M (repeatable)")
    args = parser.parse_args(argv)
    global GRAPH, INT4_M
    GRAPH = args.graph
    INT4_M = tuple(args.m) if args.m else None
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; this benchmark needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    runners = {"int4": bench_int4, "attention": bench_attention, "store": bench_store}
    rows = []
    started = time.time()
    for suite in args.only or SUITES:
        suite_rows = (runners[suite](device, args.rep, args.quick, args.sweep) if suite != "store"
                      else runners[suite](device, args.rep, args.quick))
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
