"""kvguard's host time per decode iteration on the H200, with the overlap scheduler on and off.

    python bench/sglang_h200_host.py [RAW_OVERHEAD_JSON ...] [--out bench/results/sglang_h200_host.json]

Reads raw ``python3 -m faultlab.sglang_gpu overhead`` results (default: the December 2-4 runs with the check on and
off in alternate blocks of decode steps within each run, ``--interleave 8`` (``bench/sglang_h200_interleave.sh``):
dec04e, dec04d, dec04c and dec04b (the working tree committed as 047b6dc, the clean check's result word compared inline
and the TP group looked up once: dec04b overlap off at c=1 and 64 and on at c=1 and 64, dec04c c=256 at 1024/300, then
dec04d (off and on at c=64) and dec04e (off at c=64) on the same machine minutes later, while its host ran kvguard's
off steps ~1.9x slower), dec04a (commit 0abeb32, the baseline of that session: overlap off at c=64, the same machine),
dec03b (commit 6856081, the captured check's result word read before any wait: overlap off at c=1, 4 runs, on
a machine as slow as dec03a's; the budget skipped c=64), dec03a (commit 7908b13, the decode record reading the step's pages in place and launching from a prebuilt
argument list: overlap off twice (off, off2) and on, at c=1 and 64, on a sixth machine whose host ran ~1.5x slower),
dec02r (commit 676cd97, the decode-mode tests without is_decode(): long overlap-off runs, 18 at c=1 and 4 at c=64, and
overlap on, 10 and 3, on a fifth machine), dec02q (commit f76886b, the second session's final hot path: overlap off and on at c=1 and 64, and c=256 at 1024/300),
dec02o (commit c423939, the trimmed arming and verdict read and the profiler's calibrated share; overlap off and on
at c=1 and 64, a fourth machine), dec02n (commit 97f3b87, overlap off at c=1 and 64, a third machine, the off steps' bookkeeping timed too), dec02m (commit fd19881, the decode check armed in the alloc_for_decode hook; overlap off and on at c=1 and 64, and
c=256 at 1024/300) and dec02l (commit 7f08808, before that change, another machine); then the in-engine A/B runs,
``--switch``: dec02k (commit acb1b1d, overlap on and off at c=1, another machine) and dec02j (commit bd35b63,
overlap off and on at c=1 and 64, c=256 at 1024/300) after the hot-path trim and with the leaner profiler and a
warm-up run per concurrency; dec02i (overlap off, c=1 and 64) with no event on the captured check's path; dec02h with the
decode check captured into SGLang's decode graphs (overlap off at c=1 and 64, on at c=1); dec02g after the cached-stream event (overlap off and on at 8192/1000, and c=256 at 1024/300);
dec02e (overlap off, 8192/1000) and dec02d/on (overlap on, 1024/1000) after the per-step launch work; then the
December 1 runs before it, dec01d and dec01e) and writes one
row per (run, overlap, concurrency) in the issue's format, each raw file's command kept beside its rows, and
the per-piece host and GPU costs of ``bench/host_path_h200.py`` (dec02h/graph1/host_path.json, with the GPU
time of the check as SGLang's graphs carry it) under ``pieces``.
A row whose concurrency the run's time budget skipped has no ratios (null). An interleaved run's rows are computed
again here from its labelled steps (``faultlab.sglang_gpu.overhead.attach_interleaved``), by the harness's rule now.
"""
import argparse
import json
import os

from faultlab.sglang_gpu.overhead import attach_interleaved

