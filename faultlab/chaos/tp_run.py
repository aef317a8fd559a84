"""Tensor-parallel chaos driver: N ranks (gloo on CPU; gloo or NCCL on CUDA), a rank-local fault, every rank must abort the same requests.

    python -m faultlab.chaos.tp_run --nproc 2 --fault rank_divergent_entry --seeds 20
    python -m faultlab.chaos.tp_run --nproc 2 --fault rank_divergent_entry --seeds 5 --no-combine   # the failure mode
    python -m faultlab.chaos.tp_run --nproc 2 --seeds 20 --piggyback        # verdict rides on the last all-reduce
    python -m faultlab.chaos.tp_run --nproc 2 --seeds 20 --device cuda      # NCCL on >= 2 GPUs, else gloo on one
    torchrun --nproc-per-node 2 -m faultlab.chaos.tp_run --fault rank_divergent_entry --seeds 5     # torchrun env

``--device cuda``: rank r runs on ``cuda:(r % device_count)`` with the Triton kernels and the engine's
CUDA activation dtype (bf16). ``--dist-backend auto`` picks NCCL when there are at least ``nproc`` GPUs,
else gloo (gloo all-reduces CUDA tensors through the host, so 2 ranks can share one GPU for a plumbing
run; NCCL refuses two ranks on one GPU). Every process gets ``NCCL_NVLS_ENABLE=0``. On CUDA the TP
logits differ from the single process by bf16 rounding (each rank rounds its partial sums before the
all-reduce), so the logits check uses a tolerance relative to the logits' scale and the token-for-token
comparison with the single-process engine is reported but not required (greedy near-ties can flip).

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
import socket
import sys
import time
from dataclasses import asdict, replace

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from faultlab.engine.choices import check_choice  # noqa: E402
from faultlab.engine.factory import make_engine  # noqa: E402
from faultlab.engine.options import KV_DTYPES, WEIGHT_DTYPES  # noqa: E402
from faultlab.chaos.tp_rank import RunSpec, init_rank, make_arrivals, rank_engine, rank_main, worker  # noqa: E402

__all__ = ["RunSpec", "free_port", "judge", "launch", "main", "resolve_backend"]

DIST_BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("cpu", "cuda")


def resolve_backend(device: str, requested: str, nproc: int) -> str:
    """The process-group backend: gloo on CPU; on CUDA NCCL if every rank has its own GPU, else gloo."""
    check_choice("--device", device, DEVICES)
    check_choice("--dist-backend", requested, DIST_BACKENDS)
    if device == "cpu":
        if requested == "nccl":
            raise ValueError("--dist-backend nccl needs --device cuda")
        return "gloo"
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    gpus = torch.cuda.device_count()
    if requested == "auto":
        return "nccl" if gpus >= nproc else "gloo"
    if requested == "nccl" and gpus < nproc:
        raise ValueError(f"--dist-backend nccl: {nproc} ranks on {gpus} GPU(s); NCCL refuses two ranks on one "
                         f"GPU (use gloo, or --nproc {gpus})")
    return requested


# -- the parent ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: RunSpec, nproc: int = 2, deadline_s: float = 600.0) -> tuple[list[dict], list[int]]:
    """Spawn ``nproc`` ranks; (their results, ranks that did not finish by the deadline = hangs)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, nproc, port, spec, queue), daemon=True) for r in range(nproc)]
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
    from faultlab.chaos.runner import drive

    engine = make_engine(rank_engine(spec, 0))
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
    if spec.check_logits and results:
        totals["logits_ok"] = all(r.get("logits_ok", False) for r in results)
        totals["piggyback_probe_ok"] = all(r.get("piggyback_ok", False) for r in results)
        totals["logits_top1_agree_min"] = min(r.get("logits_top1_agree", 0.0) for r in results)
    totals["ok"] = (not hung and not errors and len(done) == len(spec.seeds) and totals["false_aborts"] == 0
                    and (totals["tp_equals_single_process"] == len(done) or not spec.exact)
                    and totals.get("logits_ok", True) and totals.get("piggyback_probe_ok", True)
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
    if "run" in report:
        print("RUN", json.dumps(report["run"]))
    for row in report["seeds"]:
        print(json.dumps({k: v for k, v in row.items() if k not in ("aborts",)}))
    print("TOTALS", json.dumps(report["totals"], indent=2))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m faultlab.chaos.tp_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--fault", default="rank_divergent_entry", help="a fault name, or 'none'")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0)
    base = RunSpec().engine
    p.add_argument("--kv-dtype", default=base.kv_dtype, choices=tuple(KV_DTYPES))
    p.add_argument("--weight-dtype", default=base.weight_dtype, choices=WEIGHT_DTYPES)
    p.add_argument("--model", default=base.model,
                   help="a random-weight preset of faultlab/engine/config.py (tiny, llama3-8b)")
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="cuda: rank r on cuda:(r %% device_count), Triton kernels, bf16 activations")
    p.add_argument("--dist-backend", default="auto", choices=DIST_BACKENDS,
                   help="auto: gloo on CPU; on CUDA nccl with >= nproc GPUs, else gloo (ranks share GPUs)")
    p.add_argument("--piggyback", action="store_true",
                   help="the verdict rides on the step's last all-reduce instead of its own")
    p.add_argument("--no-combine", action="store_true", help="keep verdicts rank-local (shows the failure)")
    p.add_argument("--no-verify-schedule", action="store_true", help="no per-step scheduler agreement check")
    p.add_argument("--collective-timeout", type=float, default=30.0)
    p.add_argument("--deadline", type=float, default=900.0, help="seconds before a rank counts as hung")
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


