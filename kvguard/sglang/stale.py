"""A request whose row is not its own never runs another step (SGLang 0.5.23): aborted before any decode step is
prepared, on both paths that prepare one.

A request's row is not its own when SGLang gave it to another request (a stale row: SGLang's row generation
tells, host side) or kvguard no longer follows it (released under the request, or never recorded for it):
:meth:`kvguard.sglang.follow.PoolFollower.stale_flags`. SGLang indexes more than the KV table by the batch's device
row indices. Each step it writes every request's sampled token into the overlap FutureMap's
``output_tokens_buf[row]``, from which the next step takes every request's input token; two requests on one row
make the owner's next input whichever token the duplicate-index write kept (measured on the H200: the owner decoded
a wrong token one or two steps later; on the CPU the later write wins).

SGLang prepares a decode step on two paths, and both first ask ``Scheduler._reqs_finishing_inflight`` which running
requests sit the step out, then filter the running batch (dropping finished requests) and call its
``prepare_for_decode``: ``Scheduler.update_running_batch`` (a decode step) and the mixed chunked-prefill step of
``Scheduler.get_new_batch_prefill`` (``enable_mixed_chunk``), which runs after the new prefill's rows were handed
out (where a row changes hands) and then mixes the prepared running batch into the prefill
(``ScheduleBatch.mix_with_running``). kvguard's hook there (:func:`around_reqs_finishing_inflight`) aborts every
request whose row is not its own (SGLang's prepare_abort, its error streamed, released without touching the row:
:mod:`kvguard.sglang.release`), and SGLang's own filter_batch right after drops it as finished. With attention TP
the ranks agree first (one small CPU all-reduce per batch composition and row-pool change), or they would prepare
different batches and hang.
"""
from __future__ import annotations

from . import runtime


def around_reqs_finishing_inflight(original, scheduler, batch, *args, **kwargs):
    """``Scheduler._reqs_finishing_inflight(batch)``: SGLang is about to filter ``batch`` and prepare its decode step
    (update_running_batch, or the mixed chunked-prefill step). Requests whose row is not their own are aborted
    first; SGLang's filter_batch drops them."""
    if not batch.reqs:  # (ScheduleBatch.is_empty)
        return original(scheduler, batch, *args, **kwargs)
    allocator = getattr(batch, "token_to_kv_pool_allocator", None)  # (runtime._guard_of_batch, inline: per step)
    guard = getattr(allocator, "_kvguard", None) if allocator is not None else runtime._guard_of_batch(batch)
    if guard is not None:
        group = None if runtime._ONE_RANK else (runtime._GROUP[0] if runtime._GROUP else runtime._attn_tp())[0]
        if group is not None or guard.stale_flags(batch)[1]:  # (the steady state on one rank: nothing stale)
            # NOTE (attention TP): the ranks agree once per batch composition and row-pool change
            # (SGLangGuard.stale_aborts). A row released under a request on one rank only (kvguard's known changes
            # on that rank alone) is then caught at this step's verdict instead, which every rank agrees on.
            stale = guard.stale_aborts(batch, group)
            if stale:
                guard.abort(stale, tree_cache=scheduler.tree_cache, stream=scheduler.output_streamer.stream_output)
    return original(scheduler, batch, *args, **kwargs)
