"""Tensor-parallel chaos driver: N ranks on gloo (CPU), a rank-local fault, every rank must abort the same requests.

    python -m faultlab.tp_run --nproc 2 --fault rank_divergent_entry --seeds 20
    python -m faultlab.tp_run --nproc 2 --fault rank_divergent_entry --seeds 5 --no-combine   # the failure mode
    torchrun --nproc-per-node 2 -m faultlab.tp_run --fault rank_divergent_entry --seeds 5     # torchrun env

Per seed every rank runs the same workload twice on a ``TPEngine`` with a ``RankTracker``: fault-free,
then with the fault (same seed on every rank; the fault picks one rank). Each rank has its own oracle;
a request is a victim if any rank's oracle says so. The parent checks, per seed: the ranks aborted the
same requests at the same steps and streamed the same tokens, no abort outside the victims, no victim
left running, no hang (processes joined under a deadline, collectives under a gloo timeout), and that
the fault-free TP outputs equal a single-process engine's. It also compares TP and single-process
logits of one prefill + decode (fp32 KV).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from faultlab.engine.engine import Engine, EngineConfig, load_model  # noqa: E402
from faultlab.engine.kvcache import PagedKVCache  # noqa: E402
from faultlab.scenario import Scenario, WorkloadSpec  # noqa: E402
from faultlab.chaos import _drive  # noqa: E402


@dataclass(frozen=True)
class RunSpec:
    """What every rank runs (picklable: sent to the spawned workers)."""

    fault: str | None = "rank_divergent_entry"
    seeds: tuple[int, ...] = (0,)
    engine: EngineConfig = EngineConfig(model="tiny", kv_dtype="fp32", weight_dtype="int4", page_size=16,
                                        num_pages=48, max_running=4)
    workload: WorkloadSpec = WorkloadSpec(requests=8, prompt_len=(6, 30), output_len=(6, 16), concurrency=4,
                                          shared_prefix_fraction=0.5, shared_prefix_len=32,
                                          arrival="staggered", arrivals_per_step=2)
    step_range: tuple[int, int] = (2, 8)
    combine: bool = True
    verify_schedule: bool = True
    collective_timeout_s: float = 30.0
    check_logits: bool = True


# -- one rank ------------------------------------------------------------------------------------------
def logits_check(config: EngineConfig, group=None) -> float:
    """Max |TP logits - single-process logits| over a 20-token prefill and one decode step (fp32 KV)."""
    from faultlab.engine.tp import load_tp_model

    full, _ = load_model(config.model, config.weight_dtype, config.backend, config.device, config.seed)
    tp = load_tp_model(config.model, config.weight_dtype, config.backend, config.device, config.seed, group)
    return float((_probe(full) - _probe(tp)).abs().max())


def _probe(model) -> torch.Tensor:
    """Logits [21, vocab] of a fixed prompt's prefill and one decode step, on a fresh fp32 cache."""
    c, ps, n = model.config, 16, 20
    kv = PagedKVCache(c.n_layers, 4, ps, c.n_kv_heads, c.head_dim, dtype="fp32", device=model.device)
    row = torch.tensor([3, 1, 4, 2], dtype=torch.int32)
    pos = torch.arange(n + 1)
    slots = row.long()[pos // ps] * ps + pos % ps
    prompt = (torch.arange(n) * 7 + 3) % c.vocab
    prefill = model.prefill(prompt, 0, kv, row, slots[:n])
    decode = model.decode(torch.tensor([5]), pos[n:], kv, row[None], slots[n:])
    return torch.cat([prefill, decode])


def make_arrivals(spec: RunSpec, seed: int):
    """The seed's workload (the chaos runner's generator)."""
    from faultlab.chaos import make_workload
    from faultlab.engine.config import get_preset

    scenario = Scenario(name="tp", workload=spec.workload, engine=spec.engine)
    return make_workload(scenario, seed, get_preset(spec.engine.model).vocab)


def run_case(spec: RunSpec, seed: int, fault: str | None, group=None) -> dict:
    """One TP case on this rank: aborts, this rank's oracle victims, outputs, injections."""
    from kvguard import TrackerConfig
    from kvguard.distributed import RankTracker
    from prometheus_client import CollectorRegistry

    from faultlab.engine.tp import TPEngine
    from faultlab.faults.injector import Injector, Trigger
    from faultlab.oracle import Oracle

    oracle, observers, injector = Oracle(), [], None
    if fault is not None:
        trigger = Trigger(mode="step", step=random.Random(seed ^ 0x5EED).randint(*spec.step_range))
        injector = Injector(fault, trigger, 1, seed)
        observers.append(injector)
    tracker = RankTracker(TrackerConfig(mode="check", log_violations=False), CollectorRegistry(), group=group,
                          combine=spec.combine)
    engine = TPEngine(spec.engine, tracker=tracker, observers=[*observers, oracle], group=group,
                      verify_schedule=spec.verify_schedule)
    arrivals = make_arrivals(spec, seed)
    _drive(engine, arrivals)
    rep = oracle.report
    return {"aborts": dict(rep.aborted_by_tracker), "victims": dict(rep.victims), "steps": engine.step_id,
            "injected": injector.injected if injector else [],
            "outputs": {r.rid: [r.status, list(r.output)] for _, r in arrivals}}


def rank_main(spec: RunSpec, group=None) -> dict:
    """Everything one rank runs: the logits check, then per seed a fault-free and a faulty case."""
    out = {"rank": dist.get_rank(), "logits_max_abs_diff": None, "cases": {}, "error": None}
    try:
        if spec.check_logits:
            out["logits_max_abs_diff"] = logits_check(spec.engine, group)
        for seed in spec.seeds:
            t = time.perf_counter()
            case = {"clean": run_case(spec, seed, None, group)}
            if spec.fault is not None:
                case["fault"] = run_case(spec, seed, spec.fault, group)
            case["seconds"] = time.perf_counter() - t
            out["cases"][seed] = case
    except Exception as err:  # a divergence or a collective timeout: report it; the group may be unusable
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc(limit=6)
    return out


def _worker(rank: int, world: int, port: int, spec: RunSpec, queue) -> None:
    """A spawned rank: init gloo, run, put the result on the queue."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
    try:
        queue.put(rank_main(spec))
    finally:
        dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: RunSpec, nproc: int = 2, deadline_s: float = 600.0) -> tuple[list[dict], list[int]]:
    """Spawn ``nproc`` gloo ranks; (their results, ranks that did not finish by the deadline = hangs)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, spec, queue), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    results, end = [], time.monotonic() + deadline_s
    while len(results) < nproc and time.monotonic() < end:
        try:
            results.append(queue.get(timeout=1.0))
        except Exception:  # queue.Empty, or a dead rank
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    hung = [r for r, p in enumerate(procs) if _join(p, end)]
    return sorted(results, key=lambda r: r["rank"]), hung