def spec_from_args(args, nproc: int) -> RunSpec:
    """The run's spec; raises ValueError on a bad device / backend / model choice."""
    from faultlab.engine.config import get_preset

    if args.model == "smollm2":
        raise ValueError("--model smollm2: TP runs random-weight presets only (the GGUF loader is single-process)")
    get_preset(args.model)  # an unknown name raises, naming the presets
    base = RunSpec()
    return replace(base, fault=None if args.fault == "none" else args.fault,
                   seeds=tuple(range(args.first_seed, args.first_seed + args.seeds)),
                   engine=replace(base.engine, model=args.model, kv_dtype=args.kv_dtype,
                                  weight_dtype=args.weight_dtype),
                   combine=not args.no_combine, verify_schedule=not args.no_verify_schedule,
                   collective_timeout_s=args.collective_timeout, device=args.device,
                   dist_backend=resolve_backend(args.device, args.dist_backend, nproc), piggyback=args.piggyback)


def run_info(spec: RunSpec, nproc: int, argv) -> dict:
    """What the report records about the run: command line, device, backend, GPUs, model."""
    cuda = spec.device == "cuda"
    engine = rank_engine(spec, 0)
    return {"command": "python -m faultlab.chaos.tp_run " + " ".join(argv), "nproc": nproc, "device": spec.device,
            "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
            "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "dist_backend": spec.dist_backend, "model": spec.engine.model, "kv_dtype": spec.engine.kv_dtype,
            "weight_dtype": spec.engine.weight_dtype, "kernels": engine.backend,
            "act_dtype": "bfloat16" if cuda else "float32", "piggyback": spec.piggyback,
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torchrun = "LOCAL_RANK" in os.environ
    nproc = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc
    try:
        spec = spec_from_args(args, nproc)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the single-process reference runs beside the ranks (tiny shapes)
    if torchrun:  # launched by torchrun: this process is one rank
        return _torchrun_rank(spec, args, nproc, argv)
    started = time.perf_counter()
    results, hung = launch(spec, args.nproc, args.deadline)
    report = judge(spec, results, hung, args.nproc)
    report["totals"]["wall_s"] = round(time.perf_counter() - started, 1)
    _finish(report, spec, args, nproc, argv)
    return 0 if report["totals"]["ok"] else 1


def _finish(report: dict, spec: RunSpec, args, nproc: int, argv) -> None:
    report["run"] = run_info(spec, nproc, argv)
    report["spec"] = asdict(spec)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)


def _torchrun_rank(spec: RunSpec, args, nproc: int, argv) -> int:
    """One rank under torchrun (env://): gather every rank's result on rank 0, which judges."""
    torch.set_num_threads(1)
    init_rank(spec, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    mine = rank_main(spec)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    ok = True
    if dist.get_rank() == 0:
        report = judge(spec, gathered, [], dist.get_world_size())
        _finish(report, spec, args, nproc, argv)
        ok = report["totals"]["ok"]
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
