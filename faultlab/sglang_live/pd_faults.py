"""PD over Mooncake or NIXL: a send held in flight, and a prefill-side mapping fault (test environment only).

Installed by faultlab's SGLang plugin (:func:`faultlab.sglang_live.inject.register`) in every SGLang process:

``FAULTLAB_SGLANG_PD_SLOW_SEND=<trigger path>:<seconds>``
    AROUND SGLang's ``MooncakeKVManager.send_kvcache`` and ``NixlKVManager.send_kvcache`` (the prefill transfer
    worker's write of one chunk into the decode server's pages; only the pair's backend runs): a send that starts
    while the trigger file exists removes it and waits, at most ``<seconds>``, for ``<trigger path>.go`` before
    SGLang's own send, then creates ``<trigger path>.landed``. A driver creates the trigger right before it sends one
    request, so that request's transfer is in flight long enough for the driver to abort it on the decode server:
    the write then lands after the abort, as a late write does.
``FAULTLAB_SGLANG_PD_LATE_LAND=<trigger path>:<late rid prefix>:<victim rid prefix>``
    On the decode server: the held write lands in pages decoding requests hold, in that order, not by timing.
    AFTER ``ScheduleBatch.prepare_for_decode``: each victim's first decode step logs ``victim_decoding`` (its own
    transfer has landed), and the first one merges SGLang's release list into its free list
    (``merge_and_sort_free``, which SGLang's PD allocator runs itself whenever its free list runs dry), so that from
    then on the release list holds the late request's slots alone. AFTER ``DecodePreallocQueue._pre_alloc`` the
    late request's destination slots are recorded. Until SGLang frees them (on its deferred-release timeout after
    the abort), each victim step is paced (:data:`PACE_S`), so the victims do not run the free list dry first. Once
    the allocator has handed :data:`GO_HITS` of them to victims, and the forward that wrote the victims' own K/V
    there has run, it creates ``<trigger path>.go`` and waits (the scheduler thread only; the transfer engine
    receives on threads of its own) for ``<trigger path>.landed``. The victims' next step reads the late K/V.
    ``inject`` line: ``late_transfer_landed``, its victims, their slots and output lengths at the landing.
``FAULTLAB_SGLANG_PD_PREFILL_SHIFT=<rid prefix>``
    ``prefill_index_shift`` on the prefill server: AFTER ``ScheduleBatch.prepare_for_extend`` (SGLang wrote the
    extend's row entries; kvguard's own AFTER hook, registered after faultlab's, checks them next), each request
    whose rid starts with the prefix gets the entry of its first extended position pointed at the slot of the
    next one, once. Its prefill then reads position p+1's K/V at p, and its send ships that slot at p: the
    decode server computes from a wrong prompt KV. Victim: that request (``inject`` line, ``victims``).
``FAULTLAB_SGLANG_PD_PREFILL_FREE=<trigger path>:<victim rid prefix>:<reuser rid prefix>``
    ``prefill_freed_mid_send`` on the prefill server (a prefill without a radix cache: the victim's pages are its own).
    AROUND ``_send_kv_chunk``: right after SGLang queued the victim's last chunk (its send held by
    ``FAULTLAB_SGLANG_PD_SLOW_SEND``), the page of its last prompt position is freed to the head of the allocator's
    free list, once, while its row still names it; the next request's prefill takes it and writes its own K/V there.
    When a reuser's chunk is queued (its forward ran), ``<trigger path>.go`` lets the held send read the victim's pages.
    ``inject`` line: the victim, its page; ``reuser_took``: whether the reuser's row holds that page.
"""
from __future__ import annotations

import os
import time

SLOW_ENV, SHIFT_ENV = "FAULTLAB_SGLANG_PD_SLOW_SEND", "FAULTLAB_SGLANG_PD_PREFILL_SHIFT"
LAND_ENV, FREE_ENV = "FAULTLAB_SGLANG_PD_LATE_LAND", "FAULTLAB_SGLANG_PD_PREFILL_FREE"
ENVS = (SLOW_ENV, SHIFT_ENV, LAND_ENV, FREE_ENV)
SEND_CHUNK = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk"
PREALLOC = "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc"
DECODE = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"
PACE_S, GO_HITS, LAND_WAIT_S = 0.25, 4, 60.0
SENDS = ("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache",
         "sglang.srt.disaggregation.nixl.conn.NixlKVManager.send_kvcache")
EXTEND = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"


def install(env) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if env.get(SLOW_ENV):
        hook = _slow_send(env[SLOW_ENV])
        for send in SENDS:
            HookRegistry.register(send, hook, HookType.AROUND)
    if env.get(SHIFT_ENV):
        HookRegistry.register(EXTEND, _prefill_shift(env[SHIFT_ENV]), HookType.AFTER)
    if env.get(FREE_ENV):
        HookRegistry.register(SEND_CHUNK, _PrefillFree(*env[FREE_ENV].rsplit(":", 2)).around_send, HookType.AROUND)
    if env.get(LAND_ENV):
        land = _LateLanding(*env[LAND_ENV].rsplit(":", 2))
        HookRegistry.register(PREALLOC, land.after_pre_alloc, HookType.AFTER)
        HookRegistry.register(DECODE, land.after_prepare_for_decode, HookType.AFTER)


def _slow_send(value: str):
    path, _, seconds = value.rpartition(":")
    delay = float(seconds)

    def around_send(original, manager, *args, **kwargs):
        try:
            os.remove(path)
        except FileNotFoundError:
            return original(manager, *args, **kwargs)
        _wait_for(path + ".go", delay)
        try:
            return original(manager, *args, **kwargs)
        finally:
            open(path + ".landed", "w").close()

    return around_send


