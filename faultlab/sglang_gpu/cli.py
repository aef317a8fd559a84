"""kvguard in a real SGLang 0.5.23 server on the H200: overhead, first requests, KV dtypes, INT4, live faults.

Run on the GPU machine (after ``source bench/sglang_h200_setup.sh``, which installs the offline SGLang
bundle from ``.sgl/`` and puts the plugin entry points' folder on ``PYTHONPATH``):

    python3 -m faultlab.sglang_gpu overhead --out $OUT    # kvguard check vs off vs off (A/A), c = 1, 8, 64
    python3 -m faultlab.sglang_gpu extras --out $OUT      # FP8 vs BF16 KV, first requests, INT4 vs BF16 weights
    python3 -m faultlab.sglang_gpu faults --out $OUT      # live faults (faultlab.sglang_live), kvguard on/off
    python3 -m faultlab.sglang_gpu hicache --out $OUT     # HiCache write-back, eviction, load-back: off vs check
    python3 -m faultlab.sglang_gpu pd --out $OUT          # a PD decode server over NIXL: check vs off vs off (A/A)
    python3 -m faultlab.sglang_gpu report                 # here: raw JSONs -> bench/results/sglang_h200*.json + png

The same phases dry-run on a CPU with ``--cpu`` (tiny Llama, torch_native attention, short lengths).

Engines: in-process ``sglang.Engine`` (not ``launch_server``): the same scheduler, plugin loader, pools
and CUDA graphs as the HTTP server, without HTTP/JSON encoding in the timed path, so the figures isolate
what kvguard adds; kvguard's abort reaches the client the same way (the Engine's stream ends with a
``finish_reason`` of type ``abort`` and status 500, the HTTP server turns the same object into HTTP 500).
Each engine lives in its own worker process (see :mod:`faultlab.sglang_gpu.workers` for why); the engines
for one comparison are alive at once and the runs alternate between them (off/check in ABBA order), same
workload and seed, so drift and warm-up hit both modes alike. kvguard is switched by ``KVGUARD_MODE`` in
each worker's environment, read by SGLang's plugin loader in the scheduler process that engine spawns.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from faultlab.sglang_gpu.common import RESULTS, add_common
from faultlab.sglang_gpu.extras import cmd_extras
from faultlab.sglang_gpu.faults import cmd_fault_engine, cmd_faults
from faultlab.sglang_gpu.hicache import cmd_hicache
from faultlab.sglang_gpu.interleave import MIN_BLOCK
from faultlab.sglang_gpu.overhead import MIN_WINDOW, cmd_overhead
from faultlab.sglang_gpu.pd import cmd_pd
from faultlab.sglang_gpu.report import cmd_report
from faultlab.sglang_live.plan import EPISODE_CLASSES


RAW_RUNS = ("dec01b", "dec01", "nov30")  # bench/results/sglang_h200_raw/<run>, newest first


def _json_object(text: str) -> str:
    """An option holding a JSON object (kept as text; argparse names the option when this raises)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is expected, got {type(value).__name__}")
    return text


def _integer(lo: int, hi: int | None, why: str):
    """An integer option's type: lo..hi (or lo or more without ``hi``); ``why`` says why in the error."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer is expected, got {text!r}") from None
        if n < lo or hi is not None and n > hi:
            span = f"{lo}..{hi}" if hi is not None else f"{lo} or more"
            raise argparse.ArgumentTypeError(f"must be {span} ({why}), got {n}")
        return n
    return parse


# overhead --warmup-tokens: 0 (no warm-up run), or fewer output tokens than a measured run's window
_warmup_tokens = _integer(0, MIN_WINDOW - 1, "a warm-up run is never measured")
def _fractions(text: str) -> str:
    """pd --mem-fractions: three fractions in (0, 1), comma separated."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"three numbers are expected, got {text!r}") from None
    if len(values) != 3 or not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"three fractions in (0, 1) are expected (prefill, off, check), got {text!r}")
    return text


