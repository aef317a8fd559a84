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

from faultlab.engine.config import get_preset  # noqa: E402
from faultlab.engine.kvcache import PagedKVCache, ResidualLayout, token_bytes  # noqa: E402
from faultlab.engine.model import LlamaModel  # noqa: E402
from faultlab.engine.weights import Int4Weight, random_weights  # noqa: E402
from kvguard import NoopTracker, TagTracker, TrackerConfig  # noqa: E402


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


# -- measurement helpers ---------------------------------------------------------------------------
def copy_bandwidth(dev) -> float:
    """Device-to-device copy, GB/s of bytes read + written (the roofline's ceiling)."""
    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    times = timed(lambda: y.copy_(x), reps=20)
    del x, y
    return 2 * n / statistics.median(times) / 1e9


def timed(fn, reps=20, warmup=3) -> list[float]:
    """Seconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    marks = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        marks.append((a, b))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in marks]


def capture(fn):
    """A CUDA graph of fn (warmed up on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def interleaved(graphs: dict, pairs: int) -> dict:
    """Replay graphs in rotating order; seconds per replay, per graph."""
    names = list(graphs)
    marks = {n: [] for n in names}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    for i in range(pairs):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[n].replay()
            b.record()
            marks[n].append((a, b))
    torch.cuda.synchronize()
    return {n: [a.elapsed_time(b) / 1e3 for a, b in m] for n, m in marks.items()}


# -- the decode step -------------------------------------------------------------------------------
class DecodeState:
    """B requests at context ``ctx`` on scattered pages, with their expected tags recorded."""

    def __init__(self, model, batch, ctx, page_size, kv_dtype, dev, backend, seed=0, rotate_k=None, residual=False):
        c = model.config
        self.ps, self.batch = page_size, batch
        self.width = -(-(ctx + 1) // page_size)
        num_pages = batch * self.width
        layout = ResidualLayout.of(batch, page_size) if residual else None  # first 16, last 128 tokens
        self.kv = PagedKVCache(c.n_layers, num_pages, page_size, c.n_kv_heads, c.head_dim, dtype=kv_dtype,
                               device=dev, backend=backend, rotate_k=rotate_k, residual=layout)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        pages = (torch.randperm(num_pages, generator=gen) + 1).view(batch, self.width)  # scattered pages
        self.table = pages.to(dev, torch.int32)
        self.rows = torch.arange(batch, dtype=torch.int32, device=dev)
        self.n_entries = torch.full((batch,), self.width, dtype=torch.int32, device=dev)
        self.positions = torch.full((batch,), ctx, dtype=torch.int64, device=dev)
        self.tokens = torch.randint(3, c.vocab, (batch,), generator=gen).to(dev)
        self.page_idx = (self.positions // page_size)[:, None]
        self.offs = self.positions % page_size
        for layer in range(c.n_layers):  # random KV content (what a prefill would have left)
            for cache in (self.kv.k[layer], self.kv.v[layer]):
                cache.view(torch.uint8 if cache.dtype == torch.float8_e4m3fn else cache.dtype)[1:num_pages + 1] \
                    .copy_(_noise(cache, num_pages))
            if self.kv.residual is not None:
                for res in (self.kv.k_res[layer], self.kv.v_res[layer]):
                    res.view(torch.uint8).copy_(_noise(res, res.shape[0]))
        self.tracker = TagTracker(TrackerConfig(mode="check", log_violations=False))
        self.tracker.attach(num_pages=num_pages + 1, num_rows=batch, max_entries=self.width, device=dev,
                            page_size=page_size)
        flat = self.table.flatten().long()
        self.tracker.on_alloc(flat)
        self.tracker.record_many(self.rows.long().repeat_interleave(self.width),
                                 torch.arange(self.width, device=dev).repeat(batch), flat)

    def step(self, model, tracker):
        block = self.table.index_select(0, self.rows)  # [B, W] the kernel-visible copy
        check = tracker.validate(block, self.rows, self.n_entries, max_entries=self.width,
                                 source=self.table, source_rows=self.rows)
        slots = block.gather(1, self.page_idx).squeeze(1).long() * self.ps + self.offs
        rows = {} if self.kv.residual is None else {"rows": self.rows}
        logits = model.decode(self.tokens, self.positions, self.kv, block, slots, **rows)
        return logits.argmax(-1), (None if check is None else check.verdict)


def _noise(cache, num_pages):
    shape = (num_pages, *cache.shape[1:])
    if cache.dtype == torch.float8_e4m3fn:
        return torch.randint(0, 120, shape, dtype=torch.uint8, device=cache.device)  # |x| < ~1 in e4m3
    return (torch.randn(shape, device=cache.device) * 0.5).to(cache.dtype)


def weight_bytes(model) -> int:
    total = model.embedding.numel() * model.embedding.element_size() // model.config.vocab  # one row
    mats = [model.output] + [w for layer in model.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    for w in mats:
        if isinstance(w, Int4Weight):
            total += w.qweight.numel() + 2 * w.scales.numel() * w.scales.element_size()
        else:
            total += w.numel() * w.element_size()
    return total


def bench_step(model, batch, ctx, ps, kv_dtype, dev, backend, pairs, dry):
    state = DecodeState(model, batch, ctx, ps, kv_dtype, dev, backend)
    noop, check = NoopTracker(), state.tracker
    if dry:
        a, _ = state.step(model, noop)
        b, verdict = state.step(model, check)
        assert torch.equal(a, b) and int(verdict.sum()) == 0, "check changed a clean step"
        return {"dry_run": True}, state
    g_a, _ = capture(lambda: state.step(model, noop))
    g_a2, _ = capture(lambda: state.step(model, noop))
    g_b, (_, verdict) = capture(lambda: state.step(model, check))
    t = interleaved({"noop": g_a, "noop2": g_a2, "check": g_b}, pairs)
    assert int(verdict.sum()) == 0, "false positive in the benchmark"
    med = {k: statistics.median(v) for k, v in t.items()}
    p99 = {k: pct(v, 99) for k, v in t.items()}
    kv_bytes = batch * (ctx + 1) * token_bytes(model.config.n_layers, model.config.n_kv_heads,
                                               model.config.head_dim, kv_dtype)
    row = {
        "concurrency": batch, "page_size": ps, "context": ctx, "kv_dtype": kv_dtype,
        "step_ms_median_noop": med["noop"] * 1e3, "step_ms_median_check": med["check"] * 1e3,
        "step_ms_p99_noop": p99["noop"] * 1e3, "step_ms_p99_check": p99["check"] * 1e3,
        "overhead_median_pct": 100 * (med["check"] / med["noop"] - 1),
        "overhead_p99_pct": 100 * (p99["check"] / p99["noop"] - 1),
        "aa_spread_median_pct": 100 * (med["noop2"] / med["noop"] - 1),
        "aa_spread_p99_pct": 100 * (p99["noop2"] / p99["noop"] - 1),
        "tokens_per_s_noop": batch / med["noop"], "tokens_per_s_check": batch / med["check"],
        "kv_bytes_read": kv_bytes, "replays_per_variant": pairs,
    }
    del g_a, g_a2, g_b
    return row, state


def bench_kernel_alone(state, dev):
    """The validation kernel alone (eager launches, do_bench-style) against its sector floor."""
    from kvguard.kernels.tag_check import tag_check

    tr = state.tracker
    block = state.table.clone()
    fn = lambda: tag_check(block, state.rows, state.rows, state.n_entries, tr.tags.tags, tr.expected,  # noqa: E731
                           max_entries=state.width)
    reps = 50  # NOTE: 50 back-to-back launches in one graph: per-launch time without the replay's own latency
    g, _ = capture(lambda: [fn() for _ in range(reps)])
    g1, _ = capture(fn)
    t_graph = statistics.median(timed(g.replay, reps=50)) / reps
    t_single = statistics.median(timed(g1.replay, reps=200))
    t_eager = statistics.median(timed(fn, reps=200))
    n = state.batch * state.width
    sectors = n * 32 + n * 4 + n * 8  # one 32-byte sector per random tag gather; table + expected rows
    return {"concurrency": state.batch, "page_size": state.ps, "entries": n, "kernel_us_graph": t_graph * 1e6, "single_launch_graph_replay_us": t_single * 1e6,
            "kernel_us_eager": t_eager * 1e6, "sector_bytes": sectors}


# -- sections --------------------------------------------------------------------------------------
def build(name, weights, dev, backend, dry):
    config = get_preset(name)
    w = random_weights(config, seed=0, weight_dtype=weights, group_size=128 if not dry else 32, device=dev)
    return LlamaModel(config, w, backend=backend)


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


class _CheckOnly:
    """Just what the validation kernel reads: a scattered page table, tags and expected tags."""

    def __init__(self, batch, ctx, page_size, dev):
        self.batch, self.ps = batch, page_size
        self.width = -(-(ctx + 1) // page_size)
        num_pages = batch * self.width
        self.table = (torch.randperm(num_pages) + 1).view(batch, self.width).to(dev, torch.int32)
        self.rows = torch.arange(batch, dtype=torch.int32, device=dev)
        self.n_entries = torch.full((batch,), self.width, dtype=torch.int32, device=dev)
        self.tracker = TagTracker(TrackerConfig(mode="check", log_violations=False))
        self.tracker.attach(num_pages=num_pages + 1, num_rows=batch, max_entries=self.width, device=dev)
        flat = self.table.flatten().long()
        self.tracker.on_alloc(flat)
        self.tracker.record_many(self.rows.long().repeat_interleave(self.width),
                                 torch.arange(self.width, device=dev).repeat(batch), flat)


def section_kernel(args, dev, log):
    bw = copy_bandwidth(dev)
    rows = []
    for ps in (16, 1):
        for batch in (1, 8, 64, 128):
            row = bench_kernel_alone(_CheckOnly(batch, args.ctx, ps, dev), dev)
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
    fn = lambda: model.prefill(tokens, 0, kv, row, slots, last_only=True)  # noqa: E731
    if args.dry_run:
        fn()
        return {"tokens": n, "dry_run": True}
    t = timed(fn, reps=5, warmup=2)
    return {"tokens": n, "ms_median": statistics.median(t) * 1e3, "tokens_per_s": n / statistics.median(t)}


def section_sanitizer(args, log):
    """compute-sanitizer memcheck over decode steps whose tables hold out-of-range and negative ids."""
    out = {}
    for mode in ("on", "off"):
        cmd = ["compute-sanitizer", "--tool", "memcheck", sys.executable, "-m", "faultlab.gpubench",
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
    tracker = state.tracker if mode == "on" else NoopTracker()
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
