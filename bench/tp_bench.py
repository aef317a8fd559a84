"""kvguard under tensor parallelism: tracker overhead in a TP decode step, and the verdict all-reduce's cost.

    python bench/tp_bench.py --nproc 2 --out bench/results        # 2 H200s, NCCL, llama3-8b INT4, FP8 KV, graphs
    torchrun --nproc-per-node 2 bench/tp_bench.py --out bench/results   # the same under torchrun
    python bench/tp_bench.py --nproc 1 --out /tmp/tp1               # 1 GPU, NCCL world 1: the graphs capture
    python bench/tp_bench.py --nproc 2 --dist-backend gloo --out /tmp/tpg   # 2 ranks on 1 GPU: gloo, eager
    python bench/tp_bench.py --dry-run --out /tmp/tp_bench         # CPU: gloo, tiny shapes, eager, checks the plumbing

Method (as faultlab/gpu/bench.py): each rank builds the same B requests at context ``ctx`` on scattered
pages (its own KV shard: n_kv_heads / world heads), decode steps are captured as CUDA graphs, one per
variant, and replayed interleaved in rotating order (every rank replays the same order, so the NCCL
collectives inside the graphs pair up); medians and p99 per variant over all replays, CUDA events.
Variants (``--variants``): ``noop`` and ``noop2`` (no tracker: A/A noise floor), ``check_local`` (each
rank's tag check, no combine: the single-GPU tracker cost), ``check`` (tag check + the verdict
all-reduce (MAX) of ``kvguard.distributed.RankTracker``: what TP deployments run), ``check_piggyback``
(tag check, the verdict riding as one extra column on the last layer's w_down all-reduce:
``RankTracker(piggyback=True)`` + the check's ride in the forward's ``StepContext``; no all-reduce of its own, no
host sync, captured in the graph like the others). The all-reduce section times ``combine_verdict``
alone (eager and 50-in-a-graph) next to a hidden-state all-reduce of the same batch, [B, hidden], and
the piggyback's [B, hidden + 1].
CUDA graphs need NCCL: with ``--dist-backend gloo`` on GPUs (ranks sharing one GPU) every variant runs
eagerly, timed with perf_counter around a device sync, which checks the plumbing, not the overheads.
On CPU (``--dry-run``) the same steps run eagerly on gloo. Every process has ``NCCL_NVLS_ENABLE=0``.
Rank 0 writes tp_overhead.json and tp_allreduce.json (every rank's rows).
"""
import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch
import torch.distributed as dist

from faultlab.chaos.runner import checking_tracker
from faultlab.engine.config import get_preset
from faultlab.engine.context import StepContext
from faultlab.engine.tp import TPLlamaModel
from faultlab.engine.weights import random_weights
from faultlab.gpu.step import DecodeState
from faultlab.gpu.timing import capture, interleaved, pct
from faultlab.chaos.tp_run import DIST_BACKENDS
from kvguard import TrackerConfig
from kvguard.distributed import RankTracker, combine_verdict, make_rank_tracker


# -- timing ----------------------------------------------------------------------------------------
def eager_interleaved(fns: dict, pairs: int, dev) -> dict:
    """Call fns in rotating order (same order on every rank); seconds per call, per fn."""
    names, out = list(fns), {n: [] for n in fns}
    for fn in fns.values():
        fn()
    for i in range(pairs):
        for n in names[i % len(names):] + names[:i % len(names)]:
            _sync(dev)
            t = time.perf_counter()
            fns[n]()
            _sync(dev)
            out[n].append(time.perf_counter() - t)
    return out


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def summary(times: dict) -> dict:
    """Median and p99 (ms) per variant, and the overheads against ``noop``."""
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    p99 = {k: pct(v, 99) * 1e3 for k, v in times.items()}
    row = {f"step_ms_median_{k}": v for k, v in med.items()} | {f"step_ms_p99_{k}": v for k, v in p99.items()}
    for k in times:
        if k != "noop":
            row[f"overhead_median_pct_{k}"] = 100 * (med[k] / med["noop"] - 1)
            row[f"overhead_p99_pct_{k}"] = 100 * (p99[k] / p99["noop"] - 1)
    return row


# -- the TP decode step ----------------------------------------------------------------------------
VARIANTS = ("noop", "noop2", "check_local", "check", "check_piggyback")


def rank_tracker(state: DecodeState, dev, combine: bool, piggyback: bool = False) -> RankTracker:
    """A ``RankTracker`` holding the same tags and expected rows as ``state.tracker``."""
    t = make_rank_tracker(TrackerConfig(mode="check", log_violations=False), combine=combine, piggyback=piggyback)
    t.attach(num_pages=state.batch * state.width + 1, num_rows=state.batch, max_entries=state.width, device=dev,
             page_size=state.ps)
    flat = state.table.flatten().long()
    t.on_alloc(flat)
    t.record_many(state.rows.long().repeat_interleave(state.width),
                  torch.arange(state.width, device=dev).repeat(state.batch), flat)
    return t


