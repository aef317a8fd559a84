"""``faultlab soak``: fault-free runs with the tracker on. Every abort would be a false one."""
import sys
import time

from faultlab.chaos.runner import drive, checking_tracker, make_workload
from faultlab.engine.factory import make_engine
from faultlab.chaos.report import write_json
from faultlab.chaos.scenario import load


class _Counter:
    """Counts the request-steps the tracker validated (requests per forward)."""

    def __init__(self):
        self.request_steps = 0
        self.aborts = []

    def before_read(self, engine, step, requests, lengths):
        self.request_steps += len(requests)

    def on_abort(self, request, step, by_tracker):
        self.aborts.append({"rid": request.rid, "step": step, "error": request.error})


def run_soak(args) -> int:
    from dataclasses import replace

    import torch
    from tqdm import tqdm

    torch.set_num_threads(1)

    scenario = load(args.scenario)
    seeds = args.seeds or scenario.faults.seeds
    engine_cfg = replace(scenario.engine, max_running=scenario.workload.concurrency)
    started, total, aborts, steps = time.time(), 0, [], 0
    bar = tqdm(range(seeds), desc=f"soak {scenario.name}", unit="seed", file=sys.stderr)
    for seed in bar:
        counter = _Counter()
        tracker = checking_tracker(log=True)
        engine = make_engine(engine_cfg, tracker=tracker, observers=[counter])
        drive(engine, make_workload(scenario, seed, engine.model.config.vocab))
        total += counter.request_steps
        steps += engine.step_id
        aborts += counter.aborts
        bar.set_postfix(request_steps=total, false_aborts=len(aborts))
    payload = {"scenario": scenario.name, "seeds": seeds, "validated_request_steps": total,
               "engine_steps": steps, "false_aborts": len(aborts), "aborts": aborts[:20],
               "seconds": round(time.time() - started, 1)}
    print(f"{total:,} validated request-steps over {steps:,} engine steps, {seeds} seeds: "
          f"{len(aborts)} false aborts ({payload['seconds']} s)")
    if args.json_out:
        write_json(args.json_out, payload)
    return 1 if aborts else 0
