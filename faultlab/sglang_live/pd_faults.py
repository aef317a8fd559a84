"""PD over Mooncake or NIXL: a send held in flight, and a prefill-side mapping fault (test environment only).

Installed by faultlab's SGLang plugin (:func:`faultlab.sglang_live.inject.register`) in every SGLang process:

``FAULTLAB_SGLANG_PD_SLOW_SEND=<trigger path>:<seconds>``
    AROUND SGLang's ``MooncakeKVManager.send_kvcache`` and ``NixlKVManager.send_kvcache`` (the prefill transfer
    worker's write of one chunk into the decode server's pages; only the pair's backend runs): a send that starts
    while the trigger file exists removes it and waits ``<seconds>`` before SGLang's own send. A driver creates
    the file right before it sends one request, so that request's transfer is in flight long enough for the
    driver to abort it on the decode server: the write then lands after the abort, as a late write does.
``FAULTLAB_SGLANG_PD_PREFILL_SHIFT=<rid prefix>``
    ``prefill_index_shift`` on the prefill server: AFTER ``ScheduleBatch.prepare_for_extend`` (SGLang wrote the
    extend's row entries; kvguard's own AFTER hook, registered after faultlab's, checks them next), each request
    whose rid starts with the prefix gets the entry of its first extended position pointed at the slot of the
    next one, once. Its prefill then reads position p+1's K/V at p, and its send ships that slot at p: the
    decode server computes from a wrong prompt KV. Victim: that request (``inject`` line, ``victims``).
"""
from __future__ import annotations

import os
import time

SLOW_ENV, SHIFT_ENV = "FAULTLAB_SGLANG_PD_SLOW_SEND", "FAULTLAB_SGLANG_PD_PREFILL_SHIFT"
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


def _slow_send(value: str):
    path, _, seconds = value.rpartition(":")
    delay = float(seconds)

    def around_send(original, manager, *args, **kwargs):
        try:
            os.remove(path)
        except FileNotFoundError:
            return original(manager, *args, **kwargs)
        time.sleep(delay)
        return original(manager, *args, **kwargs)

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
