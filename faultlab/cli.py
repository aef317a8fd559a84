"""The ``faultlab`` console script.

    faultlab faults                           the fault catalog
    faultlab run SCENARIO --json OUT          the scenario as written (its classes, tracker on/off)
    faultlab matrix SCENARIO --json OUT       every class x tracker off/on x seeds
    faultlab soak SCENARIO --json OUT         fault-free, tracker on: validated request-steps, false aborts
    faultlab demo                             the real model: a faulted run, tracker off then on
    faultlab generate --model smollm2 "PROMPT"
    faultlab eval-kv --model smollm2 --json OUT

Exit codes: 0 ok, 1 expectations failed, 2 bad input (nothing written).
"""
import argparse
import sys
import time

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad input from the command line (exit code 2)."""


def _add_run_args(p):
    p.add_argument("scenario", help="scenario TOML file (see scenarios/)")
    p.add_argument("--json", dest="json_out", help="write the JSON report here")
    p.add_argument("--plot", help="write a PNG plot here (default: next to --json)")
    p.add_argument("--seeds", type=int, help="override [faults].seeds")
    p.add_argument("--first-seed", type=int, help="override [faults].first_seed")
    p.add_argument("--tracker", choices=("on", "off", "both"), default="both")
    p.add_argument("--faults", help="comma-separated fault classes (override the scenario)")
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per core)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the fault-free run per seed (no non-victim output comparison; faster)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="faultlab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("faults", help="list the fault catalog").add_argument("--json", dest="json_out")
    _add_run_args(sub.add_parser("run", help="run a scenario"))
    _add_run_args(sub.add_parser("matrix", help="every fault class x tracker off/on x seeds"))
    soak = sub.add_parser("soak", help="fault-free soak with the tracker on")
    soak.add_argument("scenario")
    soak.add_argument("--json", dest="json_out")
    soak.add_argument("--seeds", type=int)
    demo = sub.add_parser("demo", help="the chaos demo on the real SmolLM2 model")
    demo.add_argument("--fault", default="premature_free")
    demo.add_argument("--out", default="out/demo", help="folder for report.json and plot.png")
    demo.add_argument("--max-tokens", type=int, default=16)
    gen = sub.add_parser("generate", help="greedy completion of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2")
    gen.add_argument("--kv-dtype", default="fp8", choices=("fp8", "bf16", "fp32"))
    gen.add_argument("--weights", default="int4", choices=("int4", "bf16", "fp32"))
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--page-size", type=int, default=16)
    gen.add_argument("--kv-residual", action="store_true",
                     help="FP8 K/V at ~BF16 precision for the first and most recent tokens (engine.kv_residual)")
    bench = sub.add_parser("bench", help="GPU benchmarks (H200): tracker overhead and the write-up's claims",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    ev = sub.add_parser("eval-kv", help="FP8 vs BF16 KV: top-1 agreement and KL on real text")
    ev.add_argument("--model", default="smollm2")
    ev.add_argument("--positions", type=int, default=2000)
    ev.add_argument("--rotate-k", action="store_true",
                    help="the FP8 cache with its opt-in Hadamard K rotation (engine.kv_rotate_k)")
    ev.add_argument("--kv-residual", action="store_true",
                    help="the FP8 cache with its opt-in KV residual for each window's first and last tokens "
                         "(engine.kv_residual)")
    ev.add_argument("--residual-sink", type=int, help="tokens (--kv-residual; default: engine.kv_residual_sink)")
    ev.add_argument("--residual-window", type=int, help="tokens (--kv-residual; default: engine.kv_residual_window)")
    ev.add_argument("--window", type=int, default=512, help="tokens of context per text window")
    ev.add_argument("--prompt", type=int, default=0,
                    help="the first N tokens of each window are a prompt, prefilled at once and not counted "
                         "(decoding right after a prompt; default: a long generation)")
    ev.add_argument("--json", dest="json_out")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own argument parser (faultlab/gpubench.py)
        from .gpubench import main as bench_main

        bench_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    args.command_line = "faultlab " + " ".join(argv)  # recorded in result files
    from .scenario import ScenarioError
    from .faults.catalog import UnknownFault

    try:
        return COMMANDS[args.command](args)
    except (ScenarioError, UnknownFault, UsageError) as err:
        print(f"faultlab: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


# -- commands --------------------------------------------------------------------------------------
def cmd_faults(args) -> int:
    from .faults.catalog import catalog
    from .report import write_json

    entries = catalog()
    for e in entries:
        det = "detectable" if e["detectable"] else "NOT detectable"
        req = f"  [needs {e['requires']}]" if e["requires"] else ""
        print(f"{e['fault']:<26} {det:<15} strikes: {e['where']}{req}\n{'':<26} {e['corrupts']}\n"
              f"{'':<26} why: {e['why']}")
    if args.json_out:
        write_json(args.json_out, {"faults": entries})
    return 0


def _load_classes(args, scenario, all_classes: bool) -> list[str]:
    from .faults.catalog import get_fault
    from .scenario import available_faults, fault_classes

    if args.faults:
        names = [n.strip() for n in args.faults.split(",") if n.strip()]
        for n in names:
            get_fault(n)  # unknown -> UnknownFault (exit 2)
        return names
    if all_classes:
        return available_faults(scenario.engine)  # phase_split-only classes when the engine splits
    return fault_classes(scenario)


_BASELINES: dict = {}


def _case_job(job):
    """One (fault, seed) pair, every tracker setting; runs in a worker process."""
    import torch

    from .chaos import run_case

    # NOTE: chaos cases run small models; one torch thread per process avoids thread-pool stalls
    torch.set_num_threads(1)
    scenario, fault, seed, trackers, compare = job
    key = (scenario.name, seed)
    if compare and key not in _BASELINES:
        _BASELINES[key] = run_case(scenario, None, seed, False)
    baseline = _BASELINES.get(key) if compare else None
    return [run_case(scenario, fault, seed, t == "on", baseline=baseline) for t in trackers]


def _run_cases(scenario, classes, seeds, trackers, label, jobs: int = 0, compare: bool = True):
    import multiprocessing
    import os

    from tqdm import tqdm

    first = scenario.faults.first_seed
    work = [(scenario, f, s, trackers, compare) for s in range(first, first + seeds) for f in classes]
    jobs = jobs or min(len(work), os.cpu_count() or 1)
    bar = tqdm(total=len(work) * len(trackers), desc=label, unit="case", file=sys.stderr, dynamic_ncols=True)
    cases = []
    if jobs <= 1:
        results = map(_case_job, work)
    else:
        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap(_case_job, work, chunksize=max(1, len(classes) // 2))
    for group in results:
        cases.extend(group)
        bar.update(len(group))
    bar.close()
    if jobs > 1:
        pool.close()
    return cases


def _report(args, scenario, cases, started) -> int:
    from pathlib import Path

    from .report import aggregate, plot, table, verdict, write_json

    rows = aggregate(cases)
    print(table(rows))
    failed = [r["fault"] for r in rows if verdict(r) == "FAIL"]
    payload = {"scenario": scenario.name, "scenario_path": scenario.path, "classes": rows,
               "seconds": round(time.time() - started, 1), "failed": failed,
               "cases": [c.to_json() | {"outputs": None} for c in cases]}
    if args.json_out:
        write_json(args.json_out, payload)
        plot_path = args.plot or str(Path(args.json_out).with_suffix(".png"))
        plot(rows, plot_path, f"faultlab {scenario.name}: {len(cases)} cases")
        print(f"\nwrote {args.json_out} and {plot_path}")
    print(f"{len(cases)} cases in {time.time() - started:.0f} s; "
          + ("all expectations met" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


def cmd_run(args, all_classes: bool = False) -> int:
    from .scenario import load

    scenario = load(args.scenario)
    if args.first_seed is not None:
        from dataclasses import replace

        scenario = replace(scenario, faults=replace(scenario.faults, first_seed=args.first_seed))
    classes = _load_classes(args, scenario, all_classes)
    if not classes:
        raise UsageError(f"{args.scenario}: [faults].classes is empty; use `faultlab soak` for fault-free runs")
    trackers = ("off", "on") if args.tracker == "both" else (args.tracker,)
    started = time.time()
    cases = _run_cases(scenario, classes, args.seeds or scenario.faults.seeds, trackers, scenario.name,
                       args.jobs, compare=not args.no_compare)
    return _report(args, scenario, cases, started)


def cmd_matrix(args) -> int:
    return cmd_run(args, all_classes=True)


def cmd_soak(args) -> int:
    from .soak import run_soak

    return run_soak(args)


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args)


def cmd_generate(args) -> int:
    from .engine.engine import Engine, EngineConfig
    from .engine.requests import Request

    if args.model != "smollm2":
        raise UsageError(f"--model {args.model!r}: generate needs a model with a tokenizer; valid: ['smollm2']")
    engine = Engine(EngineConfig(model="smollm2", kv_dtype=args.kv_dtype, weight_dtype=args.weights,
                                 page_size=args.page_size, kv_budget_mb=64, batch_invariant=False,
                                 kv_residual=args.kv_residual))
    tok = engine.tokenizer
    request = Request("cli", tok.encode(args.prompt, add_bos=False), args.max_tokens, stop_ids=(tok.eos_id,))
    engine.add_request(request)
    sys.stdout.write(args.prompt)
    for event in iter(lambda: engine.step() if engine.has_work() else None, None):
        for e in event:
            if e.kind == "token" and e.token != tok.eos_id:
                sys.stdout.write(tok.decode([e.token]))
                sys.stdout.flush()
            if e.kind == "abort":
                print(f"\n[aborted: {e.message}]", file=sys.stderr)
    sys.stdout.write("\n")
    return 0


def cmd_eval_kv(args) -> int:
    from .evalkv import eval_kv
    from .report import write_json

    sizes = {k: v for k, v in (("residual_sink", args.residual_sink), ("residual_window", args.residual_window))
             if v is not None}
    result = eval_kv(args.model, n_positions=args.positions, window=args.window, rotate_k=args.rotate_k,
                     residual=args.kv_residual, prompt=args.prompt, **sizes)
    print(result)
    if args.json_out:
        write_json(args.json_out, {"command": args.command_line, **result})
    return 0


COMMANDS = {"faults": cmd_faults, "run": cmd_run, "matrix": cmd_matrix, "soak": cmd_soak, "demo": cmd_demo,
            "generate": cmd_generate, "eval-kv": cmd_eval_kv}

if __name__ == "__main__":
    sys.exit(main())
