"""``python -m faultlab.sglang_gpu pd``: kvguard's cost on a PD decode server, the write-up's architecture (GPU).

Three engines on one GPU, each in its own worker process: one prefill server (``KVGUARD_MODE=check``, as a
deployment runs both sides; it also runs SGLang's bootstrap server) and two decode servers, kvguard off and check.
Every request goes to the prefill server and to one decode server with one bootstrap room, as SGLang's router
sends it; the KV moves over the real transfer backend (``--backend``: NIXL's UCX, GPU to GPU). The runs alternate
between the two decode servers in ABBA order, the same workload and seed, and the ratios and A/A come from
:func:`faultlab.sglang_gpu.workload.compare` as in ``overhead``: what kvguard adds on the decode side, with the
prefill and the transfer the same for both. The check decode server also runs the ``kvguard_bench`` profiler
(kvguard's host time per decode iteration) and every run keeps its tokens: ``tokens_equal`` per concurrency says
whether the check server's tokens equal the off server's, request by request.

``--switch``: one decode server with kvguard installed, whose "off" runs pass kvguard's hooks straight to SGLang's
code (``overhead --switch``'s in-engine switch): no instance-to-instance difference in the ratio (two instances of
one build differ by ~1.5-2% at c=1; the overlap-off PD run of December 6 is what it is for).

``--mem-fractions P,D,D``: SGLang sizes an engine against the memory free when it starts (its slack is that free
memory times 1 - mem_fraction_static), so the engines started later get larger fractions of what is left.
``--cpu``: a dry run with the tiny model over Mooncake's TCP transport (faultlab's CPU PD shims).
"""
from __future__ import annotations

import itertools
import json
import os
import time

from faultlab.sglang_gpu.common import (
    command_line, dump, engine_kwargs, environment, log, model_dir, parse_reps, setup_env, slim, start_engines,
    stop_all, vocab_of,
)
from faultlab.sglang_gpu.overhead import flip_switch, print_rows, read_host_timing
from faultlab.sglang_gpu.profiler import SWITCH_ENV, TIMING_ENV
from faultlab.sglang_gpu.workload import compare
from faultlab.sglang_live.plan import ENV_LOG

HOST = "127.0.0.1"
DECODE_RESERVE = 512  # SGLang's num_reserved_decode_tokens (its default)


def cmd_pd(a) -> None:
    setup_env(a)
    os.makedirs(a.out, exist_ok=True)
    model = model_dir(a, "llama3.2-1b-shape")
    vocab = vocab_of(model)
    reps = parse_reps(a.reps)
    cmax = max(reps)
    timing = os.path.join(a.out, "kvguard_host_timing.json")
    switch = os.path.join(a.out, "kvguard_switch") if a.switch else None
    specs = _specs(a, model, cmax, timing, switch)
    result = {"command": command_line(a), "environment": environment(), "backend": a.backend, "reps": reps,
              "switch": bool(a.switch),
              "input_len": a.input_len, "output_len": a.output_len, "page_size": a.page_size,
              "engine_kwargs": {name: kw for name, _, kw in specs}}
    t_all = time.perf_counter()
    flip_switch(switch, "check")
    engines = start_engines(specs, a.start_timeout)
    workers = {**engines, "off": engines["check"]} if a.switch else engines
    rooms = itertools.count(1)
    bootstrap = {"host": HOST, "port": a.bootstrap_port}

    def run(mode: str, c: int, output_len: int, seed: int, tag: str) -> dict:
        """One run through the prefill server and the ``mode`` decode server, one bootstrap room per request."""
        flip_switch(switch, mode)  # (without --switch: an idle gap, so that the profiler ends its window)
        boot = {**bootstrap, "room": next(rooms) * 100_000}
        load = dict(n=c, input_len=a.input_len, output_len=output_len, seed=seed, vocab=vocab, bootstrap=boot)
        workers["prefill"].submit("run", {**load, "tag": tag})
        try:
            res = workers[mode].run(**load, tag=tag, keep_ids=True)
        finally:
            pre = workers["prefill"].collect("run", timeout=600)
        res["prefill_errors"] = pre["errors"]
        return res

    try:
        result["engines"] = {n: w.info for n, w in engines.items()}
        rows, all_runs, skipped = [], [], []
        for c in sorted(reps):
            for mode in ("off", "check") if a.warmup_tokens else ():
                w = run(mode, c, a.warmup_tokens, a.seed + 11, f"warmup-c{c}-{mode}")
                log(f"c={c} warm-up {mode}: {w['wall_s']:.2f} s, errors {w['errors']} (prefill {w['prefill_errors']})")
            runs = []
            for r in range(reps[c]):
                est = 2.2 * runs[-1]["wall_s"] if runs else 0.0
                if a.budget and time.perf_counter() - t_all + est > a.budget:
                    skipped.append({"concurrency": c, "rep": r})
                    log(f"c={c} rep={r}: skipped (budget {a.budget:.0f} s)")
                    continue
                for mode in ("off", "check") if r % 2 == 0 else ("check", "off"):
                    res = run(mode, c, a.output_len, a.seed, f"c{c}-{mode}-{r}")
                    res["mode"], res["concurrency"] = mode, c
                    runs.append(res)
                    log(f"c={c} rep={r} {mode:5s}: {res['throughput']:9.1f} tok/s  itl p50 "
                        f"{1e3 * res['itl_p50']:.3f} ms p99 {1e3 * res['itl_p99']:.3f} ms  ttft p99 "
                        f"{res['ttft_p99']:.3f} s  wall {res['wall_s']:.2f} s  errors {res['errors']} "
                        f"(prefill {res['prefill_errors']})")
            row = {"concurrency": c, "input_len": a.input_len, "output_len": a.output_len, "backend": a.backend,
                   "overlap": not json.loads(a.overrides).get("disable_overlap_schedule", False),
                   "tokens_equal": _tokens_equal(runs), **(compare(runs) if runs else {})}
            rows.append(row)
            if runs:
                log(f"c={c}: throughput x{row['throughput_ratio']:.4f} (A/A x{row['aa_throughput_ratio']:.4f}), "
                    f"itl p50 x{row['itl_p50_ratio']:.4f} (A/A x{row['aa_itl_p50_ratio']:.4f}); "
                    f"tokens equal {row['tokens_equal']}")
            all_runs += [slim(x) for x in runs]
            result["rows"], result["runs"], result["skipped"] = rows, all_runs, skipped
            dump(a, a.name, result)
        for tag in ("flush", "flush2"):  # the profiler writes its file at an idle boundary
            time.sleep(1.0)
            run("check", 1, 4, a.seed, tag)
    finally:
        stop_all(engines)
    read_host_timing(result, timing)
    result["total_s"] = time.perf_counter() - t_all
    dump(a, a.name, result)
    print_rows(result)
    if not result.get("runs") or any(r["errors"] or r["prefill_errors"] for r in result["runs"]):
        raise SystemExit(1)  # a run that measured nothing, or served errors, does not pass


