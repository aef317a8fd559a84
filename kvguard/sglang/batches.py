"""The plain (aggregated) extend and decode batches (SGLang 0.5.23): kvguard's hooks from allocation to result.

=================================================================  ======  ==================================
target (``sglang.srt.``)                                           type    what kvguard does there
=================================================================  ======  ==================================
``mem_cache.allocation.alloc_for_extend``                          AROUND  record each request's pages
``mem_cache.allocation.alloc_for_decode``                          AROUND  record decode growth pages; a
                                                                           stale request writes the padding
                                                                           row, never its old row; arm the
                                                                           decode check, guard its write slots
``mem_cache.common.release_kv_cache``                              AROUND  an aborted or retracted request
                                                                           frees only the pages it
                                                                           legitimately holds, never a row
                                                                           not its own (kvguard.sglang.release)
``managers.schedule_batch.ScheduleBatch.prepare_for_extend``       AFTER   check the extend batch, guard
                                                                           its write slots
``managers.schedule_batch.ScheduleBatch.copy``                     AFTER   carry the check (overlap)
``managers.schedule_batch.ScheduleBatch.mix_with_running``         AROUND  launch the decode part's check,
                                                                           carry it into the mixed batch
``...SchedulerBatchResultProcessor.process_batch_result_prefill``  AROUND  read verdict, discard flagged
``...SchedulerBatchResultProcessor.process_batch_result_decode``   AROUND  read verdict, abort flagged
``beam_search.coordinator.BeamCoordinator.validate_and_init``      AROUND  turn a beam-search request away
                                                                           (a path refused per request)
=================================================================  ======  ==================================

The decode check armed at ``alloc_for_decode`` is launched by the forward that runs the batch
(:mod:`kvguard.sglang.graphs`), or here, by ``mix_with_running``, for a mixed chunked-prefill batch.
:func:`record_alloc_for_decode` is not a hook: a benchmark calls it in ``alloc_for_decode``'s hook's place.

Only this subpackage imports SGLang, and only inside functions.
"""
from __future__ import annotations

import logging

import torch

from . import runtime
from .guard import PADDING_ROW
from .runtime import _PENDING, _flagged, _guard_of_batch, _still_in, guard_of, unchecked

log = logging.getLogger("kvguard.sglang")

_SRT = "sglang.srt"
_PROCESSOR = f"{_SRT}.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_BATCH = f"{_SRT}.managers.schedule_batch.ScheduleBatch"


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
    # Armed, not launched: the forward that runs the batch launches it (kvguard.sglang.graphs, the runners).
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
    # The step's new pages are bumped by its record launch below (one launch for both): PoolWraps.deferred_bump.
    with guard.deferred_bump():
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


# name -> (SGLang target, hook, HookRegistry type); composed into kvguard.sglang.plugin's TARGETS and hooks()
HOOKS = {
    "alloc_for_extend": (f"{_SRT}.mem_cache.allocation.alloc_for_extend", _around_alloc_for_extend, "AROUND"),
    "alloc_for_decode": (f"{_SRT}.mem_cache.allocation.alloc_for_decode", _around_alloc_for_decode, "AROUND"),
    "release_kv_cache": (f"{_SRT}.mem_cache.common.release_kv_cache", _around_release_kv_cache, "AROUND"),
    "prepare_for_extend": (f"{_BATCH}.prepare_for_extend", _after_prepare_for_extend, "AFTER"),
    "batch_copy": (f"{_BATCH}.copy", _after_batch_copy, "AFTER"),
    "mix_with_running": (f"{_BATCH}.mix_with_running", _around_mix_with_running, "AROUND"),
    "process_batch_result_prefill": (f"{_PROCESSOR}.process_batch_result_prefill",
                                     _around_process_batch_result_prefill, "AROUND"),
    "process_batch_result_decode": (f"{_PROCESSOR}.process_batch_result_decode",
                                    _around_process_batch_result_decode, "AROUND"),
    "beam_validate": (f"{_SRT}.beam_search.coordinator.BeamCoordinator.validate_and_init", _around_beam_validate,
                      "AROUND"),
}