def _prefill_shift(prefix: str):
    struck: set[str] = set()

    def after_prepare_for_extend(result, batch, *args, **kwargs):
        from .runtime import log

        table = batch.req_to_token_pool.req_to_token
        for req in batch.reqs:
            rid = str(req.rid)
            if not rid.startswith(prefix) or rid in struck or req.extend_end - req.prefix_len < 2:
                continue
            struck.add(rid)
            row, p = int(req.kv.req_pool_idx), int(req.prefix_len)
            old = int(table[row, p])
            table[row, p] = table[row, p + 1]
            log("inject", fault="prefill_index_shift", label=prefix, victims=[rid], row=row, position=p,
                slot=old, now=int(table[row, p]))
        return None

    return after_prepare_for_extend


def _wait_for(path: str, seconds: float) -> bool:
    """Poll until ``path`` exists (True) or ``seconds`` passed (False)."""
    deadline = time.time() + seconds
    while not os.path.exists(path):
        if time.time() >= deadline:
            return False
        time.sleep(0.01)
    return True


class _LateLanding:
    """The decode side of ``FAULTLAB_SGLANG_PD_LATE_LAND`` (module docstring)."""

    def __init__(self, trigger: str, late: str, victim: str):
        self.trigger, self.late, self.victim = trigger, late, victim
        self.dest, self.dest_set = None, set()  # the late request's destination slots, once preallocated
        self.decoding: set[str] = set()
        self.hits: dict[str, list[int]] = {}  # victim rid -> the destination slots it was given
        self.released = self.armed = self.done = False

    def after_pre_alloc(self, result, queue, req, *args, **kwargs):
        if self.dest is None and str(req.rid).startswith(self.late) and result is not None:
            from .runtime import log

            self.dest = result.detach().to("cpu", copy=True)
            slots = self.dest.tolist()
            self.dest_set = set(slots)
            log("late_destination", rid=str(req.rid), slots=slots)
        return None

    def after_prepare_for_decode(self, result, batch, *args, **kwargs):
        victims = [i for i, r in enumerate(batch.reqs) if str(r.rid).startswith(self.victim)]
        if self.done or not victims:
            return None
        import torch

        from .runtime import log

        allocator = batch.token_to_kv_pool_allocator
        for i in victims:
            rid = str(batch.reqs[i].rid)
            if rid not in self.decoding:
                if not self.decoding and getattr(allocator, "need_sort", False):
                    allocator.merge_and_sort_free()
                self.decoding.add(rid)
                log("victim_decoding", rid=rid)
        if self.armed:  # the forward that wrote the victims' K/V into the destination has run
            self._land(batch)
            return None
        locs = batch.out_cache_loc.to("cpu")[victims]  # the victims' slots of this step
        if not self.released:
            if self.dest is not None:  # freed: on the free lists, or handed to a victim by this step's alloc
                ps = int(allocator.page_size)
                free = torch.cat([p.to("cpu") for p in (allocator.free_pages, allocator.release_pages)
                                  if p is not None] + [locs // ps])
                self.released = bool(torch.isin(self.dest // ps, free).all())
            if not self.released:
                time.sleep(PACE_S)  # the abort and the deferred release are handled between steps
                return None
        for i, loc in zip(victims, locs.tolist()):
            if loc in self.dest_set:
                self.hits.setdefault(str(batch.reqs[i].rid), []).append(loc)
        self.armed = sum(map(len, self.hits.values())) >= GO_HITS
        return None

    def _land(self, batch) -> None:
        from .runtime import log

        self.done = True
        open(self.trigger + ".go", "w").close()
        landed = _wait_for(self.trigger + ".landed", LAND_WAIT_S)
        at = {str(r.rid): len(r.output_ids) for r in batch.reqs if str(r.rid) in self.hits}
        log("inject", fault="late_transfer_landed", victims=sorted(self.hits), slots=self.hits, landed=landed,
            output_len_at_landing=at)


class _PrefillFree:
    """The prefill side of ``FAULTLAB_SGLANG_PD_PREFILL_FREE`` (module docstring)."""

    def __init__(self, trigger: str, victim: str, reuser: str):
        self.trigger, self.victim, self.reuser = trigger, victim, reuser
        self.page: int | None = None

    def around_send(self, original, scheduler, req, *args, **kwargs):
        import torch

        from .runtime import log

        rid, table = str(req.rid), scheduler.req_to_token_pool.req_to_token
        allocator = scheduler.token_to_kv_pool_allocator
        ps, row = int(allocator.page_size), req.kv.req_pool_idx
        end = min(int(req.extend_end), len(req.origin_input_ids))
        if self.page is not None and rid.startswith(self.reuser) and row is not None:
            took = self.page in set((table[int(row), :end].long() // ps).tolist())
            log("reuser_took", rid=rid, page=self.page, took=took)
            open(self.trigger + ".go", "w").close()
        out = original(scheduler, req, *args, **kwargs)
        if self.page is None and rid.startswith(self.victim) and row is not None and end > 0:
            self.page = int(table[int(row), end - 1]) // ps
            allocator.free(torch.arange(self.page * ps, self.page * ps + ps, device=table.device))
            if getattr(allocator, "need_sort", False):  # SGLang stages frees until its free list runs dry
                allocator.merge_and_sort_free()
            free = allocator.free_pages  # page ids (slot ids at page size 1): the freed one first
            allocator.free_pages = torch.cat((free[free == self.page], free[free != self.page]))
            log("inject", fault="prefill_freed_mid_send", label=self.victim, victims=[rid], row=int(row),
                position=end - 1, page=self.page)
        return out
