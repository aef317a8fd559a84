"""Speculative decoding (SGLang 0.5.23's spec v2 worker, chain drafting): kvguard's hooks, records and check.

What SGLang does each spec decode step (``ScheduleBatch.prepare_for_decode`` -> ``eagle_prepare_for_decode``):
``alloc_for_spec_decode`` reserves the slots ``[kv_allocated_len, nxt)`` of each request, ``nxt`` =
``ceil_page(kv_committed_len + 2 * per-step)`` (the 2x absorbs the overlap scheduler's one-step lag of
``kv_committed_len``), and writes them into its ``req_to_token`` row. Then ``EAGLEWorkerV2.forward_batch_generation``
runs the draft forwards (draft model, its own KV pool, the same slot ids), the target-verify forward and the draft
extend over the accepted tokens; every one reads ``req_to_token[row, :seq + draft tokens]``, inside ``[0, nxt)``,
and writes the KV of the step's draft and verify tokens at slots read from that row. Rejected tokens' slots stay
reserved (overwritten next step); what lies past the committed length is freed when the request is released
(``_release_overallocated_kv_indices``), through the allocator's release path kvguard wraps (tags bumped:
:class:`kvguard.sglang.follow.PoolFollower`).

=========================================================================  ======  ==================================
target                                                                     type    what kvguard does there
=========================================================================  ======  ==================================
``mem_cache.allocation.alloc_for_spec_decode``                              AROUND  record the reserved region from the
                                                                                   allocator's output, with its tags;
                                                                                   arm the step's check
``speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation``      AROUND  launch the armed check before the
                                                                                   step's first forward (the draft)
=========================================================================  ======  ==================================

**The check.** One batched launch of the tag check per spec step, right before the step's first forward: every
entry ``[0, nxt)`` of each request's row (all the draft, verify and draft-extend forwards of the step read; rows are
not written between them) must name the page recorded for it, with its tag. One check of the rows covers both
pools: the draft pool is indexed by the same slot ids. The same launch rewrites a flagged request's row entries
``[seq_lens, nxt)`` to SGLang's padding slot (the write guard over ``req_to_token`` itself: the step's draft, verify
and draft-extend writes are addressed through those entries), so its forwards write no other request's KV. NOTE:
the violation message is read from the row after that rewrite, so it names the first rewritten entry (page 0) when
the broken entry lies in ``[seq_lens, nxt)``; the request and the verdict are right, the position may not be.

On a sliding-window hybrid (:mod:`kvguard.sglang.swa`) a second launch follows, into the same verdict, with the same
write guard: every position the step's sliding-window layers (target and draft) read, ``[seq_lens - window, nxt)``,
must map through ``full_to_swa_index_mapping`` to the SWA slot the allocator paired with its full slot, whose page
still carries the tag it had then (:meth:`SWASide.check <kvguard.sglang.swa.SWASide.check>`). The reserve's pairs
are recorded where every pairing is: ``alloc_for_spec_decode`` allocates through the composite allocator's
``alloc`` / ``alloc_extend``, which pair through ``set_full_to_swa_mapping``. On a hybrid linear-attention / mamba
model the step's recurrent-state check follows, and its commit is guarded (:mod:`kvguard.sglang.mamba_spec`).

The verdict is read where SGLang's result processing reads the sampled ids, before any of the step's tokens are
committed or streamed (``batches._around_process_batch_result_decode``), and flagged requests are aborted through
``SGLangGuard.abort`` (SGLang's own per-request abort, kvguard's safe release). A spec batch that reached its result
without its check (a worker class not hooked here) stops the scheduler (``SGLangGuard.resolve``).

Only chain drafting (``speculative_eagle_topk`` 1) of the algorithms in :data:`CHECKED_ALGORITHMS` is checked; the
registry (:mod:`kvguard.sglang.paths`) refuses the rest at start, and :func:`refusal_now` again at each step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.tag_check import WriteGuard
from . import mamba_spec
from .guard import PADDING_ROW, SCRATCH_SLOT, SMALL, Pending, max_and_sum
from .paths import SPEC_CHECKED as CHECKED_ALGORITHMS  # noqa: F401  (the registry holds the list; re-exported)

log = logging.getLogger("kvguard.sglang")


@dataclass(slots=True)
class SpecStep:
    """A spec step's check, armed at its allocation and launched by its forward (:func:`fire`)."""

    n_entries: torch.Tensor  # [B] device: each request's nxt (entries [0, nxt) are read and checked)
    max_entries: int
    total: int
    rows_: object  # the composition's rows (SGLangGuard.batch_rows): what fire's bound launch is bound to
    agreement: object = None  # attention TP's VerdictAgreement, or None (one rank)


