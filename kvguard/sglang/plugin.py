"""kvguard as an SGLang 0.5.23 general plugin: tag-versioned checks of every KV mapping a forward reads.

SGLang's loader (``sglang.srt.plugins.load_plugins``, run in every SGLang process) calls :func:`register`. With
``KVGUARD_MODE=off`` (the default) it returns at once: no hook is registered and SGLang runs exactly as shipped.
With ``KVGUARD_MODE=check`` it registers these hooks with SGLang's ``HookRegistry`` (applied by the loader right
after all plugins ran). Each lives in the module of its SGLang path (column "in", ``kvguard.sglang.<in>``), whose
``HOOKS`` table this module composes (:data:`TARGETS`, :func:`hooks`):

=================================================================  ======  =======  ==================================
target                                                             type    in       what kvguard does there
=================================================================  ======  =======  ==================================
``server_args.ServerArgs.check_server_args``                       AFTER   startup  refuse a path kvguard does not
                                                                                    check (kvguard.sglang.paths)
``disaggregation.decode.DecodePreallocQueue._pre_alloc``           AROUND  pd       PD decode: record the row, the
                                                                                    transfer ticket
``mem_cache.kv_cache_builder.build_kv_cache``                      AFTER   plugin   self-check, registry, install on
                                                                                    that pool set, warm up
``mem_cache.allocation.alloc_for_extend``                          AROUND  batches  record each request's pages
``mem_cache.allocation.alloc_for_decode``                          AROUND  batches  record decode growth pages; a
                                                                                    stale request writes the padding
                                                                                    row, never its old row; arm the
                                                                                    decode check, guard its write slots
``mem_cache.common.release_kv_cache``                              AROUND  batches  an aborted or retracted request
                                                                                    frees only the pages it
                                                                                    legitimately holds, never a row
                                                                                    not its own (kvguard.sglang.release)
``managers.schedule_batch.release_req``                            AROUND  release  mark SGLang's releases between
                                                                                    steps (retraction, pause(retract),
                                                                                    priority preemption) as safe ones
``managers.schedule_batch.ScheduleBatch.prepare_for_extend``       AFTER   batches  check the extend batch, guard
                                                                                    its write slots
``managers.schedule_batch.ScheduleBatch.copy``                     AFTER   batches  carry the check (overlap)
``managers.schedule_batch.ScheduleBatch.mix_with_running``         AROUND  batches  launch the decode part's check,
                                                                                    carry it into the mixed batch
``SchedulerBatchResultProcessor.process_batch_result_prefill``     AROUND  batches  read verdict, discard flagged
``SchedulerBatchResultProcessor.process_batch_result_decode``      AROUND  batches  read verdict, abort flagged
``managers.scheduler.Scheduler._reqs_finishing_inflight``          AROUND  stale    abort requests whose row is not
                                                                                    their own before a decode step is
                                                                                    prepared, mixed chunk included
``managers.scheduler.Scheduler.init_all_cuda_graphs``              AROUND  plugin   install before the graphs are
                                                                                    captured: the decode check is
                                                                                    captured into every decode graph
``...runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute`` AROUND  graphs   a replay runs the armed decode
                                                                                    check (its epoch)
``...runner.eager_runner.EagerRunner.execute``                     AROUND  graphs   an eager decode forward: launch
                                                                                    the armed decode check first
``beam_search.coordinator.BeamCoordinator.validate_and_init``      AROUND  batches  turn a beam-search request away
                                                                                    (a path refused per request)
``mem_cache.allocation.alloc_for_spec_decode``, ``speculative.``   AROUND  spec     speculative decoding: record the
``eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation``                          reserved region, check each spec
                                                                                    step
``mem_cache.allocator.mamba.MambaSlotAllocator._do_alloc``         AFTER   mamba    hybrid linear-attention models:
``mem_cache.memory_pool.HybridReqToTokenPool.alloc``,              AROUND           state slot generations, each
``...HybridReqToTokenPool.free_mamba_cache``                                        request's (slot, generation), safe
                                                                                    release
``...components.mamba.MambaComponent.cleanup_after_caching_req``,  AROUND  mamba_   a hybrid model's radix tree: the
``finalize_match_result_in_cache`` (AFTER), ``managers.``                  radix    generation the tree took each
``schedule_batch.ScheduleBatch._collect_deferred_mamba_cow_and_``                   state slot at, checked where a
``clear``                                                                           matching request's copy is staged
``...hybrid_linear_attn_backend.HybridLinearAttnBackend.``         AROUND  mamba_   a hybrid model's spec commit: each
``update_mamba_state_after_mtp_verify``                                    spec     destination state slot must be its
                                                                                    request's own (else the dummy slot,
                                                                                    the request flagged)
``disaggregation.`` (six more targets)                             both    pd       PD on a real transfer backend:
                                                                                    the transfer's ticket and release;
                                                                                    the prefill send's page tags
``mem_cache.common.backup_kv_cache``, ``restore_kv_cache``,        AROUND  pd_      PD decode's retraction backup: the
``managers.schedule_batch.ScheduleBatch.retract_decode``                   backup   row checked before the copy out and
                                                                                    before the restore writes through it
``...hybrid_cache_controller.HybridCacheController.load``,          AROUND  hicache  HiCache load-back: the new device
``managers.cache_controller.HiCacheController.start_loading``                       pages expect LOADING until their copy
                                                                                    is submitted, then the tree adopts
                                                                                    them with their allocation's tags
=================================================================  ======  =======  ==================================

(:mod:`kvguard.sglang.swa`'s table is empty: the sliding-window side rides the allocator SGLang built and the main
check.) The two install points are this module's own hooks: they first run :func:`preflight`, whose
:func:`self_check` reads this whole table, so they live with it (a path module holding them would import the
plugin back). What the hooks share is in :mod:`kvguard.sglang.runtime`; :func:`install` and the other start-up
functions in :mod:`kvguard.sglang.startup` (re-exported here).

**Fail closed.** SGLang's loader catches every ``Exception`` a plugin raises and serves on without it. An
invalid ``KVGUARD_*`` value, or a hook target this SGLang does not have, therefore raises
:class:`KVGuardStartupError` (a ``SystemExit``, which the loader does not catch): the process stops with
one message naming the variable and the valid values, and nothing serves. An allocator kvguard does not
cover, a serving path the registry refuses, or a hook SGLang failed to apply (:func:`self_check`) stops
the scheduler at install the same way.

Only this subpackage imports SGLang, and only inside functions.
"""
from __future__ import annotations

