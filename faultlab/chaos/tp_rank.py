"""What one rank of a tensor-parallel chaos run does (``python -m faultlab.chaos.tp_run`` spawns and judges them).

``RunSpec`` is what every rank runs (picklable: sent to the spawned workers). A rank checks its TP logits
against the single process's (and the verdict piggyback probe), then per seed runs the workload fault-free
and with the fault on a ``TPEngine`` with a ``RankTracker`` and its own oracle, and reports aborts,
victims, outputs and injections.
"""
from __future__ import annotations

import os
import random
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from faultlab.chaos.runner import drive  # noqa: E402
from faultlab.engine.context import StepContext  # noqa: E402
from faultlab.engine.factory import make_engine  # noqa: E402
from faultlab.engine.kvcache import PagedKVCache  # noqa: E402
from faultlab.engine.model import load_model  # noqa: E402
from faultlab.engine.options import EngineConfig  # noqa: E402
from faultlab.chaos.scenario import Scenario, WorkloadSpec  # noqa: E402


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
    device: str = "cpu"  # cpu | cuda (rank r on cuda:(r % device_count), Triton kernels)
    dist_backend: str = "gloo"  # resolved by the parent (see resolve_backend)
    piggyback: bool = False  # the verdict rides on the step's last all-reduce (RankTracker(piggyback=True))

    @property
    def exact(self) -> bool:
        """Are TP and single-process outputs bit-comparable? (fp32 activations: on CPU.)"""
        return self.device == "cpu"


def rank_engine(spec: RunSpec, rank: int) -> EngineConfig:
    """The engine config of rank ``rank``: on CUDA its own GPU (round robin) and the Triton kernels."""
    if spec.device == "cpu":
        return spec.engine
    return replace(spec.engine, device=f"cuda:{rank % torch.cuda.device_count()}", backend="triton")


def logits_tolerance(act_dtype: torch.dtype, scale: float) -> float:
    """Allowed max |TP - single| logits difference: fp32 ~ summation order; bf16 ~ per-rank rounding.

    bf16: every row-parallel output is rounded to bf16 once per rank before the all-reduce instead of
    once after the full sum (2^-8 relative per layer, compounding over the layers); a sharding bug
    gives differences of the order of the logits themselves.
    """
    rel = 1e-4 if act_dtype == torch.float32 else 0.1
    return rel * max(1.0, scale)


def logits_check(config: EngineConfig, group=None) -> dict:
    """TP logits against single-process logits over a 20-token prefill and one decode step (fp32 KV).

    Also the piggyback probe: the same forward with a ``VerdictRide`` on its last all-reduce (rank 0
    flags the request) must give bit-identical logits, and every rank must land the verdict 1.
    """
    from faultlab.engine.tp import load_tp_model

    full, _ = load_model(config.model, config.weight_dtype, config.backend, config.device, config.seed)
    tp = load_tp_model(config.model, config.weight_dtype, config.backend, config.device, config.seed, group)
    ref, got = _probe(full), _probe(tp)
    load_model.cache_clear()  # the full model is not needed again on this rank (GPU memory when ranks share one)
    del full
    diff, scale = float((ref - got).abs().max()), float(ref.abs().max())
    tol = logits_tolerance(tp.act_dtype, scale)
    rides = _rides(tp, group)
    ridden = _probe(tp, rides)
    landed = [int(r.out.sum()) for r in rides]  # 1 = only rank 0 flagged (the column is a SUM)
    return {"logits_max_abs_diff": diff, "logits_scale": scale, "logits_tol": tol, "logits_ok": diff <= tol,
            "logits_top1_agree": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
            "act_dtype": str(tp.act_dtype),
            "piggyback_logits_max_abs_diff": float((ridden - got).abs().max()),
            "piggyback_landed": landed, "piggyback_ok": landed == [1, 1] and _same(ridden, got, tp.world, tol)}


def _same(ridden: torch.Tensor, plain: torch.Tensor, world: int, tol: float) -> bool:
    """The ride must not perturb the logits: bit-identical at <= 2 ranks (a sum of two is commutative);
    at more, a backend may chunk the wider buffer differently (reduction order: last bits), so tol."""
    return torch.equal(ridden, plain) if world <= 2 else float((ridden - plain).abs().max()) <= tol


