"""What kvguard does as an SGLang server starts (SGLang 0.5.23): the registry's verdict on its settings, and the
install of a guard on one pool set.

=================================================================  ======  ==================================
target (``sglang.srt.``)                                           type    what kvguard does there
=================================================================  ======  ==================================
``server_args.ServerArgs.check_server_args``                       AFTER   refuse a path kvguard does not
                                                                           check (kvguard.sglang.paths)
=================================================================  ======  ==================================

:func:`install` is what the two install points call (``build_kv_cache`` and ``Scheduler.init_all_cuda_graphs``,
:mod:`kvguard.sglang.plugin`: they first run its preflight, which checks every hook of the plugin's table); a test
or a benchmark calls it on pools of its own. :func:`covered` names the allocators kvguard follows, :func:`guards`
the guards installed in this process, :func:`server_refusal` the registry's verdict before any scheduler starts
(:mod:`kvguard.sglang.launch` asks it too).

Only this subpackage imports SGLang, and only inside functions.
"""
from __future__ import annotations

import logging

from ..metrics import metrics_for
from ..settings import TrackerConfig
from .guard import SGLangGuard
from .model_facts import pool_refusal
from .paths import KVGuardRefused
from .runtime import KVGuardStartupError, guard_of

log = logging.getLogger("kvguard.sglang")

_guards: list[SGLangGuard] = []


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


# name -> (SGLang target, hook, HookRegistry type); composed into kvguard.sglang.plugin's TARGETS and hooks()
HOOKS = {
    "check_server_args": ("sglang.srt.server_args.ServerArgs.check_server_args", _after_check_server_args, "AFTER"),
}
