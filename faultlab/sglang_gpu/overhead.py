"""``overhead``: kvguard check vs off vs off (A/A) at the write-up's benchmark, and the first requests.

Two engines alive at once (kvguard off and check, switched by ``KVGUARD_MODE`` in each worker's
environment), the same workload and seed; the runs alternate between them in ABBA order, so drift and
warm-up hit both modes alike. The check engine also runs the ``kvguard_bench`` profiler (kvguard's host
time per decode iteration).

``--switch``: one engine instance with kvguard installed; its "off" runs pass kvguard's SGLang hooks straight
to SGLang's code (``faultlab.sglang_gpu.profiler.SWITCH_ENV``, flipped between runs while the engine is idle),
so the comparison carries no instance-to-instance difference (two instances of one build differ by ~1.5-2%
at c=1). kvguard's install, its memory and its allocator bookkeeping stay in both modes.

``--interleave B``: one engine instance, and within each run kvguard's per-step check on and off in alternate
blocks of ``B`` decode steps (:mod:`faultlab.sglang_gpu.interleave`): the two modes share each run's drift. Each
concurrency's ``--reps`` count is then its number of runs, and its row is computed from their labelled steps.
"""
from __future__ import annotations

import json
import os
import time

from faultlab.sglang_gpu.common import (
    command_line,
    dump,
    engine_kwargs,
    environment,
    log,
    model_dir,
    parse_reps,
    setup_env,
    slim,
    start_engines,
    stop_all,
    vocab_of,
)
from faultlab.sglang_gpu import interleave
from faultlab.sglang_gpu.probes import TP_PATH_ENV
from faultlab.sglang_gpu.profiler import IDLE_S, SWITCH_ENV, SWITCH_PERIOD_S, TIMING_ENV
from faultlab.sglang_gpu.workload import METRICS, compare, pct


