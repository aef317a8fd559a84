"""``python -m faultlab.sglang_gpu hicache``: HiCache's write-back, eviction and load-back under kvguard, live (GPU).

Two engines, kvguard off and check, each with ``enable_hierarchical_cache`` on a device pool too small for the
workload's prefixes (``--max-total-tokens``). Round 0 submits ``--groups`` groups of ``--per-group`` requests, one
group after another (group ``g``: its own shared prefix, seed ``seed + g``); the tree outgrows the device pool, so
earlier groups' nodes go to host memory and their device pages are evicted. Round 1 submits the same requests
again: their prefixes come back from host (load-back) into new device pages, which kvguard must expect exactly.

What it shows, per engine: no request aborted or failed, and every round-1 request's tokens equal round 0's (greedy,
so the loaded-back KV is the KV written); across the engines: check's tokens equal off's. How many load-backs kvguard
adopted: its ``HybridCacheController.load`` / ``HiCacheController.start_loading`` hooks' calls in the check engine's
profiler file (``kvguard_host_timing.json``). A run in which no load-back happened tested nothing: it fails (exit 1).
``--overrides`` (both engines' settings) with a draft model runs the same under speculative decoding (HiCache with
EAGLE); kvguard's spec steps are counted the same way, and a run with none fails.
"""
from __future__ import annotations

import json
import os
import time

from faultlab.sglang_gpu.common import dump, engine_kwargs, log, model_dir, setup_env, start_engines, stop_all, vocab_of
from faultlab.sglang_gpu.profiler import TIMING_ENV

LOAD_HOOKS = ("hook:load", "hook:start_loading")  # kvguard.sglang.hicache's hooks, as the profiler names them
SPEC_HOOK = "hook:alloc_for_spec_decode"  # kvguard.sglang.spec's: one call per verify step (--overrides with a draft)


def cmd_hicache(a) -> None:
    setup_env(a)
    os.makedirs(a.out, exist_ok=True)  # (checked at the command line; made here, as every phase does)
    model = model_dir(a, "llama3.2-1b-shape")
    vocab = vocab_of(model)
    timing = os.path.join(a.out, "kvguard_host_timing.json")
    specs = _specs(a, model, timing)
    kw = specs[0][2]
    workers = start_engines(specs, a.start_timeout)
    result = {"settings": {k: v for k, v in kw.items() if k != "model_path"}, "model": os.path.basename(model),
              "groups": a.groups, "per_group": a.per_group, "input_len": a.input_len, "shared": a.shared,
              "output_len": a.output_len, "engines": {}}
    try:
        for name, w in workers.items():
            result["engines"][name] = _rounds(a, w, vocab)
            log(f"{name}: {_summary(result['engines'][name])}")
        for _ in range(2):  # idle gaps: the profiler writes its file at an idle boundary
            time.sleep(1.5)
            workers["check"].run(n=1, input_len=32, output_len=2, seed=a.seed + 999, vocab=vocab, tag="tail")
        time.sleep(1.5)
    finally:
        stop_all(workers)
    result["kvguard_hook_calls"] = _hook_calls(timing)
    result["verdict"] = _verdict(result)
    dump(a, a.name, result)
    log(f"kvguard's HiCache hooks: {result['kvguard_hook_calls']}; verdict: {result['verdict']}")
    if result["verdict"] != "pass":
        raise SystemExit(1)


def _specs(a, model: str, timing: str) -> list:
    """The two engines (name, environment, settings): kvguard off and check, the same settings (``--overrides`` over
    the HiCache ones), the check engine's profiler writing ``timing``."""
    kw = engine_kwargs(a, model=model, max_total_tokens=a.max_total_tokens, disable_radix_cache=False,
                       enable_hierarchical_cache=True, hicache_write_policy=a.policy, hicache_ratio=a.ratio)
    kw.update(json.loads(a.overrides))
    return [("off", {"KVGUARD_MODE": "off"}, kw), ("check", {"KVGUARD_MODE": "check", TIMING_ENV: timing}, kw)]


def _rounds(a, worker, vocab: int) -> dict:
    rounds = []
    for r in range(2):
        groups = []
        for g in range(a.groups):
            res = worker.run(n=a.per_group, input_len=a.input_len, output_len=a.output_len, seed=a.seed + g,
                             vocab=vocab, shared_prefix=a.shared, keep_ids=True, tag=f"r{r}g{g}")
            groups.append([{"ids": q.get("output_ids"), "tokens": q["tokens"], "error": q["error"],
                            "finish": (q["finish"] or {}).get("type")} for q in res["requests"]])
        rounds.append(groups)
    return {"rounds": rounds}


def _summary(engine: dict) -> str:
    reqs = [q for rnd in engine["rounds"] for grp in rnd for q in grp]
    bad = sum(1 for q in reqs if q["error"] or q["finish"] == "abort")
    same = sum(1 for g0, g1 in zip(*engine["rounds"]) for q0, q1 in zip(g0, g1) if q0["ids"] == q1["ids"])
    return f"{len(reqs)} requests, {bad} aborted or failed, round 1 equal to round 0: {same}/{len(reqs) // 2}"


def _hook_calls(path: str) -> dict:
    try:
        with open(path) as f:
            per_fn = json.load(f).get("per_function_us_per_call", {})
    except (OSError, ValueError):
        return {}
    return {name: per_fn.get(name, {}).get("calls", 0) for name in LOAD_HOOKS + (SPEC_HOOK,)}


def _verdict(result: dict) -> str:
    engines = result["engines"]
    for name, engine in engines.items():
        for rnd in engine["rounds"]:
            for grp in rnd:
                if any(q["error"] or q["finish"] == "abort" or not q["ids"] for q in grp):
                    return f"fail: {name} aborted or failed a request"
        if any(q0["ids"] != q1["ids"] for g0, g1 in zip(*engine["rounds"]) for q0, q1 in zip(g0, g1)):
            return f"fail: {name}'s round 1 differs from its round 0"
    if engines["off"]["rounds"] != engines["check"]["rounds"]:
        return "fail: check's tokens differ from off's"
    if not result["kvguard_hook_calls"].get("hook:start_loading"):
        return "fail: no load-back happened (nothing tested): raise --groups or lower --max-total-tokens"
    if result["settings"].get("speculative_algorithm") and not result["kvguard_hook_calls"].get(SPEC_HOOK):
        return "fail: speculative decoding asked for, but no spec step was checked (nothing tested)"
    return "pass"