import logging
import pkgutil
from typing import Mapping

from ..incidents import prepare_dir
from ..metrics import metrics_for
from ..settings import SettingsError, TrackerConfig
from . import (batches, dp_attention, graphs, hicache, mamba, mamba_radix, mamba_spec, pd, pd_backup, runtime, spec,
               startup, swa)
from .runtime import KVGuardStartupError, guard_of, stamp_transfer, transfer_ticket
from .startup import _resolved, covered, guards, install, server_refusal

__all__ = ["TARGETS", "register", "hooks", "self_check", "preflight", "install", "covered", "guards",
           "server_refusal", "guard_of", "transfer_ticket", "stamp_transfer", "KVGuardStartupError"]

log = logging.getLogger("kvguard.sglang")

_SRT = "sglang.srt"
_SCHEDULER = f"{_SRT}.managers.scheduler.Scheduler"
# The path modules, each with its HOOKS table: name -> (SGLang target, kvguard's hook, HookRegistry type).
_PATHS = (startup, pd, pd_backup, batches, graphs, dp_attention, spec, mamba, mamba_radix, mamba_spec, swa, hicache)
# The hooks no path module's table holds: the two install points (this module's own, below) and SGLang's releases
# between steps and the stale-row abort (kvguard.sglang.release, kvguard.sglang.stale: hooks() names them).
TARGETS = {
    "build_kv_cache": f"{_SRT}.mem_cache.kv_cache_builder.build_kv_cache",
    "release_req": f"{_SRT}.managers.schedule_batch.release_req",
    "reqs_finishing_inflight": f"{_SCHEDULER}._reqs_finishing_inflight",
    "init_all_cuda_graphs": f"{_SCHEDULER}.init_all_cuda_graphs",
} | {name: target for path in _PATHS for name, (target, _, _) in path.HOOKS.items()}

