"""CPU test engines: SGLang's scheduler and detokenizer forked from the process that runs the engine, which imported
SGLang already (tests only; used by :func:`faultlab.sglang_live.harness.run` and :mod:`faultlab.sglang_live.pd_pair`;
a server an operator launches keeps SGLang's own start method)."""
from __future__ import annotations


def children_forked() -> None:
    """The next ``sglang.Engine`` in this process forks its children (CPU test engines) instead of spawning them.

    NOTE: SGLang sets the ``spawn`` start method (``engine._set_envs_and_config``; CUDA cannot be forked), so its
    scheduler and its detokenizer each import torch, transformers and SGLang afresh. On a CPU nothing stands in the
    way of ``fork``: the harness has imported SGLang, loaded SGLang's plugins (kvguard, the injector: ``Engine``
    loads them before it launches anything, with the environment the harness set) and started no thread of its own
    yet, and the children inherit all of it (their own ``load_plugins`` is then a no-op). A tiny Llama engine with one
    clean episode on the 2-core machine, back to back under another job's load (December 6): ``startup_s`` 14.2 and
    15.0 s with a forkserver that imported the children's modules once per engine (the previous way), 5.7 and 5.8 s
    forked; the harness's whole run 20.5 / 21.6 s against 12.3 / 12.7 s. A child's SIGQUIT on a crash reaches this
    process, whose :func:`faultlab.sglang_live.harness.watchdog` notes it and reports the dead child.
    """
    import multiprocessing as mp

    from sglang.srt.entrypoints import engine as sglang_engine

    set_envs = sglang_engine._set_envs_and_config

    def set_envs_then_fork(server_args):
        set_envs(server_args)
        mp.set_start_method("fork", force=True)

    sglang_engine._set_envs_and_config = set_envs_then_fork
