"""PD disaggregation on a real transfer backend (SGLang 0.5.23, Mooncake): what kvguard follows there.

The decode side's rows and destination pages are recorded where SGLang preallocates them
(``DecodePreallocQueue._pre_alloc``: the transfer ticket); the prefill side's extend batches are recorded and
checked through ``alloc_for_extend`` / ``prepare_for_extend`` like any other (kvguard.sglang.batches). The rest
of this module is what a real backend needs on top:

=====================================================================  ======  ===============================
target (``sglang.srt.disaggregation.``)                                type    what kvguard does there
=====================================================================  ======  ===============================
``decode.DecodePreallocQueue._pre_alloc``                              AROUND  PD decode: record the row, the
                                                                               transfer ticket
``decode.DecodePreallocQueue.__init__``                                AFTER   refuse a real backend without
                                                                               SGLang's deferred release
``decode.DecodeTransferQueue._commit_transfer_to_req``                 AFTER   stamp the transfer's ticket
``decode.DecodeTransferQueue._defer_release``                          AROUND  an aborted transfer's pages are
                                                                               held until every prefill rank
                                                                               acked its drain (no timeout)
``decode.DecodeTransferQueue._release_request``                        AROUND  never free a destination while
                                                                               its transfer may still write
``prefill.SchedulerDisaggregationPrefillMixin.``                       AROUND  read the extend check's verdict
``process_batch_result_disagg_prefill``                                        before anything is sent
``prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk``         AROUND  PD prefill: the tags of the
                                                                               pages a send will read
``common.conn.CommonKVManager.conclude_transfer``                      AROUND  PD prefill: a room whose pages
                                                                               changed hands before its reads
                                                                               ended concludes Failed
=====================================================================  ======  ===============================

NOTE (the equivalent of a transfer tag written by the prefill side, and why it is one). The issue's design has
the prefill writer put each destination page's expected tag after its KV. On SGLang's Mooncake backend the
decode side learns ``KVPoll.Success`` for a room only from the prefill's status message, which the prefill's
transfer worker sends after ``batch_transfer_sync_write`` of the room's last chunk returned (every byte of it
acknowledged by the receiving transfer engine). So at commit every write of that transfer has landed, and
the decode side stamps the ticket then (``SGLangGuard.stamp``): a current transfer changes nothing; a transfer
whose destination pages changed hands while it ran gives those pages fresh tags, so their new holder's next
check aborts it. What remains is a write landing *after* its request's pages went back to the allocator:
SGLang frees a destination only through ``_release_request``, and with a transfer not concluded
(``KVPoll.Failed`` after an abort or a peer fault) it defers that release until the prefill ranks ack their
drain, or until ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` passed -- "a timeout cannot prove
that a remote write has stopped" (SGLang's own comment). kvguard drops the timeout: the pages stay held until
the drain ack, and a release of a destination whose transfer is neither committed nor drained stops the
scheduler (fail closed) instead of handing the pages out.

NOTE (a prefill page freed while its send reads it). The prefill's transfer worker reads a request's pages after
the scheduler queued the chunk, on its own thread; nothing checks the request again (it is in no batch). A page
freed meanwhile (a bookkeeping bug: a premature or double free) goes to the next extend, whose KV the send then
ships as the request's. kvguard takes the tags of the pages each send reads when SGLang queues it
(``_send_kv_chunk``: the row's ``[start_send_idx, end)``, SGLang's own arithmetic, so an early send of a cached
prefix is followed too; on the scheduler thread, a device gather, no sync) and compares them when the backend concludes
the room (``conclude_transfer``, on the transfer thread, after every read of it ended: Mooncake's writes returned,
NIXL's handles read DONE). Tags change on every free and allocation, so a page that changed hands before its read
ended carries another tag: the room concludes ``Failed`` instead of ``Success`` (the decode side never commits it;
SGLang fails it on both sides and the clients see the error), and the request is released as one kvguard aborted
(only the pages it still holds go back). On a GPU the comparison first waits for the device, so a free queued
before the conclusion has bumped its tags (the transfer thread waits, not the scheduler). Shown with the prefill's
radix cache off (faultlab's ``prefill_freed_mid_send``): with it on, the request's pages are the tree's by then, and
a tree page freed under the tree is the radix path's concern (kvguard.sglang.radix).

Only this subpackage imports SGLang, and only inside functions.
"""
from __future__ import annotations

import logging
import math

from .runtime import guard_of

log = logging.getLogger("kvguard.sglang")

_DISAGG = "sglang.srt.disaggregation"
_QUEUE = f"{_DISAGG}.decode.DecodeTransferQueue"
_DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"


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