_registered_config: TrackerConfig | None = None


# ------------------------------------------------------------------------------------------------
# Plugin entry
# ------------------------------------------------------------------------------------------------
def register(env: Mapping[str, str] | None = None) -> bool:
    """SGLang plugin entry point. Returns True when hooks were registered (``KVGUARD_MODE=check``).

    Raises :class:`KVGuardStartupError` for an invalid ``KVGUARD_*`` setting or a missing hook target.
    Idempotent: a second call in the same process registers nothing more.
    """
    global _registered_config
    try:
        config = TrackerConfig.from_env(env)
        if config.mode == "check":
            prepare_dir(config.incident_dir)
    except SettingsError as err:
        raise KVGuardStartupError(f"kvguard: refusing to start: {err}. Fix the KVGUARD_* environment "
                                  f"(KVGUARD_MODE=off disables kvguard).") from None
    if config.mode == "off":
        return False
    if _registered_config is not None:
        return True
    missing = []
    for target in TARGETS.values():
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as err:
            missing.append(f"{target} ({type(err).__name__}: {err})")
    if missing:
        raise KVGuardStartupError("kvguard: refusing to start: KVGUARD_MODE=check but this SGLang lacks hook "
                                  "targets kvguard needs (it supports SGLang 0.5.23): " + "; ".join(missing))
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _registered_config = config
    for name, (fn, kind) in hooks().items():
        HookRegistry.register(TARGETS[name], fn, getattr(HookType, kind))
    log.info("kvguard: SGLang hooks registered (KVGUARD_MODE=check)")
    return True


def hooks() -> dict[str, tuple]:
    """kvguard's hook on each target of :data:`TARGETS`: (function, HookRegistry type name)."""
    from .release import around_release_req
    from .stale import around_reqs_finishing_inflight

    return {
        "build_kv_cache": (_after_build_kv_cache, "AFTER"),
        "release_req": (around_release_req, "AROUND"),
        "reqs_finishing_inflight": (around_reqs_finishing_inflight, "AROUND"),
        "init_all_cuda_graphs": (_around_init_all_cuda_graphs, "AROUND"),
    } | {name: (fn, kind) for path in _PATHS for name, (_, fn, kind) in path.HOOKS.items()}


def _chain(fn):
    """``fn`` and every function it wraps (HookRegistry's wrappers set ``__wrapped__``)."""
    seen = []
    while fn is not None and all(fn is not f for f in seen):
        seen.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return seen


def _closes_over(wrapper, fn) -> bool:
    """``wrapper`` (one of HookRegistry's) calls ``fn``: it holds ``fn``, or a wrapper of it (a profiler's)."""
    return any(any(f is fn for f in _chain(cell.cell_contents))
               for cell in (getattr(wrapper, "__closure__", None) or ()) if _filled(cell))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def self_check() -> list[str]:
    """After SGLang applied the hooks: every target of kvguard carries kvguard's hook. What is wrong, or [].

    SGLang's ``HookRegistry.apply_hooks`` logs and skips a target it fails to patch, which would leave a
    partly hooked, partly unchecked server. Checked per target: kvguard's hook function is in the wrapper
    chain now installed there, and no SGLang module still holds the unwrapped function under that name (a
    stale ``from X import Y`` copy that ``_propagate_patch`` missed).
    """
    import sys

    problems = []
    for name, (fn, _) in hooks().items():
        target = TARGETS[name]
        try:
            chain = _chain(pkgutil.resolve_name(target))
        except (ImportError, AttributeError) as err:
            problems.append(f"{target}: cannot be resolved ({err})")
            continue
        if not any(_closes_over(w, fn) for w in chain):
            problems.append(f"{target}: kvguard's hook {fn.__name__} is not applied")
            continue
        original, attr = chain[-1], target.rsplit(".", 1)[1]
        for mod_name, mod in list(sys.modules.items()):
            if mod_name.startswith("sglang") and getattr(mod, "__dict__", {}).get(attr) is original:
                problems.append(f"{mod_name}.{attr}: still the unhooked {target}")
    return problems


