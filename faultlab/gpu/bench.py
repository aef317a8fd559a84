"""H200 benchmarks: kvguard's overhead inside a CUDA-graphed FP8-KV / INT4 decode step, and the
write-up's other claims, in one script (one device call).

    faultlab bench --out DIR                  # on the GPU: writes DIR/h200_*.json (+ h200_overhead.png)
    python bench/h200.py --out DIR            # the same, from a source checkout without installation
    faultlab bench --dry-run --out DIR        # on CPU: tiny shapes, no graphs, checks the plumbing

Method (see the device tool's METHOD.md): decode steps are captured as CUDA graphs, one graph per
variant; variants are replayed interleaved (A, A', B in rotating order) and timed with CUDA events;
medians and p99 over all pairs. A and A' are the same step without a tracker (the no-op tracker
launches nothing, so "no-op" and "none" capture the same graph): their spread is the noise floor.
B adds kvguard's validation kernel (with quarantine) inside the graph. The engine reads the verdict
together with the sampled ids (one D2H copy it does anyway), so the graph holds all device work.
The step is faultlab/gpu/step.py, the timing (CUDA events, graphs) faultlab/gpu/timing.py.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from faultlab.chaos.runner import checking_tracker
from faultlab.engine.context import StepContext
from faultlab.engine.kvcache import PagedKVCache, token_bytes
from faultlab.gpu.step import CheckOnly, DecodeState, bench_kernel_alone, bench_step, build, weight_bytes
from faultlab.gpu.timing import copy_bandwidth, timed


# -- sections --------------------------------------------------------------------------------------
def section_overhead(args, dev, backend, log):
    model = build(args.model, "int4", dev, backend, args.dry_run)
    bw = copy_bandwidth(dev) if not args.dry_run else 0.0
    wbytes = weight_bytes(model)
    rows, kernels = [], []
    for ps, batches in ((16, args.batches), (1, [b for b in args.batches if b <= 64])):
        for batch in batches:
            row, state = bench_step(model, batch, args.ctx, ps, "fp8", dev, backend, args.pairs, args.dry_run)
            if not args.dry_run:
                floor = (wbytes + row["kv_bytes_read"]) / (bw * 1e9)
                row.update(roofline_ms=floor * 1e3, roofline_fraction=floor / (row["step_ms_median_noop"] / 1e3),
                           weight_bytes=wbytes)
                kernels.append(bench_kernel_alone(state, dev))
                for k in kernels[-1:]:
                    k["floor_us"] = k["sector_bytes"] / (bw * 1e9) * 1e6
            rows.append(row)
            log(f"overhead ps={ps} B={batch}: {row}")
            del state
            torch.cuda.empty_cache() if dev.type == "cuda" else None
    return {"copy_bandwidth_gbs": bw, "rows": rows}, {"rows": kernels}


def section_kernel(args, dev, log):
    bw = copy_bandwidth(dev)
    rows = []
    for ps in (16, 1):
        for batch in (1, 8, 64, 128):
            row = bench_kernel_alone(CheckOnly(batch, args.ctx, ps, dev), dev)
            row["floor_us"] = row["sector_bytes"] / (bw * 1e9) * 1e6
            rows.append(row)
            log(f"kernel: {row}")
    return {"copy_bandwidth_gbs": bw, "rows": rows}


def section_kv(args, dev, backend, log):
    """FP8 vs BF16 KV at equal memory: tokens that fit, and peak decode throughput."""
    model = build(args.model, "int4", dev, backend, args.dry_run)
    c = model.config
    budget = args.kv_budget_gb * 2**30
    out = {"kv_budget_gib": args.kv_budget_gb, "context": args.ctx}
    for kv_dtype in ("bf16", "fp8"):
        per_req = (args.ctx + 1) * token_bytes(c.n_layers, c.n_kv_heads, c.head_dim, kv_dtype)
        batch = max(1, int(budget // per_req)) if not args.dry_run else 2
        row, state = bench_step(model, batch, args.ctx, 16, kv_dtype, dev, backend, args.pairs // 2, args.dry_run)
        out[kv_dtype] = {"tokens_that_fit": int(budget // token_bytes(c.n_layers, c.n_kv_heads, c.head_dim, kv_dtype)),
                         "max_concurrency": batch, **row}
        log(f"kv {kv_dtype}: {out[kv_dtype]}")
        del state
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if not args.dry_run:
        out["tokens_ratio"] = out["fp8"]["tokens_that_fit"] / out["bf16"]["tokens_that_fit"]
        out["peak_throughput_ratio"] = out["fp8"]["tokens_per_s_noop"] / out["bf16"]["tokens_per_s_noop"]
    return out


def section_weights(args, dev, backend, log):
    """INT4 vs BF16 weights: decode at concurrency 1 and 64, and prefill."""
    out = {}
    for weights in ("bf16", "int4"):
        model = build(args.model, weights, dev, backend, args.dry_run)
        res = {}
        for batch in (1, 64) if not args.dry_run else (1,):
            row, state = bench_step(model, batch, args.ctx, 16, "fp8", dev, backend, args.pairs // 2, args.dry_run)
            res[f"decode_b{batch}"] = row
            del state
        res["prefill"] = bench_prefill(model, args, dev, backend)
        out[weights] = res
        log(f"weights {weights}: {res}")
        del model
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if not args.dry_run:
        for key in ("decode_b1", "decode_b64"):
            out[f"{key}_speedup_int4"] = out["bf16"][key]["step_ms_median_noop"] / out["int4"][key]["step_ms_median_noop"]
        out["prefill_speedup_int4"] = out["bf16"]["prefill"]["ms_median"] / out["int4"]["prefill"]["ms_median"]
    return out


def bench_prefill(model, args, dev, backend):
    n = args.prefill_tokens if not args.dry_run else 8
    c = model.config
    kv = PagedKVCache(c.n_layers, -(-n // 16) + 1, 16, c.n_kv_heads, c.head_dim, dtype="bf16", device=dev,
                      backend=backend)
    row = torch.arange(1, -(-n // 16) + 2, dtype=torch.int32, device=dev)
    tokens = torch.randint(3, c.vocab, (n,), device=dev)
    slots = torch.arange(16, 16 + n, device=dev)
    fn = lambda: model.forward(tokens, kv, StepContext.for_prefill(0, slots, row), last_only=True)  # noqa: E731
    if args.dry_run:
        fn()
        return {"tokens": n, "dry_run": True}
    t = timed(fn, reps=5, warmup=2)
    return {"tokens": n, "ms_median": statistics.median(t) * 1e3, "tokens_per_s": n / statistics.median(t)}


def section_sanitizer(args, log):
    """compute-sanitizer memcheck over decode steps whose tables hold out-of-range and negative ids."""
    out = {}
    for mode in ("on", "off"):
        cmd = ["compute-sanitizer", "--tool", "memcheck", sys.executable, "-m", "faultlab.gpu.bench",
               "--sanitize-child", mode]
        t = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        text = proc.stdout + proc.stderr
        summary = [line for line in text.splitlines() if "ERROR SUMMARY" in line]
        out[f"tracker_{mode}"] = {"returncode": proc.returncode, "summary": summary[-1] if summary else None,
                                  "seconds": round(time.time() - t, 1), "tail": text[-1500:]}
        log(f"sanitizer tracker {mode}: {out[f'tracker_{mode}']['summary']}")
    return out


def sanitize_child(mode):
    """A small model's decode step with corrupted entries, tracker on (quarantine) or off."""
    dev = torch.device("cuda")
    model = build("tiny", "int4", dev, "triton", True)
    state = DecodeState(model, 4, 200, 16, "fp8", dev, "triton")
    state.table[1, 3] = 10**7  # far out of range
    state.table[2, 0] = -5  # negative
    tracker = state.tracker if mode == "on" else checking_tracker(on=False)
    nxt, verdict = state.step(model, tracker)
    torch.cuda.synchronize()
    print("verdict", None if verdict is None else verdict.sum(1).tolist(), "tokens", nxt.tolist())