def _specs(a, model: str, cmax: int, timing: str, switch: str | None = None) -> list[tuple[str, dict, dict]]:
    """(name, environment, sglang.Engine settings) of the prefill server and the two decode servers (``switch``:
    the one decode server, "check", with the in-engine switch's file)."""
    fractions = [float(x) for x in a.mem_fractions.split(",")]
    role = dict(disaggregation_transfer_backend=a.backend, disaggregation_bootstrap_port=a.bootstrap_port)
    # NOTE: a PD decode server admits a request only with SGLang's decode reserve (num_reserved_decode_tokens, 512)
    # free beside it for each running request, and room for one more: the pool holds that on top of the workload
    per_request = a.input_len + max(a.output_len, DECODE_RESERVE) + a.page_size + DECODE_RESERVE
    max_total = cmax * per_request + a.input_len + 2 * DECODE_RESERVE
    base_env = {"SGLANG_HOST_IP": HOST}
    if a.cpu:  # the tiny model over Mooncake's TCP transport, faultlab's CPU PD shims (faultlab.sglang_live.pd_pair)
        from faultlab.sglang_live.pd_pair import BASE_ENV

        base_env.update(BASE_ENV)
    specs = []
    roles = (("prefill", {"KVGUARD_MODE": "check"}), ("off", {"KVGUARD_MODE": "off"}),
             ("check", {"KVGUARD_MODE": "check", TIMING_ENV: timing, **({SWITCH_ENV: switch} if switch else {})}))
    if switch:  # one decode server; it gets the off server's memory fraction (it starts second)
        roles, fractions = (roles[0], roles[2]), fractions[:2]
    for i, ((name, env), frac) in enumerate(zip(roles, fractions)):
        decode = name != "prefill"
        # NOTE: each server its own SGLang port (its PD endpoints are derived from it), as pd_pair's servers have
        kw = engine_kwargs(a, model=model, max_total_tokens=max_total, max_running=cmax,
                           graph_bs=cmax if decode else None, disaggregation_mode="decode" if decode else "prefill",
                           port=a.bootstrap_port + 1000 * (i + 1), **role,
                           **({} if a.cpu else {"mem_fraction_static": frac}))
        kw.update(json.loads(a.overrides if decode else a.prefill_overrides))
        # (--cpu: faultlab's CPU shims log their accounting checks; into --out, not the working directory)
        log_file = {ENV_LOG: os.path.join(a.out, f"faultlab_{name}.jsonl")} if a.cpu else {}
        specs.append((name, {**base_env, **env, **log_file}, kw))
    return specs


def _tokens_equal(runs: list[dict]) -> str:
    """'k/n': requests whose tokens in the first check run equal the first off run's (same prompts, greedy)."""
    first = {m: next((r for r in runs if r["mode"] == m), None) for m in ("off", "check")}
    if None in first.values():
        return "-"
    off = {q["rid"].split("-", 3)[-1]: q.get("output_ids") for q in first["off"]["requests"]}
    chk = {q["rid"].split("-", 3)[-1]: q.get("output_ids") for q in first["check"]["requests"]}
    return f"{sum(1 for k, v in chk.items() if v and off.get(k) == v)}/{len(chk)}"