# overhead --interleave: decode steps per block
_block = _integer(MIN_BLOCK, None, "a block's first step is left out")


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, option and default of the harness (the results in bench/results were made with them)."""
    ap = argparse.ArgumentParser(prog="python -m faultlab.sglang_gpu", description=__doc__.split("\n")[0])
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
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--switch", action="store_true",
                      help="one engine instance; its off runs bypass kvguard's hooks (in-engine A/B, no instance spread)")
    mode.add_argument("--interleave", type=_block, default=0, metavar="B",
                      help="one engine instance; in each run the per-step check is on and off in alternate blocks of B "
                           "decode steps, in a seeded random order (--reps: runs per concurrency)")
    p.add_argument("--tp-path", action="store_true",
                   help="kvguard serves its attention-TP path (eager check, device all-reduce of the verdict) over "
                        "SGLang's one-rank groups: that path's host cost on one GPU (faultlab.sglang_gpu.probes)")
    p.add_argument("--warmup-tokens", type=_warmup_tokens, default=8,
                   help="before each concurrency's pairs: one unmeasured run of it with this many output tokens on "
                        "each engine (its first prefill of that shape is not in a pair); 0: none")
    p.add_argument("--name", default="overhead.json")
    p.add_argument("--budget", type=float, default=0, help="seconds; skip A/B pairs that would not fit")
    p.add_argument("--est", default="1:9,8:10,64:44", help="concurrency:seconds per run, before one is measured")
    p.add_argument("--overrides", default="{}", type=_json_object,
                   help='JSON: sglang.Engine settings over both engines\' own, e.g. \'{"disable_overlap_schedule": true}\'')
    p.set_defaults(func=cmd_overhead)
    p = sub.add_parser("faults", help="live faults (faultlab.sglang_live), kvguard check and off")
    add_common(p)
    p.add_argument("--classes", default=",".join(EPISODE_CLASSES))
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--off-seeds", type=int, default=2)
    p.add_argument("--page-sizes", default="16,1", type=lambda t: [int(x) for x in t.split(",")])
    p.add_argument("--fault-rank", type=int, default=None, help="TP: inject on this rank only")
    p.add_argument("--fault-mem-fraction", type=float, default=0.5)
    p.add_argument("--split-killers", action="store_true")
    p.add_argument("--overrides", default="{}", type=_json_object, help="JSON: sglang.Engine settings over the fault engines' own")
    p.add_argument("--env", default="{}", type=_json_object, help="JSON: extra environment of every fault engine "
                   "(e.g. FAULTLAB_SGLANG_KV_WATCH=1, a diagnostic)")
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
    p = sub.add_parser("hicache", help="HiCache write-back, eviction and load-back, kvguard off vs check")
    add_common(p)
    p.add_argument("--groups", type=_integer(2, None, "load-back needs earlier groups evicted by later ones"),
                   default=10, help="request groups, one shared prefix each")
    p.add_argument("--per-group", type=_integer(1, None, "a group needs a request"), default=2)
    p.add_argument("--input-len", type=_integer(2, None, "a prompt"), default=2048)
    p.add_argument("--shared", type=_integer(1, None, "the group's prefix"), default=2000)
    p.add_argument("--output-len", type=_integer(1, None, "a token"), default=16)
    p.add_argument("--max-total-tokens", type=_integer(256, None, "a device pool"), default=12288,
                   help="the device pool: smaller than the groups' prefixes together, so they are evicted")
    p.add_argument("--policy", choices=["write_back", "write_through", "write_through_selective"],
                   default="write_back")
    p.add_argument("--ratio", type=float, default=2.0, help="host pool size / device pool size")
    p.add_argument("--overrides", default="{}", type=_json_object,
                   help="JSON: sglang.Engine settings of both engines (e.g. an EAGLE draft: HiCache with spec)")
    p.add_argument("--name", default="hicache.json")
    p.set_defaults(func=cmd_hicache)
    p = sub.add_parser("pd", help="a PD decode server (a prefill + two decode servers, NIXL): check vs off vs off")
    add_common(p)
    p.add_argument("--backend", choices=["nixl", "mooncake"], default="nixl", help="SGLang's transfer backend")
    p.add_argument("--reps", default="1:2,64:2", help="concurrency:pairs, comma separated")
    p.add_argument("--input-len", type=_integer(1, None, "a prompt"), default=8192)
    p.add_argument("--output-len", type=_integer(MIN_WINDOW, None, "a measured run's profiler window"), default=1000)
    p.add_argument("--warmup-tokens", type=_warmup_tokens, default=8)
    p.add_argument("--mem-fractions", default="0.26,0.36,0.56", type=_fractions,
                   help="mem_fraction_static of the prefill, the off and the check decode server, started in that "
                        "order (each of the memory free when it starts)")
    p.add_argument("--bootstrap-port", type=_integer(1024, 65535, "a TCP port"), default=8998)
    p.add_argument("--switch", action="store_true",
                   help="one decode server; its off runs bypass kvguard's hooks (in-engine A/B, no instance spread)")
    p.add_argument("--overrides", default="{}", type=_json_object,
                   help="JSON: sglang.Engine settings of both decode servers")
    p.add_argument("--prefill-overrides", default="{}", type=_json_object, help="JSON: the prefill server's settings")
    p.add_argument("--budget", type=float, default=0, help="seconds; skip A/B pairs that would not fit")
    p.add_argument("--name", default="pd.json")
    p.set_defaults(func=cmd_pd)
    p = sub.add_parser("report", help="raw JSONs -> bench/results/sglang_h200*.json and the plot (here)")
    p.add_argument("--raw", nargs="+", default=[os.path.join(RESULTS, "sglang_h200_raw", d) for d in RAW_RUNS],
                   help="folders of raw runs, newest first: each part of the report comes from the first that has "
                        "it (dec01b: live faults after the stale-row fix; dec01: overhead, INT4; nov30: KV dtypes, TP=2)")
    p.add_argument("--results", default=RESULTS)
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("fault-engine", help=argparse.SUPPRESS)
    add_common(p)
    p.add_argument("--spec", required=True)
    p.add_argument("--result", required=True)
    p.set_defaults(func=cmd_fault_engine)
    return ap


def check_outputs(a) -> None:
    """Every output option before any work (UsageError: exit 2): ``--out`` (a folder, made if missing) and
    ``--name`` (a file name in it); report's ``--results`` and fault-engine's ``--result`` (their folders
    must exist: nothing creates them)."""
    from faultlab.chaos.validate import UsageError, check_output_dir, check_output_file

    if a.cmd == "report":
        check_output_dir("--results", a.results, make_folder=False)
        return
    if a.cmd == "hicache" and a.shared >= a.input_len:
        raise UsageError(f"--shared {a.shared} must be below --input-len {a.input_len} (a request's own tokens follow "
                         "its group's prefix)")
    check_output_dir("--out", a.out)
    name = getattr(a, "name", None)
    if name is not None:
        if name in ("", ".", "..") or os.path.basename(name) != name:
            raise UsageError(f"--name {name!r} is not valid; give a file name (it is written in --out)")
        check_output_file("--name", os.path.join(a.out, name))
    if a.cmd == "fault-engine":
        check_output_file("--result", a.result, make_folder=False)


def main(argv=None) -> int:
    from faultlab.chaos.validate import UsageError

    a = build_parser().parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)  # for the re-execution and the results' command
    try:
        check_outputs(a)
    except UsageError as err:
        print(f"python -m faultlab.sglang_gpu {a.cmd}: error: {err}", file=sys.stderr)
        return 2
    a.func(a)
    return 0