def variant_tracker(name: str, state: DecodeState, dev):
    """The tracker of variant ``name``: the no-op one, or a RankTracker (kvguard.distributed.make_rank_tracker)."""
    if name.startswith("noop"):
        return checking_tracker(on=False)
    return rank_tracker(state, dev, combine=name != "check_local", piggyback=name == "check_piggyback")


def decode_step(state: DecodeState, model, tracker):
    """``DecodeState.step``, handing a piggyback check's ride to the forward (its last all-reduce)."""
    block = state.table.index_select(0, state.rows)  # [B, W] the kernel-visible copy
    check = tracker.validate(block, state.rows, state.n_entries, max_entries=state.width,
                             source=state.table, source_rows=state.rows)
    slots = block.gather(1, state.page_idx).squeeze(1).long() * state.ps + state.offs
    ctx = StepContext.for_decode(state.positions, slots, block, ride=getattr(check, "ride", None))
    logits = model.forward(state.tokens, state.kv, ctx)
    return logits.argmax(-1), (None if check is None else check.verdict)


def verdict_agreement(state: DecodeState, run: dict, dev) -> dict:
    """After timing: rank 0's table gets an out-of-range entry in request 0; every combining variant
    (as timed: the graph replayed, or the eager step) must flag request 0 only, on every rank."""
    names = [n for n in ("check", "check_piggyback") if n in run]
    saved = state.table[0, 0].clone()
    if dist.get_rank() == 0:
        state.table[0, 0] = 1 << 30  # quarantined to the scratch page by the check: safe to run
    flagged = {n: (run[n]()[1].flatten() > 0).tolist() for n in names}  # same order on every rank
    _sync(dev)
    state.table[0, 0] = saved
    want = [True] + [False] * (state.batch - 1)
    assert all(f == want for f in flagged.values()), f"verdicts disagree on a rank-0 fault: {flagged}"
    return {n: "request 0 flagged on every rank" for n in names}


def bench_overhead(model, batch, args, dev, backend) -> dict:
    """One concurrency: the variants' decode steps, interleaved (graphs on NCCL, eager otherwise)."""
    state = DecodeState(model, batch, args.ctx, args.page_size, args.kv_dtype, dev, backend)
    trackers = {n: variant_tracker(n, state, dev) for n in args.variants}
    steps = {n: (lambda t=t: decode_step(state, model, t)) for n, t in trackers.items()}
    dist.barrier()
    first = {}
    if args.eager:
        first = {n: fn() for n, fn in steps.items()}
        times = eager_interleaved(steps, args.pairs, dev)
        run = {n: fn for n, fn in steps.items()}
    else:
        graphs = {n: capture(fn) for n, fn in steps.items()}
        for n, (g, out) in graphs.items():
            g.replay()  # a captured graph's outputs hold values only once it has run
            # copies: verdict_agreement below replays the graphs with a fault, overwriting `out`
            first[n] = tuple(None if x is None else x.clone() for x in out)
        torch.cuda.synchronize()
        times = interleaved({n: g for n, (g, _) in graphs.items()}, args.pairs)
        run = {n: (lambda g=g, out=out: (g.replay(), out)[1]) for n, (g, out) in graphs.items()}
    agree = verdict_agreement(state, run, dev)
    base = first[args.variants[0]][0]
    mismatch = {n: int((out[0] != base).sum()) for n, out in first.items()}
    # NOTE: at <= 2 ranks every variant's tokens are bit-identical (the piggyback's wider all-reduce sums
    # two values, which commutes); at more ranks a wider buffer may be chunked differently (last bits).
    assert dist.get_world_size() > 2 or not any(mismatch.values()), f"a tracker changed clean tokens: {mismatch}"
    for n, (_, verdict) in first.items():
        assert verdict is None or int(verdict.sum()) == 0, f"false positive in {n}"
    row = {"concurrency": batch, "page_size": args.page_size, "context": args.ctx, "kv_dtype": args.kv_dtype,
           "replays_per_variant": args.pairs, "timing": "eager" if args.eager else "cuda_graph",
           "tokens_differing_from_noop": mismatch, "verdict_on_rank0_fault": agree, **summary(times)}
    return row