def _join(proc, end: float) -> bool:
    """Join one of our ranks by the deadline; True (and terminated) if it is still running."""
    proc.join(max(0.0, end - time.monotonic()) + 5.0)
    if proc.is_alive():
        proc.terminate()
        proc.join(5.0)
        return True
    return False


def single_process(spec: RunSpec, seed: int) -> dict:
    """The fault-free outputs of the same workload on the single-process engine."""
    from faultlab.chaos import _drive as drive

    engine = Engine(spec.engine)
    arrivals = make_arrivals(spec, seed)
    drive(engine, arrivals)
    return {r.rid: [r.status, list(r.output)] for _, r in arrivals}


def judge(spec: RunSpec, results: list[dict], hung: list[int], nproc: int) -> dict:
    """Per-seed verdicts across ranks, and the totals."""
    rows, errors = [], [r["error"] for r in results if r["error"]]
    for seed in spec.seeds:
        cases = [r["cases"].get(seed) for r in results]
        if len(cases) < nproc or any(c is None for c in cases):
            rows.append({"seed": seed, "completed": False})
            continue
        rows.append(_judge_seed(spec, seed, cases))
    done = [r for r in rows if r["completed"]]
    totals = {
        "seeds": len(spec.seeds), "completed": len(done), "hangs": len(hung), "errors": errors,
        "injected": sum(r.get("injected", 0) for r in done),
        "same_aborts_all_ranks": sum(r.get("same_aborts", False) for r in done),
        "false_aborts": sum(r.get("false_aborts", 0) for r in done),
        "missed_victims": sum(r.get("missed_victims", 0) for r in done),
        "tp_equals_single_process": sum(r["tp_equals_single"] for r in done),
        "nonvictim_mismatches": sum(r.get("nonvictim_mismatches", 0) for r in done),
        "logits_max_abs_diff": max((r["logits_max_abs_diff"] or 0.0) for r in results) if results else None,
    }
    totals["ok"] = (not hung and not errors and len(done) == len(spec.seeds) and totals["false_aborts"] == 0
                    and totals["tp_equals_single_process"] == len(done)
                    and (spec.fault is None or (totals["same_aborts_all_ranks"] == len(done)
                                                 and totals["missed_victims"] == 0)))
    return {"totals": totals, "seeds": rows}