def after_commit_transfer(result, queue, decode_req, *args, **kwargs):
    """The transfer concluded (``KVPoll.Success``): every write of it landed. Stamp its ticket."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    from .runtime import stamp_transfer, transfer_ticket

    req = decode_req.req
    req.__dict__["kvguard_transfer_done"] = True  # its pages take no more writes from this transfer
    if _is_fake_transfer(req):  # the fake backend writes nothing; its writer (a test's) stamps
        return None
    stamp_transfer(queue.scheduler.token_to_kv_pool_allocator, transfer_ticket(req))
    return None


def around_defer_release(original, queue, decode_req, *args, **kwargs):
    """An aborted transfer's pages: held until the drain ack, never released by a timeout."""
    _require_deferred_release(queue)
    out = original(queue, decode_req, *args, **kwargs)
    entry = queue._deferred_releases[-1]
    assert entry[0] is decode_req, "SGLang's _defer_release did not append this request's entry last"
    req, start, _, idx, acks = entry
    queue._deferred_releases[-1] = (req, start, math.inf, idx, acks)  # released on the drain ack alone
    decode_req.req.__dict__["kvguard_transfer_held"] = True
    log.warning("kvguard: request %s's transfer (room %s) was aborted in flight: its destination is held until "
                "%d prefill rank(s) acked the drain (no timeout)", decode_req.req.rid, decode_req.req.bootstrap_room,
                acks)
    return out


def around_release_request(original, queue, decode_req, *args, **kwargs):
    """A destination goes back to the allocator only once no write of its transfer can land there."""
    req = decode_req.req
    ticket = req.__dict__.get("kvguard_transfer")
    if ticket is not None and not _concluded(queue, decode_req):
        message = (f"kvguard: the decode server released request {req.rid}'s transfer destination (room "
                   f"{req.bootstrap_room}) while its transfer was neither committed nor drained: a late write "
                   f"from it could land in the pages' next holder. Keep {_DEFERRED_ENV}=1 (SGLang's default).")
        log.critical(message)
        raise RuntimeError(message)
    return original(queue, decode_req, *args, **kwargs)