# -- the all-reduce alone --------------------------------------------------------------------------
def bench_allreduce(batch, hidden, act_dtype, args, dev) -> dict:
    """``combine_verdict`` of B int32 (eager; and per call in a 50-call graph on CUDA) vs a [B, hidden] all-reduce."""
    verdict = torch.zeros(batch, dtype=torch.int32, device=dev)
    hid = torch.zeros(batch, hidden, dtype=act_dtype, device=dev)
    wide = torch.zeros(batch, hidden + 1, dtype=act_dtype, device=dev)  # the piggyback's buffer
    fns = {"verdict": lambda: combine_verdict(verdict), "hidden": lambda: dist.all_reduce(hid),
           "hidden_wide": lambda: dist.all_reduce(wide)}
    dist.barrier()
    t = eager_interleaved(fns, args.reps, dev)
    row = {"batch": batch, "verdict_us_median_eager": statistics.median(t["verdict"]) * 1e6,
           "verdict_us_p99_eager": pct(t["verdict"], 99) * 1e6,
           "hidden_us_median_eager": statistics.median(t["hidden"]) * 1e6,
           "hidden_wide_us_median_eager": statistics.median(t["hidden_wide"]) * 1e6, "hidden_dtype": str(act_dtype)}
    if not args.eager:
        reps = 50
        graphs = {"verdict": capture(lambda: [combine_verdict(verdict) for _ in range(reps)])[0],
                  "hidden": capture(lambda: [dist.all_reduce(hid) for _ in range(reps)])[0],
                  "hidden_wide": capture(lambda: [dist.all_reduce(wide) for _ in range(reps)])[0]}
        tg = interleaved(graphs, 20)
        for k in graphs:
            row[f"{k}_us_median_graph"] = statistics.median(tg[k]) / reps * 1e6
    return row


# -- one rank --------------------------------------------------------------------------------------
def build_model(args, dev, backend) -> TPLlamaModel:
    """This rank's shard of the preset (full random INT4 weights drawn on the device, then sliced)."""
    config = get_preset(args.model)
    weights = random_weights(config, seed=0, weight_dtype="int4", group_size=32 if args.dry_run else 128, device=dev)
    return TPLlamaModel(config, weights, backend=backend)


def rank_main(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    backend = os.environ.get("BENCH_BACKEND", "torch" if args.dry_run else "triton")
    started = time.time()
    log = lambda msg: print(f"[rank {rank} {time.time() - started:7.1f}s] {msg}", flush=True)  # noqa: E731
    _warm(dev)
    model = build_model(args, dev, backend)
    overhead = []
    for batch in args.batches:
        overhead.append(bench_overhead(model, batch, args, dev, backend))
        log(f"overhead B={batch}: {json.dumps(overhead[-1])}")
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    allreduce = []
    for batch in (*args.batches, 128, 256):
        allreduce.append(bench_allreduce(batch, model.config.hidden, model.act_dtype, args, dev))
        log(f"all-reduce B={batch}: {json.dumps(allreduce[-1])}")
    _write(args, {"overhead": overhead, "allreduce": allreduce}, world, dev)


def _warm(dev) -> None:
    """One collective before any graph capture (the communicator is created outside a capture)."""
    x = torch.zeros(1, device=dev)
    dist.all_reduce(x)
    _sync(dev)


def _write(args, mine: dict, world: int, dev) -> None:
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return
    meta = {"command": "python " + " ".join(sys.argv), "world": world, "model": args.model,
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "backend": dist.get_backend(), "gpu_count": torch.cuda.device_count() if dev.type == "cuda" else 0,
            "timing": "eager" if args.eager else "cuda_graph", "variants": list(args.variants),
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
            "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for key in ("overhead", "allreduce"):
        path = out / f"tp_{key}.json"
        path.write_text(json.dumps({**meta, "ranks": [g[key] for g in gathered]}, indent=2))
        print(f"wrote {path}", flush=True)


# -- launch ----------------------------------------------------------------------------------------
def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    _init(args, rank, world, f"tcp://127.0.0.1:{port}")
    try:
        rank_main(args)
    finally:
        dist.destroy_process_group()


def _init(args, rank: int, world: int, init_method: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.dry_run:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        return
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(args.dist_backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtype", default="fp8")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--pairs", type=int, default=None, help="replays per variant (60; dry run 10)")
    p.add_argument("--reps", type=int, default=None, help="eager all-reduce calls per variant (200; dry run 100)")
    p.add_argument("--dist-backend", default="auto", choices=DIST_BACKENDS,
                   help="auto: nccl when every rank has its own GPU, else gloo (eager, no graphs)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="decode-step variants, replayed interleaved; the first is the baseline (noop)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.variants[0] != "noop":
        p.error("--variants must start with noop (the baseline of the overheads)")
    if args.dry_run:
        args.model, args.ctx, args.dist_backend = "tiny", 40, "gloo"
    elif args.dist_backend == "auto":
        world = int(os.environ.get("WORLD_SIZE", args.nproc))
        args.dist_backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    args.eager = args.dry_run or args.dist_backend == "gloo"  # gloo collectives cannot be graph-captured
    args.pairs = args.pairs or (10 if args.eager else 60)
    args.reps = args.reps or (100 if args.eager else 200)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # torchrun
        _init(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
        try:
            rank_main(args)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    from faultlab.chaos.tp_run import free_port

    mp.spawn(_spawned, args=(args.nproc, free_port(), args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
