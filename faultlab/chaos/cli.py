"""The ``faultlab`` console script.

    faultlab faults                           the fault catalog
    faultlab run SCENARIO --json OUT          the scenario as written (its classes, tracker on/off)
    faultlab matrix SCENARIO --json OUT       every class x tracker off/on x seeds
    faultlab soak SCENARIO --json OUT         fault-free, tracker on: validated request-steps, false aborts
    faultlab demo                             the real model: a faulted run, tracker off then on
    faultlab generate --model smollm2 "PROMPT"
    faultlab eval-kv --model smollm2 --json OUT

Exit codes: 0 ok, 1 expectations failed (or nothing was tested), 2 bad input (nothing written).
Every input is checked before any work (faultlab/chaos/validate.py, faultlab/chaos/scenario.py).
"""
import argparse
import sys
import time

from faultlab.chaos.validate import UsageError

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EVAL_TEXT_TOKENS = 80_000  # eval-kv reads at most this many tokens of pydoc_data (it has ~110,000)


def _add_run_args(p):
    p.add_argument("scenario", help="scenario TOML file (see scenarios/)")
    p.add_argument("--json", dest="json_out", help="write the JSON report here")
    p.add_argument("--plot", help="write a PNG plot here (default: next to --json)")
    p.add_argument("--seeds", type=int, help="override [faults].seeds")
    p.add_argument("--first-seed", type=int, help="override [faults].first_seed")
    p.add_argument("--tracker", choices=("on", "off", "both"), default="both")
    p.add_argument("--faults", help="comma-separated fault classes (override the scenario)")
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default 0: one per core; at most "
                                                      "one per core)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the fault-free run per seed (no non-victim output comparison; faster)")


