"""The ``kvguard_bench`` SGLang plugin: kvguard's host-time profiler (:mod:`.profiler`) and TP probes.

SGLang's plugin loader imports this module in every scheduler process (entry point
``kvguard_bench = faultlab.sglang_gpu.probes:register_bench``, declared in the dist-info folder that
:func:`faultlab.sglang_gpu.common.setup_env` writes). Each part does nothing without its environment
variable. SGLang is imported inside the register functions only.
"""
from __future__ import annotations

import json
import os
import time

from faultlab.sglang_gpu.profiler import register_timing

FAULT_RANK_ENV = "KVGUARD_BENCH_FAULT_RANK"  # only this TP rank runs faultlab's injector hooks
ABORT_LOG_ENV = "KVGUARD_BENCH_ABORT_LOG"  # JSON lines: every rank's kvguard aborts (rank, rid, message)
TP_PATH_ENV = "KVGUARD_BENCH_TP_PATH"  # "1": kvguard serves its attention-TP path over SGLang's one-rank groups


# ------------------------------------------------------------------------------------------------
# Live-fault helpers for tensor parallelism (active only with their variables)
# ------------------------------------------------------------------------------------------------
def _tp_rank() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def register_tp_probes() -> None:
    """Rank-local faults and a per-rank abort log, for the TP runs (no effect without the variables).

    * ``KVGUARD_BENCH_FAULT_RANK=r``: faultlab's injector hooks (module ``faultlab.sglang_live.inject``)
      run only in the scheduler of TP rank ``r``; on the other ranks they pass straight through, so the
      corruption is a divergence of one rank's page table from the others'.
    * ``KVGUARD_BENCH_ABORT_LOG=path``: every call of SGLang's ``prepare_abort`` whose message comes from
      kvguard is appended as a JSON line with the rank, so the run can show that every rank aborted the
      same requests (only rank 0's output reaches the client).
    """
    fault_rank = os.environ.get(FAULT_RANK_ENV)
    abort_log = os.environ.get(ABORT_LOG_ENV)
    if fault_rank not in (None, ""):
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        want = int(fault_rank)

        def gate(hook, hook_type):
            def gated(*a, **k):
                if _tp_rank() == want:
                    return hook(*a, **k)
                if hook_type == HookType.AROUND:
                    return a[0](*a[1:], **k)
                return None
            gated.__module__ = "kvguard_bench_gate"
            return gated

        def is_injector(hook) -> bool:
            return str(getattr(hook, "__module__", "") or "").startswith("faultlab.sglang_live")

        for target, hooks in HookRegistry._hooks.items():
            for i, (ht, h, src) in enumerate(hooks):
                if is_injector(h) and not target.endswith("load_model") and "invariant_checker" not in target:
                    hooks[i] = (ht, gate(h, ht), src)
        original_register = HookRegistry.register.__func__

        def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
            if is_injector(hook) and not target.endswith("load_model") and "invariant_checker" not in target:
                hook = gate(hook, hook_type)
            return original_register(cls, target, hook, hook_type, source=source)

        HookRegistry.register = classmethod(register)
    if abort_log:
        import sglang.srt.disaggregation.utils as du

        original = du.prepare_abort

        def prepare_abort(req, message, *a, **k):
            if "kvguard" in str(message):
                with open(abort_log, "a") as f:
                    f.write(json.dumps({"rank": _tp_rank(), "pid": os.getpid(), "rid": str(req.rid),
                                        "message": str(message)[:300], "time": time.time()}) + "\n")
            return original(req, message, *a, **k)

        du.prepare_abort = prepare_abort


def register_tp_path() -> None:
    """``KVGUARD_BENCH_TP_PATH=1`` (``overhead --tp-path``): kvguard's attention-TP path at one rank.

    kvguard takes its TP path when the attention-TP group has two or more ranks: the decode check launched as
    each batch is prepared (not captured into SGLang's decode graphs), its verdict all-reduced across the ranks
    over kvguard's own NCCL communicator and read with the step's result. With one GPU there is no second rank, so
    this serves that path over the one-rank group SGLang creates at TP 1 (kvguard's lookup,
    ``kvguard.sglang.runtime._attn_tp``, with ``min_ranks=1``): the host work per step is the TP path's, the
    all-reduce's enqueue over a one-rank communicator included (not a peer's wait). A stand-in for measuring the
    path's host cost, not a TP run.
    """
    if os.environ.get(TP_PATH_ENV) != "1":
        return
    import functools

    import kvguard.sglang.runtime as runtime

    runtime._attn_tp = functools.partial(runtime._attn_tp, min_ranks=1)


def register_bench() -> None:
    """The ``kvguard_bench`` entry point: the profiler and the TP probes (each off without its variable)."""
    register_timing()
    register_tp_probes()
    register_tp_path()
