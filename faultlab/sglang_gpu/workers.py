"""Engine worker processes, and the dist-info folder through which SGLang's plugin loader finds plugins.

Why one worker process per engine (each holding one in-process ``sglang.Engine``), not several Engines
in the harness process: ``Engine.shutdown()`` kills *every* child of the calling process
(``kill_process_tree(os.getpid(), include_parent=False)``), SGLang keeps per-process globals (server
args, plugin loading happens once per process), and kvguard is switched by ``KVGUARD_MODE``, read by
SGLang's plugin loader in the scheduler process that the Engine spawns. A worker per engine gives each
engine its own environment and its own clean shutdown, while all engines stay alive at once so the
off / check / off runs can be interleaved on one GPU (only one engine runs a workload at a time).

SGLang is imported inside the worker process only.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

from faultlab.sglang_gpu.workload import run_workload

PLUGIN_GROUP = "sglang.srt.plugins"


# ------------------------------------------------------------------------------------------------
# Entry points: SGLang finds plugins through installed distributions (importlib.metadata)
# ------------------------------------------------------------------------------------------------
def project_plugin_entry_points(pyproject: str) -> dict[str, str]:
    """The project's own ``sglang.srt.plugins`` entry points, read from pyproject.toml (written once)."""
    import tomllib

    with open(pyproject, "rb") as f:
        data = tomllib.load(f)
    return dict(data["project"]["entry-points"][PLUGIN_GROUP])


def write_dist_info(folder: str, dist: str, entry_points: dict[str, str], version: str = "0.1.0") -> str:
    """A minimal ``<dist>-<version>.dist-info`` under ``folder`` declaring ``entry_points``."""
    d = os.path.join(folder, f"{dist}-{version}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        f.write(f"[{PLUGIN_GROUP}]\n")
        f.writelines(f"{name} = {value}\n" for name, value in entry_points.items())
    return d


# ------------------------------------------------------------------------------------------------
# The worker: one sglang.Engine in its own process, driven over a Pipe
# ------------------------------------------------------------------------------------------------
def worker_main(conn, env: dict, engine_kwargs: dict) -> None:
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        import sglang

        t0 = time.perf_counter()
        engine = sglang.Engine(**engine_kwargs)
        start_s = time.perf_counter() - t0
        conn.send(("ready", {"start_s": start_s, **server_info(engine)}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "run":
                conn.send(("ok", run_workload(engine, **arg)))
            elif cmd == "info":
                conn.send(("ok", server_info(engine)))
            elif cmd == "stop":
                engine.shutdown()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def server_info(engine) -> dict:
    info = engine.get_server_info()
    keep = ("max_total_num_tokens", "max_req_input_len", "kv_cache_dtype", "page_size", "tp_size",
            "quantization", "attention_backend", "mem_fraction_static", "version", "disable_cuda_graph")
    out = {k: info.get(k) for k in keep if k in info}
    states = info.get("internal_states") or []
    if states and isinstance(states[0], dict):
        keep_state = ("last_gen_throughput", "decode_cuda_graph_memory_gb", "max_running_requests",
                      "chunked_prefill_size", "effective_max_running_requests_per_dp", "max_total_tokens")
        out["internal_state"] = {k: states[0][k] for k in keep_state if k in states[0]}
    return out


class Worker:
    """Harness-side handle of one engine worker."""

    def __init__(self, name: str, env: dict, engine_kwargs: dict):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, env, engine_kwargs), name=f"engine-{name}")
        self.proc.start()
        self.info = None

    def wait_ready(self, timeout: float) -> dict:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine {self.name} did not start within {timeout:.0f} s")
        status, payload = self.conn.recv()
        if status != "ready":
            raise RuntimeError(f"engine {self.name} failed to start:\n{payload}")
        self.info = payload
        return payload

    def call(self, cmd: str, arg=None, timeout: float = 600):
        self.submit(cmd, arg)
        return self.collect(cmd, timeout)

    def submit(self, cmd: str, arg=None) -> None:
        """Send a command without waiting (:meth:`collect` takes its answer): two engines working at once."""
        self.conn.send((cmd, arg))

    def collect(self, cmd: str, timeout: float = 600):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine {self.name}: {cmd} took over {timeout:.0f} s")
        status, payload = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {self.name}: {cmd} failed:\n{payload}")
        return payload

    def run(self, **workload) -> dict:
        return self.call("run", workload, timeout=workload.get("timeout", 600))

    def stop(self, timeout: float = 90, graceful: bool = True) -> None:
        try:
            if graceful and self.proc.is_alive() and self.info is not None:
                self.call("stop", timeout=timeout)
        except Exception as e:  # noqa: BLE001 - report and make sure the process goes
            print(f"[{self.name}] stop: {e}", file=sys.stderr)
        self.proc.join(10 if graceful and self.info is not None else 0.1)
        kill_tree(self.proc.pid)
        self.proc.join(5)


def kill_tree(pid: int) -> None:
    """Kill a worker and every process below it (the engine's scheduler holds the GPU memory)."""
    try:
        import psutil

        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except Exception:  # noqa: BLE001 - already gone
        return
    for p in procs:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass
