"""PD over SGLang's real transfer backends: every PD fault x seeds x backends, kvguard check or off (CPU).

    python -m faultlab.sglang_live.pd_sweep --seeds 1-2 --backends mooncake,nixl --mode check --out out/pd_sweep.json

Per backend and seed, a fresh prefill/decode pair (:class:`.pd_pair.Pair`: two ``sglang.Engine`` processes, the KV
moved by Mooncake's TCP transfer engine or NIXL's UCX backend, every request sent to both with one bootstrap room),
both servers ``KVGUARD_MODE=--mode``, carrying the faults of :func:`fault_envs` (faultlab/sglang_live/pd_faults.py,
the decode server's injector plan). Episodes, in this order, on the seed's own prompts:

``clean``
    five prompts of NEW tokens, and the late write's four victims' prompts of LONG tokens: the references.
``swapped_entries``
    on the decode server (the injector's plan, seeded): its ``inject`` line names the victims.
``late_transfer_landed``
    the four victims decode; ``late-0``'s send is held on the prefill; the decode server aborts ``late-0`` while
    its write is on its way. Without kvguard, SGLang frees the destination on its deferred-release timeout and its
    allocator hands it to the victims; the decode server's injector lets the write land only then, in slots the
    victims hold (ordered by signals, not by timing). With kvguard the destination is held until the prefill's
    drain ack: the write lands in no one's pages.
``prefill_index_shift``
    on the prefill server: the fifth prompt's first extended position pointed at the next one's slot. Its reference
    ran in ``clean`` and left the prefill's radix cache (its pool is PREFILL_TOKENS), so the fault strikes.
``after``
    a fault-free request with the shifted prompt (a radix hit on the prefill: the victim's row, if it was kept).
``prefill_freed_mid_send``
    on a second pair (its prefill without a radix cache, so a request's pages are its own; :func:`run_prefill_free`):
    a request's send held, one of its pages freed to the head of the prefill's free list, the next request's prefill
    taking it and writing its own K/V there, then the send let go: it reads the reuser's K/V as the victim's.

An episode is *exact* when exactly the injector's victims got an error, every other request's tokens equal the
references, SGLang never released ``late-0``'s destination on its timeout, the ``after`` request got the fault-free
tokens, and both servers' idle accounting is balanced at the end (of each pair). Prints one line per pair, writes
every episode's answers and verdicts to ``--out`` (written once, at the end). Exit 1 when an episode is not exact, a
pair failed, or no backend could run; 2 for bad arguments (nothing written).
tests/test_faultlab/test_sglang_live/test_sglang_pd_transfer_off.py runs both pairs of this with kvguard off in CI
(:func:`run_pair`, :func:`run_prefill_free`), test_sglang_pd_transfer.py the second with kvguard on.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import sys
import tempfile
import time

from kvguard.settings import MODES

from ..chaos.validate import UsageError, check_output_file
from .sweep import parse_seeds

NEW, LONG = 24, 55  # output tokens: the five prompts' (swap candidates then decode together), the late write's victims'
HOLD_S = 5.0  # a held send waits this long when nothing lets it go (kvguard on: no destination is ever freed)
LAND_HOLD_S = 60.0  # kvguard off: late-0's send waits at most this long for the victims to take its freed slots
# backend: (the module its transfer engine needs, a pair's base port, its engine settings)
BACKENDS = {"mooncake": ("mooncake.engine", 31000, {}),
            "nixl": ("nixl._api", 35000, {"disaggregation_transfer_backend": "nixl"})}
SWAP_RIDS = ["swap-a0", "swap-a1", "swap-b2", "swap-b3"]  # the i-th on prompt i; swap-a* are the candidates
LAND_RIDS = [f"land-v{i}" for i in range(4)]  # 4 x (24 + LONG) tokens = the decode pool - 4
PREFILL_TOKENS = 128  # < the 150 tokens of the five prompts: the least recently used prompt is evicted
DECODE_TOKENS, RESERVED = 320, 8  # the decode pool, and SGLang's decode reservation per request (512 by default)


def pd_prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(24 + 3 * i)] for i in range(n)]


def land_prompts(seed: int = 11) -> tuple[list[list[int]], list[int]]:
    """The victims' prompts (24 tokens each) and late-0's (64: its destination is what the victims take last)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(24)] for _ in LAND_RIDS], [rng.randrange(3, 1000) for _ in range(64)]