def refusal_now() -> str | None:
    """The registry's path name for this process's spec configuration if kvguard does not check it (else None).
    Read once per process (SGLang's resolved spec settings do not change while serving)."""
    if _REFUSAL:
        return _REFUSAL[0]
    from sglang.srt.runtime_context import get_spec

    from .paths import Facts, active

    spec = get_spec()
    algorithm = spec.speculative_algorithm
    facts = Facts(speculative_algorithm=str(getattr(algorithm, "name", algorithm)),
                  spec_topk=int(spec.speculative_eagle_topk or 1),
                  spec_multi_layer=bool(getattr(spec, "enable_multi_layer_eagle", False)))
    refused = [p.name for p in active(facts) if p.status == "refused"]
    _REFUSAL.append(refused[0] if refused else None)
    return _REFUSAL[0]


_REFUSAL: list = []


def around_alloc_for_spec_decode(original, tree_cache, req_to_token_pool, *, reqs, req_pool_indices, cur_kv_lens,
                                 cur_kv_lens_cpu, nxt_kv_lens, nxt_kv_lens_cpu, num_needed_tokens, batch=None,
                                 **kwargs):
    guard = getattr(tree_cache.token_to_kv_pool_allocator, "_kvguard", None)
    call = dict(reqs=reqs, req_pool_indices=req_pool_indices, cur_kv_lens=cur_kv_lens,
                cur_kv_lens_cpu=cur_kv_lens_cpu, nxt_kv_lens=nxt_kv_lens, nxt_kv_lens_cpu=nxt_kv_lens_cpu,
                num_needed_tokens=num_needed_tokens, batch=batch, **kwargs)
    if guard is None:
        return original(tree_cache, req_to_token_pool, **call)
    from .runtime import unchecked

    refused = refusal_now()
    if refused is not None or batch is None or batch.reqs is not reqs:
        raise unchecked(refused or "speculative_other_algorithms")
    batch._kvguard = None
    stale, any_stale = guard.stale_flags(batch)
    if any_stale:
        # A backstop (kvguard.sglang.stale aborts such requests before the step is prepared): a request whose row is
        # not its own gets SGLang's padding row for this step, so that neither this allocation nor its forwards
        # write into the row's new owner's entries; it is aborted at this step's verdict.
        batch.req_pool_indices = call["req_pool_indices"] = torch.where(
            guard.to_device(stale, torch.bool), PADDING_ROW, req_pool_indices)
    if num_needed_tokens > 0:
        with guard.deferred_bump():  # the reserve's pages are bumped by its record launch
            out = _allocated(guard, original, tree_cache, req_to_token_pool, call)
            if any_stale or out is None or not record_reserve(guard, batch, out, cur_kv_lens, nxt_kv_lens,
                                                              cur_kv_lens_cpu, nxt_kv_lens_cpu):
                guard.flush_alloc()  # (the general record below reads the new pages' tags)
                record(guard, batch, out, cur_kv_lens_cpu, nxt_kv_lens_cpu, stale if any_stale else None)
    else:  # nothing to reserve this step (SGLang's call only updates lengths)
        original(tree_cache, req_to_token_pool, **call)
    if reqs:
        arm(guard, batch, nxt_kv_lens, nxt_kv_lens_cpu, stale, any_stale)
    return None


def _allocated(guard, original, tree_cache, req_to_token_pool, call) -> torch.Tensor | None:
    """SGLang's ``alloc_for_spec_decode``, and the slots its one allocation handed out (allocation order), or None
    when it did not allocate exactly once (its new entries then expect nothing: flagged, never guessed).

    NOTE: the slots are taken from the allocator's own output (``alloc`` at page size 1, ``alloc_extend`` past it),
    not read back from the rows SGLang then writes: a wrong write would be laundered into the expectation."""
    a, got = guard.allocator, []

    def capture(fn):
        def allocation(*args, **kwargs):
            out = fn(*args, **kwargs)
            got.append(out)
            return out
        return allocation

    saved = a.alloc, a.alloc_extend
    a.alloc, a.alloc_extend = capture(saved[0]), capture(saved[1])
    guard._fresh = None  # set by the allocation's wrapper (kvguard.sglang.follow): the new pages' tags
    try:
        original(tree_cache, req_to_token_pool, **call)
    finally:
        a.alloc, a.alloc_extend = saved
    if len(got) != 1 or got[0] is None:
        log.error("kvguard: a spec step made %d allocations where one was expected; its reserved entries expect "
                  "nothing and are flagged", len(got))
        return None
    return got[0]


