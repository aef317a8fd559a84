"""kvguard in a real SGLang 0.5.23 server on the H200: overhead, first requests, KV dtypes, INT4, live faults.

Run on the GPU machine (after ``source bench/sglang_h200_setup.sh``, which installs the offline SGLang
bundle from ``.sgl/``):

    python3 bench/sglang_h200.py overhead --out $OUT          # kvguard check vs off vs off (A/A), c = 1, 8, 64
    python3 bench/sglang_h200.py kvdtype --out $OUT           # FP8 vs BF16 KV: tokens that fit, peak decode
    python3 bench/sglang_h200.py int4 --out $OUT              # INT4 (GPTQ-Marlin, dummy) vs BF16 weights
    python3 bench/sglang_h200.py faults --out $OUT            # live faults (faultlab.sglang_live), kvguard on/off
    python3 bench/sglang_h200.py report --raw DIR             # here: raw JSONs -> bench/results/sglang_h200*.json + png

The same phases dry-run on a CPU with ``--cpu`` (tiny Llama, torch_native attention, short lengths).

Engines: in-process ``sglang.Engine`` (not ``launch_server``): the same scheduler, plugin loader, pools
and CUDA graphs as the HTTP server, without HTTP/JSON encoding in the timed path, so the figures isolate
what kvguard adds; kvguard's abort reaches the client the same way (the Engine's stream ends with a
``finish_reason`` of type ``abort`` and status 500, the HTTP server turns the same object into HTTP 500).
Each engine lives in its own worker process (see bench/sglang_h200_lib.py for why); the engines for one
comparison are alive at once and the runs alternate between them (off/check in ABBA order), same
workload and seed, so drift and warm-up hit both modes alike. kvguard is switched by ``KVGUARD_MODE`` in
each worker's environment, read by SGLang's plugin loader in the scheduler process that engine spawns.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import sglang_h200_lib as lib  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
# The offline SGLang bundle (../shared/tools/sglang-h200/build.sh): $SGL_BUNDLE, else .sgl beside or above ROOT.
BUNDLE = os.environ.get("SGL_BUNDLE") or next(
    (p for p in (os.path.join(ROOT, ".sgl"), os.path.join(os.path.dirname(ROOT), ".sgl")) if os.path.isdir(p)),
    os.path.join(ROOT, ".sgl"))
BUNDLE_MODELS = os.path.join(BUNDLE, "model")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
def parse_reps(text: str) -> dict[int, int]:
    """'1:3,8:3' -> {1: 3, 8: 3} (values may be floats)."""
    out = {}
    for item in text.split(","):
        c, _, r = item.partition(":")
        out[int(c)] = float(r) if "." in r else int(r)
    return out


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for raw JSON results")
    p.add_argument("--cpu", action="store_true", help="dry run on the CPU (tiny model, short lengths)")
    p.add_argument("--model", default=None, help="model folder (config.json; dummy weights)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtype", default=None, help="SGLang kv_cache_dtype (default fp8_e4m3; CPU: auto)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--log-level", default="warning")


def setup_env(a) -> None:
    """Entry points SGLang's loader must find in every process it starts (the workers inherit these)."""
    ep_dir = os.path.join("/tmp", "kvguard_bench_ep")
    lib.write_dist_info(ep_dir, "kvguard_bench", {"kvguard_bench": "sglang_h200_lib:register_bench"})
    if not a.cpu:
        # On the GPU machine the project is not pip-installed: declare its own plugins (kvguard, and
        # faultlab's test-only injector, which registers nothing unless its variables are set).
        lib.write_dist_info(ep_dir, "kvguard", lib.project_plugin_entry_points(os.path.join(ROOT, "pyproject.toml")))
    paths = [ROOT, HERE, ep_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # multiprocessing's spawn hands the workers this process's sys.path, not PYTHONPATH: add them here too
    for p in reversed([ROOT, HERE, ep_dir]):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
    if a.cpu:
        os.environ.setdefault("FAULTLAB_SGLANG_CPU_ROTARY", "1")
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[k] = "0" if k == "NCCL_NVLS_ENABLE" else "1"
    if a.tp > 1:
        # engines of several runs share the GPUs here; SGLang's TP start-up refuses unequal free memory
        # across the ranks' GPUs unless this check is a warning
        os.environ["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "0"


def model_dir(a, name: str = "llama3-8b-shape") -> str:
    if a.model:
        return a.model
    return os.path.join(BUNDLE_MODELS, "tiny-llama" if a.cpu else name)


def vocab_of(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def engine_kwargs(a, *, model: str, kv_dtype: str | None = None, max_total_tokens: int | None = None,
                  max_running: int | None = None, graph_bs: int | None = None, **extra) -> dict:
    kw = dict(model_path=model, load_format="dummy", skip_tokenizer_init=True,
              kv_cache_dtype=kv_dtype or a.kv_dtype or ("auto" if a.cpu else "fp8_e4m3"),
              page_size=a.page_size, sampling_backend="pytorch", disable_radix_cache=True,
              random_seed=a.seed, log_level=a.log_level, tp_size=a.tp)
    if a.cpu:
        kw.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True)
    else:
        kw.update(attention_backend="triton", mem_fraction_static=a.mem_fraction)
        if graph_bs:
            kw["cuda_graph_max_bs_decode"] = graph_bs
    if max_total_tokens:
        kw["max_total_tokens"] = max_total_tokens
    if max_running:
        kw["max_running_requests"] = max_running
    kw.update(extra)
    return kw


def start_engines(specs: list[tuple[str, dict, dict]], timeout: float) -> dict[str, lib.Worker]:
    """Start engines one after another (SGLang JIT-compiles into a shared cache at first start)."""
    workers = {}
    try:
        for name, env, kw in specs:
            log(f"starting engine {name} ({env})")
            w = lib.Worker(name, env, kw)
            workers[name] = w
            info = w.wait_ready(timeout)
            log(f"engine {name} ready in {info['start_s']:.1f} s: max_total_num_tokens={info.get('max_total_num_tokens')}")
    except BaseException:
        stop_all(workers)
        raise
    return workers


def stop_all(workers: dict) -> None:
    for w in workers.values():
        w.stop()


def environment() -> dict:
    env = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpus"] = torch.cuda.device_count()
        import triton

        env["triton"] = triton.__version__
        import sglang

        env["sglang"] = sglang.__version__
    except Exception as e:  # noqa: BLE001
        env["error"] = str(e)
    try:
        env["git"] = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%h %s"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return env


def dump(a, name: str, data: dict) -> str:
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    log(f"wrote {path}")
    return path


def slim(run: dict, keep_requests: bool = False) -> dict:
    """A run without its per-chunk gap lists (the JSON stays small); per-request summaries kept."""
    out = {k: v for k, v in run.items() if k != "requests"}
    if keep_requests:
        out["requests"] = run["requests"]
    else:
        out["per_request"] = [{k: r.get(k) for k in ("rid", "ttft", "end", "tokens", "error")}
                              | {"finish": (r.get("finish") or {}).get("type")} for r in run["requests"]]
    return out


# ------------------------------------------------------------------------------------------------
# overhead: kvguard check vs off vs off (A/A)
# ------------------------------------------------------------------------------------------------
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
    specs = [("off", {"KVGUARD_MODE": "off"}, kw),
             ("check", {"KVGUARD_MODE": "check", lib.TIMING_ENV: timing_path}, kw)]
    result = {"command": " ".join(["python3", "bench/sglang_h200.py"] + sys.argv[1:]),
              "environment": environment(), "engine_kwargs": kw, "reps": reps,
              "input_len": a.input_len, "output_len": a.output_len, "page_size": a.page_size}
    t_all = time.perf_counter()
    workers = start_engines(specs, a.start_timeout)
    try:
        result["engines"] = {n: w.info for n, w in workers.items()}
        # -- first requests after start: the same batch twice on each fresh engine -----------------
        first = {}
        fw = dict(n=a.first_n, input_len=a.input_len, output_len=a.first_output, seed=a.seed + 7, vocab=vocab)
        for mode in (("off", "check") if a.first_n else ()):
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
            for r in range(reps[c]):
                # a pair must fit in what is left of --budget (estimated from this concurrency's last run)
                est = 2.2 * (runs[-1]["wall_s"] if runs else est_wall.get(c, 0.0))
                if a.budget and time.perf_counter() - t_all + est > a.budget:
                    skipped.append({"concurrency": c, "rep": r})
                    log(f"c={c} rep={r}: skipped (budget {a.budget:.0f} s)")
                    continue
                for mode in (("off", "check") if r % 2 == 0 else ("check", "off")):
                    res = workers[mode].run(n=c, input_len=a.input_len, output_len=a.output_len,
                                            seed=a.seed, vocab=vocab, tag=f"c{c}-{mode}-{r}")
                    res["mode"], res["concurrency"] = mode, c
                    runs.append(res)
                    log(f"c={c} rep={r} {mode:5s}: {res['throughput']:9.1f} tok/s  itl p50 "
                        f"{1e3 * res['itl_p50']:.3f} ms p99 {1e3 * res['itl_p99']:.3f} ms  ttft p99 "
                        f"{res['ttft_p99']:.3f} s  wall {res['wall_s']:.2f} s  errors {res['errors']}")
            cmp = lib.compare(runs)
            rows.append({"concurrency": c, "page_size": a.page_size, "input_len": a.input_len,
                         "output_len": a.output_len, **cmp})
            all_runs += [slim(x) for x in runs]
            log(f"c={c}: throughput x{cmp['throughput_ratio']:.4f} (A/A x{cmp['aa_throughput_ratio']:.4f}), "
                f"itl p99 x{cmp['itl_p99_ratio']:.4f} (A/A x{cmp['aa_itl_p99_ratio']:.4f})")
            result["rows"], result["runs"], result["skipped"] = rows, all_runs, skipped
            dump(a, a.name, result)  # keep what is measured so far
        # one tiny request after the last run: the profiler writes its file at an idle boundary
        workers["check"].run(n=1, input_len=16, output_len=4, seed=a.seed, vocab=vocab, tag="flush")
        workers["check"].run(n=1, input_len=16, output_len=4, seed=a.seed, vocab=vocab, tag="flush2")
    finally:
        stop_all(workers)
    try:
        with open(timing_path) as f:
            result["host_timing"] = json.load(f)
    except OSError as e:
        result["host_timing"] = {"error": str(e)}
    result["total_s"] = time.perf_counter() - t_all
    dump(a, a.name, result)
    print_rows(result)


def print_rows(result: dict) -> None:
    print("\nconcurrency | throughput ratio (A/A) | ITL p50 ratio (A/A) | ITL p99 ratio (A/A) | TTFT p99 ratio (A/A)")
    for row in result.get("rows", []):
        print(f"{row['concurrency']:>11} | " + " | ".join(
            f"{row[m + '_ratio']:.4f} ({row['aa_' + m + '_ratio']:.4f})" for m in lib.METRICS))
    ht = result.get("host_timing") or {}
    if ht.get("iterations"):
        print(f"kvguard host time per decode iteration: mean {ht['kvguard_us_per_iter_mean']:.1f} us, "
              f"p50 {ht['kvguard_us_per_iter_p50']:.1f} us, p99 {ht['kvguard_us_per_iter_p99']:.1f} us "
              f"over {ht['iterations']} iterations (step p50 {ht['step_ms_p50']:.2f} ms)")


# ------------------------------------------------------------------------------------------------
# faults: faultlab's live injector (faultlab.sglang_live) in real engines, kvguard on and off
# ------------------------------------------------------------------------------------------------
ALL_CLASSES = ("swapped_entries", "index_shift", "in_page_entry", "out_of_range_entry", "premature_free",
               "double_free", "stale_row")


def fault_engine(spec: dict, out_path: str) -> int:
    """One engine through fault episodes (faultlab.sglang_live.harness's episode driver and workload),
    with this bench's engine settings (GPU, CUDA graphs, tensor parallel). Writes OUT after each episode."""
    import sglang
    from faultlab.sglang_live import harness as H
    from faultlab.sglang_live.inject import ENV_ACCOUNTING, ENV_DUMMY, ENV_FAULTS, ENV_LOG, ENV_ROTARY

    workload = {**H.WORKLOAD, **spec.get("workload", {})}
    page_size = int(spec["page_size"])
    tmp = spec["workdir"]
    os.makedirs(tmp, exist_ok=True)
    log_path = os.path.join(tmp, "inject.jsonl")
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
        abort_log = spec.get("env", {}).get(lib.ABORT_LOG_ENV)
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
    wave1, wave2 = H.prompts(workload, page_size)
    try:
        for ep in spec["episodes"]:
            t = time.time()
            extra = {"timeout": spec.get("timeout", 60)} if "timeout" in inspect.signature(H._episode).parameters else {}
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
        engine.shutdown()
    save()
    return 0


def judge(run: dict) -> list[dict]:
    """Per episode: injected?, victims, victims aborted, false aborts, non-victim token mismatches
    against the run's fault-free episode (same prompts), pool accounting after the episode."""
    eps = run.get("episodes", [])
    clean = next((e for e in eps if not e["fault"]), None)
    ref = {}
    if clean is not None:
        ref = {r["rid"].split("-", 1)[1]: r["output_ids"] for r in clean["requests"]}
    out = []
    for ep in eps:
        victims = set(ep["victims"])
        injected = bool(victims) or not ep["fault"]
        row = {"label": ep["label"], "fault": ep["fault"] or "none", "seed": ep["seed"], "armed": ep["armed"],
               "injected": injected, "victims": len(victims), "victims_aborted": 0, "victims_corrupted": 0,
               "non_victim_mismatches": 0, "false_aborts": 0, "requests": len(ep["requests"]),
               "balanced": (ep.get("idle_check") or {}).get("balanced"), "seconds": ep.get("seconds")}
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
        out.append(row)
    return out


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
                kept = [e for e in g["episodes"] if e["fault"] != killer]
                mine = [e for e in g["episodes"] if e["fault"] == killer]
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
        env = {"KVGUARD_MODE": g["mode"]}
        if a.tp == 1 and a.spread_gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(i % a.spread_gpus)
        if a.tp > 1:
            env[lib.ABORT_LOG_ENV] = os.path.join("/tmp", name + "_aborts.jsonl")
            if a.fault_rank is not None:
                env[lib.FAULT_RANK_ENV] = str(a.fault_rank)
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
        cmd = [sys.executable, os.path.abspath(__file__), "fault-engine", "--out", a.out, "--spec", spec_path,
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
    summary = {"command": " ".join(["python3", "bench/sglang_h200.py"] + sys.argv[1:]),
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
        entry["raw_episodes"] = run.get("episodes", [])  # what every client got (output ids or the error)
        summary["engines"].append(entry)
        bad = [r for r in rows if r["fault"] != "none" and (r["victims_aborted"] != r["victims"] or r["false_aborts"]
                                                           or r["non_victim_mismatches"])]
        log(f"{name}: rc={p.returncode} {len(rows)}/{planned} episodes; not clean: "
            + ", ".join(f"{r['label']}(v{r['victims']}/a{r['victims_aborted']}/fa{r['false_aborts']}/m{r['non_victim_mismatches']}/bal{r['balanced']})" for r in bad[:12]))
    dump(a, a.name, summary)


# ------------------------------------------------------------------------------------------------
# extras: FP8 vs BF16 KV, the first requests after start, INT4 vs BF16 weights
# ------------------------------------------------------------------------------------------------
def cmd_extras(a) -> None:
    """In order, each step skipped when --budget would be exceeded:

    1. FP8 KV engine (kvguard off, --mem-fraction): tokens that fit (SGLang's max_total_num_tokens); its
       first batch after start (cold compile caches on a fresh machine); peak decode throughput: as many
       8192+out requests as fit (up to --peak-cap), submitted at once (SGLang prefills waiting requests
       before decoding, so the decode steps run at the full batch): requests / median inter-token latency.
    2. The same with BF16 KV.
    3. First requests after start, caches warm: a fresh kvguard-check engine and a fresh off engine
       (FP8 KV), the same batch twice on each (first vs second, check vs off).
    4. INT4 (GPTQ config, SGLang picks gptq_marlin, dummy weights) vs BF16 weights, single-stream decode,
       CUDA graphs off or (--weight-graphs) on; start capped. On a fresh machine the INT4 engine's first
       forward JIT-compiles the Marlin kernels (~6 min seen): with graphs that happens at start.
    """
    setup_env(a)
    model = model_dir(a)
    vocab = vocab_of(model)
    t0 = time.perf_counter()
    result = {"command": " ".join(["python3", "bench/sglang_h200.py"] + sys.argv[1:]),
              "environment": environment(), "input_len": a.input_len}
    ctx = a.input_len + a.peak_output + a.page_size

    def left() -> float:
        return a.budget - (time.perf_counter() - t0) if a.budget else 1e9

    def save():
        dump(a, a.name, result)

    first_w = dict(n=a.first_n, input_len=a.input_len, output_len=a.first_output, seed=a.seed + 7, vocab=vocab)
    # -- 1, 2: KV dtypes --------------------------------------------------------------------------------
    kv = {}
    for dt in [x for x in a.kv_dtypes.split(",") if x]:
        if left() < a.need_kv:
            kv[dt] = {"skipped": f"budget ({left():.0f} s left)"}
            continue
        kw = engine_kwargs(a, model=model, kv_dtype=dt, max_running=a.peak_cap, graph_bs=a.peak_cap)
        w = None
        try:
            w = start_engines([(f"kv-{dt}", {"KVGUARD_MODE": "off"}, kw)], a.start_timeout)[f"kv-{dt}"]
            info = dict(w.info)
            fit = int(info["max_total_num_tokens"])
            entry = {"engine": info, "max_total_num_tokens": fit, "requests_fit_at_context": fit // ctx}
            r1 = w.run(tag=f"first-{dt}", **first_w)
            entry["first_batch_s"], entry["first_batch_ttft_p99"] = r1["wall_s"], r1["ttft_p99"]
            c = max(1, min(fit // ctx, a.peak_cap, int(info.get("internal_state", {}).get("max_running_requests") or a.peak_cap)))
            if a.cpu:
                c = min(c, 4)
            r = w.run(n=c, input_len=a.input_len, output_len=a.peak_output, seed=a.seed, vocab=vocab, tag=f"peak-{dt}")
            entry.update(peak_concurrency=c, peak_run=slim(r), peak_decode_tok_s=c / r["itl_p50"],
                         peak_itl_p50_ms=1e3 * r["itl_p50"])
            log(f"KV {dt}: {fit} tokens fit ({fit // ctx} requests of {ctx}); first batch {r1['wall_s']:.2f} s; "
                f"peak decode at c={c}: {c / r['itl_p50']:.0f} tok/s (ITL p50 {1e3 * r['itl_p50']:.2f} ms)")
            kv[dt] = entry
        except Exception as e:  # noqa: BLE001 - report and go on
            kv[dt] = {"error": str(e)[-2000:]}
            log(f"KV {dt}: failed: {str(e)[-500:]}")
        finally:
            if w is not None:
                w.stop()
        result["kv_dtypes"] = kv
        save()
    # -- 3: first requests after start, caches warm -------------------------------------------------------
    if left() > a.need_first:
        first = {}
        kw = engine_kwargs(a, model=model, max_total_tokens=a.first_n * ctx + 64 * a.page_size,
                           max_running=a.first_n, graph_bs=a.first_n)
        workers = {}
        try:
            workers = start_engines([("check", {"KVGUARD_MODE": "check"}, kw), ("off", {"KVGUARD_MODE": "off"}, kw)],
                                    a.start_timeout)
            for mode in ("check", "off"):
                r1 = workers[mode].run(tag=f"first-{mode}", **first_w)
                r2 = workers[mode].run(tag=f"second-{mode}", **first_w)
                first[mode] = {"start_s": workers[mode].info["start_s"], "first": slim(r1), "second": slim(r2)}
                log(f"warm-cache first batch {mode}: {r1['wall_s']:.3f} s (ttft p99 {r1['ttft_p99']:.3f}), "
                    f"second {r2['wall_s']:.3f} s (ttft p99 {r2['ttft_p99']:.3f}); start {workers[mode].info['start_s']:.1f} s")
        except Exception as e:  # noqa: BLE001
            first["error"] = str(e)[-2000:]
            log(f"first requests: failed: {str(e)[-500:]}")
        finally:
            stop_all(workers)
        result["first_requests_warm_cache"] = first
        save()
    else:
        result["first_requests_warm_cache"] = {"skipped": f"budget ({left():.0f} s left)"}
    # -- 4: INT4 vs BF16 weights --------------------------------------------------------------------------
    weights = {}
    for label, name in (("int4_gptq", "llama3-8b-gptq"), ("bf16", "llama3-8b-shape")):
        if label not in a.weights.split(","):
            continue
        if left() < a.need_int4:
            weights[label] = {"skipped": f"budget ({left():.0f} s left)"}
            continue
        mdir = os.path.join(BUNDLE_MODELS, "tiny-llama" if a.cpu else name)
        kw = engine_kwargs(a, model=mdir, max_total_tokens=8 * 1024, max_running=4,
                           **({"cuda_graph_max_bs_decode": 1} if a.weight_graphs else {"disable_cuda_graph": True}))
        w = None
        try:
            w = start_engines([(label, {"KVGUARD_MODE": "off"}, kw)], min(a.int4_start_timeout, left() - 30))[label]
            r = w.run(n=1, input_len=a.single_input, output_len=a.single_output, seed=a.seed, vocab=vocab_of(mdir),
                      tag=f"single-{label}")
            r2 = w.run(n=1, input_len=a.single_input, output_len=a.single_output, seed=a.seed, vocab=vocab_of(mdir),
                       tag=f"single2-{label}")
            best = min((r, r2), key=lambda x: x["itl_p50"])
            weights[label] = {"engine": w.info, "decode_tok_s": 1.0 / best["itl_p50"], "itl_p50_ms": 1e3 * best["itl_p50"],
                              "runs": [slim(r), slim(r2)]}
            weights[label]["cuda_graphs"] = bool(a.weight_graphs)
            log(f"weights {label}: single-stream decode {1.0 / best['itl_p50']:.1f} tok/s (ITL p50 {1e3 * best['itl_p50']:.2f} ms, "
                f"CUDA graphs {'on' if a.weight_graphs else 'off'}); start {w.info['start_s']:.0f} s")
        except Exception as e:  # noqa: BLE001
            weights[label] = {"error": str(e)[-2000:]}
            log(f"weights {label}: failed: {str(e)[-500:]}")
        finally:
            if w is not None:
                w.stop(timeout=30)
        result["weights"] = weights
        save()
    result["total_s"] = time.perf_counter() - t0
    save()


# ------------------------------------------------------------------------------------------------
# report: raw JSONs from the GPU machine -> bench/results/sglang_h200*.json and the plot
# ------------------------------------------------------------------------------------------------
def fault_table(faults: dict) -> list[dict]:
    """Per (engine mode, page size, class): episodes summed over seeds."""
    table = {}
    for eng in faults.get("engines", []):
        for ep in eng["episodes"]:
            key = (eng["mode"], eng["page_size"], ep["fault"])
            row = table.setdefault(key, {"fault": ep["fault"], "kvguard": eng["mode"], "page_size": eng["page_size"],
                                         "episodes": 0, "injected": 0, "victims": 0, "victims_aborted": 0,
                                         "victims_corrupted": 0, "non_victim_mismatches": 0, "false_aborts": 0,
                                         "unbalanced_after": 0, "requests": 0})
            row["episodes"] += 1
            row["injected"] += int(ep["injected"] and ep["fault"] != "none")
            for k in ("victims", "victims_aborted", "victims_corrupted", "non_victim_mismatches", "false_aborts",
                      "requests"):
                row[k] += ep[k]
            row["unbalanced_after"] += int(ep["balanced"] is False)
        if eng["completed"] < eng["planned"]:
            # the episodes the engine never reached (its scheduler died, or the run was cut)
            key = (eng["mode"], eng["page_size"], "_engine")
            table.setdefault(key, {"fault": "(engine stopped early)", "kvguard": eng["mode"],
                                   "page_size": eng["page_size"], "engine": eng["name"], "rc": eng["rc"],
                                   **dict.fromkeys(("injected", "victims", "victims_aborted",
                                                    "non_victim_mismatches", "false_aborts")),
                                   "completed": eng["completed"], "planned": eng["planned"],
                                   "log_tail": eng["log_tail"][-600:]})
    return list(table.values())


def rank_agreement(faults: dict) -> list[dict]:
    """TP: per episode, the requests each rank's kvguard aborted (from the per-rank abort log)."""
    out = []
    for eng in faults.get("engines", []):
        per = {}
        for rec in eng.get("rank_aborts", []):
            label = rec["rid"].rsplit("-", 1)[0]
            per.setdefault(label, {}).setdefault(rec["rank"], set()).add(rec["rid"])
        for ep in eng["episodes"]:
            ranks = per.get(ep["label"], {})
            sets = [sorted(v) for _, v in sorted(ranks.items())]
            out.append({"engine": eng["name"], "label": ep["label"], "fault": ep["fault"],
                        "ranks_reporting": sorted(ranks), "aborted_per_rank": {str(r): sorted(v) for r, v in ranks.items()},
                        "agree": all(x == sets[0] for x in sets) if sets else True})
    return out


def _log_lines(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [x.rstrip("\n") for x in f]


def tp2_summary(raw: str) -> dict:
    """The TP=2 runs (2-GPU machine), from what came back: per-rank abort logs, the injector's logs, and
    the harness's log lines (its JSON results exceeded the 8 files a call returns and were lost)."""
    import re

    out = {"command": "bash bench/sglang_h200_x2.sh (from .snap, after sourcing bench/sglang_h200_setup.sh)",
           "tp_size": 2, "faults": [], "rank_agreement": [], "client_side": {}, "overhead": {}}
    for run, fault_rank in (("faults_tp2_rank1", 1), ("faults_tp2_all", None)):
        aborts = [json.loads(x) for x in _log_lines(os.path.join(raw, f"{run}_check_ps16_0_aborts.jsonl")) if x]
        events = [json.loads(x) for x in _log_lines(os.path.join(raw, f"{run}_inject.jsonl")) if x]
        per, victims, pids, faults = {}, {}, {}, {}
        for rec in aborts:
            per.setdefault(rec["rid"].rsplit("-", 1)[0], {}).setdefault(rec["rank"], set()).add(rec["rid"])
        for e in events:
            if e["event"] == "armed":
                faults[e["label"]] = e["fault"]
            if e["event"] == "inject":
                victims.setdefault(e["label"], set()).update(e["victims"])
                pids.setdefault(e["label"], set()).add(e["pid"])
            if e["event"] == "victim":
                victims.setdefault(e["label"], set()).add(e["rid"])
        for label, fault in faults.items():
            ranks = per.get(label, {})
            sets = [v for _, v in sorted(ranks.items())]
            v = victims.get(label, set())
            out["rank_agreement"].append({
                "run": run, "fault_rank": fault_rank, "label": label, "fault": fault,
                "injecting_processes": len(pids.get(label, ())), "victims": sorted(v),
                "aborted_per_rank": {str(r): sorted(x) for r, x in sorted(ranks.items())},
                "every_rank_aborted_exactly_the_victims": len(ranks) == 2 and all(x == v for x in sets) if v else not ranks})
    for line in _log_lines(os.path.join(raw, "faults_tp2.log")):
        m = re.search(r"(faults_tp2_\w+): rc=(-?\d+) (\d+)/(\d+) episodes; not clean: (.*)$", line)
        if m:
            out["client_side"][m.group(1)] = {"rc": int(m.group(2)), "completed": int(m.group(3)),
                                              "planned": int(m.group(4)), "not_clean": m.group(5).strip(),
                                              "legend": "label(v victims/a victims aborted/fa false aborts/"
                                                        "m non-victim token mismatches/bal pools balanced)"}
    runs = []
    for line in _log_lines(os.path.join(raw, "overhead_tp2.log")):
        m = re.search(r"c=(\d+) rep=(\d+) (\w+)\s*: +([\d.]+) tok/s  itl p50 ([\d.]+) ms p99 ([\d.]+) ms  ttft p99 "
                      r"([\d.]+) s", line)
        if m:
            runs.append({"concurrency": int(m.group(1)), "rep": int(m.group(2)), "mode": m.group(3),
                         "throughput": float(m.group(4)), "itl_p50_ms": float(m.group(5)),
                         "itl_p99_ms": float(m.group(6)), "ttft_p99_s": float(m.group(7))})
        if line.startswith("kvguard host time"):
            out["overhead"]["host_time_line"] = line
    out["overhead"]["runs"] = runs
    warm = [r for r in runs if r["rep"] >= 1]
    off = next((r for r in warm if r["mode"] == "off"), None)
    chk = next((r for r in warm if r["mode"] == "check"), None)
    if off and chk:
        out["overhead"]["warm_pair_ratios"] = {k: chk[k] / off[k] for k in ("throughput", "itl_p50_ms", "itl_p99_ms", "ttft_p99_s")}
    out["overhead"]["note"] = ("c=8, 8192 in / 1000 out, 2 pairs; rep 0 was the first batch on each fresh engine "
                               "(no warm-up batch was run), so only rep 1 is a warm A/B pair: no A/A spread. "
                               "c=64 skipped for the call's time budget.")
    return out


def cmd_report(a) -> None:
    def load(name):
        for folder in (a.raw, a.raw_before):
            path = os.path.join(folder, name)
            if os.path.exists(path):
                with open(path) as f:
                    return json.load(f)
        return None

    over, faults, extras, int4 = (load("overhead_h200.json"), load("faults_h200.json"), load("extras_h200.json"),
                                  load("extras_int4.json"))
    repeat, stale = load("overhead_repeat.json"), load("faults_stale.json")
    weights = {lab: load(f"weights_{lab}.json") for lab in ("int4", "bf16", "eager")}
    sources = [x for x in (over, repeat, faults, stale, extras, int4, *weights.values()) if x]
    out = {"command": "; ".join(x["command"] for x in sources),
           "sglang": (over or {}).get("environment", {}).get("sglang"), "environment": (over or {}).get("environment"),
           "engine_kwargs": (over or {}).get("engine_kwargs"), "rows": [], "faults": []}

    def overhead_rows(run, label):
        return [{k: r[k] for k in ("concurrency", "page_size", "input_len", "output_len")} | {"run": label}
                | {k: r[k] for k in r if k.endswith("_ratio") or k.endswith("_range")
                   or k.endswith("_off") or k.endswith("_check") or k.startswith("n_")} for r in run["rows"]]

    if over:
        rows = overhead_rows(over, "main")
        rows += overhead_rows(repeat, "repeat") if repeat else []
        # per concurrency, the run with the most A/B pairs is the row; the others are kept as repeats
        best = {}
        for r in rows:
            if r["concurrency"] not in best or r["n_off"] > best[r["concurrency"]]["n_off"]:
                best[r["concurrency"]] = r
        out["rows"] = [best[c] for c in sorted(best)]
        out["repeat_rows"] = [r for r in rows if r is not best[r["concurrency"]]]
        out["host_timing"] = over.get("host_timing")
        if repeat:
            out["host_timing_repeat"] = repeat.get("host_timing")
        out["first_requests_fresh_machine"] = {m: {k: v["wall_s"] for k, v in d.items()}
                                               for m, d in (over.get("first_requests") or {}).items()}
    if faults:
        out["faults"] = fault_table(faults)
        out["fault_engines"] = [{k: e[k] for k in ("name", "mode", "page_size", "rc", "started", "planned", "completed")}
                                for e in faults["engines"]]
    if stale:
        out["faults_stale_row_repeat"] = fault_table(stale)
    if extras:
        out["kv_dtypes"] = {k: {x: v.get(x) for x in ("max_total_num_tokens", "requests_fit_at_context",
                                                       "peak_concurrency", "peak_decode_tok_s", "peak_itl_p50_ms",
                                                       "first_batch_s", "error", "skipped")}
                            for k, v in (extras.get("kv_dtypes") or {}).items()}
        fr = extras.get("first_requests_warm_cache") or {}
        out["first_requests_warm_cache"] = {m: ({k: d[k]["wall_s"] for k in ("first", "second")}
                                                | {"ttft_first": d["first"]["ttft_p99"], "ttft_second": d["second"]["ttft_p99"],
                                                   "start_s": d.get("start_s")}) if isinstance(d, dict) and "first" in d else d
                                            for m, d in fr.items()}
    keep = ("decode_tok_s", "itl_p50_ms", "cuda_graphs", "error", "skipped")
    for run in [int4] + [weights["int4"], weights["bf16"]]:
        for k, v in ((run or {}).get("weights") or {}).items():
            if not v.get("skipped"):
                out.setdefault("weights", {})[k] = {x: v.get(x) for x in keep} | {"start_s": (v.get("engine") or {}).get("start_s")}
    for k, v in ((weights["eager"] or {}).get("weights") or {}).items():
        if not v.get("skipped"):
            out.setdefault("weights_no_cuda_graphs", {})[k] = {x: v.get(x) for x in keep}
    w = out.get("weights", {})
    if all(w.get(k, {}).get("decode_tok_s") for k in ("int4_gptq", "bf16")):
        out["int4_vs_bf16_single_stream_decode"] = w["int4_gptq"]["decode_tok_s"] / w["bf16"]["decode_tok_s"]
    tp2_dir = os.path.join(a.raw_before, "tp2")
    if os.path.isdir(tp2_dir):
        tp2 = tp2_summary(tp2_dir)
        with open(os.path.join(a.results, "sglang_h200_tp2.json"), "w") as f:
            json.dump(tp2, f, indent=1)
        log(f"wrote {os.path.join(a.results, 'sglang_h200_tp2.json')}")
        out["tp2"] = "bench/results/sglang_h200_tp2.json"
    with open(os.path.join(a.results, "sglang_h200.json"), "w") as f:
        json.dump(out, f, indent=1)
    log(f"wrote {os.path.join(a.results, 'sglang_h200.json')}")
    if over:
        plot(over, os.path.join(a.results, "sglang_h200.png"))


def plot(over: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = over["rows"]
    lim_pct = 3.0
    fig, axes = plt.subplots(1, len(lib.METRICS), figsize=(4 * len(lib.METRICS), 3.6), sharey=True)
    for ax, m in zip(axes, lib.METRICS):
        for i, r in enumerate(rows):
            runs = [x for x in over["runs"] if x["concurrency"] == r["concurrency"]]
            base = r[f"{m}_off"]
            for mode, dx, color in (("off", -0.12, "tab:blue"), ("check", 0.12, "tab:red")):
                ys = [100 * (x[m] / base - 1) for x in runs if x["mode"] == mode]
                inside = [y for y in ys if abs(y) <= lim_pct]
                ax.scatter([i + dx] * len(inside), inside, color=color, s=18,
                           label=f"kvguard {mode}" if i == 0 and m == lib.METRICS[0] else None)
                for y in (y for y in ys if abs(y) > lim_pct):  # an outlier run: drawn at the edge, labelled
                    edge = lim_pct * 0.97 * (1 if y > 0 else -1)
                    ax.scatter([i + dx], [edge], color=color, s=30, marker="^" if y > 0 else "v")
                    ax.annotate(f"{y:+.0f}%", (i + dx, edge), textcoords="offset points", xytext=(6, -3), fontsize=7)
        ax.axhline(0, color="gray", lw=0.8)
        for lim in (-1, 1):
            ax.axhline(lim, color="gray", lw=0.6, ls=":")
        ax.set_xticks(range(len(rows)), [f"c={r['concurrency']}" for r in rows])
        ax.set_title(m.replace("_", " "))
        ax.set_ylim(-lim_pct, lim_pct)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("each run, % vs median of kvguard-off runs")
    axes[0].legend(fontsize=8)
    fig.suptitle("kvguard in SGLang 0.5.23 on one H200: 8B-shaped BF16, FP8 KV, page 16, CUDA graphs, 8192 in / 1000 out",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


# ------------------------------------------------------------------------------------------------
# Entry
# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("overhead", help="kvguard check vs off vs off (A/A)")
    add_common(p)
    p.add_argument("--reps", default="1:3,8:3,64:2", help="concurrency:pairs, comma separated")
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--first-n", type=int, default=8, help="first batch after start: requests")
    p.add_argument("--first-output", type=int, default=64, help="first batch after start: output tokens")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--chunked-prefill", type=int, default=None)
    p.add_argument("--name", default="overhead.json")
    p.add_argument("--budget", type=float, default=0, help="seconds; skip A/B pairs that would not fit")
    p.add_argument("--est", default="1:9,8:10,64:44", help="concurrency:seconds per run, before one is measured")
    p.set_defaults(func=cmd_overhead)
    p = sub.add_parser("faults", help="live faults (faultlab.sglang_live), kvguard check and off")
    add_common(p)
    p.add_argument("--classes", default=",".join(ALL_CLASSES))
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--off-seeds", type=int, default=2)
    p.add_argument("--page-sizes", default="16,1", type=lambda t: [int(x) for x in t.split(",")])
    p.add_argument("--fault-rank", type=int, default=None, help="TP: inject on this rank only")
    p.add_argument("--fault-mem-fraction", type=float, default=0.5)
    p.add_argument("--split-killers", action="store_true")
    p.add_argument("--overrides", default="{}", help="JSON: sglang.Engine settings over the fault engines' own")
    p.add_argument("--spread-gpus", type=int, default=1, help="tp 1: engine i on GPU i %% N")
    p.add_argument("--budget", type=float, default=0)
    p.add_argument("--name", default="faults.json")
    p.set_defaults(func=cmd_faults)
    p = sub.add_parser("extras", help="FP8 vs BF16 KV, first requests (warm caches), INT4 vs BF16 weights")
    add_common(p)
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--peak-output", type=int, default=48)
    p.add_argument("--peak-cap", type=int, default=192)
    p.add_argument("--kv-dtypes", default="fp8_e4m3,bf16")
    p.add_argument("--first-n", type=int, default=8)
    p.add_argument("--first-output", type=int, default=64)
    p.add_argument("--single-input", type=int, default=128)
    p.add_argument("--single-output", type=int, default=256)
    p.add_argument("--int4-start-timeout", type=float, default=150)
    p.add_argument("--weights", default="int4_gptq,bf16", help="which weight formats step 4 runs")
    p.add_argument("--weight-graphs", action="store_true", help="step 4 with CUDA graphs (decode batch 1)")
    p.add_argument("--need-kv", type=float, default=120, help="seconds one KV-dtype step needs")
    p.add_argument("--need-first", type=float, default=100)
    p.add_argument("--need-int4", type=float, default=60)
    p.add_argument("--budget", type=float, default=0)
    p.add_argument("--name", default="extras.json")
    p.set_defaults(func=cmd_extras)
    p = sub.add_parser("report", help="raw JSONs -> bench/results/sglang_h200*.json and the plot (here)")
    p.add_argument("--raw", default=os.path.join(RESULTS, "sglang_h200_raw", "dec01"))
    p.add_argument("--raw-before", default=os.path.join(RESULTS, "sglang_h200_raw", "nov30"),
                   help="earlier runs whose parts this run did not repeat (KV dtypes, first requests, TP=2)")
    p.add_argument("--results", default=RESULTS)
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("fault-engine", help=argparse.SUPPRESS)
    add_common(p)
    p.add_argument("--spec", required=True)
    p.add_argument("--result", required=True)
    p.set_defaults(func=cmd_fault_engine)
    a = ap.parse_args(argv)
    a.func(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