def swap_plan(seed: int = 1) -> str:
    return json.dumps([{"fault": "swapped_entries", "seed": seed, "rid_prefix": "swap-a", "min_candidates": 2,
                        "step": 3, "label": "swap"}])


def fault_envs(mode: str, trigger: str, hold_s: float = HOLD_S, land: str | None = None,
               swap_seed: int = 1) -> tuple[dict, dict]:
    """The prefill's and the decode's environment: kvguard's mode, and the faults each server carries (a send held
    at most ``hold_s`` seconds once ``trigger`` exists, prefill_index_shift on rids ``pshift-*``; swapped_entries on
    the decode server, its deferred-release timeout shortened to 1 s, and with ``land`` ("<late prefix>:<victim
    prefix>") the held write landing in a decoding victim's pages)."""
    prefill = {"KVGUARD_MODE": mode, "FAULTLAB_SGLANG_PD_SLOW_SEND": f"{trigger}:{hold_s}",
               "FAULTLAB_SGLANG_PD_PREFILL_SHIFT": "pshift-"}
    decode = {"KVGUARD_MODE": mode, "FAULTLAB_SGLANG_FAULTS": swap_plan(swap_seed),
              "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "1"}
    if land:
        decode["FAULTLAB_SGLANG_PD_LATE_LAND"] = f"{trigger}:{land}"
    return prefill, decode


def released(folder: str, rid: str) -> bool:
    """Whether the decode server logged SGLang's timeout release of ``rid``'s transfer destination."""
    with open(os.path.join(folder, "decode.stderr")) as f:
        log = f.read()
    room = re.search(rf"rid='{rid}' decode_req\.req\.bootstrap_room=(\d+)", log)
    return bool(room) and f"Deferred KV release for room {room.group(1)} timed out" in log


def send_held(pair, trigger: str, request: tuple[str, list[int], int]) -> None:
    """Send ``request`` with the prefill's next KV send held (``FAULTLAB_SGLANG_PD_SLOW_SEND``); return once the
    prefill's transfer worker took it (the trigger file gone)."""
    open(trigger, "w").close()
    sent = time.time()
    pair.send(request)
    while os.path.exists(trigger):
        if time.time() - sent > 120:
            raise TimeoutError(f"{request[0]}'s KV send never started")
        time.sleep(0.05)


def late_land(pair, folder: str, trigger: str, seed: int = 11) -> dict:
    """The victims decoding, late-0's send held, late-0 aborted on the decode server: the answers, and whether SGLang
    released late-0's destination on its deferred-release timeout."""
    victims, late = land_prompts(seed)
    for rid, prompt in zip(LAND_RIDS, victims):
        pair.send((rid, prompt, LONG))
    t0 = time.time()
    while len({e["rid"] for e in pair.decode.events() if e["event"] == "victim_decoding"}) < len(LAND_RIDS):
        if time.time() - t0 > 120:  # their KV landed: the trigger holds late-0's send, not theirs
            raise TimeoutError("the late write's victims never all decoded")
        time.sleep(0.02)
    send_held(pair, trigger, ("late-0", late, NEW))
    time.sleep(0.5)
    pair.decode.send({"op": "abort", "rid": "late-0"})
    answers = pair.answers(["late-0", *LAND_RIDS])
    return {"answer": answers.pop("late-0"), "victims": answers, "released": released(folder, "late-0")}


def close_pair(pair, out: dict) -> None:
    """Both servers' event logs and the prefill's answers into ``out``; then the pair closed."""
    out["decode_events"], out["prefill_events"] = pair.decode.events(), pair.prefill.events()
    out["prefill_answers"] = pair.prefill_answers()
    pair.close()


def run_pair(backend: str, mode: str, folder: str, seed: int | None = None, port: int | None = None) -> dict:
    """One pair on ``backend``, every episode (module docstring) on seed ``seed``'s prompts (None: the tests' fixed
    ones), the pair closed after: what the clients and both servers' logs said."""
    from .pd_pair import Pair

    _, base, engine = BACKENDS[backend]
    trigger = os.path.join(folder, "hold-next-send")
    hold = LAND_HOLD_S if mode == "off" else HOLD_S
    pair = Pair(folder, *fault_envs(mode, trigger, hold, "late-:land-v", 1 if seed is None else seed),
                base_port=base if port is None else port, engine=engine,
                prefill_spec={"max_total_tokens": PREFILL_TOKENS},
                decode_spec={"max_total_tokens": DECODE_TOKENS, "engine": {"num_reserved_decode_tokens": RESERVED}})
    prompts = pd_prompts(5) if seed is None else pd_prompts(5, 1000 + seed)  # the last one is the prefill fault's
    land_seed = 11 if seed is None else 2000 + seed
    out = {"backend": backend, "mode": mode, "seed": seed}
    try:
        out["clean"] = pair.generate([("clean-4", prompts[4], NEW)])  # first: the prefill evicts it first
        out["clean"].update(pair.generate([(f"clean-{i}", p, NEW) for i, p in enumerate(prompts[:4])]))
        out["clean_long"] = pair.generate([(f"clean-{rid}", p, LONG)
                                           for rid, p in zip(LAND_RIDS, land_prompts(land_seed)[0])])
        out["swap"] = pair.generate([(rid, p, NEW) for rid, p in zip(SWAP_RIDS, prompts)])
        out["late"] = late_land(pair, folder, trigger, land_seed)
        out["pshift"] = pair.generate([("pshift-4", prompts[4], NEW)] +
                                      [(f"pb-{i}", p, NEW) for i, p in enumerate(prompts[1:4], 1)])
        out["after"] = pair.generate([("after-4", prompts[4], NEW)])  # a radix hit on the victim's row, if kept
        time.sleep(1.0)
        out["idle"] = pair.idle_checks(time.time())
    finally:
        close_pair(pair, out)
    return out


def run_prefill_free(backend: str, mode: str, folder: str, seed: int | None = None, port: int | None = None) -> dict:
    """``prefill_freed_mid_send`` on a pair of its own (a prefill without a radix cache, so the victim's pages are its
    own): fault-free references, then the victim's send held, a page of it freed, a reuser's prefill taking it, the
    send let go. What the clients and both servers' logs said."""
    from .pd_pair import Pair

    _, base, engine = BACKENDS[backend]
    trigger = os.path.join(folder, "hold-next-send")
    prefill = {"KVGUARD_MODE": mode, "FAULTLAB_SGLANG_PD_SLOW_SEND": f"{trigger}:{LAND_HOLD_S}",
               "FAULTLAB_SGLANG_PD_PREFILL_FREE": f"{trigger}:pfree-v:pfree-r"}
    pair = Pair(folder, prefill, {"KVGUARD_MODE": mode}, base_port=(base if port is None else port) + 25,
                engine=engine, prefill_spec={"engine": {"disable_radix_cache": True}})
    victim, reuser = pd_prompts(2, 3000 + (seed or 0))
    out = {}
    try:
        out["refs"] = pair.generate([("ref-v", victim, NEW), ("ref-r", reuser, NEW)])
        send_held(pair, trigger, ("pfree-v", victim, NEW))
        pair.send(("pfree-r", reuser, NEW))
        out["answers"] = pair.answers(["pfree-v", "pfree-r"])
        time.sleep(1.0)
        out["idle"] = pair.idle_checks(time.time())
    finally:
        close_pair(pair, out)
    return out


def judge_prefill_free(out: dict) -> list[str]:
    """What is wrong with the ``prefill_freed_mid_send`` episode (empty: exact)."""
    if "answers" not in out:
        return ["not run"]
    struck = _injected(out.get("prefill_events", []), fault="prefill_freed_mid_send")
    took = [e["took"] for e in out.get("prefill_events", []) if e["event"] == "reuser_took"]
    if [e["victims"] for e in struck] != [["pfree-v"]] or took[:1] != [True]:
        return [f"the fault did not strike as planned: inject {struck}, reuser took the page {took}"]
    problems = []
    victim, reuser = out["answers"]["pfree-v"], out["answers"]["pfree-r"]
    if victim["error"] is None:
        problems.append("errors [] != victims ['pfree-v']" + (
            "" if victim["output_ids"] == out["refs"]["ref-v"]["output_ids"] else " (served wrong tokens)"))
    if not _served_as(reuser, out["refs"]["ref-r"]):
        problems.append(f"non-victims' tokens differ: ['pfree-r'] ({reuser['error']})")
    return problems + [f"{role}'s accounting: {(c or {}).get('messages', 'no idle check')}"
                       for role, c in (out.get("idle") or {"pair": None}).items() if not (c or {}).get("balanced")]


def _injected(events: list[dict], **match) -> list[dict]:
    return [e for e in events if e["event"] == "inject" and all(e.get(k) == v for k, v in match.items())]


def _served_as(got: dict | None, want: dict | None) -> bool:
    return bool(got and want and got["error"] is None and want["error"] is None
                and got["output_ids"] == want["output_ids"])


def _references(out: dict) -> dict[str, dict | None]:
    """Each fault episode's request: the fault-free answer of its prompt."""
    clean, long = out.get("clean", {}), out.get("clean_long", {})
    return {**{rid: clean.get(f"clean-{i}") for i, rid in enumerate(SWAP_RIDS)}, "pshift-4": clean.get("clean-4"),
            **{f"pb-{i}": clean.get(f"clean-{i}") for i in (1, 2, 3)}, "after-4": clean.get("clean-4"),
            **{rid: long.get(f"clean-{rid}") for rid in LAND_RIDS}}


def served_wrong(out: dict) -> list[str]:
    """The requests answered without an error whose tokens differ from their prompt's fault-free run: what a client
    got wrong (kvguard's promise: none)."""
    ref = _references(out)
    answers = {**out.get("swap", {}), **(out.get("late") or {}).get("victims", {}), **out.get("pshift", {}),
               **out.get("after", {})}
    return sorted(rid for rid, r in answers.items()
                  if r["error"] is None and ref.get(rid) and r["output_ids"] != ref[rid]["output_ids"])


def judge(out: dict) -> dict[str, list[str]]:
    """What is wrong with each episode of one pair (empty lists: exact), by kvguard's promise: exactly the injected
    victims get an error, everyone else the fault-free tokens, no page changes hands while a write to it may land."""
    clean, v = out.get("clean", {}), {}
    v["clean"] = [f"{rid} not served" for rid, r in {**clean, **out.get("clean_long", {})}.items()
                  if r["error"] is not None or not r["output_ids"]]
    ref = _references(out)

    def exact(answers: dict, victims: set[str]) -> list[str]:
        errors = {rid for rid, r in answers.items() if r["error"] is not None}
        problems = [] if errors == victims else [f"errors {sorted(errors)} != victims {sorted(victims)}"]
        wrong = sorted(rid for rid in answers if rid not in victims and not _served_as(answers[rid], ref.get(rid)))
        return problems + ([f"non-victims' tokens differ: {wrong}"] if wrong else [])

    swap = _injected(out.get("decode_events", []), label="swap")
    v["swapped_entries"] = (exact(out["swap"], set(swap[0]["victims"])) if swap and swap[0]["victims"]
                            else ["the injector reports no victim"]) if "swap" in out else ["not run"]
    late = out.get("late")
    if late is None:
        v["late_transfer_landed"] = ["not run"]
    else:
        v["late_transfer_landed"] = exact(late["victims"], set()) + (
            [] if late["answer"]["error"] is not None else ["late-0 was not aborted"]) + (
            ["SGLang released late-0's destination on its timeout while its write was in flight"]
            if late["released"] else [])
    shift = _injected(out.get("prefill_events", []), fault="prefill_index_shift")
    v["prefill_index_shift"] = (exact(out["pshift"], {"pshift-4"}) if [e["victims"] for e in shift] == [["pshift-4"]]
                                else [f"the injector struck {shift}"]) if "pshift" in out else ["not run"]
    v["after"] = (exact(out["after"], set()) if "after" in out else ["not run"]) + [
        f"{role}'s accounting: {(c or {}).get('messages', 'no idle check')}"
        for role, c in (out.get("idle") or {"pair": None}).items() if not (c or {}).get("balanced")]
    return v


def _importable(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 (a wheel's missing library raises OSError, not ImportError)
        return f"{module} does not import: {type(err).__name__}: {err}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1-2", help="N or N-M (default 1-2)")
    ap.add_argument("--backends", default="mooncake,nixl", help=f"comma separated, of {sorted(BACKENDS)}")
    ap.add_argument("--mode", default="check", choices=MODES, help="KVGUARD_MODE of both servers (default check)")
    ap.add_argument("--port", type=int, default=41000, help="the first pair's base port (each pair takes +50)")
    ap.add_argument("--out", required=True, help="raw JSON results")
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    try:
        seeds = parse_seeds(args.seeds)
        if not backends or set(backends) - set(BACKENDS):
            raise UsageError(f"--backends {args.backends!r} is not valid; give a comma-separated list of "
                             f"{sorted(BACKENDS)}")
        if not 1024 <= args.port <= 60000 - 2050 - 50 * len(backends) * len(seeds):
            raise UsageError(f"--port {args.port} is not valid; give a port in [1024, "
                             f"{60000 - 2050 - 50 * len(backends) * len(seeds)}]")
        check_output_file("--out", args.out, make_folder=False)  # before any engine starts
    except UsageError as err:
        print(f"pd_sweep: error: {err}", file=sys.stderr)
        return 2
    report = {"command": " ".join(["python -m faultlab.sglang_live.pd_sweep"] +
                                  list(sys.argv[1:] if argv is None else argv)),
              "mode": args.mode, "seeds": seeds, "skipped": {}, "pairs": [], "failed": []}
    tmp, k, bad = tempfile.mkdtemp(prefix="faultlab_pd_sweep_"), 0, 0
    report["logs"] = tmp
    for backend in backends:
        why = _importable(BACKENDS[backend][0])
        if why:
            report["skipped"][backend] = why
            print(f"{backend}: skipped ({why})", flush=True)
            continue
        for seed in seeds:
            folder, t0 = os.path.join(tmp, f"{backend}-{seed}"), time.time()
            os.makedirs(folder)
            try:
                out = run_pair(backend, args.mode, folder, seed, args.port + 50 * k)
                os.makedirs(folder + "-free")
                out["prefill_free"] = run_prefill_free(backend, args.mode, folder + "-free", seed, args.port + 50 * k)
            except Exception as err:  # noqa: BLE001 (an engine that died: recorded, the next pair runs)
                report["failed"].append({"backend": backend, "seed": seed, "error": f"{type(err).__name__}: {err}",
                                         "folder": folder})
                print(f"{backend} seed {seed}: FAILED ({type(err).__name__}: {err}; logs in {folder})", flush=True)
                bad, k = bad + 1, k + 1
                continue
            k += 1
            out["verdicts"], out["served_wrong"] = judge(out), served_wrong(out)
            out["verdicts"]["prefill_freed_mid_send"] = judge_prefill_free(out["prefill_free"])
            answers = out["prefill_free"]["answers"]
            out["served_wrong"] += [rid for rid, ref in (("pfree-v", "ref-v"), ("pfree-r", "ref-r"))
                                    if answers[rid]["error"] is None
                                    and answers[rid]["output_ids"] != out["prefill_free"]["refs"][ref]["output_ids"]]
            out["seconds"] = round(time.time() - t0, 1)
            wrong = {label: p for label, p in out["verdicts"].items() if p}
            bad += len(wrong)
            report["pairs"].append(out)
            print(f"{backend} seed {seed}: {len(out['verdicts']) - len(wrong)} of {len(out['verdicts'])} episodes "
                  f"exact, {len(out['served_wrong'])} requests served wrong tokens without an error, "
                  f"{out['seconds']:.0f} s" + "".join(f"\n  {label}: {'; '.join(p)}"
                                                             for label, p in wrong.items()), flush=True)
    episodes = [p for pair in report["pairs"] for p in pair["verdicts"].values()]
    report["summary"] = {"pairs": len(report["pairs"]), "episodes": len(episodes),
                         "exact": sum(not p for p in episodes), "failed_pairs": len(report["failed"]),
                         "served_wrong": sum(len(p["served_wrong"]) for p in report["pairs"])}
    part = args.out + ".part"
    with open(part, "w") as f:
        json.dump(report, f)
    os.replace(part, args.out)
    print(f"{report['summary']['exact']} of {len(episodes)} episodes exact over {len(report['pairs'])} pairs, "
          f"{report['summary']['served_wrong']} requests served wrong tokens without an error ({args.mode}); "
          f"wrote {args.out} (the servers' logs: {tmp})")
    if not report["pairs"]:
        print("pd_sweep: no pair ran: nothing was tested", file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