def _concluded(queue, decode_req) -> bool:
    """True when no write of ``decode_req``'s transfer can land any more."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    req, receiver = decode_req.req, decode_req.kv_receiver
    if _is_fake_transfer(req) or req.__dict__.get("kvguard_transfer_done"):
        return True
    if req.__dict__.get("kvguard_transfer_held"):  # held with no deadline: released once drained
        return True
    if receiver is None:
        return False
    # NOTE: a receiver that never published its destination (no bootstrap info, or its metadata never sent:
    # SGLang's init_time) has no prefill rank that could write there; one that did is held (above) or not released.
    return getattr(receiver, "bootstrap_infos", None) is None or getattr(receiver, "init_time", None) is None


def after_prealloc_queue_init(result, queue, *args, **kwargs):
    """At start: a real backend needs SGLang's deferred release, or an aborted transfer's pages go back at once."""
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.environ import envs

    deferred = envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
    if queue.transfer_backend != TransferBackend.FAKE and not deferred:
        _refuse_no_deferred_release()
    return None


def _require_deferred_release(queue) -> None:
    if not queue.enable_deferred_kv_release:
        _refuse_no_deferred_release()


def _refuse_no_deferred_release():
    message = (f"kvguard: {_DEFERRED_ENV}=0: an aborted transfer's destination would be freed while its writes may "
               f"still land; kvguard needs SGLang's default ({_DEFERRED_ENV}=1)")
    log.critical(message)
    raise RuntimeError(message)


def around_prefill_result(original, scheduler, batch, result, *args, **kwargs):
    """PD prefill: the extend check's verdict, read before SGLang sends any KV of the batch.

    A flagged request finishes through ``Req.discard_output_reason`` (SGLang's path for KV that never
    landed): ``process_batch_result_disagg_prefill`` aborts it instead of queueing its last chunk, its sender's
    room fails (so the decode side never gets ``Success`` for it; a router aborts it there) and the client sees
    the error. The send of a clean request reads the row checked here: nothing writes a row between this verdict
    and ``send_kv_chunk`` in the same call.
    """
    from .runtime import _flagged

    guard, flagged = _flagged(batch, result)
    if flagged:
        guard.discard(flagged)
    return original(scheduler, batch, result, *args, **kwargs)


_SENDING: dict = {}  # room -> (guard, req, [(first position, pages, their tags) per queued send]): PD prefill


def _send_range(req, page_size: int, args, kwargs) -> tuple[int, int]:
    """The row positions ``[start, end)`` that ``_send_kv_chunk(req, last_chunk, end_idx)`` sends (SGLang's own
    arithmetic: from ``req.start_send_idx``; a chunk before the last ends on a page boundary)."""
    last = args[0] if args else kwargs.get("last_chunk", False)
    end = args[1] if len(args) > 1 else kwargs.get("end_idx")
    end = min(int(req.extend_end), len(req.origin_input_ids)) if end is None else int(end)
    return int(req.start_send_idx), end if last else end - end % page_size


def around_send_kv_chunk(original, scheduler, req, *args, **kwargs):
    """PD prefill: the tags of the pages this send reads (its part of ``req``'s row), taken as SGLang queues it."""
    guard = guard_of(scheduler)
    row = req.kv.req_pool_idx
    if guard is not None and row is not None and req.bootstrap_room is not None:
        start, end = _send_range(req, int(guard.page_size), args, kwargs)
        if end > start:
            pages = guard.req_to_token_pool.req_to_token[int(row), start:end].long() // int(guard.page_size)
            if len(_SENDING) > 1024:  # rooms that never concluded (cleared first): their requests are released
                for stale in [r for r, v in list(_SENDING.items()) if v[1].kv.req_pool_idx is None]:
                    _SENDING.pop(stale, None)
            # each send keeps its own baseline (an early send of a cached prefix, chunks of a chunked prefill)
            sent = _SENDING.setdefault(int(req.bootstrap_room), (guard, req, []))
            sent[2].append((start, pages, guard.tracker.current_tags(pages).clone()))
    return original(scheduler, req, *args, **kwargs)


def around_conclude_transfer(original, manager, *args, **kwargs):
    """PD prefill: a room concludes ``Success`` only if none of its pages changed hands while its reads ran."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    room = kwargs.get("bootstrap_room")
    sent = _SENDING.pop(int(room), None) if room is not None else None
    if sent is None or kwargs.get("status") != KVPoll.Success:
        return original(manager, *args, **kwargs)
    import torch

    guard, req, sends = sent
    pages, tags = (torch.cat([send[i] for send in sends]) for i in (1, 2))
    if pages.is_cuda:
        torch.cuda.synchronize(pages.device)  # every free queued so far has bumped its pages' tags
    now = guard.tracker.current_tags(pages)
    moved = (now != tags).nonzero().flatten()
    if moved.numel():
        from ..violations import Violation
        from .aborts import mark_aborted

        at = int(moved[0])
        page, row = int(pages[at]), req.kv.req_pool_idx
        position = int(torch.cat([torch.arange(start, start + len(p)) for start, p, _ in sends])[at])
        message = (f"kvguard: request {req.rid} aborted: KV page {page} (position {position}) changed hands while its "
                   f"transfer (room {room}) read it (expected tag {int(tags[at])}, found tag {int(now[at])})")
        log.error(message)
        guard.tracker.report(Violation(request_id=str(req.rid), row=-1 if row is None else int(row),
                                       logical_position=position, page=page, expected_tag=int(tags[at]),
                                       found_tag=int(now[at]), reason="tag_mismatch", bad_entries=int(moved.numel())))
        mark_aborted(req)  # released as kvguard's aborts are: only the pages it still holds go back
        guard.tracker.note_aborted(1)
        kwargs.update(status=KVPoll.Failed, failure_reason=message)
    return original(manager, *args, **kwargs)


HOOKS = {
    "pd_pre_alloc": (f"{_DISAGG}.decode.DecodePreallocQueue._pre_alloc", _around_pd_pre_alloc, "AROUND"),
    "pd_prealloc_queue_init": (f"{_DISAGG}.decode.DecodePreallocQueue.__init__", after_prealloc_queue_init, "AFTER"),
    "pd_commit_transfer": (f"{_QUEUE}._commit_transfer_to_req", after_commit_transfer, "AFTER"),
    "pd_defer_release": (f"{_QUEUE}._defer_release", around_defer_release, "AROUND"),
    "pd_release_request": (f"{_QUEUE}._release_request", around_release_request, "AROUND"),
    "pd_prefill_result": (f"{_DISAGG}.prefill.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill",
                          around_prefill_result, "AROUND"),
    "pd_prefill_send": (f"{_DISAGG}.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk", around_send_kv_chunk,
                        "AROUND"),
    "pd_prefill_conclude": (f"{_DISAGG}.common.conn.CommonKVManager.conclude_transfer", around_conclude_transfer,
                            "AROUND"),
}