def main(argv=None):
    p = argparse.ArgumentParser(prog="faultlab bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128])
    p.add_argument("--pairs", type=int, default=60)
    p.add_argument("--kv-budget-gb", type=float, default=40.0)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--sections", nargs="+", default=["overhead", "kv", "weights", "sanitizer"])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--sanitize-child", choices=("on", "off"))
    args = p.parse_args(argv)
    if args.sanitize_child:
        return sanitize_child(args.sanitize_child)
    dev = torch.device("cpu" if args.dry_run else "cuda")
    backend = os.environ.get("BENCH_BACKEND", "torch" if args.dry_run else "triton")
    if args.dry_run:
        args.model, args.ctx, args.batches, args.pairs = "tiny", 40, [1, 3], 4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log = lambda msg: print(f"[{time.time() - started:7.1f}s] {msg}", flush=True)  # noqa: E731
    meta = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name() if not args.dry_run else "cpu",
            "torch": torch.__version__, "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    for section in args.sections:
        if section == "overhead":
            overhead, kernel = section_overhead(args, dev, backend, log)
            dump(out / "h200_overhead.json", {**meta, **overhead})
            dump(out / "h200_kernel.json", {**meta, **kernel})
        elif section == "kernel":
            dump(out / "h200_kernel.json", {**meta, **section_kernel(args, dev, log)})
        elif section == "kv":
            dump(out / "h200_fp8_vs_bf16_kv.json", {**meta, **section_kv(args, dev, backend, log)})
        elif section == "weights":
            dump(out / "h200_int4_vs_bf16_weights.json", {**meta, **section_weights(args, dev, backend, log)})
        elif section == "sanitizer" and not args.dry_run:
            dump(out / "h200_sanitizer.json", {**meta, **section_sanitizer(args, log)})
    if (out / "h200_overhead.json").exists() and not args.dry_run:
        plot_overhead(out / "h200_overhead.json", out / "h200_overhead.png")
    log("done")


def plot_overhead(src: Path, dst: Path) -> None:
    """Overhead (median, p99) and the A/A spread per concurrency and page size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(src.read_text())["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, ps in zip(axes, (16, 1)):
        sel = [r for r in rows if "overhead_median_pct" in r and r["page_size"] == ps]
        xs = [str(r["concurrency"]) for r in sel]
        for key, label in (("overhead_median_pct", "tracker overhead, median"),
                           ("overhead_p99_pct", "tracker overhead, p99"),
                           ("aa_spread_median_pct", "A/A spread, median (noise)")):
            ax.plot(xs, [r[key] for r in sel], marker="o", label=label)
        ax.axhline(0.25, color="red", linestyle="--", linewidth=1, label="target 0.25%")
        ax.axhline(-0.25, color="red", linestyle="--", linewidth=1)
        ax.set_title(f"page size {ps}")
        ax.set_xlabel("concurrency (8,192-token contexts)")
    axes[0].set_ylabel("% of decode-step time (CUDA graph)")
    axes[0].legend(fontsize=8)
    fig.suptitle("kvguard on an H200: 8B-shaped model, INT4 weights, FP8 KV")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


def dump(path, payload):
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
