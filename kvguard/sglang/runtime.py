"""What kvguard's SGLang hooks share in one scheduler process, below the plugin and the path modules.

The plugin (:mod:`kvguard.sglang.plugin`) composes the path modules' hook tables; the path modules (spec, stale,
pd, ...) and the plugin both read what is here, and nothing here imports either, so the imports point one way:

- :class:`KVGuardStartupError` (the stop that SGLang's plugin loader does not swallow) and :func:`unchecked` (a
  refused path's batch reached a hook: stop);
- :func:`guard_of` / :func:`_guard_of_batch`: the guard of a pool set, a batch, a scheduler;
- PD's transfer ticket and stamp (:func:`transfer_ticket`, :func:`stamp_transfer`);
- attention TP: the ranks this process agrees with (:func:`_attn_tp`, looked up once: ``_GROUP``, ``_ONE_RANK``;
  read as ``runtime._ONE_RANK`` so that a test or a benchmark that sets them is seen by every hook);
- the checks a batch carries (``_PENDING``) and their verdict at its result (:func:`_flagged`).

Only functions import SGLang, and only when they run.
"""
from __future__ import annotations

import logging

import torch

from .guard import SGLangGuard

log = logging.getLogger("kvguard.sglang")


class KVGuardStartupError(SystemExit):
    """kvguard was asked for and cannot run as asked: the process must not serve without it.

    A ``SystemExit`` on purpose: SGLang's plugin loader swallows ``Exception`` from plugins (the server
    would start unguarded); a ``SystemExit`` passes through and stops the process with this message.
    """

    def __init__(self, message: str):
        log.critical(message)
        super().__init__(message)


def guard_of(obj) -> SGLangGuard | None:
    """The guard covering ``obj``: an allocator, a tree cache, a ScheduleBatch or a Scheduler (or None).

    This is the public way to reach a running scheduler's guard (its tracker, metrics and tags).
    """
    for name in (None, "token_to_kv_pool_allocator", "tree_cache"):
        target = obj if name is None else getattr(obj, name, None)
        for holder in (target, getattr(target, "token_to_kv_pool_allocator", None)):
            guard = getattr(holder, "__dict__", {}).get("_kvguard")
            if isinstance(guard, SGLangGuard):
                return guard
    return None


def transfer_ticket(req):
    """PD decode: the transfer ticket of ``req`` (its destination pages and their tags), or None.

    What the transfer's writer is handed with the destination pages; after its KV lands, the writer
    calls :func:`stamp_transfer` with it. A late write from a transfer whose pages were handed out since
    then stamps tags their new owners do not expect, and their next check aborts them.
    """
    return req.__dict__.get("kvguard_transfer")


def stamp_transfer(allocator, ticket) -> None:
    """The writer's stamp after a transfer's KV landed in the pool set of ``allocator``."""
    guard = guard_of(allocator)
    if guard is not None and ticket is not None:
        guard.stamp(ticket)


_GROUP: list = []  # this process's attention-TP (CPU group, VerdictAgreement) once looked up; (None, None): one rank
_ONE_RANK = False  # looked up, and one rank (_GROUP == [(None, None)])
# (the per-step hooks read ``_GROUP[0] if _GROUP else _attn_tp()``: no call once it is looked up)


def _attn_tp(min_ranks: int = 2) -> tuple:
    """The attention-TP ranks this process agrees with: (SGLang's CPU group of them, kvguard's
    :class:`~kvguard.sglang.agree.VerdictAgreement` over them), or (None, None) with fewer than ``min_ranks``.

    Looked up once (SGLang initialises torch.distributed at TP 1 too; one rank agrees with itself). ``min_ranks``:
    1 serves the TP path over one rank (a benchmark's stand-in for measuring its host cost on one GPU)."""
    if _GROUP:
        return _GROUP[0]
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None, None  # not yet: looked up again later
    try:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        cpu_group = get_attn_tp_group().cpu_group
    except Exception as err:
        # NOTE: "one rank" is cached for the process's life, so it is concluded only where it is true: a process
        # alone in its torch.distributed world. Otherwise ranks that could not be looked up might drop different
        # requests and hang: stop instead.
        if torch.distributed.get_world_size() > 1:
            raise KVGuardStartupError(f"kvguard: refusing to serve: SGLang's attention-TP group could not be looked "
                                      f"up ({type(err).__name__}: {err}) in a world of "
                                      f"{torch.distributed.get_world_size()} ranks, so the ranks' verdicts could "
                                      f"not agree") from err
        cpu_group = None
    groups = (None, None)
    if cpu_group is not None and torch.distributed.get_world_size(cpu_group) >= min_ranks:
        from .agree import VerdictAgreement

        cuda = torch.cuda.is_available()
        groups = (cpu_group, VerdictAgreement(cpu_group, torch.device("cuda", torch.cuda.current_device()) if cuda
                                              else torch.device("cpu")))
    global _ONE_RANK
    _GROUP.append(groups)
    _ONE_RANK = groups[0] is None
    return groups


def _guard_of_batch(batch) -> SGLangGuard | None:
    allocator = getattr(batch, "token_to_kv_pool_allocator", None)
    if allocator is None and getattr(batch, "tree_cache", None) is not None:
        allocator = batch.tree_cache.token_to_kv_pool_allocator
    return getattr(allocator, "_kvguard", None)


def unchecked(path: str) -> RuntimeError:
    """A batch of a path the registry refuses reached a hook: stop (fail closed), never serve it unchecked.

    Unreachable when the server was started through SGLang's ``check_server_args`` (refused there); this
    is the last line of defence for a configuration that slipped past it.
    """
    from .paths import BY_NAME

    p = BY_NAME[path]
    message = f"kvguard: a {path} batch ({p.turned_on_by}) reached the scheduler, and kvguard does not check it: {p.why}"
    log.critical(message)
    return RuntimeError(message)


_PENDING = ("_kvguard", "_kvguard_mixed")  # the batch's own check; a mixed batch's decode-part check


def _flagged(batch, result):
    """Resolve the checks launched for this batch (if any): flagged (req, message, stale) still in it.

    Read after SGLang's own wait for this batch's forward (``result.copy_done``, or its sampled ids copied to
    the host: SGLangGuard.wait_forward), which the checks preceded on the stream."""
    guard, flagged, held = None, [], batch.__dict__
    for pending in (held.pop(_PENDING[0], None), held.pop(_PENDING[1], None)):
        if pending is None:
            continue
        guard = pending.guard
        flagged += guard.resolve(pending, _attn_tp()[0], getattr(result, "copy_done", None), result)
    return guard, _still_in(batch, flagged)


def _still_in(batch, flagged: list) -> list:
    """The flagged (req, message, stale) whose request is still in the batch."""
    if not flagged:
        return flagged
    in_batch = {id(req) for req in batch.reqs}
    return [item for item in flagged if id(item[0]) in in_batch]
