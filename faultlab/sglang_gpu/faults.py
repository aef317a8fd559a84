"""``faults``: faultlab's live injector (:mod:`faultlab.sglang_live`) in real engines, kvguard on and off.

Several engines (kvguard check at page 16 and 1, off at 16), each in a process of its own
(``python -m faultlab.sglang_gpu fault-engine``: a fault that kills SGLang's scheduler takes only its
engine down), started one after another and run at once; per episode the client-side verdict
(:func:`judge`). With ``--tp`` > 1 the ``kvguard_bench`` probes log every rank's aborts and can confine
the injector to one rank.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time

from faultlab.sglang_gpu.common import (
    MODULE,
    command_line,
    dump,
    environment,
    log,
    setup_env,
)
from faultlab.sglang_gpu.probes import ABORT_LOG_ENV, FAULT_RANK_ENV
from faultlab.sglang_gpu.profiler import TIMING_ENV
from faultlab.sglang_live.plan import TWIN



def fault_engine(spec: dict, out_path: str) -> int:
    """One engine through fault episodes (faultlab.sglang_live.harness's episode driver and workload),
    with this bench's engine settings (GPU, CUDA graphs, tensor parallel). Writes OUT after each episode."""
    import sglang

    from faultlab.sglang_live import harness as H
    from faultlab.sglang_live.inject import (
        ENV_ACCOUNTING,
        ENV_DUMMY,
        ENV_FAULTS,
        ENV_LOG,
        ENV_ROTARY,
    )

    workload = {**H.WORKLOAD, **spec.get("workload", {})}
    page_size = int(spec["page_size"])
    tmp = spec["workdir"]
    os.makedirs(tmp, exist_ok=True)
    log_path = os.path.join(tmp, "inject.jsonl")
    if os.path.exists(log_path):  # a previous run's lines would answer this run's waits (its "armed")
        os.remove(log_path)
    model = H.write_model(os.path.join(tmp, "model"), spec.get("model"))
    plan = [{"fault": ep.get("fault") or "none", "seed": int(ep.get("seed", 0)), "rid_prefix": f"{ep['label']}-a",
             "reuser_prefix": f"{ep['label']}-b", "min_candidates": workload["n1"], "label": ep["label"]}
            for ep in spec["episodes"]]
    os.environ.update({ENV_FAULTS: json.dumps(plan), ENV_LOG: log_path, ENV_ACCOUNTING: "1",
                       ENV_DUMMY: str(spec.get("dummy_std", 1.0))})
    if spec.get("cpu"):
        os.environ[ENV_ROTARY] = "1"
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    result = {"spec": spec, "started": False, "episodes": []}

    def save():
        result["events"] = H._read_log(log_path)
        abort_log = spec.get("env", {}).get(ABORT_LOG_ENV)
        if abort_log and os.path.exists(abort_log):
            with open(abort_log) as f:
                result["rank_aborts"] = [json.loads(x) for x in f if x.strip()]
        with open(out_path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out_path + ".tmp", out_path)

    t = time.time()
    kw = dict(model_path=model, load_format="dummy", skip_tokenizer_init=True, page_size=page_size,
              sampling_backend="pytorch", max_total_tokens=int(spec.get("max_total_tokens", 4096)),
              disable_radix_cache=not spec.get("radix", True), log_level=spec.get("log_level", "error"),
              tp_size=int(spec.get("tp", 1)), kv_cache_dtype=spec.get("kv_dtype", "auto"))
    if spec.get("cpu"):
        kw.update(device="cpu", attention_backend="torch_native", dtype="float32")
    else:
        kw.update(attention_backend="triton", mem_fraction_static=float(spec.get("mem_fraction", 0.5)),
                  cuda_graph_max_bs_decode=16, disable_prefill_cuda_graph=True)
    kw.update(spec.get("overrides") or {})  # a diagnostic run's engine settings (--overrides)
    engine = sglang.Engine(**kw)
    result.update(started=True, startup_s=time.time() - t, engine_kwargs=kw)
    save()
    H.watchdog(result, save, engine)  # a scheduler that dies (a fault kvguard-off lets through) ends this process
    wave1, wave2 = H.prompts(workload, page_size)
    try:
        for ep in spec["episodes"]:
            t = time.time()
            params = inspect.signature(H._episode).parameters
            extra = {"timeout": spec.get("timeout", 60)} if "timeout" in params else {}
            if "opts" in params:
                extra["opts"] = {}  # plain requests (no PD bootstrap, no streaming)
            outs, armed = engine.loop.run_until_complete(
                H._episode(engine, ep["label"], wave1, wave2, workload, log_path, **extra))
            end = time.time()
            idle = None
            while time.time() - end < 10:
                idle = next((e for e in H._read_log(log_path)[::-1]
                             if e["event"] == "idle_check" and e["time"] > end), None)
                if idle is not None:
                    break
                time.sleep(0.05)
            engine.flush_cache()
            events = [e for e in H._read_log(log_path) if e.get("label") == ep["label"]]
            victims = sorted({v for e in events if e["event"] == "inject" for v in e["victims"]}
                             | {e["rid"] for e in events if e["event"] == "victim"})
            result["episodes"].append({"label": ep["label"], "fault": ep.get("fault"), "seed": ep.get("seed", 0),
                                       "armed": armed, "requests": outs, "victims": victims, "idle_check": idle,
                                       "seconds": end - t})
            save()
    finally:
        result["closing"] = True
        engine.shutdown()
    save()
    return 0


def judge(run: dict) -> list[dict]:
    """Per episode: injected?, victims, victims aborted, false aborts, non-victim token mismatches
    against the run's fault-free episode (same prompts), pool accounting after the episode.

    A fault episode whose twin control ran in the same engine with the same seed (``sglang_abort`` for
    ``stale_row``: the same victim aborted by SGLang itself at the same step, nothing corrupted) also gets
    ``twin_mismatches``: its non-victims' tokens against that control's. The fault-free episode keeps every
    request in the batch to the end; the twin loses the victim at the same step as the fault episode, so it
    separates what the fault did from what removing a request from the batch does to the GPU's numerics.
    """
    eps = run.get("episodes", [])

    def outputs(ep):
        return {r["rid"].split("-", 1)[1]: r["output_ids"] for r in ep["requests"]}

    clean = next((e for e in eps if not e["fault"]), None)
    ref = outputs(clean) if clean is not None else {}
    twins = {(TWIN[e["fault"]], e["seed"]): e for e in eps if e["fault"] in TWIN}
    out = []
    for ep in eps:
        victims = set(ep["victims"])
        injected = bool(victims) or not ep["fault"]
        row = {"label": ep["label"], "fault": ep["fault"] or "none", "seed": ep["seed"], "armed": ep["armed"],
               "injected": injected, "victims": len(victims), "victims_aborted": 0, "victims_corrupted": 0,
               "non_victim_mismatches": 0, "false_aborts": 0, "requests": len(ep["requests"]),
               "balanced": (ep.get("idle_check") or {}).get("balanced"), "seconds": ep.get("seconds")}
        row["shared_row_steps"] = sum(1 for e in run.get("events", [])
                                      if e["event"] == "shared_row" and e.get("label") == ep["label"])
        twin = twins.get((ep["fault"], ep["seed"]))
        twin_out = outputs(twin) if twin is not None else None
        if twin is not None:
            row.update(twin=twin["label"], twin_mismatches=0, twin_victims_same=sorted(twin["victims"]) == sorted(
                v.replace(ep["label"], twin["label"], 1) for v in victims))
        for r in ep["requests"]:
            key = r["rid"].split("-", 1)[1]
            aborted = r["error"] is not None
            same = ref.get(key) is not None and r["output_ids"] == ref.get(key)
            if r["rid"] in victims:
                row["victims_aborted"] += aborted
                row["victims_corrupted"] += (not aborted) and not same
            else:
                row["false_aborts"] += aborted
                row["non_victim_mismatches"] += (not aborted) and not same
                if twin_out is not None:
                    row["twin_mismatches"] += (not aborted) and r["output_ids"] != twin_out.get(key)
        out.append(row)
    _kv_compare(run.get("events", []), eps, out)
    return out


def _kv_compare(events: list, eps: list, rows: list) -> None:
    """With the KV watch on (faultlab.sglang_live.kvwatch): its findings per episode, and per watched
    request the first position whose K/V differs from the same request in the fault-free episode and in
    the twin control (None: equal as far as both were seen)."""
    finals: dict = {}
    for e in events:
        if e["event"] == "kv_final":
            trace = finals.setdefault(e["rid"], {})
            for i, p in enumerate(e["prints"]):
                trace[e["first"] + i] = p
    if not finals:
        return
    clean = next((e["label"] for e in eps if not e["fault"]), None)
    by_label = {r["label"]: r for r in rows}

    def first_diff(a: dict, b: dict):
        common = sorted(set(a) & set(b))
        return next((p for p in common if a[p] != b[p]), None), len(common)

    for ep, row in zip(eps, rows):
        label = ep["label"]
        row["kv_events"] = {k: sum(1 for e in events if e["event"] == k and e.get("label") == label)
                            for k in ("kv_changed", "kv_not_written")}
        diffs = {}
        for rid, trace in finals.items():
            if not rid.startswith(label + "-"):
                continue
            key = rid[len(label) + 1:]
            for name, other in (("clean", clean), ("twin", (by_label.get(label) or {}).get("twin"))):
                if other and other != label and f"{other}-{key}" in finals:
                    diffs[f"{key}_vs_{name}"] = first_diff(trace, finals[f"{other}-{key}"])
        row["kv_first_diff"] = diffs


def cmd_fault_engine(a) -> None:
    setup_env(a)
    with open(a.spec) as f:
        spec = json.load(f)
    sys.exit(fault_engine(spec, a.result))


def cmd_faults(a) -> None:
    """Several engines (kvguard check at page 16 and 1, off at 16), each a process of its own (a fault
    that kills SGLang's scheduler takes only its engine down), started one after another, run at once."""
    setup_env(a)
    seeds = list(range(a.seeds))
    groups = []
    for mode, ps, classes, nseeds in (("check", 16, a.classes, a.seeds), ("check", 1, a.classes, a.seeds),
                                      ("off", 16, a.classes, a.off_seeds)):
        if ps not in a.page_sizes or (mode == "off" and not a.off_seeds):
            continue
        cl = [c for c in classes.split(",") if c and not (c == "in_page_entry" and ps == 1)]
        # scheduler killers last in their engine (off: out-of-range reads; check: accounting faults)
        order = sorted(cl, key=lambda c: {"double_free": 8, "stale_row": 9, "out_of_range_entry": 10}.get(c, 0)
                       if mode == "off" else {"double_free": 8, "stale_row": 9}.get(c, 0))
        eps = [{"label": f"clean{i}", "fault": None, "seed": i} for i in range(2)]
        eps += [{"label": f"{c[:6]}{s}", "fault": c, "seed": s} for c in order for s in seeds[:nseeds]]
        groups.append({"mode": mode, "page_size": ps, "episodes": eps})
    if a.split_killers:
        # stale_row and double_free in engines of their own, so one scheduler death loses no other class
        extra = []
        for g in groups:
            if g["mode"] != "check":
                continue
            for killer in ("stale_row", "double_free"):
                ours = {killer} | {c for c, twin in TWIN.items() if twin == killer}  # its twin control too
                kept = [e for e in g["episodes"] if e["fault"] not in ours]
                mine = [e for e in g["episodes"] if e["fault"] in ours]
                if mine and len(kept) > 2:
                    g["episodes"] = kept
                    extra.append({"mode": g["mode"], "page_size": g["page_size"], "episodes": g["episodes"][:2] + mine})
        groups += extra
    os.makedirs(a.out, exist_ok=True)
    procs = []
    t0 = time.perf_counter()
    stem = os.path.splitext(a.name)[0]
    for i, g in enumerate(groups):
        name = f"{stem}_{g['mode']}_ps{g['page_size']}_{i}"
        env = {"KVGUARD_MODE": g["mode"], **json.loads(a.env)}
        if a.tp == 1 and a.spread_gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(i % a.spread_gpus)
        if g["mode"] == "check":
            # kvguard's own account of where its checks ran (decode graphs or eager), reported beside the
            # verdicts (never read by judge: the injector's victims are the ground truth)
            env[TIMING_ENV] = os.path.join("/tmp", name + "_timing.json")
        if a.tp > 1:
            env[ABORT_LOG_ENV] = os.path.join("/tmp", name + "_aborts.jsonl")
            if a.fault_rank is not None:
                env[FAULT_RANK_ENV] = str(a.fault_rank)
        spec = {"page_size": g["page_size"], "episodes": g["episodes"], "env": env, "tp": a.tp,
                "workdir": os.path.join("/tmp", name), "cpu": a.cpu, "mem_fraction": a.fault_mem_fraction,
                "kv_dtype": a.kv_dtype or ("auto" if a.cpu else "fp8_e4m3"), "timeout": 60,
                "overrides": json.loads(a.overrides),
                # head_dim 64: SGLang's Triton attention needs K >= 32 in its dots (the 16 of
                # faultlab's default tiny Llama fails to compile on the GPU); BF16 as in serving
                "model": {} if a.cpu else {"hidden_size": 256, "intermediate_size": 512, "torch_dtype": "bfloat16"}}
        spec_path = os.path.join("/tmp", name + ".spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        out_path = os.path.join("/tmp", name + ".json")  # the summary below keeps it: a call returns 8 files
        cmd = [sys.executable, "-m", MODULE, "fault-engine", "--out", a.out, "--spec", spec_path,
               "--result", out_path] + (["--cpu"] if a.cpu else [])
        logf = open(os.path.join("/tmp", name + ".log"), "w")
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        procs.append((name, g, p, out_path, logf))
        log(f"started {name}: {len(g['episodes'])} episodes")
        if i == 0:
            # the first engine JIT-compiles SGLang's kernels; the others start once it is up
            while p.poll() is None and time.perf_counter() - t0 < a.start_timeout:
                if os.path.exists(out_path):
                    break
                time.sleep(1)
    deadline = t0 + a.budget if a.budget else None
    for name, g, p, out_path, logf in procs:
        try:
            p.wait(timeout=None if deadline is None else max(1, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            log(f"{name}: over budget, killed")
            p.kill()
            p.wait()
        logf.close()
    summary = {"command": command_line(a),
               "environment": environment(), "tp": a.tp, "fault_rank": a.fault_rank, "engines": []}
    for name, g, p, out_path, logf in procs:
        try:
            with open(out_path) as f:
                run = json.load(f)
        except OSError:
            run = {"episodes": [], "started": False}
        rows = judge(run)
        planned = len(g["episodes"])
        with open(os.path.join("/tmp", name + ".log")) as f:
            tail = f.read()[-3000:]
        entry = {"name": name, "mode": g["mode"], "page_size": g["page_size"], "rc": p.returncode,
                 "started": run.get("started"), "startup_s": run.get("startup_s"), "planned": planned,
                 "completed": len(rows), "episodes": rows, "log_tail": tail}
        if a.tp > 1:
            entry["rank_aborts"] = run.get("rank_aborts", [])
        timing = os.path.join("/tmp", name + "_timing.json")
        if g["mode"] == "check" and os.path.exists(timing):
            with open(timing) as f:
                entry["kvguard_guards"] = json.load(f).get("guards")
        entry["raw_episodes"] = run.get("episodes", [])  # what every client got (output ids or the error)
        summary["engines"].append(entry)
        bad = [r for r in rows if r["fault"] != "none" and (r["victims_aborted"] != r["victims"] or r["false_aborts"]
                                                           or r["non_victim_mismatches"])]
        log(f"{name}: rc={p.returncode} {len(rows)}/{planned} episodes; not clean: "
            + ", ".join(f"{r['label']}(v{r['victims']}/a{r['victims_aborted']}/fa{r['false_aborts']}/m{r['non_victim_mismatches']}"
                     f"/twin{r.get('twin_mismatches', '-')}/bal{r['balanced']})" for r in bad[:12])
            + (f"; kvguard {entry['kvguard_guards']}" if entry.get("kvguard_guards") else ""))
    dump(a, a.name, summary)
