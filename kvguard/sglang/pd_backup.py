"""PD decode with SGLang's retraction backup (SGLang 0.5.23): a retracted request's KV leaves through its row and
comes back through a new one, checked at both ends.

When a PD decode server runs out of KV pages it retracts requests (``ScheduleBatch.retract_decode`` ->
``schedule_batch.release_req``). Unless ``disaggregation_decode_retraction_backup=none``, SGLang first copies the
request's KV out, read through its ``req_to_token`` row ``[0, seqlen - 1)`` (``mem_cache.common.backup_kv_cache``:
``cpu_tensor`` -> ``Req.offload_kv_cache``, ``host_pool`` -> ``UnifiedRadixCache.backup_kv_cache``), releases it
(the safe release: :mod:`kvguard.sglang.release`), and later restores it (``DecodePreallocQueue.
resume_retracted_reqs``: ``_pre_alloc`` takes a new row and new pages, then ``restore_kv_cache`` writes the saved KV
through that row) and the request rejoins decode without recompute. The row the copy reads was last checked a step
before; a row broken since would copy another request's KV out and restore it as this request's, unseen.

=====================================================================  ======  ===================================
target (``sglang.srt.``)                                               type    what kvguard does there
=====================================================================  ======  ===================================
``mem_cache.common.backup_kv_cache``                                   AROUND  check the row's ``[0, seqlen - 1)``
                                                                               before anything is copied; broken
                                                                               (or not its own): nothing copied,
                                                                               the request aborted, released safely
``managers.schedule_batch.ScheduleBatch.retract_decode``               AROUND  such a request's abort carries
                                                                               kvguard's message (HTTP 500)
``mem_cache.common.restore_kv_cache``                                  AROUND  check the new row against what
                                                                               ``_pre_alloc`` recorded before the
                                                                               saved KV is written through it
``mem_cache.kv_cache_builder.resolve_decode_retraction_backup``        AFTER   stop a PD decode scheduler with
                                                                               decode host KV buffering (not
                                                                               shown: see below)
=====================================================================  ======  ===================================

NOTE (where the hooks sit). Both functions are module-level in ``mem_cache.common`` and SGLang calls them there by
name: ``schedule_batch.release_req`` (``from ...common import backup_kv_cache``) and
``DecodePreallocQueue.resume_retracted_reqs`` / ``get_new_prebuilt_batch`` in ``disaggregation.decode`` (``from
...common import restore_kv_cache``). HookRegistry rebinds such ``from X import Y`` copies in every loaded module
(``_propagate_patch``), a module imported later reads the hooked attribute, and the plugin's self-check refuses to
serve while any ``sglang`` module still holds the unhooked function. One hook per direction covers both backends
(the ``Req`` / ``UnifiedRadixCache`` methods are each one backend's), and runs before either reads the row.

NOTE (the restored row's expectations). ``_pre_alloc``, called right before the restore, is kvguard's PD decode
hook (:mod:`kvguard.sglang.pd`): the new row ``[0, seqlen - 1)`` is recorded there with the tags its pages got at
this allocation (``record_prealloc``), the row generation too, so the restored request is its row's owner
(:mod:`kvguard.sglang.stale`). The restore writes KV, not the row; recording the row again from the table after it
would launder a row broken in between. Instead the restore is checked against that record first (a broken row
would write the saved KV into another request's pages), and the request's next decode check covers the row after.

NOTE (shown where). Both backends run on the CPU through SGLang's real PD decode scheduling, on the decode tree
SGLang builds (``mem_cache.registry.default_radix_cache_factory``: a ``UnifiedRadixCache`` with its radix cache off;
for ``host_pool`` with HiCache attached by its own ``init_hicache``, a ``HybridCacheController`` over an
``MHATokenToKVPoolHost``) (tests/test_kvguard/test_sglang/test_sglang_pd_backup.py). The host pool runs there with
the two shims of the HiCache test (tests/host_pool_shims.py: ``cudaHostRegister`` a no-op, the ``direct`` IO
backend's ``transfer_kv_direct`` a torch copy), ``hicache_io_backend=direct``, ``layer_first``. The tree's
``backup_kv_cache`` / ``restore_kv_cache`` read the row's ``[0, seqlen - 1)`` (``_retraction_device_transfers``)
padded to the end of its last page (slots of the page the check covers), after the hooks: a clean backup and
restore leave no false flag, a broken row is neither copied out nor written through. Not shown: SGLang's default
``kernel`` IO backend's copy ops (``sgl_kernel``, same indices), and the second restore site,
``get_new_prebuilt_batch``'s (decode host KV buffering, ``disaggregation_decode_host_receive_threshold < 1``, which
SGLang allows only with ``host_pool``): there the KV transfer itself writes the request's KV into host pages, which
kvguard's transfer ticket (device pages) does not follow; :func:`after_resolve_backup` stops such a scheduler.

Attention TP: every rank retracts and restores the same requests in the same order; the ranks agree on each
verdict (one small CPU all-reduce per retracted or restored request: retraction is rare), so all drop the same.

Only functions of this subpackage import SGLang, and only when they run.
"""
from __future__ import annotations

