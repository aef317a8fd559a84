"""The per-process state of faultlab's SGLang plugin (its plan, its log path, what the idle check saw last)
and its JSON-lines log (faultlab/sglang_live/inject.py lists the events). Stdlib only.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class State:
    """What the plugin keeps per process (class attributes: one plugin per process)."""

    plan: list = []  # the plan's Entry objects (faultlab/sglang_live/plan.py)
    log_path: str = "faultlab_sglang.jsonl"
    lock = threading.Lock()
    last_idle: Any = None
    last_idle_time: float = 0.0
    idle_wanted = False  # the scheduler received something since the last idle_check line: log the next one
    registered = False
    decode_steps = 0  # decode batches prepared in this process (reported on idle_check lines)
    chunk_continuations = 0  # extends of a request that already held KV (a chunked prefill's next chunk)
    mixed_batches = 0  # prefill batches that took the running decode requests in (ScheduleBatch.mix_with_running)
    tp_rank: int | None = None  # SGLang's TP rank of this process, once an entry naming one asked (strike_tools.here)
    # PD decode, faultlab's prefill writer (faultlab/sglang_live/pd.py): rid -> the transfer it wrote
    # (the writer's own record: row, slots, tokens, kvguard's ticket), kept after the request finished
    transfers: dict = {}
    kv_tables: dict = {}  # the writer's K/V tables, by (layer, heads, dims, vocab) (pd.kv_values)


def log(event: str, **fields) -> None:
    """One JSON line ``{"event", "time", "pid", **fields}`` appended to the plugin's log."""
    line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields}) + "\n"
    with State.lock:  # one O_APPEND write per line: readers never see half of it
        fd = os.open(State.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def label_of(rid: str) -> str:
    """The episode label of a driver's request id (``<label>-a<i>`` / ``<label>-b<i>``, harness.py)."""
    return rid.rsplit("-", 1)[0]
