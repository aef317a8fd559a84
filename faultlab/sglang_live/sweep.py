"""Every live fault class x seeds x SGLang configurations, one engine per configuration (CPU by default).

    python -m faultlab.sglang_live.sweep --seeds 2-7 --out out/sglang_sweep.json

Configurations: page size 16 and 1, SGLang's overlap and normal event loops, radix cache on; plus page
size 16 with the radix cache off (``--retract``: SGLang retracts decode requests every few steps, its
``SGLANG_TEST_RETRACT``, as under a full KV pool). Each engine runs a fault-free episode first, then every class
(``in_page_entry`` at page size > 1 only) for every seed, all with ``KVGUARD_MODE=check`` unless
``--mode`` says otherwise. An episode is *exact* when exactly the injector's victims got an error, every
other request's tokens equal the fault-free episode's, and SGLang's idle accounting is balanced after it.
Prints one line per configuration and writes every episode's raw record to ``--out``. Exit 1 when an
episode is not exact or an engine died (its remaining episodes then run on a fresh engine).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from kvguard.settings import MODES

from ..chaos.validate import UsageError, check_output_file
from .plan import EPISODE_CLASSES

CONFIGS = [  # (name, page size, overlap, radix)
    ("ps16-overlap", 16, True, True), ("ps16-normal", 16, False, True),
    ("ps1-overlap", 1, True, True), ("ps1-normal", 1, False, True), ("ps16-noradix", 16, True, False),
]


def judge(ep: dict, clean: dict) -> list[str]:
    """What is wrong with one episode (empty: exact).

    Exact: the requests with an error are the injector's victims, except a victim SGLang retracted after the fault
    (``retract`` lines: its KV was recomputed from its tokens before its broken mapping was read), which must then
    return the fault-free tokens like any other request."""
    problems = []
    victims = set(ep["victims"])
    errors = {r["rid"] for r in ep["requests"] if r["error"]}
    cured = {e["rid"] for e in ep.get("events", []) if e["event"] == "retract"} & victims - errors
    if ep["fault"] and not victims:
        problems.append("the injector reports no victim")
    if errors != victims - cured:
        problems.append(f"errors {sorted(errors)} != victims {sorted(victims)}")
    ref = {r["rid"].split("-", 1)[1]: r["output_ids"] for r in clean["requests"]}
    wrong = sorted(r["rid"] for r in ep["requests"]
                   if (r["rid"] not in victims or r["rid"] in cured)
                   and r["output_ids"] != ref[r["rid"].split("-", 1)[1]])
    if wrong:
        problems.append(f"non-victims' tokens differ: {wrong}")
    if not (ep.get("idle_check") or {}).get("balanced"):
        problems.append(f"accounting: {(ep.get('idle_check') or {}).get('messages')}")
    return problems


def summarize(configs: dict) -> dict:
    """Episode counts over every configuration: exact ones, deaths, and the two ways a run goes wrong."""
    verdicts = [(label, v) for c in configs.values() for label, v in c["verdicts"].items() if label != "clean"]
    return {"fault_episodes": len(verdicts), "exact": sum(not v for _, v in verdicts),
            "server_deaths": sum(len(c["deaths"]) for c in configs.values()),
            "episodes_victims_not_aborted": sum(any(p.startswith("errors ") for p in v) for _, v in verdicts),
            "episodes_with_non_victim_token_mismatch": sum(any(p.startswith("non-victims' tokens differ")
                                                               for p in v) for _, v in verdicts)}


def parse_seeds(text: str) -> list[int]:
    """``--seeds`` N or N-M (N <= M); else :class:`UsageError` naming the flag."""
    try:
        lo, _, hi = text.partition("-")
        seeds = list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        seeds = []
    if not seeds:
        raise UsageError(f"--seeds {text!r} is not valid; give N or N-M with N <= M")
    return seeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1-3", help="N or N-M (default 1-3)")
    ap.add_argument("--mode", default="check", choices=MODES, help="KVGUARD_MODE (default check)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", action="append", choices=[c[0] for c in CONFIGS],
                    help="run only these configurations (repeatable; default all)")
    ap.add_argument("--retract", action="store_true",
                    help="SGLang retracts decode requests every few steps (SGLANG_TEST_RETRACT=1), as with a full KV pool")
    ap.add_argument("--out", required=True, help="raw JSON results")
    args = ap.parse_args(argv)
    configs = [c for c in CONFIGS if not args.config or c[0] in args.config]
    try:  # before any engine starts; the folder must exist (nothing here creates it)
        seeds = parse_seeds(args.seeds)
        check_output_file("--out", args.out, make_folder=False)
    except UsageError as err:
        print(f"sweep: error: {err}", file=sys.stderr)
        return 2
    classes = list(EPISODE_CLASSES)
    report, bad = {"seeds": seeds, "mode": args.mode, "retract": args.retract, "configs": {}}, 0
    tmp = tempfile.mkdtemp(prefix="faultlab_sweep_")
    for name, ps, overlap, radix in configs:
        todo = [{"label": "clean", "fault": None}] + [
            {"label": f"{c.replace('_', '')}{s}", "fault": c, "seed": s}
            for s in seeds for c in classes if not (c == "in_page_entry" and ps == 1)]
        episodes, deaths, why, t0 = {}, [], {}, time.time()
        while len(todo) > 1:
            spec = {"device": args.device, "page_size": ps, "overlap": overlap, "radix": radix,
                    "env": {"KVGUARD_MODE": args.mode, **({"SGLANG_TEST_RETRACT": "1"} if args.retract else {})},
                    "episodes": todo}
            spec_path, out_path = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            if os.path.exists(out_path):
                os.remove(out_path)
            proc = subprocess.run([sys.executable, "-m", "faultlab.sglang_live.harness", spec_path, out_path],
                                  capture_output=True, text=True)
            result = json.load(open(out_path)) if os.path.exists(out_path) else {}
            if not result.get("started"):
                print(f"{name}: the engine did not start (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
                return 1
            for ep in result["episodes"]:
                episodes[ep["label"]] = ep
            if proc.returncode == 0:
                break
            died = (result.get("died") or {}).get("during") or result.get("current")
            deaths.append(died)
            why[str(died)] = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "kvguard" in ln][-6:]
            todo = todo[:1] + [e for e in todo if e["label"] not in episodes and e["label"] != died]
        clean = episodes["clean"]
        verdicts = {label: judge(ep, clean) for label, ep in episodes.items()}
        for label in deaths:
            verdicts.setdefault(label, []).append("the server died in this episode")
        wrong = {k: v for k, v in verdicts.items() if v}
        bad += len(wrong)
        report["configs"][name] = {"page_size": ps, "overlap": overlap, "radix": radix, "deaths": deaths,
                                   "death_errors": why,
                                   "seconds": time.time() - t0, "verdicts": verdicts, "episodes": episodes}
        print(f"{name}: {len(verdicts) - 1} fault episodes, {len(verdicts) - 1 - len(wrong)} exact, "
              f"{len(deaths)} server deaths, {time.time() - t0:.0f} s" + "".join(
                  f"\n  {label}: {'; '.join(v)}" for label, v in wrong.items()))
    report["summary"] = summarize(report["configs"])
    report["command"] = " ".join(["python -m faultlab.sglang_live.sweep"] + list(sys.argv[1:] if argv is None else argv))
    with open(args.out, "w") as f:
        json.dump(report, f)
    print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