def record_reserve(guard, batch, out, cur, nxt, cur_cpu, nxt_cpu) -> bool:
    """The common case of :func:`record` in one launch (False: not the common case, nothing done).

    Every reserved token of request ``i`` (positions ``cur_i..nxt_i - 1``, slots ``out`` in that order, what
    ``assign_req_to_token_pool`` writes) is one entry of SGLang's decode recorder: an entry whose position starts a
    page got the allocation's next page (batch order), which the same launch bumps (``kvguard.kernels.record``). The
    launch reads the step's device lengths ``cur``/``nxt`` (SGLang's own): the host lengths only decide whether the
    allocation is what the rows took."""
    rows_, ps = guard.batch_rows(batch), guard.page_size
    pending, fresh = guard._pending_alloc, guard._fresh
    handed_out = pending[1] if pending is not None else 0 if fresh is None else fresh.numel()
    n_tokens, n_new = _reserved(cur_cpu, nxt_cpu, ps)
    if not rows_.all_known or out.numel() != n_tokens or n_new != handed_out \
            or cur.device != out.device or nxt.device != out.device:
        return False  # (an allocation not what the rows took: the general record flags it, never guesses)
    if n_new == 0:
        return True  # the reserve stays inside each request's last page: nothing new to expect
    guard._pending_alloc = None
    alloc, n_alloc = pending if pending is not None else (None, None)
    guard.tracker.record_reserve(rows_.owner_dev, cur, nxt, out, fresh=None if alloc is not None else fresh,
                                 alloc=alloc, n_alloc=n_alloc)
    return True


