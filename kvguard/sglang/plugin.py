"""kvguard as an SGLang 0.5.23 general plugin: tag-versioned KV page checks on every decode step.

SGLang's loader (``sglang.srt.plugins.load_plugins``, run in every SGLang process) calls
:func:`register`. With ``KVGUARD_MODE=off`` (the default) it returns at once: no hook is registered and
SGLang runs exactly as shipped. With ``KVGUARD_MODE=check`` it registers these hooks with SGLang's
``HookRegistry`` (applied by the loader right after all plugins ran):

=============================================================  ======  ===========================
target                                                         type    what kvguard does there
=============================================================  ======  ===========================
``mem_cache.kv_cache_builder.build_kv_cache``                  AFTER   install on that pool set
``mem_cache.allocation.alloc_for_extend``                      AROUND  record each request's pages
``mem_cache.allocation.alloc_for_decode``                      AFTER   record decode growth pages
``managers.schedule_batch.ScheduleBatch.prepare_for_decode``   AFTER   launch the batched check
``managers.schedule_batch.ScheduleBatch.copy``                 AFTER   carry the check (overlap)
``SchedulerBatchResultProcessor.process_batch_result_decode``  AROUND  read verdict, abort flagged
``SchedulerBatchResultProcessor._handle_finish_state_updated_req``  AROUND  skip already-aborted
=============================================================  ======  ===========================

The install step wraps methods of the *instances* that ``build_kv_cache`` returned (the allocator, the
tree cache), so draft workers' pools and every other allocator in the process stay untouched; the
function hooks find the guard through ``allocator._kvguard`` and pass straight through when there is
none.

Only this subpackage imports SGLang, and only inside functions.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from ..settings import TrackerConfig
from ..tags import UNSET
from ..tracker import Check, TagTracker
from ..violations import KVGuardViolation

log = logging.getLogger("kvguard.sglang")

_SRT = "sglang.srt"
_PROCESSOR = f"{_SRT}.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
TARGETS = {
    "build_kv_cache": f"{_SRT}.mem_cache.kv_cache_builder.build_kv_cache",
    "alloc_for_extend": f"{_SRT}.mem_cache.allocation.alloc_for_extend",
    "alloc_for_decode": f"{_SRT}.mem_cache.allocation.alloc_for_decode",
    "prepare_for_decode": f"{_SRT}.managers.schedule_batch.ScheduleBatch.prepare_for_decode",
    "batch_copy": f"{_SRT}.managers.schedule_batch.ScheduleBatch.copy",
    "process_batch_result_decode": f"{_PROCESSOR}.process_batch_result_decode",
    "handle_finish": f"{_PROCESSOR}._handle_finish_state_updated_req",
}
ABORT_MESSAGE = "kvguard: KV page mapping broken"

_registered_config: TrackerConfig | None = None


# ------------------------------------------------------------------------------------------------
# Plugin entry
# ------------------------------------------------------------------------------------------------
def register(env: Mapping[str, str] | None = None) -> bool:
    """SGLang plugin entry point. Returns True when hooks were registered (``KVGUARD_MODE=check``).

    Idempotent: a second call in the same process registers nothing more.
    """
    global _registered_config
    config = TrackerConfig.from_env(env)
    if config.mode == "off":
        return False
    if _registered_config is not None:
        return True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _registered_config = config
    HookRegistry.register(TARGETS["build_kv_cache"], _after_build_kv_cache, HookType.AFTER)
    HookRegistry.register(TARGETS["alloc_for_extend"], _around_alloc_for_extend, HookType.AROUND)
    HookRegistry.register(TARGETS["alloc_for_decode"], _after_alloc_for_decode, HookType.AFTER)
    HookRegistry.register(TARGETS["prepare_for_decode"], _after_prepare_for_decode, HookType.AFTER)
    HookRegistry.register(TARGETS["batch_copy"], _after_batch_copy, HookType.AFTER)
    HookRegistry.register(TARGETS["process_batch_result_decode"], _around_process_batch_result_decode,
                          HookType.AROUND)
    HookRegistry.register(TARGETS["handle_finish"], _around_handle_finish, HookType.AROUND)
    log.info("kvguard: SGLang hooks registered (KVGUARD_MODE=check)")
    return True


def _after_build_kv_cache(result, *args, **kwargs):
    install(result.req_to_token_pool, result.token_to_kv_pool_allocator, result.tree_cache,
            config=_registered_config)
    return None  # keep SGLang's result as is


def install(req_to_token_pool, allocator, tree_cache, *, config: TrackerConfig | None = None,
            registry=None) -> "SGLangGuard | None":
    """Attach a guard to one pool set; None (and a warning) for allocators kvguard does not cover."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    if type(allocator) not in (PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator):
        log.warning("kvguard: allocator %s is not covered (paged / token allocators only); "
                    "kvguard stays off for this pool", type(allocator).__name__)
        return None
    if getattr(allocator, "_kvguard", None) is not None:
        return allocator._kvguard
    guard = SGLangGuard(req_to_token_pool, allocator, tree_cache,
                        config or TrackerConfig.from_env(mode="check"), registry=registry)
    allocator._kvguard = guard
    log.info("kvguard: installed on %s (page_size=%d, %d pages, %d rows)", type(allocator).__name__,
             guard.page_size, guard.num_pages, guard.num_rows)
    return guard