def cmd_overhead(a) -> None:
    setup_env(a)
    model = model_dir(a)
    vocab = vocab_of(model)
    reps = parse_reps(a.reps)
    cmax = max(reps)
    tokens_needed = cmax * (a.input_len + a.output_len + a.page_size)
    max_total = a.max_total_tokens or (tokens_needed + 8 * a.page_size)
    timing_path = os.path.join(a.out, "kvguard_host_timing.json")
    os.makedirs(a.out, exist_ok=True)
    kw = engine_kwargs(a, model=model, max_total_tokens=max_total, max_running=cmax, graph_bs=cmax,
                       chunked_prefill_size=a.chunked_prefill or None)
    kw = {k: v for k, v in kw.items() if v is not None}
    kw.update(json.loads(a.overrides))
    overlap = not kw.get("disable_overlap_schedule", False)
    switch_path = os.path.join(a.out, "kvguard_switch") if a.switch else None
    tp_path = {TP_PATH_ENV: "1"} if a.tp_path else {}
    if a.interleave:
        specs = [("check", {"KVGUARD_MODE": "check", TIMING_ENV: timing_path,
                            interleave.INTERLEAVE_ENV: f"{a.interleave}:{a.seed}", **tp_path}, kw)]
    elif a.switch:
        flip_switch(switch_path, "check")
        specs = [("check", {"KVGUARD_MODE": "check", TIMING_ENV: timing_path, SWITCH_ENV: switch_path, **tp_path}, kw)]
    else:
        specs = [("off", {"KVGUARD_MODE": "off"}, kw),
                 ("check", {"KVGUARD_MODE": "check", TIMING_ENV: timing_path, **tp_path}, kw)]
    result = {"command": command_line(a), "switch": bool(a.switch), "interleave": a.interleave,
              "environment": environment(), "engine_kwargs": kw, "reps": reps,
              "input_len": a.input_len, "output_len": a.output_len, "page_size": a.page_size}
    t_all = time.perf_counter()
    workers = start_engines(specs, a.start_timeout)
    engines = dict(workers)
    if a.switch or a.interleave:
        workers = {"off": workers["check"], "check": workers["check"]}  # one instance, two modes
    try:
        result["engines"] = {n: w.info for n, w in engines.items()}
        # -- first requests after start: the same batch twice on each fresh engine -----------------
        first = {}
        fw = dict(n=a.first_n, input_len=a.input_len, output_len=a.first_output, seed=a.seed + 7, vocab=vocab)
        for mode in (("off", "check") if a.first_n else ()):
            flip_switch(switch_path, mode)
            r1 = workers[mode].run(tag=f"first-{mode}", **fw)
            r2 = workers[mode].run(tag=f"second-{mode}", **fw)
            first[mode] = {"first": slim(r1), "second": slim(r2)}
            log(f"first batch {mode}: {r1['wall_s']:.3f} s, again {r2['wall_s']:.3f} s "
                f"(ttft p99 {r1['ttft_p99']:.3f} / {r2['ttft_p99']:.3f} s)")
        result["first_requests"] = first
        # -- interleaved A/B runs ---------------------------------------------------------------------
        rows, all_runs, skipped = [], [], []
        est_wall = parse_reps(a.est) if a.est else {}
        for c in sorted(reps):
            runs = []
            # NOTE: the first run of an engine at a shape pays for what the shape compiles or tunes (measured: TTFT
            # 1.6 s vs 0.1 s at 8192 in); unwarmed, the first pair's first run carried it into its ratio and A/A.
            # The warm-up's few decode steps make a profiler window shorter than MIN_WINDOW: not a measured run.
            one = a.switch or a.interleave
            for mode in ((("check",) if one else ("off", "check")) if a.warmup_tokens else ()):
                flip_switch(switch_path, mode)
                w = workers[mode].run(n=c, input_len=a.input_len, output_len=a.warmup_tokens, seed=a.seed + 11,
                                      vocab=vocab, tag=f"warmup-c{c}-{mode}")
                log(f"c={c} warm-up {mode}: {w['wall_s']:.2f} s (ttft p99 {w['ttft_p99']:.3f} s)")
            for r in range(reps[c]):
                # a pair must fit in what is left of --budget (estimated from this concurrency's last run)
                est = (1.1 if a.interleave else 2.2) * (runs[-1]["wall_s"] if runs else est_wall.get(c, 0.0))
                if a.budget and time.perf_counter() - t_all + est > a.budget:
                    skipped.append({"concurrency": c, "rep": r})
                    log(f"c={c} rep={r}: skipped (budget {a.budget:.0f} s)")
                    continue
                for mode in (("check",) if a.interleave else ("off", "check") if r % 2 == 0 else ("check", "off")):
                    flip_switch(switch_path, mode)
                    res = workers[mode].run(n=c, input_len=a.input_len, output_len=a.output_len,
                                            seed=a.seed, vocab=vocab, tag=f"c{c}-{mode}-{r}")
                    res["mode"], res["concurrency"] = mode, c
                    runs.append(res)
                    log(f"c={c} rep={r} {mode:5s}: {res['throughput']:9.1f} tok/s  itl p50 "
                        f"{1e3 * res['itl_p50']:.3f} ms p99 {1e3 * res['itl_p99']:.3f} ms  ttft p99 "
                        f"{res['ttft_p99']:.3f} s  wall {res['wall_s']:.2f} s  errors {res['errors']}")
            all_runs += [slim(x) for x in runs]
            rows.append({"concurrency": c, "page_size": a.page_size, "input_len": a.input_len,
                         "output_len": a.output_len, "overlap": overlap, "tp": a.tp, "tp_path": a.tp > 1 or a.tp_path,
                         **({} if a.interleave else compare(runs))})
            if not a.interleave:
                log(f"c={c}: throughput x{rows[-1]['throughput_ratio']:.4f} (A/A x{rows[-1]['aa_throughput_ratio']:.4f}), "
                    f"itl p99 x{rows[-1]['itl_p99_ratio']:.4f} (A/A x{rows[-1]['aa_itl_p99_ratio']:.4f})")
            result["rows"], result["runs"], result["skipped"] = rows, all_runs, skipped
            dump(a, a.name, result)  # keep what is measured so far
        # tiny requests after the last run, each after an idle gap: the profiler closes the last run's
        # window and writes its file at an idle boundary
        flip_switch(switch_path, "check")
        for tag in ("flush", "flush2"):
            time.sleep(1.0)
            workers["check"].run(n=1, input_len=16, output_len=4, seed=a.seed, vocab=vocab, tag=tag)
    finally:
        stop_all(engines)
    read_host_timing(result, timing_path)
    if a.interleave:
        attach_interleaved(result)
    result["total_s"] = time.perf_counter() - t_all
    dump(a, a.name, result)
    print_rows(result)


