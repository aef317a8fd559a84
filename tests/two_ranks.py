"""Two gloo ranks, each a process of its own running a test file's scenarios on SGLang 0.5.23's real classes, with
kvguard's hooks applied by SGLang's own plugin loader (test_sglang_tp_stale.py, test_sglang_mamba_tp.py)."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket


def load_kvguard(rank: int, port: int) -> None:
    """This rank's process group (gloo, two ranks) and kvguard's hooks, applied by SGLang's plugin loader."""
    import torch.distributed as dist

    os.environ.update({"SGLANG_PLUGINS": "kvguard", "KVGUARD_MODE": "check", "KVGUARD_BACKEND": "torch"})
    import sglang.srt.managers.scheduler  # noqa: F401  (the hook targets exist before the loader runs)
    import sglang.srt.plugins as plugins

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    plugins._plugins_loaded = False
    plugins.load_plugins()


def _rank(rank: int, port: int, join, scenarios: dict, out) -> None:
    """One rank: ``join`` (its group and hooks), then every scenario in turn, each reported (never a silent hang)."""
    import torch.distributed as dist

    try:
        join(rank, port)
        for name, scenario in scenarios.items():
            try:
                out.put({"rank": rank, "scenario": name, **scenario(rank)})
            except BaseException as exc:
                out.put({"rank": rank, "scenario": name, "error": repr(exc)})
                raise
    except BaseException as exc:
        out.put({"rank": rank, "scenario": None, "error": repr(exc)})
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(join, scenarios: dict, timeout: float) -> dict:
    """{scenario: {rank: what that rank reported}}: one launch of two spawned ranks runs every scenario (module-level
    callables of ``rank``, e.g. ``functools.partial``s); a rank that failed reports ``error``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, join, scenarios, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        while sum(len(v) for v in results.values()) < 2 * len(scenarios):
            r = out.get(timeout=timeout)
            results.setdefault(r["scenario"], {})[r["rank"]] = r
            if r["scenario"] is None:
                break
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results


def of(ranks: dict, scenario: str) -> tuple[dict, dict]:
    """Rank 0's and rank 1's reports of ``scenario``; fails when a rank did not report it or reported an error."""
    got = ranks.get(scenario, {})
    assert set(got) == {0, 1} and all("error" not in r for r in got.values()), ranks
    return got[0], got[1]
