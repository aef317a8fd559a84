"""kvguard under tensor parallelism: tracker overhead in a TP decode step, and the verdict all-reduce's cost.

    python bench/tp_bench.py --nproc 2 --out bench/results        # 2 H200s, NCCL, llama3-8b INT4, FP8 KV, graphs
    torchrun --nproc-per-node 2 bench/tp_bench.py --out bench/results   # the same under torchrun
    python bench/tp_bench.py --dry-run --out /tmp/tp_bench         # CPU: gloo, tiny shapes, eager, checks the plumbing

Method (as faultlab/gpubench.py): each rank builds the same B requests at context ``ctx`` on scattered
pages (its own KV shard: n_kv_heads / world heads), decode steps are captured as CUDA graphs, one per
variant, and replayed interleaved in rotating order (every rank replays the same order, so the NCCL
collectives inside the graphs pair up); medians and p99 per variant over all replays, CUDA events.
Variants: ``noop`` and ``noop2`` (no tracker: A/A noise floor), ``check_local`` (each rank's tag check,
no combine: the single-GPU tracker cost), ``check`` (tag check + the verdict all-reduce (MAX) of
``kvguard.distributed.RankTracker``: what TP deployments run). The all-reduce section times
``combine_verdict`` alone (eager and 50-in-a-graph) next to a hidden-state all-reduce of the same batch.
On CPU (``--dry-run``) the same steps run eagerly on gloo, timed with perf_counter.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from faultlab.engine.config import get_preset  # noqa: E402
from faultlab.engine.tp import TPLlamaModel  # noqa: E402
from faultlab.engine.weights import random_weights  # noqa: E402
from faultlab.gpubench import DecodeState, capture, interleaved, pct  # noqa: E402
from kvguard import NoopTracker, TrackerConfig  # noqa: E402
from kvguard.distributed import RankTracker, combine_verdict  # noqa: E402


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
def rank_tracker(state: DecodeState, dev, combine: bool) -> RankTracker:
    """A ``RankTracker`` holding the same tags and expected rows as ``state.tracker``."""
    t = RankTracker(TrackerConfig(mode="check", log_violations=False), combine=combine)
    t.attach(num_pages=state.batch * state.width + 1, num_rows=state.batch, max_entries=state.width, device=dev,
             page_size=state.ps)
    flat = state.table.flatten().long()
    t.on_alloc(flat)
    t.record_many(state.rows.long().repeat_interleave(state.width),
                  torch.arange(state.width, device=dev).repeat(state.batch), flat)
    return t


def bench_overhead(model, batch, args, dev, backend) -> dict:
    """One concurrency: interleaved noop / noop2 / check_local / check decode steps."""
    state = DecodeState(model, batch, args.ctx, args.page_size, args.kv_dtype, dev, backend)
    trackers = {"noop": NoopTracker(), "noop2": NoopTracker(), "check_local": rank_tracker(state, dev, False),
                "check": rank_tracker(state, dev, True)}
    steps = {n: (lambda t=t: state.step(model, t)) for n, t in trackers.items()}
    dist.barrier()
    if args.dry_run:
        ids = {n: fn()[0] for n, fn in steps.items()}
        assert all(torch.equal(ids["noop"], v) for v in ids.values()), "a tracker changed a clean step"
        times = eager_interleaved(steps, args.pairs, dev)
    else:
        graphs = {}
        for n, fn in steps.items():
            graphs[n], (_, verdict) = capture(fn)
            assert verdict is None or int(verdict.sum()) == 0, f"false positive in {n}"
        times = interleaved(graphs, args.pairs)
    row = {"concurrency": batch, "page_size": args.page_size, "context": args.ctx, "kv_dtype": args.kv_dtype,
           "replays_per_variant": args.pairs, **summary(times)}
    del state
    return row


# -- the all-reduce alone --------------------------------------------------------------------------
def bench_allreduce(batch, hidden, act_dtype, args, dev) -> dict:
    """``combine_verdict`` of B int32 (eager; and per call in a 50-call graph on CUDA) vs a [B, hidden] all-reduce."""
    verdict = torch.zeros(batch, dtype=torch.int32, device=dev)
    hid = torch.zeros(batch, hidden, dtype=act_dtype, device=dev)
    fns = {"verdict": lambda: combine_verdict(verdict), "hidden": lambda: dist.all_reduce(hid)}
    dist.barrier()
    t = eager_interleaved(fns, args.reps, dev)
    row = {"batch": batch, "verdict_us_median_eager": statistics.median(t["verdict"]) * 1e6,
           "verdict_us_p99_eager": pct(t["verdict"], 99) * 1e6,
           "hidden_us_median_eager": statistics.median(t["hidden"]) * 1e6, "hidden_dtype": str(act_dtype)}
    if dev.type == "cuda":
        reps = 50
        g, _ = capture(lambda: [combine_verdict(verdict) for _ in range(reps)])
        gh, _ = capture(lambda: [dist.all_reduce(hid) for _ in range(reps)])
        tg = interleaved({"verdict": g, "hidden": gh}, 20)
        row["verdict_us_median_graph"] = statistics.median(tg["verdict"]) / reps * 1e6
        row["hidden_us_median_graph"] = statistics.median(tg["hidden"]) / reps * 1e6
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
            "backend": dist.get_backend(), "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M")}
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
    if args.dry_run:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        return
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
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
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.ctx = "tiny", 40
    args.pairs = args.pairs or (10 if args.dry_run else 60)
    args.reps = args.reps or (100 if args.dry_run else 200)
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

    from faultlab.tp_run import free_port

    mp.spawn(_spawned, args=(args.nproc, free_port(), args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