def _reserved(cur_cpu, nxt_cpu, ps: int) -> tuple[int, int]:
    """(positions reserved, positions that start a page) over the batch, from the host lengths: Python lists up to
    SMALL requests (as :func:`kvguard.sglang.guard.max_and_sum`), numpy past that."""
    if cur_cpu.numel() <= SMALL:
        c, n = cur_cpu.tolist(), nxt_cpu.tolist()
        return sum(n) - sum(c), sum([(b + ps - 1) // ps - (a + ps - 1) // ps for a, b in zip(c, n)])
    c, n = cur_cpu.numpy(), nxt_cpu.numpy()
    return int(np.add.reduce(n - c)), int(np.add.reduce((n + ps - 1) // ps - (c + ps - 1) // ps))


def record(guard, batch, out, cur_cpu, nxt_cpu, stale) -> None:
    """Each request's row maps the pages just reserved at logical pages ``[ceil(cur/ps), ceil(nxt/ps))``.

    ``out``: the allocation's slots, request ``i``'s tokens ``cur_i..nxt_i`` in batch order (what
    ``assign_req_to_token_pool`` writes into the rows); the k-th new page (batch order) got the allocation's k-th tag.
    One vectorised record (``TagTracker.record_many``); its indices are built from host lengths (no device sync)."""
    ps = guard.page_size
    cur, nxt = cur_cpu.long(), nxt_cpu.long()
    first, last = (cur + ps - 1) // ps, (nxt + ps - 1) // ps
    n_new = last - first  # [B] new pages of each request
    total = int(n_new.sum())
    if total == 0:
        return
    seg = nxt - cur
    fresh = guard._fresh_for(total)  # UNSET (flagged at the check) when the allocation is not what the rows took
    k = torch.arange(total) - torch.repeat_interleave(torch.cumsum(n_new, 0) - n_new, n_new)  # page k of its request
    cols = torch.repeat_interleave(first, n_new) + k  # its logical page
    idx = torch.repeat_interleave(torch.cumsum(seg, 0) - seg + first * ps - cur, n_new) + k * ps  # its slot in out
    rows = torch.repeat_interleave(guard.batch_rows(batch).owner, n_new)
    if out is None:
        pages = torch.zeros(total, dtype=torch.int64, device=guard.device)
    else:
        pages = out[guard.to_device(idx.tolist(), torch.int64) if ps > 1 or out.numel() != total else
                    slice(None)].long() // ps
    keep = rows >= 0
    if stale is not None:
        req_of = torch.repeat_interleave(torch.arange(len(batch.reqs)), n_new)
        mine = torch.tensor(stale)[req_of]
        keep &= ~mine
        _note_stale_pages(batch, pages, fresh, req_of, mine)
    if not bool(keep.all()):  # (rare: a stale request, a row kvguard does not follow)
        sel = keep.nonzero().flatten()
        sel_dev = guard.to_device(sel.tolist(), torch.int64)
        rows, cols, pages, fresh = rows[sel], cols[sel], pages[sel_dev], fresh[sel_dev]
    if rows.numel():
        guard.tracker.record_many(rows, cols, pages, tags=fresh)


def _note_stale_pages(batch, pages, fresh, req_of, mine) -> None:
    """A stale request's new pages are its own: given back when it is aborted (``release_stale``). Rare path."""
    pages, tags = pages.tolist(), fresh.tolist()
    for j in mine.nonzero().flatten().tolist():
        req = batch.reqs[int(req_of[j])]
        req.__dict__.setdefault("kvguard_extra_pages", []).append((int(pages[j]), int(tags[j])))


def arm(guard, batch, nxt, nxt_cpu, stale, any_stale) -> Pending:
    """The step's check, armed on the batch (``batch._kvguard``, carried by its copies); :func:`fire` launches it."""
    from . import runtime

    rows_ = guard.batch_rows(batch)
    longest, total = max_and_sum(nxt_cpu)
    step = SpecStep(nxt, longest, total, rows_,
                    None if runtime._ONE_RANK else (runtime._GROUP[0] if runtime._GROUP else runtime._attn_tp())[1])
    # (positional: Pending's fields in order; ``batch`` holds the armed step until it is launched)
    pending = Pending(guard, None, rows_.snapshot, -1, 0, stale, None, None, rows_.owner_dev,
                      batch.req_pool_indices, None, step, None, any_stale)
    batch._kvguard = pending
    return pending


def fire(pending: Pending, seq_lens: torch.Tensor) -> None:
    """Launch an armed spec step's check now, before the step's first forward (on the stream it runs on);
    ``seq_lens``: the batch's committed lengths as the forward reads them (device)."""
    step, pending.batch = pending.batch, None
    guard = pending.guard
    ring = guard._ring or guard._make_ring()
    slot, stamp = ring.next()
    n = len(pending.reqs)
    rows = pending.table_rows
    # The step's writes (draft, verify, draft extend) land at the slots of entries [seq_lens, nxt) of each row:
    # SGLang's own base for them. The launch rewrites a flagged request's entries there to the padding slot
    # (WriteGuard.row_tail: no tensor built per step).
    # (cached on the guard: one spec composition at a time)
    bound = guard.bound(guard, step.rows_, ring, rows, step.n_entries.dtype, seq_lens.dtype, tail=True)
    with guard.tracker.lock:
        pending.cells = bound(slot, rows, step.n_entries, seq_lens, step.max_entries, stamp)
        if guard.swa is not None:  # a sliding-window hybrid: the window the step's SWA layers read, into the same
            # verdict (q = nxt - seq_lens: the step's query positions [seq_lens, nxt) read back to seq_lens - window)
            table = guard.req_to_token_pool.req_to_token
            q = step.n_entries - seq_lens
            write_guard = WriteGuard(table.view(-1), torch.add(seq_lens, rows, alpha=table.shape[1]), q,
                                     scratch=SCRATCH_SLOT)
            guard.swa.check(rows, step.n_entries, ring.buffers()[slot][:pending.cells].view(n, -1), q=q,
                            guard=write_guard, flag=ring.flag_cells[slot], stamp=stamp)
    guard.tracker.count_check(step.total)
    side = mamba_spec.launch(pending, rows, step.agreement)  # a hybrid model's recurrent-state check, beside it
    if step.agreement is not None:
        pending.agreed = ring.agree(slot, pending.cells, n,
                                    pending.stale if pending.any_stale else None, step.agreement, side)
    ring.copy_flag(slot)
    pending.slot, pending.stamp = slot, stamp
    pending.ready = ring.record(slot) if ring.use_events else None


def around_spec_forward(original, worker, batch, *args, **kwargs):
    # NOTE: the step's first forward (the draft) runs inside this call, after SGLang prepared the step: the check
    # sees the rows as every forward of the step reads them, and is on the stream before them.
    pending = batch.__dict__.get("_kvguard") if batch is not None else None
    if pending is not None and isinstance(pending.batch, SpecStep):
        fire(pending, batch.seq_lens)
    return original(worker, batch, *args, **kwargs)


_SRT = "sglang.srt"
HOOKS = {  # name: (SGLang target, kvguard's hook, HookRegistry type); composed into kvguard.sglang.plugin's table
    "alloc_for_spec_decode": (f"{_SRT}.mem_cache.allocation.alloc_for_spec_decode", around_alloc_for_spec_decode,
                              "AROUND"),
    "spec_forward": (f"{_SRT}.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation",
                     around_spec_forward, "AROUND"),
}