def _judge_seed(spec: RunSpec, seed: int, cases: list[dict]) -> dict:
    clean, single = [c["clean"] for c in cases], single_process(spec, seed)
    row = {"seed": seed, "completed": True, "seconds": round(max(c["seconds"] for c in cases), 2),
           "tp_equals_single": all(c["outputs"] == single for c in clean),
           "clean_aborts": sum(len(c["aborts"]) for c in clean)}
    if spec.fault is None:
        row["false_aborts"] = row["clean_aborts"]
        return row
    faulty = [c["fault"] for c in cases]
    victims = set().union(*(c["victims"] for c in faulty))
    aborts = [c["aborts"] for c in faulty]
    row.update(injected=len(faulty[0]["injected"]), fault_rank=[i.get("rank") for i in faulty[0]["injected"]],
               victims=sorted(victims), aborts=aborts[0],
               same_aborts=all(a == aborts[0] for a in aborts) and all(f["outputs"] == faulty[0]["outputs"]
                                                                      for f in faulty),
               false_aborts=len(set().union(*aborts) - victims) + row["clean_aborts"],
               missed_victims=len(victims - set().union(*aborts)))
    base = clean[0]["outputs"]
    row["nonvictim_mismatches"] = sum(out != base[rid] for rid, out in faulty[0]["outputs"].items()
                                      if rid not in victims and out[0] == "finished")
    return row


def print_report(report: dict) -> None:
    for row in report["seeds"]:
        print(json.dumps({k: v for k, v in row.items() if k not in ("aborts",)}))
    print("TOTALS", json.dumps(report["totals"], indent=2))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m faultlab.tp_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--fault", default="rank_divergent_entry", help="a fault name, or 'none'")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--kv-dtype", default="fp32", choices=("fp32", "bf16", "fp8"))
    p.add_argument("--weight-dtype", default="int4", choices=("int4", "bf16", "fp32"))
    p.add_argument("--no-combine", action="store_true", help="keep verdicts rank-local (shows the failure)")
    p.add_argument("--no-verify-schedule", action="store_true", help="no per-step scheduler agreement check")
    p.add_argument("--collective-timeout", type=float, default=30.0)
    p.add_argument("--deadline", type=float, default=900.0, help="seconds before a rank counts as hung")
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


def spec_from_args(args) -> RunSpec:
    base = RunSpec()
    return replace(base, fault=None if args.fault == "none" else args.fault,
                   seeds=tuple(range(args.first_seed, args.first_seed + args.seeds)),
                   engine=replace(base.engine, kv_dtype=args.kv_dtype, weight_dtype=args.weight_dtype),
                   combine=not args.no_combine, verify_schedule=not args.no_verify_schedule,
                   collective_timeout_s=args.collective_timeout)


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = spec_from_args(args)
    torch.set_num_threads(1)  # the single-process reference runs beside the ranks (tiny shapes)
    if "LOCAL_RANK" in os.environ:  # launched by torchrun: this process is one rank
        return _torchrun_rank(spec, args)
    started = time.perf_counter()
    results, hung = launch(spec, args.nproc, args.deadline)
    report = judge(spec, results, hung, args.nproc)
    report["totals"]["wall_s"] = round(time.perf_counter() - started, 1)
    report["spec"] = asdict(spec)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if report["totals"]["ok"] else 1


def _torchrun_rank(spec: RunSpec, args) -> int:
    """One rank under torchrun (env://): gather every rank's result on rank 0, which judges."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.collective_timeout_s))
    mine = rank_main(spec)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    ok = True
    if dist.get_rank() == 0:
        report = judge(spec, gathered, [], dist.get_world_size())
        print_report(report)
        ok = report["totals"]["ok"]
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