def _guard_of(batch) -> "SGLangGuard | None":
    allocator = getattr(batch, "token_to_kv_pool_allocator", None)
    if allocator is None and getattr(batch, "tree_cache", None) is not None:
        allocator = batch.tree_cache.token_to_kv_pool_allocator
    return getattr(allocator, "_kvguard", None)


# ------------------------------------------------------------------------------------------------
# The guard: one per (req_to_token pool, allocator) pair
# ------------------------------------------------------------------------------------------------
@dataclass
class Pending:
    """A launched check, carried on the ScheduleBatch until its result is processed."""

    guard: "SGLangGuard"
    check: Check
    reqs: list  # the Req objects, in batch order at check time
    verdict_host: torch.Tensor
    ready: Any  # a CUDA event for the async verdict copy, or None (already on the host)
    stale: list  # per request: its row now belongs to a newer owner (host-side generation check)


class SGLangGuard:
    """Bookkeeping hooks + the batched check for one SGLang scheduler's pools."""

    def __init__(self, req_to_token_pool, allocator, tree_cache, config: TrackerConfig, registry=None):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = ps = int(allocator.page_size)
        self.num_pages = int(getattr(allocator, "num_pages", allocator.size // ps))
        table = req_to_token_pool.req_to_token
        self.num_rows = table.shape[0]
        self.device = table.device
        # NOTE: quarantine is off. SGLang's req_to_token is a token-level table that the attention
        # backends, the radix tree and the PD transfer all read; rewriting entries would corrupt their
        # view. A bad entry aborts its request instead (the verdict path below).
        self.tracker = TagTracker(replace(config, mode="check", quarantine=False), registry)
        self.tracker.attach(num_pages=self.num_pages + 1, num_rows=self.num_rows,
                            max_entries=math.ceil(table.shape[1] / ps), device=self.device, page_size=ps)
        # Rows whose expectations kvguard recorded itself (host side, no sync to read). Rows filled by
        # paths kvguard does not follow (PD decode prealloc, dLLM reuse) are never checked: no false
        # positives from coverage gaps.
        self.known = torch.zeros(self.num_rows, dtype=torch.bool)
        self._warned: set[str] = set()
        self._paged = hasattr(allocator, "_release_page_ids")
        self._wrap_allocator()
        self._wrap_tree_cache()
        self._wrap_req_pool()

    # -- instance wrapping -----------------------------------------------------------------------
    def _wrap_allocator(self) -> None:
        a = self.allocator
        for name in ("alloc", "alloc_extend", "alloc_decode"):
            setattr(a, name, self._alloc_wrapper(getattr(a, name)))
        if self._paged:
            # NOTE: PagedTokenToKVPoolAllocator._release_page_ids is the one place where pages go back
            # to the free list in 0.5.23: free() (after its unique), free_page_ids(), free_segment()
            # (-> free_page_ids), free_group_end() (both its pending lists) and the need_sort staging
            # all end there. Bumping there counts each release once, and a free deferred by a free
            # group is bumped when the group ends, still before the next decode check.
            release = a._release_page_ids

            def _release_page_ids(*page_ids):
                for ids in page_ids:
                    self.tracker.on_free(ids)
                return release(*page_ids)

            a._release_page_ids = _release_page_ids
        else:
            # TokenToKVPoolAllocator (page_size 1): free() releases at once, or queues into an open
            # free group whose free_group_end() calls free() again with no group open.
            free = a.free

            def _free(free_index):
                if a.free_group is None and free_index.numel() > 0:
                    self.tracker.on_free(free_index)
                return free(free_index)

            a.free = _free

    def _staged(self) -> int:
        a = self.allocator
        if hasattr(a, "num_staged_pages"):
            return int(a.num_staged_pages)
        release = getattr(a, "release_pages", None)
        return 0 if release is None else len(release)

    def _alloc_wrapper(self, original: Callable) -> Callable:
        a, ps = self.allocator, self.page_size

        def alloc_wrapper(*args, **kwargs):
            before, staged = a.free_pages, self._staged()
            out = original(*args, **kwargs)
            if out is None:
                return out
            if staged == 0 or self._staged() == staged:
                # NOTE: every allocation path of 0.5.23 hands out a prefix of free_pages (alloc takes
                # free_pages[:k]; alloc_extend / alloc_decode run their kernel, then drop
                # free_pages[:num_new_pages]). The new pages are exactly that prefix, known from two
                # lengths on the host: no device sync. (In the output they are the slots with
                # out % page_size == 0.)
                pages = before[: len(before) - len(a.free_pages)]
            else:
                # merge_and_sort_free ran inside the call (need_sort, PD): free_pages was rebuilt.
                pages = out[out % ps == 0] // ps
            self.tracker.on_alloc(pages)
            return out

        alloc_wrapper.__wrapped__ = original
        return alloc_wrapper

    def _wrap_tree_cache(self) -> None:
        tree, ps = self.tree_cache, self.page_size
        if tree is None or not hasattr(tree, "checkpoint"):
            return
        checkpoint = tree.checkpoint

        def _checkpoint(req, *args, **kwargs):
            # NOTE: checkpoint() inserts the request's KV into the tree and repoints the request's own
            # row [cache_protected_len, new protected len) to the tree's copy (duplicates are freed,
            # i.e. bumped). The tree's pages are now what the request legitimately maps: re-record
            # exactly that span from the row the tree just wrote.
            old = req.kv.cache_protected_len
            result = checkpoint(req, *args, **kwargs)
            row, new = req.kv.req_pool_idx, req.kv.cache_protected_len
            if row is not None and new > old:
                first = old // ps
                pages = self.req_to_token_pool.req_to_token[row, first * ps:new:ps].long() // ps
                self.tracker.record(int(row), first, pages)
            return result

        tree.checkpoint = _checkpoint

    def _wrap_req_pool(self) -> None:
        pool = self.req_to_token_pool
        if not hasattr(pool, "free_rows"):
            return
        free_rows = pool.free_rows

        def _free_rows(indices):
            for row in indices:
                self.drop(int(row))
            return free_rows(indices)

        pool.free_rows = _free_rows

    # -- recording ---------------------------------------------------------------------------------
    def drop(self, row: int) -> None:
        self.tracker.drop(row)
        self.known[row] = False

    def record_extend(self, batch, out_cache_loc, rows_cpu, held: list[bool]) -> None:
        """After alloc_for_extend: each request's row maps prefix pages + the pages just allocated."""
        ps, table = self.page_size, self.req_to_token_pool.req_to_token
        offset = 0
        seq_lens = batch.seq_lens_cpu.tolist()
        gens = getattr(self.req_to_token_pool, "req_generation", None)
        for i, (row, prefix_len, seq_len) in enumerate(zip(rows_cpu.tolist(), batch.prefix_lens, seq_lens)):
            first_new = -(-prefix_len // ps)
            if not held[i]:
                # SGLang's own row-reuse tag (ReqToTokenPool.req_generation, bumped in alloc_rows): a
                # request that is still scheduled after its row went to somebody else is stale.
                if gens is not None:
                    batch.reqs[i].kvguard_row_generation = int(gens[row])
                # A fresh row: its prefix pages come from the tree's match, which alloc_for_extend has
                # just written into the row (on GPU by a Triton kernel, hence read back here).
                self.tracker.drop(row)
                if first_new > 0:
                    self.tracker.record(row, 0, table[row, 0:first_new * ps:ps].long() // ps)
            # else: the row already held KV (chunked prefill, session): its prefix entries were
            # recorded when they were allocated and must NOT be refreshed from the table.
            last = -(-seq_len // ps)
            if last > first_new:
                idx = offset + torch.arange(first_new, last, device=out_cache_loc.device) * ps - prefix_len
                self.tracker.record(row, first_new, out_cache_loc[idx].long() // ps)
            offset += seq_len - prefix_len
            self.known[row] = True

    def record_decode(self, batch, out_cache_loc) -> None:
        """After alloc_for_decode (one token per request): record the entries that got a new page."""
        ps, exp = self.page_size, self.tracker.expected
        rows = batch.req_pool_indices.long()
        pos = batch.seq_lens.long()  # the position being written (seq_lens is incremented afterwards)
        cols = torch.div(pos, ps, rounding_mode="floor")
        fresh = self.tracker.tags.gather(out_cache_loc.long() // ps)
        # Continuation slots (pos % ps != 0) stay in an already-recorded page: keep that expectation,
        # never refresh it from the table (that would launder a swapped or freed entry).
        exp[rows, cols] = torch.where(pos % ps == 0, fresh, exp[rows, cols])

    # -- the check -----------------------------------------------------------------------------------
    def launch(self, batch) -> Pending | None:
        """Right before the forward: one batched validation of every request's live pages, no sync."""
        ps = self.page_size
        rows_cpu = batch.req_pool_indices_cpu
        if rows_cpu is None:
            rows_cpu = batch.req_pool_indices.cpu()
        known = self.known[rows_cpu.long()]
        n_cpu = torch.where(known, (batch.seq_lens_cpu + ps - 1) // ps, 0)
        max_entries = int(n_cpu.max()) if n_cpu.numel() else 0
        if max_entries == 0:
            return None
        gens = getattr(self.req_to_token_pool, "req_generation", None)
        if gens is not None:
            now = gens[rows_cpu.long()].tolist()
            stale = [getattr(req, "kvguard_row_generation", g) != g for req, g in zip(batch.reqs, now)]
        else:
            stale = [False] * len(batch.reqs)
        rows = batch.req_pool_indices
        on_cuda = rows.device.type == "cuda"
        n_entries = n_cpu.to(rows.device, non_blocking=on_cuda)
        check = self.tracker.validate(self.req_to_token_pool.req_to_token, rows, n_entries,
                                      max_entries=max_entries, table_rows=rows, entry_step=ps,
                                      page_div=ps, entries_hint=int(n_cpu.sum()))
        if on_cuda:
            host = torch.empty(check.verdict.shape, dtype=check.verdict.dtype, pin_memory=True)
            host.copy_(check.verdict, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = check.verdict, None
        pending = Pending(self, check, list(batch.reqs), host, ready, stale)
        batch._kvguard = pending
        return pending

    def resolve(self, pending: Pending, group=None) -> list[tuple[Any, str, bool]]:
        """Read the verdict (with the sampled ids); agree across TP ranks; (req, message, stale)."""
        if pending.ready is not None:
            pending.ready.synchronize()
        rids = [str(req.rid) for req in pending.reqs]
        found = {err.request_id: err for err in self.tracker.resolve(pending.check, pending.verdict_host, rids)}
        flags = [1 if rid in found or stale else 0 for rid, stale in zip(rids, pending.stale)]
        flags = _all_reduce_max(flags, group)
        out = []
        for req, rid, flag, stale in zip(pending.reqs, rids, flags, pending.stale):
            if not flag:
                continue
            err: KVGuardViolation | None = found.get(rid)
            if err is not None:
                message = str(err)
            elif stale:
                message = (f"kvguard: request {rid} aborted: its req_to_token row "
                           f"{req.kv.req_pool_idx} was reallocated to another request (stale row)")
                self.tracker.metrics.violations.labels(reason="stale_row").inc()
            else:
                message = f"{ABORT_MESSAGE} on a peer tensor-parallel rank (request {rid})"
            out.append((req, message, bool(stale)))
        return out

    def abort(self, flagged, *, tree_cache, stream: Callable[[list, bool], Any] | None) -> list:
        """SGLang's own per-request abort (the _handle_kv_checksum_mismatch template)."""
        from http import HTTPStatus

        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.mem_cache.common import release_kv_cache

        aborted = []
        for req, message, stale in flagged:
            if req.finished() or (not stale and not req.kv.holds_kv):
                continue  # overlap: finished/retracted requests reappear for one tick
            log.error(message)
            prepare_abort(req, message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
            req.skip_radix_cache_insert = True  # never publish this KV to the radix tree
            req.kvguard_aborted = True
            if stream is not None:
                stream([req], req.return_logprob)
            if not stale:
                release_kv_cache(req, tree_cache, checkpoint=False)
            # else: the row and its pages belong to their new owner; releasing them would free its KV
            aborted.append(req)
        if aborted:
            self.tracker.note_aborted(len(aborted))
        return aborted

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


def _all_reduce_max(flags: list[int], group) -> list[int]:
    """Every TP rank must drop the same requests, or the ranks run different batches and hang."""
    if group is None or not flags:
        return flags
    from sglang.srt.disaggregation.utils import all_reduce_flags

    return all_reduce_flags(flags, group, torch.distributed.ReduceOp.MAX)


def _attn_tp_cpu_group():
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        return get_attn_tp_group().cpu_group
    except Exception:  # no attention-TP group in this process
        return None


# ------------------------------------------------------------------------------------------------
# Hook bodies (module level so HookRegistry can name them in its logs)
# ------------------------------------------------------------------------------------------------
def _around_alloc_for_extend(original, batch, *args, **kwargs):
    guard = _guard_of(batch)
    if guard is None:
        return original(batch, *args, **kwargs)
    held = [req.kv.holds_kv for req in batch.reqs]
    result = original(batch, *args, **kwargs)
    out_cache_loc, _, rows_cpu = result
    # NOTE: this is where a request's row gets its pages, and the only place that knows which of the
    # allocator's output slots belong to which request. On GPU the row is written by a Triton kernel
    # (write_cache_indices) that bypasses ReqToTokenPool.write, so hooking write() would miss it; we
    # record from the allocator's output (new pages) and from the tree's match (prefix), not from a
    # later read of the table, which would accept whatever corruption happened in between.
    if batch.is_dllm():
        guard.warn_once("dllm", "kvguard: dLLM batches are not followed; their rows are not checked")
        guard.known[rows_cpu.long()] = False
        return result
    guard.record_extend(batch, out_cache_loc, rows_cpu, held)
    return result


def _after_alloc_for_decode(out_cache_loc, batch, token_per_req=1, *args, **kwargs):
    guard = _guard_of(batch)
    if guard is None:
        return None
    if token_per_req != 1 or batch.model_config.is_encoder_decoder:
        guard.warn_once("decode_shape", "kvguard: multi-token / encoder-decoder decode is not followed")
        guard.known[batch.req_pool_indices_cpu.long()] = False
        return None
    guard.record_decode(batch, out_cache_loc)
    return None


def _after_prepare_for_decode(result, batch, *args, **kwargs):
    guard = _guard_of(batch)
    if guard is None or batch.is_empty():
        return None
    batch._kvguard = None
    if not batch.spec_algorithm.is_none():
        guard.warn_once("spec", "kvguard: speculative decoding is not checked (spec_prepare_for_decode)")
        return None
    guard.launch(batch)
    return None


def _after_batch_copy(copy, batch, *args, **kwargs):
    pending = batch.__dict__.get("_kvguard")
    if pending is not None:
        copy._kvguard = pending
    return None


def _around_process_batch_result_decode(original, processor, batch, result, *args, **kwargs):
    pending = batch.__dict__.pop("_kvguard", None)
    if pending is not None:
        # NOTE: read here, before SGLang commits and streams this step's tokens: the verdict was computed
        # before the forward and copied to the host asynchronously, so reading it costs no extra wait
        # beside the sampled ids SGLang is about to read. Flagged requests are aborted through SGLang's
        # per-request path and finished; the original loop below then skips them (overlap: finished
        # requests are skipped; non-overlap: _around_handle_finish), none of their tokens from this step
        # is streamed (finished_output is set), and update_running_batch's filter_batch() drops them
        # from the running batch, as for any finished request.
        flagged = pending.guard.resolve(pending, _attn_tp_cpu_group())
        if flagged:
            in_batch = {id(req) for req in batch.reqs}
            flagged = [item for item in flagged if id(item[0]) in in_batch]
            pending.guard.abort(flagged, tree_cache=processor.tree_cache,
                                stream=processor.output_streamer.stream_output)
    return original(processor, batch, result, *args, **kwargs)


def _around_handle_finish(original, processor, req, *args, **kwargs):
    if getattr(req, "kvguard_aborted", False):
        return None  # already released and streamed by kvguard's abort
    return original(processor, req, *args, **kwargs)


def expected_row(guard: SGLangGuard, row: int) -> torch.Tensor:
    """The expected tags of one row, up to its last recorded entry (diagnostics and tests)."""
    exp = guard.tracker.expected[row]
    live = (exp != UNSET).nonzero().flatten()
    return exp[: int(live[-1]) + 1] if live.numel() else exp[:0]