HERE = os.path.dirname(os.path.abspath(__file__))
RAW = os.path.join(HERE, "results", "sglang_h200_raw")
DEFAULT = [os.path.join(RAW, "dec05a", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec05a", "on", "overhead_interleave_overlap.json"),
           os.path.join(RAW, "dec04b", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec04b", "on", "overhead_interleave_overlap.json"),
           os.path.join(RAW, "dec04c", "b256", "overhead_interleave_nooverlap_c256.json"),
           os.path.join(RAW, "dec04d", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec04d", "on", "overhead_interleave_overlap.json"),
           os.path.join(RAW, "dec04e", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec04a", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec03b", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec03a", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec03a", "off2", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec03a", "on", "overhead_interleave_overlap.json"),
           os.path.join(RAW, "dec02r", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec02r", "on", "overhead_interleave_overlap.json"),
           os.path.join(RAW, "dec02q", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec02q", "on", "overhead_interleave_overlap.json"),
           os.path.join(RAW, "dec02q", "b256", "overhead_interleave_nooverlap_c256.json"),
           os.path.join(RAW, "dec02o", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec02o", "on", "overhead_interleave_overlap.json"),
           os.path.join(RAW, "dec02n", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec02m", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec02m", "on", "overhead_interleave_overlap.json"),
           os.path.join(RAW, "dec02m", "b256", "overhead_interleave_nooverlap_c256.json"),
           os.path.join(RAW, "dec02l", "off", "overhead_interleave_nooverlap.json"),
           os.path.join(RAW, "dec02l", "on", "overhead_interleave_overlap.json"),
           os.path.join(RAW, "dec02k", "off", "overhead_switch_nooverlap.json"),
           os.path.join(RAW, "dec02k", "on", "overhead_switch_overlap.json"),
           os.path.join(RAW, "dec02j", "off", "overhead_switch_nooverlap.json"),
           os.path.join(RAW, "dec02j", "on", "overhead_switch_overlap.json"),
           os.path.join(RAW, "dec02j", "b256", "overhead_switch_nooverlap_c256.json"),
           os.path.join(RAW, "dec02i", "off", "overhead_switch_nooverlap.json"),
           os.path.join(RAW, "dec02h", "off", "overhead_switch_nooverlap.json"),
           os.path.join(RAW, "dec02h", "on", "overhead_switch_overlap.json"),
           os.path.join(RAW, "dec02g", "off", "overhead_switch_nooverlap.json"),
           os.path.join(RAW, "dec02g", "on", "overhead_switch_overlap.json"),
           os.path.join(RAW, "dec02g", "b256", "overhead_switch_nooverlap_c256.json"),
           os.path.join(RAW, "dec02e", "overhead_switch_nooverlap.json"),
           os.path.join(RAW, "dec02d", "on", "overhead_switch_overlap_1024.json"),
           os.path.join(RAW, "dec01d", "overhead_nooverlap.json"), os.path.join(RAW, "dec01e", "overhead_overlap_1024.json")]
PIECES = os.path.join(RAW, "dec02h", "graph1", "host_path.json")
PIECES_COMMAND = "python3 bench/host_path_h200.py --out $OUT/hp --calls 1000"
_DEC04 = ("the working tree committed as 047b6dc (the file's git field names the commit it sat on, 0abeb32) on an "
          "eighth machine (GPU-c409e6d4)")
_TP_PATH = ("kvguard's attention-TP path served over one rank (overhead --tp-path: the check launched as the batch is "
            "prepared, no graph carries it; its verdict all-reduced and read with the result): a stand-in for that "
            "path's host cost at TP >= 2, not a TP=2 run. ")
NOTES = {"dec05a/off": _TP_PATH + "Commit 34588d2, the all-reduce through torch.distributed's NCCL process group: "
                                  "359/536 us at c=1/64 (alloc_for_decode hook 338 us, the verdict's read 77 us per "
                                  "step); a ninth machine (GPU-fbb200c6); the budget ran 1 of 2 runs at c=64",
         "dec05a/on": _TP_PATH + "Commit 34588d2, as dec05a/off",
         "dec04b/off": _DEC04 + "; kvguard's off steps 18.6 us at c=1 and 22.2 us at c=64 (as fast as dec02r's host)",
         "dec04b/on": _DEC04,
         "dec04c/b256": _DEC04 + ", right after dec04b; one run of 300 output tokens (~260 interleaved steps): its "
                                 "ratios are not a figure, its host time is",
         "dec04d/off": _DEC04 + ", 10 minutes after dec04b, same code: the host now ran kvguard's off steps ~1.9x "
                                "slower (41.8 against 22.2 us at c=64; no process of ours left on the machine), and the "
                                "on steps with them (65.8 against 42.5 us)",
         "dec04d/on": _DEC04 + ", as dec04d/off (the host ~1.9x slower than in dec04b)",
         "dec04e/off": _DEC04 + ", after dec04d, same code, the host still slow (off steps 41.2 us at c=64)",
         "dec04a/off": "commit 0abeb32 (before 047b6dc), the same eighth machine, its host at dec04b's speed "
                       "(off steps 28.2 us at c=64)",
         "dec03b/off": "commit 6856081 on a seventh machine whose host ran kvguard's off steps as slowly as dec03a's "
                       "(24.5 against 25.6 us at c=1): on - off host 25.5 us here against 38.5 us on dec03a; 4 runs "
                       "at c=1 only (the device time left skipped c=64)",
         "dec03a/off": "commit 7908b13 on a sixth machine whose host ran ~1.5x slower than dec02r's (kvguard's off steps "
                       "25.6 against 16.9 us at c=1; SGLang's own hooks as slow): compare on - off host, 38 us here "
                       "against 23 us on dec02r; the budget ran 2 of 4 runs at c=64",
         "dec03a/off2": "commit 7908b13, the same sixth machine, a second overlap-off run (same code: its spread from "
                        "dec03a/off, -3 and +8 us of host p50, is the run-to-run noise)",
         "dec03a/on": "commit 7908b13, the same sixth machine",
         "dec02r/off": "commit 676cd97 on a fifth machine, whose host ran kvguard's off steps as dec02o's did (16.9 us "
                       "at c=1); 7854/7853 steps at c=1 and 1749/1745 at c=64: ITL p99 resolved (its A/A x1.0000 "
                       "and x0.9985)",
         "dec02r/on": "commit 676cd97, the same fifth machine",
         "dec02q/off": "commit f76886b (kvguard as 8a86d6e; the file's git field names the lent machine's stale .git, "
                       "1dfa246); c=1: ITL p99 x1.034 against an A/A of x0.993: the on steps' tail (13 of 1304 "
                       "steps over 9.28 ms, 0.3-1.5 ms over the median step) carries 42-75 us of kvguard host time "
                       "(one step 375 us), not what makes it long; p99 of ~1300 steps is not resolved to 1% "
                       "(x0.985 to x1.034 across dec02m-q)",
         "dec02q/on": "commit f76886b, the same machine",
         "dec02q/b256": "commit f76886b; one run of 300 output tokens (~260 interleaved steps): its ratios are not a "
                        "figure, its host time is",
         "dec02o/off": "commit c423939 (the file's git field: the lent machine's stale .git) on a fourth machine, whose host ran the off steps ~20% faster than dec02n's "
                       "(16.9 against 21.1 us at c=1): compare on - off host, 23 us here against 32 us on dec02n",
         "dec02o/on": "commit c423939, the same fourth machine",
         "dec02m/off": "the off steps' host time leaves out the bookkeeping half of the alloc_for_decode hook, which "
                       "ran untimed there (timed from 97f3b87 on, dec02n: ~11 us per step at c=1)",
         "dec02m/on": "as dec02m/off: the off steps' host time leaves out the alloc_for_decode bookkeeping half",
         "dec02m/b256": "one run of 300 output tokens (~260 interleaved steps): its ratios are not a figure, its "
                        "host time is",
         "dec02l/off": "commit 7f08808 (the check still armed in a prepare_for_decode hook of its own), on another "
                       "machine of the kind",
         "dec02l/on": "commit 7f08808, the same machine",
         "dec02k/off": "commit acb1b1d on a second machine of the same kind, whose host ran every hook ~1.4x slower "
                       "than dec02j's (same code but the last trim); three pairs at c=1 only; the off runs drifted by "
                       "7% within the run (ITL p50 8.67 -> 9.29 ms), so its ratios and A/A are not figures",
         "dec02k/on": "commit acb1b1d, the same second machine (host ~1.5x slower per hook than dec02j's); the time "
                      "budget skipped c=64",
         "dec02j/off": "commit bd35b63; c=1: the off runs' ITL p50 spread 8.54-8.96 ms and the check runs' "
                       "8.46-9.21 ms, pair to pair (the host's drift), so a ratio within +-0.8% is not resolved; "
                       "c=64: the A/A (x0.976 throughput, x1.042 ITL p50) is larger than the figures",
         "dec02j/on": "commit bd35b63 with KVGUARD_BENCH_INNER=1 (five inner timers, ~1 us each, in its host time)",
         "dec02j/b256": "commit bd35b63; one pair at 1024/300: its ratios are not a figure, its host time is",
         "dec02i/off": "commit 1e1a7ee; its in-engine 'off' mode still cleared the graph check's owner buffer on every "
                       "replay (~15 us of host time per step, fixed in 95a8c70), so its ratios favour kvguard by up to "
                       "~0.2% at c=1; c=1: the first off run was cold (TTFT 1.6 s, 60 tok/s), which the throughput "
                       "ratio and its A/A carry; c=64: the A/A (x1.043 throughput) is larger than the figure",
         "dec02h/off": "c=1: the first off run was the engine's first workload (cold: TTFT 2.3 s, 48 tok/s), "
                       "which the c=1 throughput ratio and its A/A carry; the ITL ratios do not",
         "dec02h/on": "c=1 only, two pairs (the device time left skipped c=64); the first off run was cold, so the "
                      "throughput and TTFT ratios are not figures; the ITL p50 ratio is",
         "dec02g/off": "c=1: the first off run was the engine's first workload (cold: TTFT 2.4 s, 46 tok/s), "
                       "which the c=1 throughput ratio and its A/A carry; the ITL ratios do not",
         "dec02g/b256": "one pair; the off run compiled SGLang's own attention kernel mid-run (SGLang warned): "
                        "its ratios are not a figure, its host time is",
         "dec02d": "host_us counts SGLang's own wait for the forward (copy_done), which kvguard's verdict read "
                   "made first; runs from dec02e on report it apart (sglang_wait_us_p50)"}
KEYS = ("overlap", "concurrency", "page_size", "input_len", "output_len", "throughput_ratio", "itl_p50_ratio",
        "itl_p99_ratio", "aa_throughput_ratio", "aa_itl_p50_ratio", "host_us_p50", "host_us_p99", "tp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", nargs="*", default=DEFAULT)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "sglang_h200_host.json"))
    a = ap.parse_args()
    rows, commands = [], []
    for path in a.raw:
        with open(path) as f:
            raw = json.load(f)
        commands.append(raw["command"])
        if raw.get("interleave"):  # rows from the labelled steps, by the harness's current rule (not the file's)
            attach_interleaved(raw)
        windows = {w["batch_max"]: w for w in (raw.get("host_timing") or {}).get("windows", []) if w["iterations"] >= 10}
        for row in raw["rows"]:
            clean = {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}  # NaN: not measured
            wait = windows.get(row["concurrency"], {}).get("sglang_wait_us_per_iter_p50")
            rows.append({k: clean.get(k) for k in KEYS} | {
                "pairs": min(clean.get("n_off") or 0, clean.get("n_check") or 0) or None,
                "in_engine_switch": bool(raw.get("switch")), "sglang_wait_us_p50": wait,
                "method": "interleave" if raw.get("interleave") else "switch" if raw.get("switch") else "two engines",
                **{k: clean.get(k) for k in ("n_on", "n_off", "host_off_us_p50", "host_net_us_p50", "host_net_us_p99",
                                             "host_off_net_us_p50", "step_delta_us_p50",
                                             "step_delta_us_mean", "aa_itl_p99_ratio") if k in clean},
                "tp_path": bool(clean.get("tp_path", (clean.get("tp") or 1) > 1)),
                "raw": os.path.relpath(path, HERE), "sglang": raw["environment"].get("sglang"),
                "note": next((n for d, n in NOTES.items() if f"/{d}/" in path), None)})
    out = {"command": " && ".join(commands), "sglang": rows[0]["sglang"] if rows else None, "rows": rows}
    if os.path.exists(PIECES):
        with open(PIECES) as f:
            out["pieces"] = {"command": PIECES_COMMAND,
                             "raw": os.path.relpath(PIECES, HERE), **json.load(f)}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("overlap | c | in/out | host us p50 / p99 | throughput | ITL p50 | ITL p99 (ratios check/off)")
    for r in rows:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{r['overlap']!s:>7} | {r['concurrency']:>3} | {r['input_len']}/{r['output_len']} | "
              f"{f(r['host_us_p50'], '.0f')} / {f(r['host_us_p99'], '.0f')} | {f(r['throughput_ratio'], '.4f')} | "
              f"{f(r['itl_p50_ratio'], '.4f')} | {f(r['itl_p99_ratio'], '.4f')}  ({r['raw']})")


if __name__ == "__main__":
    main()