import logging

import torch

from . import runtime
from .aborts import ABORT_MESSAGE, _all_reduce_max, mark_aborted
from .runtime import guard_of

log = logging.getLogger("kvguard.sglang")

_SRT = "sglang.srt"
BACKENDS = ("cpu_tensor", "host_pool")  # the backends that copy KV through the row (``none`` copies nothing)
REFUSED = "kvguard_backup_refused"  # req.__dict__: kvguard's message for a request whose backup it refused


def row_verdict(guard, req, n: int) -> tuple[str, bool] | None:
    """One synchronous check of ``req``'s row entries ``[0, n)`` against kvguard's record: None when clean, else
    (the message, whether the row is not its own). Violations are reported (counted, logged, incident); the ranks of
    attention TP agree (a request flagged on a peer only is flagged here too, with a message saying so)."""
    from .release import owns_row

    stale = not owns_row(guard, req)
    message = guard.stale_message(req, "aborted") if stale else _check(guard, req, n) if n > 0 else None
    group = None if runtime._ONE_RANK else (runtime._GROUP[0] if runtime._GROUP else runtime._attn_tp())[0]
    if group is not None and not _all_reduce_max([int(message is not None)], group)[0]:
        return None
    if group is not None and message is None:
        return f"{ABORT_MESSAGE} on a peer tensor-parallel rank (request {req.rid})", False
    return None if message is None else (message, stale)


def _check(guard, req, n: int) -> str | None:
    """The tag check of one request's ``n`` first entries (the per-step launch, one ring slot; waits for it)."""
    row = int(req.kv.req_pool_idx)
    rows = torch.full((1,), row, dtype=torch.int64, device=guard.device)  # its own row (owns_row): table = record
    n_entries = torch.full((1,), n, dtype=torch.int64, device=guard.device)
    ring = guard._ring or guard._make_ring()
    slot, stamp = ring.next()
    check = guard.tracker.check(ring.launch, rows, n_entries, table_rows=rows, max_entries=n,
                                verdict=ring.verdict(slot, 1, n), flag=ring.flag_cells[slot], stamp=stamp,
                                entries_hint=n)
    verdict = check.verdict.cpu()  # (waits for the launch: a retraction or a restore, rare)
    if not bool(verdict.any()):
        return None
    found = guard.tracker.resolve(check, verdict, [str(req.rid)])
    return str(found[0]) if found else f"{ABORT_MESSAGE} (request {req.rid})"


def _copied(req) -> int:
    """The entries either backend reads from the row (``req_to_token[row, :seqlen - 1]``)."""
    return max(int(req.seqlen) - 1, 0)


def around_backup_kv_cache(original, req, tree_cache, req_to_token_pool, token_to_kv_pool_allocator, backend,
                           *args, **kwargs):
    """``backup_kv_cache``: copy a retracted request's KV out only through a row kvguard finds intact.

    A broken row (or one not the request's own) is never read: nothing is copied and SGLang is told the request can
    be neither backed up nor recomputed (``False``), so ``retract_decode`` aborts it (with kvguard's message:
    :func:`around_retract_decode`). ``release_req`` releases it right after, through kvguard's safe release: only
    the pages it legitimately holds go back (:func:`kvguard.sglang.release.safe_release`)."""
    guard = guard_of(token_to_kv_pool_allocator)
    if guard is None or backend not in BACKENDS or not req.kv.holds_kv:
        return original(req, tree_cache, req_to_token_pool, token_to_kv_pool_allocator, backend, *args, **kwargs)
    bad = row_verdict(guard, req, _copied(req))
    if bad is None:
        return original(req, tree_cache, req_to_token_pool, token_to_kv_pool_allocator, backend, *args, **kwargs)
    message, stale = bad
    log.error("%s; its KV was not backed up (retraction, %s)", message, backend)
    mark_aborted(req, stale)
    req.__dict__[REFUSED] = message
    guard.tracker.note_aborted(1)
    return False


