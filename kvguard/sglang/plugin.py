"""kvguard as an SGLang 0.5.23 general plugin: tag-versioned checks of every KV mapping a forward reads.

SGLang's loader (``sglang.srt.plugins.load_plugins``, run in every SGLang process) calls
:func:`register`. With ``KVGUARD_MODE=off`` (the default) it returns at once: no hook is registered and
SGLang runs exactly as shipped. With ``KVGUARD_MODE=check`` it registers these hooks with SGLang's
``HookRegistry`` (applied by the loader right after all plugins ran):

=================================================================  ======  ==================================
target                                                             type    what kvguard does there
=================================================================  ======  ==================================
``server_args.ServerArgs.check_server_args``                       AFTER   refuse a path kvguard does not
                                                                           check (kvguard.sglang.paths)
``disaggregation.decode.DecodePreallocQueue._pre_alloc``           AROUND  PD decode: record the row, the
                                                                           transfer ticket
``mem_cache.kv_cache_builder.build_kv_cache``                      AFTER   self-check, registry, install on
                                                                           that pool set, warm up
``mem_cache.allocation.alloc_for_extend``                          AROUND  record each request's pages
``mem_cache.allocation.alloc_for_decode``                          AROUND  record decode growth pages; a
                                                                           stale request writes the padding
                                                                           row, never its old row; arm the
                                                                           decode check, guard its write slots
``mem_cache.common.release_kv_cache``                              AROUND  an aborted or retracted request
                                                                           frees only the pages it
                                                                           legitimately holds, never a row
                                                                           not its own (kvguard.sglang.release)
``managers.schedule_batch.release_req``                            AROUND  mark SGLang's releases between
                                                                           steps (retraction, pause(retract),
                                                                           priority preemption) as safe ones
``managers.schedule_batch.ScheduleBatch.prepare_for_extend``       AFTER   check the extend batch, guard
                                                                           its write slots
``managers.schedule_batch.ScheduleBatch.copy``                     AFTER   carry the check (overlap)
``managers.schedule_batch.ScheduleBatch.mix_with_running``         AROUND  launch the decode part's check,
                                                                           carry it into the mixed batch
``SchedulerBatchResultProcessor.process_batch_result_prefill``     AROUND  read verdict, discard flagged
``SchedulerBatchResultProcessor.process_batch_result_decode``      AROUND  read verdict, abort flagged
``managers.scheduler.Scheduler._reqs_finishing_inflight``          AROUND  abort requests whose row is not
                                                                           their own before a decode step is
                                                                           prepared, mixed chunk included
                                                                           (kvguard.sglang.stale)
``managers.scheduler.Scheduler.init_all_cuda_graphs``              AROUND  install before the graphs are
                                                                           captured: the decode check is
                                                                           captured into every decode graph
``...runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute`` AROUND  a replay runs the armed decode
                                                                           check (its epoch)
``...runner.eager_runner.EagerRunner.execute``                     AROUND  an eager decode forward: launch
                                                                           the armed decode check first
``beam_search.coordinator.BeamCoordinator.validate_and_init``      AROUND  turn a beam-search request away
                                                                           (a path refused per request)
``mem_cache.allocation.alloc_for_spec_decode``, ``speculative.``   AROUND  speculative decoding: record the
``eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation``                 reserved region, check each spec step
                                                                           (kvguard.sglang.spec)
``mem_cache.allocator.mamba.MambaSlotAllocator._do_alloc``         AFTER   hybrid linear-attention models:
``mem_cache.memory_pool.HybridReqToTokenPool.alloc``,              AROUND  state slot generations, each
``...HybridReqToTokenPool.free_mamba_cache``                                request's (slot, generation), safe
                                                                           release (kvguard.sglang.mamba)
=================================================================  ======  ==================================

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

import torch

from ..incidents import prepare_dir
from ..metrics import metrics_for
from ..settings import SettingsError, TrackerConfig
from .guard import PADDING_ROW, SGLangGuard
from .model_facts import pool_refusal
from .paths import KVGuardRefused
from . import runtime
from .runtime import (_PENDING, KVGuardStartupError, _flagged, _guard_of_batch, _still_in, guard_of,  # noqa: F401
                      stamp_transfer, transfer_ticket, unchecked)

log = logging.getLogger("kvguard.sglang")

_SRT = "sglang.srt"
_PROCESSOR = f"{_SRT}.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_BATCH = f"{_SRT}.managers.schedule_batch.ScheduleBatch"
_SCHEDULER = f"{_SRT}.managers.scheduler.Scheduler"
TARGETS = {
    "check_server_args": f"{_SRT}.server_args.ServerArgs.check_server_args",
    "pd_pre_alloc": f"{_SRT}.disaggregation.decode.DecodePreallocQueue._pre_alloc",
    "build_kv_cache": f"{_SRT}.mem_cache.kv_cache_builder.build_kv_cache",
    "alloc_for_extend": f"{_SRT}.mem_cache.allocation.alloc_for_extend",
    "alloc_for_decode": f"{_SRT}.mem_cache.allocation.alloc_for_decode",
    "release_kv_cache": f"{_SRT}.mem_cache.common.release_kv_cache",
    "release_req": f"{_SRT}.managers.schedule_batch.release_req",
    "prepare_for_extend": f"{_BATCH}.prepare_for_extend",
    "batch_copy": f"{_BATCH}.copy",
    "mix_with_running": f"{_BATCH}.mix_with_running",
    "process_batch_result_prefill": f"{_PROCESSOR}.process_batch_result_prefill",
    "process_batch_result_decode": f"{_PROCESSOR}.process_batch_result_decode",
    "reqs_finishing_inflight": f"{_SCHEDULER}._reqs_finishing_inflight",
    "init_all_cuda_graphs": f"{_SCHEDULER}.init_all_cuda_graphs",
    "graph_execute": f"{_SRT}.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
    "eager_execute": f"{_SRT}.model_executor.runner.eager_runner.EagerRunner.execute",
    "beam_validate": f"{_SRT}.beam_search.coordinator.BeamCoordinator.validate_and_init",
}
# Speculative decoding's hooks live with what they record and check (kvguard.sglang.spec): composed in here.
from .spec import HOOKS as _SPEC_HOOKS  # noqa: E402

TARGETS.update({name: target for name, (target, _, _) in _SPEC_HOOKS.items()})
# Hybrid linear-attention state (kvguard.sglang.mamba): composed in the same way.
from .mamba import HOOKS as _MAMBA_HOOKS  # noqa: E402

TARGETS.update({name: target for name, (target, _, _) in _MAMBA_HOOKS.items()})
# Sliding-window hybrids (kvguard.sglang.swa): composed in the same way.
from .swa import HOOKS as _SWA_HOOKS  # noqa: E402

TARGETS.update({name: target for name, (target, _, _) in _SWA_HOOKS.items()})
# PD disaggregation on a real transfer backend (kvguard.sglang.pd): composed in the same way.
from .pd import HOOKS as _PD_HOOKS  # noqa: E402

TARGETS.update({name: target for name, (target, _, _) in _PD_HOOKS.items()})

_registered_config: TrackerConfig | None = None
_guards: list[SGLangGuard] = []


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
        "check_server_args": (_after_check_server_args, "AFTER"),
        "pd_pre_alloc": (_around_pd_pre_alloc, "AROUND"),
        "build_kv_cache": (_after_build_kv_cache, "AFTER"),
        "alloc_for_extend": (_around_alloc_for_extend, "AROUND"),
        "alloc_for_decode": (_around_alloc_for_decode, "AROUND"),
        "release_kv_cache": (_around_release_kv_cache, "AROUND"),
        "release_req": (around_release_req, "AROUND"),
        "prepare_for_extend": (_after_prepare_for_extend, "AFTER"),
        "batch_copy": (_after_batch_copy, "AFTER"),
        "mix_with_running": (_around_mix_with_running, "AROUND"),
        "process_batch_result_prefill": (_around_process_batch_result_prefill, "AROUND"),
        "process_batch_result_decode": (_around_process_batch_result_decode, "AROUND"),
        "reqs_finishing_inflight": (around_reqs_finishing_inflight, "AROUND"),
        "init_all_cuda_graphs": (_around_init_all_cuda_graphs, "AROUND"),
        "graph_execute": (_around_graph_execute, "AROUND"),
        "eager_execute": (_around_eager_execute, "AROUND"),
        "beam_validate": (_around_beam_validate, "AROUND"),
    } | {name: (fn, kind) for name, (_, fn, kind) in _SPEC_HOOKS.items()} \
        | {name: (fn, kind) for name, (_, fn, kind) in _MAMBA_HOOKS.items()} \
        | {name: (fn, kind) for name, (_, fn, kind) in _SWA_HOOKS.items()} \
        | {name: (fn, kind) for name, (_, fn, kind) in _PD_HOOKS.items()}


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


def server_refusal(server_args) -> str | None:
    """The registry's verdict on a configuration (:mod:`kvguard.sglang.paths`): None, or why it is refused.

    The model's own properties (MLA, sliding window, encoder-decoder, ...) come from SGLang's
    ``ModelConfig`` (its config file only); a model whose config cannot be read is decided on the server
    settings here, and on its allocator at install.
    """
    from .paths import facts_of, refusal

    model_config = None
    try:
        from sglang.srt.configs.model_config import ModelConfig

        model_config = ModelConfig.from_server_args(server_args)
    except Exception as err:  # the scheduler decides at install, on the pools it builds
        log.debug("kvguard: model config not read before start (%s)", err)
    return refusal(facts_of(_resolved(server_args), model_config))


def _resolved(server_args):
    try:
        from sglang.srt.arg_groups.model_override_base import resolving_view

        return resolving_view(server_args)
    except Exception:
        return server_args


def _after_check_server_args(result, server_args, *args, **kwargs):
    # NOTE: runs in the process that starts SGLang (sglang.Engine, launch_server), before any scheduler
    # is spawned: a refusal reaches the caller as this exception, not as a dead scheduler's exit code.
    message = server_refusal(server_args)
    if message is not None:
        log.critical(message)
        raise KVGuardRefused(message)
    return None


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


def install(req_to_token_pool, allocator, tree_cache=None, *, config: TrackerConfig | None = None,
            registry=None, build_result=None) -> SGLangGuard:
    """Attach a guard to one pool set and return it (the same guard if already installed).

    ``req_to_token_pool`` is whatever holds the ``req_to_token`` table the attention backends read (the
    check reads it); ``tree_cache`` is optional (no radix tree: nothing to follow there). An allocator
    kvguard does not cover (anything but SGLang's paged / token allocators and their subclasses) raises
    :class:`KVGuardStartupError`, counted in ``kvguard_pools_uncovered``: asked to check, kvguard never
    leaves a pool silently unchecked.
    """
    if not covered(allocator):
        metrics_for(registry).uncovered.inc()
        raise KVGuardStartupError(
            f"kvguard: refusing to start: KVGUARD_MODE=check but the KV allocator "
            f"{type(allocator).__module__}.{type(allocator).__name__} is not covered (kvguard covers "
            f"PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator and the paged SWATokenToKVPoolAllocator); run "
            f"with KVGUARD_MODE=off")
    if getattr(req_to_token_pool, "req_to_token", None) is None:
        raise TypeError(f"kvguard.install: {type(req_to_token_pool).__name__} has no req_to_token table")
    refused = pool_refusal(req_to_token_pool, allocator, build_result, tree_cache)
    if refused is not None:  # the backstop: whatever the facts said, these pools hold state kvguard does not follow
        from .paths import BY_NAME

        metrics_for(registry).uncovered.inc()
        p = BY_NAME[refused]
        raise KVGuardStartupError(f"kvguard: refusing to start: KVGUARD_MODE=check but the pools SGLang built "
                                  f"({type(req_to_token_pool).__name__}, {type(allocator).__name__}) are those of "
                                  f"{refused} ({p.turned_on_by}): {p.why}. Serve with KVGUARD_MODE=off")
    existing = guard_of(allocator)
    if existing is not None:
        if existing.req_to_token_pool is not req_to_token_pool:
            raise KVGuardStartupError(f"kvguard: refusing to start: the KV allocator's guard follows another "
                                      f"req_to_token pool than {type(req_to_token_pool).__name__} the scheduler uses")
        if existing.tree_cache is None and tree_cache is not None:
            existing.attach_tree(tree_cache)  # installed before the graph capture, ahead of the tree
        return existing
    from . import swa

    # a sliding-window hybrid: the guard follows the full sub-allocator, kvguard.sglang.swa the SWA side
    guard = SGLangGuard(req_to_token_pool, swa.full_side(allocator), tree_cache,
                        config or TrackerConfig.from_env(mode="check"), registry=registry)
    swa.attach(guard, allocator)
    allocator._kvguard = guard
    if getattr(req_to_token_pool, "mamba_pool", None) is not None:  # let through by pool_refusal: followed
        from .mamba import follow

        follow(guard)
    _guards.append(guard)
    log.info("kvguard: installed on %s (page_size=%d, %d pages, %d rows)", type(allocator).__name__,
             guard.page_size, guard.num_pages, guard.num_rows)
    return guard


def covered(allocator) -> bool:
    """kvguard follows this KV allocator: SGLang's paged or token allocator (or a subclass), except the page
    interleave allocator (KV cache sharding), which keeps a free list per shard class instead of ``free_pages``:
    kvguard's alloc wrapper reads the pages handed out as a prefix of ``free_pages`` (kvguard.sglang.follow)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    try:
        from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    except ImportError:  # not in this SGLang
        PageInterleavePoolAllocator = ()
    from .swa import follows

    return isinstance(allocator, (PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator)) \
        and not isinstance(allocator, PageInterleavePoolAllocator) or follows(allocator)


def guards() -> list[SGLangGuard]:
    """Every guard installed in this process (one per scheduler pool set)."""
    return list(_guards)


# ------------------------------------------------------------------------------------------------
# Hook bodies (module level so HookRegistry can name them in its logs)
# ------------------------------------------------------------------------------------------------
def _around_alloc_for_extend(original, batch, *args, **kwargs):
    guard = _guard_of_batch(batch)
    if guard is None:
        return original(batch, *args, **kwargs)
    held = [req.kv.holds_kv for req in batch.reqs]
    guard._fresh = None  # set again by this batch's allocation, if it allocates
    result = original(batch, *args, **kwargs)
    out_cache_loc, _, rows_cpu = result
    # NOTE: this is where a request's row gets its pages, and the only place that knows which of the
    # allocator's output slots belong to which request. On GPU the row is written by a Triton kernel
    # (write_cache_indices) that bypasses ReqToTokenPool.write, so hooking write() would miss it; we
    # record from the allocator's output (new pages) and from the tree's match (prefix, with the tags
    # the tree adopted them with), not from a later read of the table, which would accept whatever
    # corruption happened in between.
    if batch.is_dllm():
        raise unchecked("dllm")
    guard.record_extend(batch, out_cache_loc, rows_cpu, held)
    return result


def _around_alloc_for_decode(original, batch, token_per_req=1, *args, **kwargs):
    allocator = getattr(batch, "token_to_kv_pool_allocator", None)  # (_guard_of_batch, inline: a per-step hook)
    guard = getattr(allocator, "_kvguard", None) if allocator is not None else _guard_of_batch(batch)
    if guard is None:
        return original(batch, token_per_req, *args, **kwargs)
    out_cache_loc, flags = _record_decode_alloc(guard, original, batch, token_per_req, args, kwargs)
    # NOTE: the decode check is armed here, once the step's write slots are known, inside prepare_for_decode
    # (alloc_for_decode's only caller, on every path that decodes one token per request: update_running_batch
    # and mixed chunked prefill); SGLang counts the step's token into seq_lens after this returns (ahead=1).
    # Armed, not launched: the forward that runs the batch launches it (kvguard.sglang.plugin, the runners).
    # A decode batch that never passed here (a path that prepares decode its own way) is refused at its result.
    if batch.reqs:
        guard.arm_decode(batch, out_cache_loc, flags,
                         None if runtime._ONE_RANK else
                         (runtime._GROUP[0] if runtime._GROUP else runtime._attn_tp())[1])
    return out_cache_loc


def record_alloc_for_decode(original, batch, token_per_req=1, *args, **kwargs):
    """alloc_for_decode with kvguard's bookkeeping and no check armed (the batch carries none: ``_kvguard`` None).

    Not one of kvguard's hooks: a benchmark that turns kvguard's per-step check off while requests run calls
    it in the hook's place, so that what kvguard records of their pages stays true."""
    guard = _guard_of_batch(batch)
    if guard is None:
        return original(batch, token_per_req, *args, **kwargs)
    return _record_decode_alloc(guard, original, batch, token_per_req, args, kwargs)[0]


def _record_decode_alloc(guard, original, batch, token_per_req, args, kwargs):
    """SGLang's decode allocation, recorded: (its write slots, the batch's stale flags)."""
    if token_per_req != 1 or guard.model_config is not batch.model_config:
        _decoder_only(guard, batch, token_per_req)
    batch._kvguard = None  # this step's check once armed; None: nothing to check (kvguard follows none of its rows)
    flags = guard.stale_flags(batch)
    stale, any_stale = flags
    guard._fresh = None  # set again by this step's allocation, if it hands out pages
    # The step's new pages are bumped by its record launch below (one launch for both), unless a page
    # history is kept (it notes each bump where it happens: PoolFollower.bump_in_record).
    guard.defer_bump = guard.bump_in_record
    try:
        if not any_stale:
            out_cache_loc = original(batch, token_per_req, *args, **kwargs)
        else:
            # NOTE: a backstop: both paths that prepare a decode step abort stale requests before it
            # (kvguard.sglang.stale); one stale here came some other way (attention TP: a row released on this rank
            # only, after the ranks agreed on this batch composition).
            # SGLang writes each request's new slot into req_to_token[row, seq_len]. A stale request's
            # row belongs to a newer request now, whose forward (possibly still in flight, overlap scheduler)
            # reads that row: the stale request's slot must never land there. For this one call its row index
            # is SGLang's padding row (a new tensor: the in-flight batch keeps its own); it is aborted at this
            # step's verdict and its write slot goes to the padding slot.
            rows = batch.req_pool_indices
            batch.req_pool_indices = torch.where(guard.to_device(stale, torch.bool), PADDING_ROW, rows)
            try:
                out_cache_loc = original(batch, token_per_req, *args, **kwargs)
            finally:
                batch.req_pool_indices = rows
        if any_stale or guard._pending_alloc is not None or guard._fresh is not None:
            guard.record_decode(batch, out_cache_loc, stale)
        # else: no request starts a page this step (no page was handed out): nothing to record
    finally:
        guard.defer_bump = False
        if guard._pending_alloc is not None:
            guard.flush_alloc()  # pages handed out and not recorded (an error above) are still bumped
    return out_cache_loc, flags


def _decoder_only(guard, batch, token_per_req: int) -> None:
    """A decode step of one token per request of a decoder-only model, or a refused path stops the scheduler; the
    model config once seen so (a scheduler's batches share it) is not looked into again."""
    enc_dec = batch.model_config.is_encoder_decoder
    if token_per_req != 1 or enc_dec:
        raise unchecked("encoder_decoder" if enc_dec else "speculative_other_algorithms")
    guard.model_config = batch.model_config


def _around_release_kv_cache(original, req, tree_cache, *args, **kwargs):
    # NOTE: SGLang frees [cache_protected_len, owned) as named by the request's req_to_token row. For a
    # request kvguard aborted, that row is what is broken: its bad entries name other requests' pages,
    # tree pages or pages already freed. Only the pages it still legitimately holds go back. The same for a
    # request SGLang releases between steps (schedule_batch.release_req: retraction, pause, priority preemption):
    # its row was last checked a step ago. A row that is not its own is never freed (kvguard.sglang.release).
    guard = guard_of(tree_cache)
    if guard is not None:
        guard.tracker.flush_metrics()  # the counters are exact whenever no request runs (TagTracker.count_check)
    if guard is None or not (guard.retracting or getattr(req, "kvguard_aborted", False)):
        return original(req, tree_cache, *args, **kwargs)
    from .release import safe_release

    return safe_release(guard, original, req, tree_cache, *args, **kwargs)


def _around_beam_validate(original, coordinator, req, *args, **kwargs):
    # NOTE: beam search is turned on per request (sampling_params.beam_width > 1), not by a server setting, so
    # it cannot be refused at start: SGLang's own validation of each beam request (Scheduler.handle_generate_request)
    # turns it away here, with SGLang's HTTP 400 and this message, before any of its KV is written; every other
    # request is served as usual. Never SGLang's original: kvguard does not follow a beam group's member rows.
    from .paths import BY_NAME

    p = BY_NAME["beam_search"]
    message = (f"kvguard: request {req.rid} refused: this server runs KVGUARD_MODE=check, and beam search "
               f"({p.turned_on_by}) is a path kvguard does not check: {p.why}")
    log.error(message)
    return message


def _around_pd_pre_alloc(original, queue, req, prefix_indices=None, prefix_len=None, total_prefix_len=None):
    # PD decode: a transferred request gets its row and pages here, never through alloc_for_extend.
    # NOTE: the row is recorded from what SGLang decided here (the decode tree's prefix match, the pages
    # just allocated as the transfer's destination), with the allocation's own tags: the transfer
    # writes those pages until commit, and its tags travel with the request (the transfer tags).
    guard = guard_of(queue.token_to_kv_pool_allocator)
    if guard is None:
        return original(queue, req, prefix_indices, prefix_len, total_prefix_len)
    guard._fresh = None
    kv_loc = original(queue, req, prefix_indices, prefix_len, total_prefix_len)
    prefix = prefix_len or 0
    guard.record_prealloc(req, kv_loc, prefix, prefix if total_prefix_len is None else total_prefix_len)
    return kv_loc


def _after_prepare_for_extend(result, batch, *args, **kwargs):
    guard = _guard_of_batch(batch)
    if guard is None or not batch.reqs:  # (ScheduleBatch.is_empty)
        return None
    batch._kvguard = None
    if not batch.spec_algorithm.is_none():  # chain drafting is checked (kvguard.sglang.spec); the rest stops here
        from .spec import refusal_now

        if refusal_now() is not None:
            raise unchecked(refusal_now())
    if batch.is_dllm():
        raise unchecked("dllm")
    guard.launch(batch, agreement=runtime._attn_tp()[1])
    guard.radix.unread(batch)  # its chunked request is stashed into the tree only after this verdict (radix.py)
    return None


def _after_batch_copy(copy, batch, *args, **kwargs):
    held = batch.__dict__
    for name in _PENDING:
        if name in held:  # a check, or None: nothing to check (a decode batch with neither is refused at its result)
            setattr(copy, name, held[name])
    return None


def _around_mix_with_running(original, batch, running_batch, *args, **kwargs):
    # Mixed chunked prefill: the running requests' check was armed by their own prepare_for_decode (its
    # alloc_for_decode); it is launched here, before their write slots are merged into the mixed batch's (the
    # write guard rewrites them where SGLang reads them now), and its verdict travels with the mixed batch,
    # whose result the prefill path processes.
    pending = running_batch.__dict__.get("_kvguard")
    if pending is not None and pending.batch is not None:
        pending.guard.fire(pending, running_batch.req_pool_indices, running_batch.seq_lens,
                           running_batch.out_cache_loc)
    result = original(batch, running_batch, *args, **kwargs)
    pending = running_batch.__dict__.pop("_kvguard", None)
    if pending is not None:
        batch._kvguard_mixed = pending
    return result


def _around_process_batch_result_prefill(original, processor, batch, result, *args, **kwargs):
    # NOTE: before SGLang commits and streams a first token: a flagged request is finished through
    # SGLang's own discard path (Req.discard_output_reason, as for a failed KV load): its token is not
    # committed, it is released without a checkpoint (kvguard's safe release) and its error is streamed.
    guard, flagged = _flagged(batch, result)
    if flagged:
        guard.discard(flagged)
    return original(processor, batch, result, *args, **kwargs)


def _around_process_batch_result_decode(original, processor, batch, result, *args, **kwargs):
    # NOTE: read here, before SGLang commits and streams this step's tokens: the verdict was computed
    # before the forward and copied to the host asynchronously, so reading it costs no extra wait beside
    # the sampled ids SGLang is about to read. Flagged requests are aborted through SGLang's per-request
    # path and finished; the original loop below then skips them (overlap: finished requests are
    # skipped; non-overlap: the finish handler is shadowed for that call, below), none of their tokens from this step is streamed
    # (finished_output is set), and update_running_batch's filter_batch() drops them from the running
    # batch, as for any finished request.
    pending = batch.__dict__.pop("_kvguard", _UNARMED)  # (_PENDING[0])
    if pending is None:  # kvguard follows none of this batch's rows
        return original(processor, batch, result, *args, **kwargs)
    if pending is _UNARMED:
        if batch.reqs and _guard_of_batch(batch) is not None:
            raise _unarmed(batch)
        return original(processor, batch, result, *args, **kwargs)
    clean = pending.clean
    if clean is not None and clean[0][clean[1]] == clean[2] and runtime._ONE_RANK:
        # The steady state (SGLangGuard.resolve's first test, inline): a captured check's result word says it ran
        # clean, read before any wait; the step goes on to SGLang's own wait for its sampled ids.
        return original(processor, batch, result, *args, **kwargs)
    guard = pending.guard
    group = (runtime._GROUP[0] if runtime._GROUP else runtime._attn_tp())[0]
    flagged = guard.resolve(pending, group, getattr(result, "copy_done", None),
                            result)
    if not flagged:
        return original(processor, batch, result, *args, **kwargs)
    flagged = _still_in(batch, flagged)
    aborted = guard.abort(flagged, tree_cache=processor.tree_cache, stream=processor.output_streamer.stream_output) \
        if flagged else []
    if not aborted:
        return original(processor, batch, result, *args, **kwargs)
    # NOTE: without the overlap scheduler SGLang's loop below still finishes (releases, streams) each request
    # it sees finished; the ones kvguard just aborted are already released and streamed. For this one call
    # the processor class's per-request finish skips them, and is put back right after: no per-request hook
    # runs in the steady state. (The class, not the instance: SGLang's processor refuses instance
    # attributes; the scheduler runs this loop on one thread.)
    cls = type(processor)
    own = cls.__dict__.get(_FINISH)  # None: inherited (then the patch is removed again, not restored)
    handle = getattr(cls, _FINISH)

    def _skip_aborted(self, req, *a, **k):
        if req.__dict__.get("kvguard_aborted"):
            return None
        return handle(self, req, *a, **k)

    setattr(cls, _FINISH, _skip_aborted)
    try:
        return original(processor, batch, result, *args, **kwargs)
    finally:
        if own is None:
            delattr(cls, _FINISH)
        else:
            setattr(cls, _FINISH, own)


_FINISH = "_handle_finish_state_updated_req"  # SchedulerBatchResultProcessor's per-request finish
_UNARMED = object()  # a decode batch's result with no check and no "nothing to check": it never passed alloc_for_decode


def _unarmed(batch) -> RuntimeError:
    """Fail closed: a decode batch of a scheduler kvguard guards ran, and kvguard's alloc_for_decode hook never saw
    it (a path that prepares decode batches its own way, e.g. speculative decoding): its tokens are not served."""
    message = (f"kvguard: a decode batch of {len(batch.reqs)} requests reached its result without passing "
               f"alloc_for_decode, so kvguard never checked it (a decode path kvguard does not follow, e.g. "
               f"speculative decoding); kvguard does not serve a step it did not check")
    log.critical(message)
    return RuntimeError(message)


# ------------------------------------------------------------------------------------------------
# The model runners: the decode check captured into SGLang's decode CUDA graphs
# ------------------------------------------------------------------------------------------------
# A decode step's check is armed when SGLang allocates the step's write slots (kvguard's ``alloc_for_decode``
# hook, inside ``prepare_for_decode``) and launched by the forward that runs it:
#
# - **a decode graph replay** (``DecodeCudaGraphRunner.execute``): the check was captured into every decode
#   graph, first node before the forward (SGLang's ``ModelRunner.capture_head_hooks``), on the graph's own
#   static buffers. The replay runs it: no launch on the host. kvguard counts the replays (the check's epoch,
#   :mod:`kvguard.kernels.graph_check`) and writes the batch's expectation rows into the graph's owner buffer
#   when the batch's composition changes;
# - **an eager decode forward** (``EagerRunner.execute``: no graph, or a batch larger than the graphs): the
#   check is launched right before it, on the tensors it reads;
# - **a mixed chunked-prefill batch** (``ScheduleBatch.mix_with_running``, above): launched
#   before the decode part is merged.
#
# For that, kvguard installs on the scheduler's pools before SGLang captures its graphs
# (``Scheduler.init_all_cuda_graphs``), after the same checks as at ``build_kv_cache``. Checks wait for the
# forward only when every decode forward of the scheduler goes through a runner hooked here (the model
# runner's decode runner is none, the eager runner, or one whose graphs all carry the check); otherwise they
# are launched as the batch is prepared, as before. An armed check that no forward launched is refused at its
# verdict (the scheduler stops), and so is a decode batch whose result arrives without having passed
# alloc_for_decode (_unarmed): kvguard never serves a decode step it did not check.


def _guard_of_runner(runner):
    """The guard of a model runner's pools (kept on the runner once found: a per-step lookup)."""
    guard = runner.__dict__.get("_kvguard")
    if guard is None:
        model_runner = getattr(runner, "model_runner", None)
        guard = getattr(getattr(model_runner, "token_to_kv_pool_allocator", None), "_kvguard", None)
        if guard is not None:
            runner._kvguard = guard
    return guard


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


def _around_graph_execute(original, runner, forward_batch, *args, **kwargs):
    guard = _guard_of_runner(runner)
    if guard is None or guard.graph is None or forward_batch.forward_mode != guard.decode_mode:
        return original(runner, forward_batch, *args, **kwargs)
    guard.graph_step(runner, forward_batch)
    return original(runner, forward_batch, *args, **kwargs)


def _around_eager_execute(original, runner, forward_batch, *args, **kwargs):
    guard = _guard_of_runner(runner)
    if guard is not None and guard.armed is not None and forward_batch.forward_mode == guard.decode_mode:
        guard.fire_armed(forward_batch)
    return original(runner, forward_batch, *args, **kwargs)