def flip_switch(path: str | None, mode: str) -> None:
    """The in-engine switch (``--switch``): kvguard's per-step work on ("check") or off for the next run.

    Written while the engine is idle; the wait lets the engine's next read of the file (at most every
    SWITCH_PERIOD_S) land before the run starts. Without ``--switch``: only an idle gap, so that the profiler
    ends its window (one per run) before the next run."""
    if path is None:
        time.sleep(2 * IDLE_S)
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("on" if mode == "check" else "off")
    os.replace(tmp, path)
    time.sleep(3 * SWITCH_PERIOD_S)


MIN_WINDOW = 10  # decode iterations: shorter windows are the flush requests, not a measured run


def read_host_timing(result: dict, path: str) -> None:
    """The check engine's profiler file (``kvguard_host_timing.json``) into ``result``, and each row's host time."""
    try:
        with open(path) as f:
            result["host_timing"] = json.load(f)
    except OSError as e:
        result["host_timing"] = {"error": str(e)}
    attach_host_time(result)


def attach_host_time(result: dict) -> None:
    """Each row's kvguard host time per decode iteration: the profiler's windows (one per run of the check
    engine) whose largest decode batch is the row's concurrency; the median of their p50s and p99s."""
    windows = (result.get("host_timing") or {}).get("windows") or []
    for row in result.get("rows", []):
        ws = [w for w in windows if w["batch_max"] == row["concurrency"] and w["iterations"] >= MIN_WINDOW]
        row["host_windows"] = len(ws)
        row["host_us_p50"] = pct([w["kvguard_us_per_iter_p50"] for w in ws], 50) if ws else None
        row["host_us_p99"] = pct([w["kvguard_us_per_iter_p99"] for w in ws], 50) if ws else None


def attach_interleaved(result: dict) -> None:
    """``--interleave``: each row's ratios, A/A and host times from the labelled steps of its runs' windows
    (:func:`faultlab.sglang_gpu.interleave.compare`); a row with no labelled step of either mode keeps none."""
    windows = [w for w in (result.get("host_timing") or {}).get("windows") or [] if w.get("interleave")]
    for row in result.get("rows", []):
        c = row["concurrency"]
        row.update(interleave.compare([w for w in windows if w["batch_max"] == c], c))
        row.setdefault("throughput_ratio", None)


def print_rows(result: dict) -> None:
    print("\nconcurrency | throughput ratio (A/A) | ITL p50 ratio (A/A) | ITL p99 ratio (A/A) | TTFT p99 ratio (A/A)")
    for row in result.get("rows", []):
        print(f"{row['concurrency']:>11} | " + " | ".join(
            f"{row[m + '_ratio']:.4f} ({row['aa_' + m + '_ratio']:.4f})" if row.get(m + "_ratio") else "-"
            for m in METRICS))
        if row.get("n_on"):
            print(f"{'':>11}   interleaved steps: {row['n_on']} on, {row['n_off']} off" + (
                f"; kvguard host per step p50 {row['host_us_p50']:.1f} us on, {row['host_off_us_p50']:.1f} us off "
                f"(kept in both modes); less the profiler's own share {row['host_net_us_p50']:.1f} us on, "
                f"{row['host_off_net_us_p50']:.1f} us off" if row.get("n_off") else ""))
    for row in result.get("rows", []):
        if row.get("host_us_p50") is not None:
            print(f"c={row['concurrency']} overlap={row.get('overlap')}: kvguard host time per decode iteration "
                  f"p50 {row['host_us_p50']:.1f} us, p99 {row['host_us_p99']:.1f} us ({row['host_windows']} runs)")
    ht = result.get("host_timing") or {}
    if ht.get("iterations"):
        print(f"kvguard host time per decode iteration: mean {ht['kvguard_us_per_iter_mean']:.1f} us, "
              f"p50 {ht['kvguard_us_per_iter_p50']:.1f} us, p99 {ht['kvguard_us_per_iter_p99']:.1f} us "
              f"over {ht['iterations']} iterations (step p50 {ht['step_ms_p50']:.2f} ms)")
