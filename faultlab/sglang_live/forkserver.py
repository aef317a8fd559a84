"""CPU test engines: SGLang's scheduler and detokenizer started from a forkserver that imported them once (tests only;
used by :func:`faultlab.sglang_live.harness.run`)."""
from __future__ import annotations

# What SGLang's scheduler and detokenizer processes import first (their process targets' modules)
CHILD_MODULES = ["sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager"]


def children_from_forkserver() -> None:
    """The next ``sglang.Engine`` in this process starts its children from a forkserver that imported
    :data:`CHILD_MODULES` once (CPU test engines).

    NOTE: SGLang sets the ``spawn`` start method (``engine._set_envs_and_config``), so its scheduler and its
    detokenizer each import torch, transformers and SGLang afresh, side by side. A tiny Llama engine with one
    clean episode, on the 2-core machine (December 6, two runs each): CPU seconds of the whole process tree (psutil)
    spawn 46.6 and 45.2, forkserver 31.7 and 33.5; ``startup_s`` back to back under another job's load, spawn 75
    and 81 s, forkserver 38 and 30 s (on otherwise idle cores the two imports ran in parallel: no gain). Each
    child is still a process of its own, forked from the server before it ran anything else: it loads SGLang's
    plugins (kvguard, the injector) and publishes its server arguments itself, as a spawned one does. The server
    starts at the first child, after ``_set_envs_and_config`` set the environment the children inherit. A child's
    SIGQUIT on a crash now reaches the server, not this process: the server dies, and :func:`watchdog` reports a
    dead child as before.
    """
    import multiprocessing as mp

    from sglang.srt.entrypoints import engine as sglang_engine

    set_envs = sglang_engine._set_envs_and_config

    def set_envs_then_forkserver(server_args):
        set_envs(server_args)
        mp.set_forkserver_preload(CHILD_MODULES)
        mp.set_start_method("forkserver", force=True)

    sglang_engine._set_envs_and_config = set_envs_then_forkserver