def around_retract_decode(original, batch, *args, **kwargs):
    """``ScheduleBatch.retract_decode``: a request whose backup kvguard refused is aborted with kvguard's message.

    SGLang aborts a request whose backup returned False with its own message, a retry-later HTTP 503 ("Retracted
    under decode memory pressure without a KV backup"); this one's KV mapping was broken: HTTP 500, kvguard's."""
    retracted, ratio, to_abort = original(batch, *args, **kwargs)
    refused = [req for req in to_abort if REFUSED in req.__dict__]
    if refused:
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        for req in refused:
            req.to_finish = FINISH_ABORT(req.__dict__.pop(REFUSED), status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
    return retracted, ratio, to_abort


def around_restore_kv_cache(original, req, tree_cache, req_to_token_pool, token_to_kv_pool_allocator, backend,
                            *args, **kwargs):
    """``restore_kv_cache``: write the saved KV back only through a row that is the request's as kvguard recorded it
    at this allocation (``_pre_alloc``, just before).

    A broken row is never written through (the saved KV would land in another request's pages): the backup is
    discarded and the request finishes at its prebuilt step with kvguard's message (``Req.to_finish``, SGLang's way
    for a prebuilt request: ``process_batch_result_prebuilt`` releases it, through kvguard's safe release)."""
    guard = guard_of(token_to_kv_pool_allocator)
    if guard is None or backend not in BACKENDS or (backend == "host_pool" and int(req.seqlen) <= 1):
        return original(req, tree_cache, req_to_token_pool, token_to_kv_pool_allocator, backend, *args, **kwargs)
    bad = row_verdict(guard, req, _copied(req))
    if bad is None:
        return original(req, tree_cache, req_to_token_pool, token_to_kv_pool_allocator, backend, *args, **kwargs)
    from http import HTTPStatus

    from sglang.srt.mem_cache.common import discard_kv_cache_backup
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    message, stale = bad
    log.error("%s; its saved KV was not restored", message)
    discard_kv_cache_backup(req, tree_cache, backend)  # (host_pool: its host pages go back)
    mark_aborted(req, stale)
    req.to_finish = FINISH_ABORT(message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
    guard.tracker.note_aborted(1)
    return None


HOST_RECEIVE = "pd_decode_host_receive"  # the registry row of decode host KV buffering (kvguard.sglang.paths)


def after_resolve_backup(result, *args, **kwargs):
    """SGLang's resolution of the backend at start (``kv_cache_builder.resolve_decode_retraction_backup``, after
    the pools are built). Either backend is checked (the registry inferred it from the launch line and the model;
    SGLang may resolve the other: both are shown). A PD decode server with decode host KV buffering
    (``disaggregation_decode_host_receive_threshold < 1``: the transfer writes into host pages, not followed) stops
    here before anything serves, whatever the registry answered at start."""
    from .runtime import unchecked

    from sglang.srt.runtime_context import get_disagg

    disagg = get_disagg()
    if disagg.disaggregation_mode == "decode" and disagg.disaggregation_decode_host_receive_threshold < 1:
        raise unchecked(HOST_RECEIVE)
    return result


HOOKS = {  # name: (SGLang target, kvguard's hook, HookRegistry type); composed into kvguard.sglang.plugin's table
    "pd_resolve_backup": (f"{_SRT}.mem_cache.kv_cache_builder.resolve_decode_retraction_backup", after_resolve_backup,
                          "AFTER"),
    "pd_backup_kv_cache": (f"{_SRT}.mem_cache.common.backup_kv_cache", around_backup_kv_cache, "AROUND"),
    "pd_retract_decode": (f"{_SRT}.managers.schedule_batch.ScheduleBatch.retract_decode", around_retract_decode,
                          "AROUND"),
    "pd_restore_kv_cache": (f"{_SRT}.mem_cache.common.restore_kv_cache", around_restore_kv_cache, "AROUND"),
}