def _rides(model, group=None) -> list:
    """Two ``VerdictRide``s (prefill, decode) of one request flagged on rank 0 only."""
    from kvguard.distributed import VerdictRide

    flag = 3 if dist.get_rank(group) == 0 else 0  # bad entries on this rank's shard
    return [VerdictRide(torch.tensor([flag], dtype=torch.int32, device=model.device),
                        torch.zeros(1, 1, dtype=torch.int32, device=model.device), group) for _ in range(2)]


def _probe(model, rides=(None, None)) -> torch.Tensor:
    """Logits [21, vocab] of a fixed prompt's prefill and one decode step, on a fresh fp32 cache.

    ``rides``: ``VerdictRide``s for the prefill and the decode (a TP model only).
    """
    c, ps, n, dev = model.config, 16, 20, model.device
    kv = PagedKVCache(c.n_layers, 4, ps, c.n_kv_heads, c.head_dim, dtype="fp32", device=dev, backend=model.backend)
    row = torch.tensor([3, 1, 4, 2], dtype=torch.int32, device=dev)
    pos = torch.arange(n + 1, device=dev)
    slots = row.long()[pos // ps] * ps + pos % ps
    prompt = (torch.arange(n, device=dev) * 7 + 3) % c.vocab
    prefill = model.forward(prompt, kv, StepContext.for_prefill(0, slots[:n], row, ride=rides[0]))
    decode = model.forward(torch.tensor([5], device=dev), kv,
                           StepContext.for_decode(pos[n:], slots[n:], row[None], ride=rides[1]))
    return torch.cat([prefill, decode]).float().cpu()


def make_arrivals(spec: RunSpec, seed: int):
    """The seed's workload (the chaos runner's generator)."""
    from faultlab.chaos.runner import make_workload
    from faultlab.engine.config import get_preset

    scenario = Scenario(name="tp", workload=spec.workload, engine=spec.engine)
    return make_workload(scenario, seed, get_preset(spec.engine.model).vocab)


def run_case(spec: RunSpec, seed: int, fault: str | None, group=None) -> dict:
    """One TP case on this rank: aborts, this rank's oracle victims, outputs, injections."""
    from kvguard import TrackerConfig
    from kvguard.distributed import make_rank_tracker
    from prometheus_client import CollectorRegistry

    from faultlab.faults.injector import Injector, Trigger
    from faultlab.oracle import Oracle

    oracle, observers, injector = Oracle(), [], None
    if fault is not None:
        trigger = Trigger(mode="step", step=random.Random(seed ^ 0x5EED).randint(*spec.step_range))
        injector = Injector(fault, trigger, 1, seed)
        observers.append(injector)
    tracker = make_rank_tracker(TrackerConfig(mode="check", log_violations=False), CollectorRegistry(),
                                group=group, combine=spec.combine, piggyback=spec.piggyback)
    engine = make_engine(rank_engine(spec, dist.get_rank(group)), tracker=tracker, observers=[*observers, oracle],
                         tp=True, group=group, verify_schedule=spec.verify_schedule)
    arrivals = make_arrivals(spec, seed)
    drive(engine, arrivals)
    rep = oracle.report
    return {"aborts": dict(rep.aborted_by_tracker), "victims": dict(rep.victims), "steps": engine.step_id,
            "checks": engine.verdict_checks, "verdict_rides": engine.verdict_rides,
            "injected": injector.injected if injector else [],
            "outputs": {r.rid: [r.status, list(r.output)] for _, r in arrivals}}


def rank_main(spec: RunSpec, group=None) -> dict:
    """Everything one rank runs: the logits check, then per seed a fault-free and a faulty case."""
    out = {"rank": dist.get_rank(), "logits_max_abs_diff": None, "cases": {}, "error": None,
           "device": rank_engine(spec, dist.get_rank(group)).device}
    try:
        if spec.check_logits:
            out.update(logits_check(rank_engine(spec, dist.get_rank(group)), group))
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


def worker(rank: int, world: int, port: int, spec: RunSpec, queue) -> None:
    """A spawned rank: init the process group, run, put the result on the queue."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.set_num_threads(1)
    init_rank(spec, rank, world, f"tcp://127.0.0.1:{port}")
    try:
        queue.put(rank_main(spec))
    finally:
        dist.destroy_process_group()


def init_rank(spec: RunSpec, rank: int, world: int, init_method: str = "env://") -> None:
    """This process's GPU (on CUDA), then the process group on ``spec.dist_backend``."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if spec.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(spec.dist_backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