def preflight(server_args, model_config) -> list:
    """Every hook in place and the registry's verdict on the server settings and the model this scheduler
    loaded: the active paths, or KVGuardStartupError."""
    problems = self_check()
    if problems:
        raise KVGuardStartupError("kvguard: refusing to start: KVGUARD_MODE=check but SGLang did not apply "
                                  "every kvguard hook (a partly hooked server would serve partly unchecked): "
                                  + "; ".join(problems))
    if server_args is None:
        return []
    from .paths import active, facts_of, refusal

    facts = facts_of(_resolved(server_args), model_config)
    message = refusal(facts)
    if message is not None:
        raise KVGuardStartupError(message)
    return active(facts)


# ------------------------------------------------------------------------------------------------
# The install points: on the pool set SGLang built, or before SGLang captures its decode graphs
# ------------------------------------------------------------------------------------------------
def _after_build_kv_cache(result, *args, **kwargs):
    # The last line of defence, in each scheduler (a guard installed before the graph capture is checked again).
    active = preflight(kwargs.get("server_args"), kwargs.get("model_config"))
    gauge = metrics_for().paths
    for p in active:
        gauge.labels(path=p.name, status=p.status).set(1)
    guard = install(result.req_to_token_pool, result.token_to_kv_pool_allocator, result.tree_cache,
                    config=_registered_config, build_result=result)
    guard.warm_up()
    return None  # keep SGLang's result as is


def _around_init_all_cuda_graphs(original, scheduler, *args, **kwargs):
    guard = _install_before_capture(scheduler)
    result = original(scheduler, *args, **kwargs)
    if guard is not None:
        model_runner = scheduler.tp_worker.model_runner
        decode = getattr(model_runner, "decode_cuda_graph_runner", None)
        if guard.graph is not None:
            guard.graph.reset()  # the capture's warm-up and capture runs advanced the device's count
        guard.defer = decode is None or decode is getattr(model_runner, "eager_runner", None) \
            or guard.graph_runners.get(decode, False)
        where = ("captured into SGLang's decode graphs" if guard.graph_runners.get(decode, False) else
                 "launched before each decode forward" if guard.defer else "launched as each decode batch is prepared")
        log.info("kvguard: decode checks %s", where)
    return result


def _install_before_capture(scheduler):
    """The guard on this scheduler's pools, installed now (before the capture), with the graph check's buffers
    and the capture head hook on CUDA; None where the worker has no pools yet (build_kv_cache installs). A pool
    set or path kvguard refuses stops the scheduler here (KVGuardStartupError)."""
    config = _registered_config
    model_runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    pool = getattr(model_runner, "req_to_token_pool", None)
    allocator = getattr(model_runner, "token_to_kv_pool_allocator", None)
    if config is None or pool is None:
        return None  # no pools on this worker yet: build_kv_cache installs
    # NOTE: a refusal here stops the scheduler (KVGuardStartupError), never falls back to build_kv_cache's
    # install: the hook that failed to apply may be that one, and then nothing would install at all.
    preflight(getattr(scheduler, "server_args", None), getattr(scheduler, "model_config", None))
    guard = install(pool, allocator, None, config=config)
    agreement = runtime._attn_tp()[1]
    if config.graph and guard.device.type == "cuda" and agreement is None and guard.graph is None:
        # SGLang captures batch sizes up to its row pool's size (get_batch_sizes_to_capture); a larger one would
        # capture without the check, and that runner's decode checks are then launched as batches are prepared.
        if guard.enable_graph(guard.num_rows) is not None:
            model_runner.capture_head_hooks.append(guard.capture_head)
    return guard