def build_parser() -> argparse.ArgumentParser:
    from faultlab.engine.options import KV_DTYPES, PAGE_SIZES, WEIGHT_DTYPES, EngineConfig

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
    gen.add_argument("--kv-dtype", default=EngineConfig.kv_dtype, choices=tuple(KV_DTYPES))
    gen.add_argument("--weights", default=EngineConfig.weight_dtype, choices=WEIGHT_DTYPES)
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--page-size", type=int, default=EngineConfig.page_size, choices=PAGE_SIZES)
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
    if argv[:1] == ["bench"]:  # its own argument parser (faultlab/gpu/bench.py)
        try:
            _check_bench_out(argv[1:])
        except UsageError as err:
            print(f"faultlab: error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        from faultlab.gpu.bench import main as bench_main

        bench_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    args.command_line = "faultlab " + " ".join(argv)  # recorded in result files
    from faultlab.engine.options import ConfigError
    from faultlab.faults.catalog import UnknownFault
    from faultlab.chaos.scenario import ScenarioError

    try:
        return COMMANDS[args.command](args)
    except (ScenarioError, UnknownFault, UsageError, ConfigError) as err:
        print(f"faultlab: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _check_bench_out(bench_argv) -> None:
    """``faultlab bench --out`` (a folder, made if missing) before gpubench loads torch and a model."""
    from faultlab.chaos.validate import check_output_dir

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out")  # NOTE: only when given; its default (gpubench.py) is the repository's bench/results
    out = p.parse_known_args(bench_argv)[0].out
    if out is not None:
        check_output_dir("--out", out)


# -- commands --------------------------------------------------------------------------------------
def cmd_faults(args) -> int:
    from faultlab.faults.catalog import catalog
    from faultlab.chaos.report import write_json
    from faultlab.chaos.validate import check_output_file

    check_output_file("--json", args.json_out)
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
    from faultlab.chaos.scenario import available_faults, check_classes, fault_classes

    if args.faults is not None:
        names = [n.strip() for n in args.faults.split(",")]
        if not all(names):
            raise UsageError(f"--faults {args.faults!r} is not valid; give comma-separated fault names "
                             f"(see `faultlab faults`) or 'all'")
        return check_classes(names, scenario.engine, where="--faults", suite=scenario.faults.suite)  # the checks a TOML list gets
    if all_classes:
        return available_faults(scenario.engine, scenario.faults.suite)  # of its suite, as its engine can host
    return fault_classes(scenario)


_BASELINES: dict = {}


def _case_job(job):
    """One (fault, seed) pair, every tracker setting; runs in a worker process."""
    import torch

    from faultlab.chaos.runner import run_case

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


def _report(args, scenario, cases, started, paths) -> int:
    from faultlab.chaos.report import aggregate, failures, plot, table, write_json

    rows = aggregate(cases)
    print(table(rows, scenario.expect))
    why = {f"{r['fault']} (tracker {r['tracker']})": failures(r, scenario.expect) for r in rows}
    why = {k: v for k, v in why.items() if v}
    if not cases:
        why["run"] = ["no case ran: nothing was tested"]
    failed = sorted({r["fault"] for r in rows if failures(r, scenario.expect)}) + (["run"] if not cases else [])
    payload = {"scenario": scenario.name, "scenario_path": scenario.path, "command": args.command_line,
               "seeds": scenario.faults.seeds, "first_seed": scenario.faults.first_seed, "classes": rows,
               "seconds": round(time.time() - started, 1), "failed": failed, "failures": why,
               "cases": [c.to_json() | {"outputs": None} for c in cases]}
    json_path, plot_path = paths
    if json_path is not None:
        plot(rows, plot_path, f"faultlab {scenario.name}: {len(cases)} cases")
        write_json(json_path, payload)
        print(f"\nwrote {json_path} and {plot_path}")
    for name, reasons in why.items():
        print(f"FAIL {name}: {'; '.join(reasons)}")
    print(f"{len(cases)} cases in {time.time() - started:.0f} s; "
          + ("all expectations met" if not failed else f"FAILED: {', '.join(failed)}"))
    return EXIT_FAILED if failed else 0


def _scenario_for(args):
    """The scenario with the CLI's --seeds/--first-seed applied, checked against this machine."""
    from dataclasses import replace

    from faultlab.chaos.scenario import check_seed_range, load
    from faultlab.chaos.validate import check_runnable, check_seeds

    check_seeds(args.seeds, getattr(args, "first_seed", None))
    scenario = load(args.scenario)
    overrides = {k: v for k, v in (("seeds", args.seeds), ("first_seed", getattr(args, "first_seed", None)))
                 if v is not None}
    if overrides:
        scenario = replace(scenario, faults=replace(scenario.faults, **overrides))
        check_seed_range(scenario.faults.first_seed, scenario.faults.seeds, "--first-seed + --seeds")
    check_runnable(scenario)
    return scenario


def cmd_run(args, all_classes: bool = False) -> int:
    from faultlab.chaos.validate import check_jobs, check_report_paths

    check_jobs(args.jobs)
    paths = check_report_paths(args.json_out, args.plot)
    scenario = _scenario_for(args)
    classes = _load_classes(args, scenario, all_classes)
    if not classes:
        raise UsageError(f"{args.scenario}: [faults].classes is empty; name fault classes (or 'all'), or use "
                         f"`faultlab soak` for fault-free runs")
    trackers = ("off", "on") if args.tracker == "both" else (args.tracker,)
    started = time.time()
    cases = _run_cases(scenario, classes, scenario.faults.seeds, trackers, scenario.name,
                       args.jobs, compare=not args.no_compare)
    return _report(args, scenario, cases, started, paths)


def cmd_matrix(args) -> int:
    return cmd_run(args, all_classes=True)


def cmd_soak(args) -> int:
    from faultlab.chaos.soak import run_soak
    from faultlab.chaos.validate import check_output_file

    check_output_file("--json", args.json_out)
    _scenario_for(args)  # the checks of `run`; run_soak reads the file again
    return run_soak(args)


def cmd_demo(args) -> int:
    from faultlab.chaos.demo import check_args, run_demo

    check_args(args)
    return run_demo(args)


def _tokenizer_model(flag: str, name: str):
    """The ModelConfig of a model with a tokenizer (and a real text to read: evalkv.TEXT_MODELS)."""
    from faultlab.engine.evalkv import check_text_model
    from faultlab.chaos.validate import check_model

    return check_model(flag, check_text_model(flag, name, UsageError))


def cmd_generate(args) -> int:
    from faultlab.engine.factory import make_engine
    from faultlab.engine.options import EngineConfig
    from faultlab.engine.requests import Request
    from faultlab.chaos.validate import check_tokens

    if not args.prompt.strip():
        raise UsageError("prompt '' is not valid; give some text to complete")
    mc = _tokenizer_model("--model", args.model)
    config = EngineConfig(model="smollm2", kv_dtype=args.kv_dtype, weight_dtype=args.weights,
                          page_size=args.page_size, kv_budget_mb=64, batch_invariant=False,
                          kv_residual=args.kv_residual)  # a bad combination: ConfigError, exit 2
    context = min(config.max_context, mc.max_context)
    check_tokens("--max-tokens", args.max_tokens, 1, context - 1)
    engine = make_engine(config)
    tok = engine.tokenizer
    request = Request("cli", tok.encode(args.prompt, add_bos=False), args.max_tokens, stop_ids=(tok.eos_id,))
    if request.pages_needed(engine.page_size) > min(engine.max_pages, engine.num_pages):
        raise UsageError(f"prompt ({len(request.prompt)} tokens) + --max-tokens {args.max_tokens} is too long: "
                         f"at most {min(engine.max_pages, engine.num_pages) * engine.page_size} tokens in all")
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


def _check_eval_args(args) -> dict:
    """eval-kv's numbers, before the model loads; returns the residual sizes given."""
    import inspect

    from faultlab.engine.evalkv import _windows, eval_kv
    from faultlab.chaos.validate import check_flag, check_output_file

    chunk = inspect.signature(eval_kv).parameters["chunk"].default  # eval-kv's teacher-forcing chunk

    check_output_file("--json", args.json_out)
    mc = _tokenizer_model("--model", args.model)
    check_flag("--positions", args.positions, 1, EVAL_TEXT_TOKENS)
    check_flag("--window", args.window, chunk + 1, mc.max_context)
    check_flag("--prompt", args.prompt, 0, args.window - 1)
    sizes = {k: v for k, v in (("residual_sink", args.residual_sink), ("residual_window", args.residual_window))
             if v is not None}
    if sizes and not args.kv_residual:
        raise UsageError(f"--residual-sink/--residual-window ({sizes}) are not valid without --kv-residual")
    check_flag("--residual-sink", args.residual_sink, 0, args.window)
    check_flag("--residual-window", args.residual_window, 1, args.window)
    head = max(chunk, args.prompt)
    if args.window <= head:
        raise UsageError(f"--window {args.window} is not valid with --prompt {args.prompt}: it must exceed "
                         f"max({chunk}, --prompt) = {head}")
    text = sum(n for _, n in _windows(args.positions, args.window, head))
    if text > EVAL_TEXT_TOKENS:
        raise UsageError(f"--positions {args.positions} with --window {args.window} and --prompt {args.prompt} "
                         f"reads {text} tokens of text; at most {EVAL_TEXT_TOKENS} (fewer positions or a "
                         f"longer window)")
    return sizes


def cmd_eval_kv(args) -> int:
    from faultlab.engine.evalkv import eval_kv
    from faultlab.chaos.report import write_json

    sizes = _check_eval_args(args)
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
