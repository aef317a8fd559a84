"""What every phase of the harness shares: paths, the process environment, engine settings, result files.

The plugin entry points (``kvguard_bench``, and on the GPU machine, where the project is not
pip-installed, the project's own ``kvguard`` and ``faultlab_inject``) are declared in a dist-info folder
written at run time (:data:`EP_DIR`). SGLang's loader finds them through ``importlib.metadata``, so the
folder must be on ``sys.path`` of every scheduler process SGLang spawns; multiprocessing's spawn children
inherit the parent's ``sys.path``. The folder therefore has to be on ``PYTHONPATH`` from the process
start (``bench/sglang_h200_setup.sh`` exports it); when it is not, :func:`setup_env` re-executes the
harness once with it set. ``sys.path`` itself is never edited.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from faultlab.sglang_gpu.workers import (
    Worker,
    project_plugin_entry_points,
    write_dist_info,
)
from faultlab.sglang_live.plan import ENV_ROTARY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")
# The offline SGLang bundle (../shared/tools/sglang-h200/build.sh): $SGL_BUNDLE, else .sgl beside or above ROOT.
BUNDLE = os.environ.get("SGL_BUNDLE") or next(
    (p for p in (os.path.join(ROOT, ".sgl"), os.path.join(os.path.dirname(ROOT), ".sgl")) if os.path.isdir(p)),
    os.path.join(ROOT, ".sgl"))
BUNDLE_MODELS = os.path.join(BUNDLE, "model")
EP_DIR = os.path.join("/tmp", "kvguard_bench_ep")  # the dist-info folder of the plugin entry points
PROBES_ENTRY_POINT = {"kvguard_bench": "faultlab.sglang_gpu.probes:register_bench"}
MODULE = "faultlab.sglang_gpu"
REEXEC_ENV = "KVGUARD_BENCH_REEXEC"  # set in the re-executed process: re-execute once at most


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def command_line(a) -> str:
    """The command that made a result (written into it)."""
    return " ".join(["python3", "-m", MODULE] + list(a.argv))


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
    """Entry points SGLang's loader must find in every process it starts (the workers inherit these).

    Writes the dist-info folder; if it is not on this process's ``sys.path`` (``PYTHONPATH`` did not
    name it at start), re-executes ``python -m faultlab.sglang_gpu`` with the same arguments and
    ``PYTHONPATH`` set; this function does not return then.
    """
    write_dist_info(EP_DIR, "kvguard_bench", PROBES_ENTRY_POINT)
    if not a.cpu:
        # On the GPU machine the project is not pip-installed: declare its own plugins (kvguard, and
        # faultlab's test-only injector, which registers nothing unless its variables are set).
        # Two distributions (pyproject.toml: kvguard; packaging/faultlab/pyproject.toml: faultlab, its injector).
        write_dist_info(EP_DIR, "kvguard", project_plugin_entry_points(os.path.join(ROOT, "pyproject.toml")))
        write_dist_info(EP_DIR, "faultlab", project_plugin_entry_points(
            os.path.join(ROOT, "packaging", "faultlab", "pyproject.toml")))
    paths = [ROOT, EP_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if EP_DIR not in sys.path:
        if os.environ.get(REEXEC_ENV):
            raise SystemExit(f"{EP_DIR} is on PYTHONPATH but not on sys.path after re-executing: "
                             f"PYTHONPATH={os.environ['PYTHONPATH']!r}")
        os.environ[REEXEC_ENV] = "1"
        log(f"re-executing with PYTHONPATH={os.environ['PYTHONPATH']} (the plugin entry points' folder)")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", MODULE] + list(a.argv), os.environ)
    if a.cpu:
        os.environ.setdefault(ENV_ROTARY, "1")
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


# ------------------------------------------------------------------------------------------------
# Engines and results
# ------------------------------------------------------------------------------------------------
def start_engines(specs: list[tuple[str, dict, dict]], timeout: float) -> dict[str, Worker]:
    """Start engines one after another (SGLang JIT-compiles into a shared cache at first start)."""
    workers = {}
    try:
        for name, env, kw in specs:
            log(f"starting engine {name} ({env})")
            w = Worker(name, env, kw)
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
        # (on a lent machine the checkout's .git can lag its working tree: the source digest is what ran)
        env["git"] = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%h %s"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    env["source"] = source_digest()
    return env


def source_digest(root: str = ROOT) -> str:
    """A digest of the Python sources of kvguard and faultlab under ``root`` (paths and contents): the code a run
    ran, whatever its .git says. ``python -c "from faultlab.sglang_gpu.common import source_digest as d; print(d())"``
    gives it for a checkout."""
    import hashlib

    h = hashlib.sha256()
    for package in ("kvguard", "faultlab"):
        for folder, _, files in sorted(os.walk(os.path.join(root, package))):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read() + b"\0")
    return h.hexdigest()[:16]


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
