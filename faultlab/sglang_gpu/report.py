"""``report`` (run here, not on the GPU): the raw JSONs from the GPU machine to
``bench/results/sglang_h200.json``, ``sglang_h200_tp2.json`` and the plot ``sglang_h200.png``."""
from __future__ import annotations

import json
import os
import re

from faultlab.sglang_gpu.common import log
from faultlab.sglang_gpu.workload import METRICS
from faultlab.sglang_live.runtime import label_of


def fault_table(faults: dict) -> list[dict]:
    """Per (engine mode, page size, class): episodes summed over seeds."""
    table = {}
    for eng in faults.get("engines", []):
        for ep in eng["episodes"]:
            key = (eng["mode"], eng["page_size"], ep["fault"])
            row = table.setdefault(key, {"fault": ep["fault"], "kvguard": eng["mode"], "page_size": eng["page_size"],
                                         "episodes": 0, "injected": 0, "victims": 0, "victims_aborted": 0,
                                         "victims_corrupted": 0, "non_victim_mismatches": 0, "false_aborts": 0,
                                         "unbalanced_after": 0, "requests": 0, "shared_row_steps": 0})
            row["episodes"] += 1
            row["injected"] += int(ep["injected"] and ep["fault"] != "none")
            for k in ("victims", "victims_aborted", "victims_corrupted", "non_victim_mismatches", "false_aborts",
                      "requests", "shared_row_steps"):
                row[k] += ep.get(k, 0)
            if "twin_mismatches" in ep:  # against the twin control (the same victim aborted by SGLang itself)
                row["twin"] = ep["twin"].rstrip("0123456789")
                row["twin_mismatches"] = row.get("twin_mismatches", 0) + ep["twin_mismatches"]
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
            label = label_of(rec["rid"])
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
    out = {"command": "bash bench/sglang_h200_x2.sh (from .snap, after sourcing bench/sglang_h200_setup.sh)",
           "tp_size": 2, "faults": [], "rank_agreement": [], "client_side": {}, "overhead": {}}
    for run, fault_rank in (("faults_tp2_rank1", 1), ("faults_tp2_all", None)):
        aborts = [json.loads(x) for x in _log_lines(os.path.join(raw, f"{run}_check_ps16_0_aborts.jsonl")) if x]
        events = [json.loads(x) for x in _log_lines(os.path.join(raw, f"{run}_inject.jsonl")) if x]
        per, victims, pids, faults = {}, {}, {}, {}
        for rec in aborts:
            per.setdefault(label_of(rec["rid"]), {}).setdefault(rec["rank"], set()).add(rec["rid"])
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
    def load(name):  # the newest run of each part: the first folder that has it
        for folder in a.raw:
            path = os.path.join(folder, name)
            if os.path.exists(path):
                with open(path) as f:
                    return json.load(f)
        return None

    over, faults, extras, int4 = (load("overhead_h200.json"), load("faults_h200.json"), load("extras_h200.json"),
                                  load("extras_int4.json"))
    repeat, watch, fixed = load("overhead_repeat.json"), load("stale_watch.json"), load("overhead_stale_fix.json")
    weights = {lab: load(f"weights_{lab}.json") for lab in ("int4", "bf16", "eager")}
    sources = [x for x in (over, repeat, fixed, faults, watch, extras, int4, *weights.values()) if x]
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
        rows += overhead_rows(fixed, "after_stale_row_fix") if fixed else []  # one more hook per decode step
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
        if fixed:
            out["host_timing_after_stale_row_fix"] = fixed.get("host_timing")
        out["first_requests_fresh_machine"] = {m: {k: v["wall_s"] for k, v in d.items()}
                                               for m, d in (over.get("first_requests") or {}).items()}
    if faults:
        out["faults"] = fault_table(faults)
        out["fault_engines"] = [{k: e[k] for k in ("name", "mode", "page_size", "rc", "started", "planned", "completed")}
                                for e in faults["engines"]]
    if watch:  # stale_row with the KV watch: the new owner's K/V, position by position, vs twin and clean
        out["faults_stale_row_kv_watch"] = fault_table(watch)
        out["stale_row_kv_first_diff"] = {f"{e['name']}/{ep['label']}": ep.get("kv_first_diff")
                                          for e in watch["engines"] for ep in e["episodes"] if ep["fault"] == "stale_row"}
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
    tp2_dir = next((os.path.join(d, "tp2") for d in a.raw if os.path.isdir(os.path.join(d, "tp2"))), None)
    if tp2_dir:
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
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.6), sharey=True)
    for ax, m in zip(axes, METRICS):
        for i, r in enumerate(rows):
            runs = [x for x in over["runs"] if x["concurrency"] == r["concurrency"]]
            base = r[f"{m}_off"]
            for mode, dx, color in (("off", -0.12, "tab:blue"), ("check", 0.12, "tab:red")):
                ys = [100 * (x[m] / base - 1) for x in runs if x["mode"] == mode]
                inside = [y for y in ys if abs(y) <= lim_pct]
                ax.scatter([i + dx] * len(inside), inside, color=color, s=18,
                           label=f"kvguard {mode}" if i == 0 and m == METRICS[0] else None)
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
