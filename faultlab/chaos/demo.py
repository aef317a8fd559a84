"""``faultlab demo``: the same faulted run on the real SmolLM2 model, tracker off and on.

1. fault-free run: what every client should receive;
2. the fault, tracker off: a victim streams text computed from another request's KV (the oracle
   counts the corrupted tokens);
3. the same fault, tracker on: the victim is aborted with a clear error before any corrupted token is
   streamed, and every other request's text is identical to the fault-free run.
"""
import sys
import textwrap
import time
from pathlib import Path

from faultlab.chaos.runner import CaseResult, SGLangStyleChecks, drive, judge, checking_tracker
from faultlab.engine.engine import EngineConfig
from faultlab.engine.factory import make_engine
from faultlab.engine.requests import Request
from faultlab.faults.injector import Injector, Trigger
from faultlab.oracle import Oracle
from faultlab.chaos.report import write_json

PROMPTS = (
    "The capital of France is",
    "The largest planet in our solar system is",
    "Water is made of hydrogen and",
    "The first president of the United States was",
    "A week has seven days. A year has",
    "The chemical symbol for gold is",
)
ENGINE = EngineConfig(model="smollm2", kv_dtype="fp8", weight_dtype="int4", page_size=16, num_pages=96,
                      max_running=8, prefix_cache=True, batch_invariant=True)
REPORT = "report.json"  # the file the demo writes in --out
MAX_TOKENS = 256  # per prompt: each request (<= 12 prompt tokens) fits the 96-page pool and the context


def check_args(args) -> None:
    """``--fault``, ``--max-tokens`` and ``--out`` before any work (UsageError / UnknownFault: exit 2)."""
    from faultlab.faults.catalog import FAULTS, get_fault
    from faultlab.chaos.scenario import fault_available
    from faultlab.chaos.validate import UsageError, check_model, check_output_dir, check_output_file, check_tokens

    get_fault(args.fault)
    if not fault_available(FAULTS[args.fault], ENGINE):
        raise UsageError(f"--fault {args.fault!r} cannot strike in the demo's engine (it needs "
                         f"{FAULTS[args.fault].requires!r}); see `faultlab faults`")
    check_tokens("--max-tokens", args.max_tokens, 1, MAX_TOKENS)
    check_output_dir("--out", args.out)
    check_output_file("--out", Path(args.out) / REPORT)  # not a folder of that name inside it
    check_model("the demo's model", ENGINE.model)


def _requests(tokenizer, max_tokens: int) -> list[tuple[int, Request]]:
    """Two arrivals per step, so later requests reuse pages the fault released."""
    return [(i // 2, Request(f"req{i}", tokenizer.encode(p), max_tokens, stop_ids=(tokenizer.eos_id,)))
            for i, p in enumerate(PROMPTS)]


def _run(fault: str | None, tracker_on: bool, max_tokens: int, seed: int, baseline=None):
    oracle, checks = Oracle(), SGLangStyleChecks()
    injector = Injector(fault, Trigger(mode="step", step=4), count=1, seed=seed) if fault else None
    observers = [o for o in (injector, oracle, checks) if o]
    engine = make_engine(ENGINE, tracker=checking_tracker(log=True, on=tracker_on), observers=observers)
    arrivals = _requests(engine.tokenizer, max_tokens)
    drive(engine, arrivals)
    requests = [r for _, r in arrivals]
    return engine, requests, judge(fault, seed, tracker_on, engine, requests, oracle, checks, injector, baseline)


def _text(tokenizer, request: Request) -> str:
    body = tokenizer.decode([t for t in request.output if t != tokenizer.eos_id])
    if request.status == "aborted":
        return f"{body!r} -> ABORTED"
    return repr(body)


def _print_run(title: str, tokenizer, requests, result: CaseResult, victims) -> None:
    print(f"\n== {title}")
    for r in requests:
        mark = "VICTIM " if r.rid in victims else "       "
        print(f"  {mark}{r.rid}: {_text(tokenizer, r)}")
        if r.error:
            print(textwrap.indent(textwrap.fill(r.error, 100), "           "))


def run_demo(args) -> int:
    started = time.time()
    print("faultlab demo: SmolLM2-135M-Instruct (GGUF Q4_1 -> INT4 weights), FP8 e4m3 KV cache, page size 16",
          file=sys.stderr)
    engine, base_reqs, base = _run(None, False, args.max_tokens, 0)
    tok = engine.tokenizer
    _print_run("1. fault-free run (what every client should receive)", tok, base_reqs, base, set())
    runs = {}
    for on in (False, True):
        eng, reqs, res = _run(args.fault, on, args.max_tokens, 0, baseline=base)
        victims = {rid for rid, _ in _victims(eng)}
        label = "on: victims aborted" if on else "off: corrupted text reaches the client"
        _print_run(f"{2 + on}. fault '{args.fault}' injected, kvguard {label}", tok, reqs, res, victims)
        runs["on" if on else "off"] = (res, reqs)
    return _summarize(args, tok, base_reqs, runs, started)


def _victims(engine):
    oracle = next(o for o in engine.observers if isinstance(o, Oracle))
    return oracle.report.victims.items()


def _summarize(args, tok, base_reqs, runs, started) -> int:
    off, on = runs["off"][0], runs["on"][0]
    print("\n== oracle (independent of the tracker)")
    for name, res in (("off", off), ("on", on)):
        print(f"  tracker {name:>3}: injected={res.injected} victims={res.victims} "
              f"victims_aborted={res.victims_aborted} false_positives={res.false_positives} "
              f"corrupted_tokens_returned={res.corrupted_tokens_returned} "
              f"non-victim outputs differing from the fault-free run={res.nonvictim_mismatches}")
    ok = (on.victims > 0 and on.victims_aborted == on.victims and on.false_positives == 0
          and on.corrupted_tokens_returned == 0 and on.nonvictim_mismatches == 0)
    payload = {"fault": args.fault, "engine": ENGINE.__dict__, "seconds": round(time.time() - started, 1),
               "fault_free": {r.rid: tok.decode(r.output) for r in base_reqs},
               "tracker_off": off.to_json() | {"texts": {r.rid: tok.decode(r.output) for r in runs["off"][1]}},
               "tracker_on": on.to_json() | {"texts": {r.rid: tok.decode(r.output) for r in runs["on"][1]}},
               "ok": ok}
    out = Path(args.out)
    write_json(out / REPORT, payload)
    print(f"\nwrote {out / REPORT}  ({time.time() - started:.0f} s)")
    print("RESULT:", "victims aborted, 0 corrupted tokens returned, every other output identical"
          if ok else "UNEXPECTED: see the report")
    return 0 if ok else 1
