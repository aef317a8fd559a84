"""A test-only SGLang 0.5.23 plugin that corrupts page tables and allocators of a live server.

Entry point ``faultlab_inject`` (group ``sglang.srt.plugins``). SGLang's own loader calls
:func:`register` in every SGLang process; with none of the variables below set it registers NOTHING
and SGLang runs as shipped. Device-agnostic: every corruption is a tensor op on the pools' own device.

STATUS: ready

Environment
-----------
``FAULTLAB_SGLANG_FAULTS``
    The fault plan. Either a JSON list of entries, or a comma-separated list of fault names (one entry
    each, seed from ``FAULTLAB_SGLANG_SEED``, matching every request). Entry keys:
    ``fault`` (a class below), ``seed`` (int), ``rid_prefix`` (requests whose rid starts with it are the
    candidates; default ``""``), ``reuser_prefix`` (requests whose arrival triggers the faults that
    need a reuser; default: any request that is not a candidate), ``step`` (decode step of the
    candidates at which the entry arms; default: drawn from the seed in 2..6), ``min_candidates``
    (default 2), ``label`` (free text copied into the log). Each entry fires once.
``FAULTLAB_SGLANG_SEED``
    Seed for the comma-separated form (default 0).
``FAULTLAB_SGLANG_LOG``
    JSON-lines log path (default ``faultlab_sglang.jsonl`` in the working directory).
``FAULTLAB_SGLANG_CPU_ROTARY=1``
    Install the torch rotary op SGLang needs on a plain CPU device (:mod:`.cpu_rotary`); tests only.
``FAULTLAB_SGLANG_DUMMY_INIT=<std>``
    After SGLang's dummy loader, re-draw every weight from a seeded normal (std ``<std>`` scaled by
    1/sqrt(fan-in); norms 1.0), so that a tiny dummy model's output depends on its KV cache (SGLang's
    own dummy weights, uniform in +-1e-3, give nearly context-free greedy output).
``FAULTLAB_SGLANG_ACCOUNTING=1``
    Log SGLang's own idle accounting check (``SchedulerInvariantChecker._check_all_pools``) as
    ``{"event": "idle_check", ...}`` lines (on change, or at most every 0.3 s), with the request-row pool
    counts and the number of duplicate pages in the allocator's free list. Implied by a fault plan.

When the faults strike
----------------------
An entry *arms* at the first decode step (``ScheduleBatch.prepare_for_decode``, BEFORE hook, i.e.
between two decode steps, before this step's write slot is chosen from the row) whose batch holds at
least ``min_candidates`` candidates, all with at least ``step`` output tokens. The choice of requests,
pages and entries is a pure function of the seed, the candidates sorted by rid and their rows; it
logs ``{"event": "armed"}``. A driver that needs a reuser sends it after reading that line.

* Decode-time classes strike when armed.
* ``premature_free``, ``double_free`` and ``stale_row`` strike when a reuser request's prefill is
  allocated (AROUND ``alloc_for_extend``, before SGLang allocates), so the reuse is deterministic.

Classes, and who counts as a victim
-----------------------------------
A victim is a request whose own mapping (its ``req_to_token`` row, or a page it legitimately holds)
the fault broke. Requests that merely receive a page or row through SGLang's normal allocation are
NOT victims: their mapping is correct, and they are hurt only if a victim later writes into what they
now own (the victim's write slot is ``last_loc + 1`` from its broken row), which a guard must prevent.

``none``             a control: arms and logs ``armed``, corrupts nothing.
``swapped_entries``  two candidates A, B with different pages at logical page k: the entries of page
    k are exchanged between their rows. Victims: A and B.
``index_shift``      candidate A, logical page k: every written entry of that page points one page
    further (one slot at page size 1; one page back at the top of the pool). Victim: A.
``in_page_entry``    candidate A, one written entry at a position p with p % page_size != 0 (inside a
    page, not its first entry) points to the same offset of another page. Page size > 1 only. Victim: A.
``out_of_range_entry``  candidate A, page k: its written entries point past the KV buffer (or, by
    seed, to a negative slot). Victim: A. (What an unguarded forward then reads depends on the backend:
    torch indexing wraps a negative slot around; a GPU kernel may fault.)
``premature_free``   at a reuser's prefill: one page that A holds privately (not a radix-tree page) is
    freed to the allocator's head (SGLang's ``allocator.free``), so the reuser's allocation receives
    it while A still maps it. Victim: A (the new owner is not).
``double_free``      at a reuser's prefill: the page at the head of the free list is freed again, so
    the free list holds it twice and two allocations receive it. Victims: every receiver of a copy
    that was not the last one handed out (their page was handed to someone else after them); the
    final receiver is not. Receivers are logged as ``{"event": "owner"}`` lines and victims as
    ``{"event": "victim"}`` lines once known.
``stale_row``        at a reuser's prefill: A's ``req_to_token`` row is released
    (``ReqToTokenPool.free_rows``) and popped by the reuser's allocation while A still decodes with it.
    Victim: A (the reuser is not).

Log lines (one JSON object each): ``{"event": "inject", "fault", "seed", "label", "step", "victims":
[rid...], "rows", "pages", "entries", "page_size", "time"}``; ``decoding`` (a first candidate is in a
decode batch: its prompt is in the radix tree now, so a driver can send the others to share its prefix
pages); ``armed``, ``owner``, ``victim``, ``idle_check``; ``skipped`` when a fault found nothing to
corrupt (e.g. no private page).

Used by tests/test_faultlab/test_sglang_live/test_sglang_engine.py (through :mod:`.harness`) and :mod:`.sweep`.
"""
from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

ENV_FAULTS = "FAULTLAB_SGLANG_FAULTS"
ENV_SEED = "FAULTLAB_SGLANG_SEED"
ENV_LOG = "FAULTLAB_SGLANG_LOG"
ENV_ROTARY = "FAULTLAB_SGLANG_CPU_ROTARY"
ENV_DUMMY = "FAULTLAB_SGLANG_DUMMY_INIT"
ENV_ACCOUNTING = "FAULTLAB_SGLANG_ACCOUNTING"

DECODE_FAULTS = ("swapped_entries", "index_shift", "in_page_entry", "out_of_range_entry")
CONTROL = "none"  # arms and logs like a fault, corrupts nothing (the fault-free episode of a driver)
REUSER_FAULTS = ("premature_free", "double_free", "stale_row")
FAULTS = DECODE_FAULTS + REUSER_FAULTS + (CONTROL,)

_SRT = "sglang.srt"
TARGETS = {
    "prepare_for_decode": f"{_SRT}.managers.schedule_batch.ScheduleBatch.prepare_for_decode",
    "alloc_for_extend": f"{_SRT}.mem_cache.allocation.alloc_for_extend",
    "alloc_for_decode": f"{_SRT}.mem_cache.allocation.alloc_for_decode",
    "dummy_load": f"{_SRT}.model_loader.loader.DummyModelLoader.load_model",
    "check_all_pools": f"{_SRT}.managers.scheduler_components.invariant_checker."
                       "SchedulerInvariantChecker._check_all_pools",
}


class PlanError(ValueError):
    """A malformed fault plan (raised at registration: the scheduler does not start)."""


@dataclass
class Entry:
    fault: str
    seed: int
    rid_prefix: str = ""
    reuser_prefix: str | None = None
    step: int | None = None
    min_candidates: int = 2
    label: str = ""
    # runtime state
    decoding: bool = False  # a candidate reached a decode batch (logged once: a driver's cue)
    armed: bool = False
    done: bool = False
    candidates: list = field(default_factory=list)
    rng: random.Random | None = None
    watch: dict | None = None  # double_free: page -> copies left to hand out, receivers

    def __post_init__(self):
        if self.fault not in FAULTS:
            raise PlanError(f"{ENV_FAULTS}: fault {self.fault!r} is not one of {', '.join(FAULTS)}")
        self.rng = random.Random(f"{self.fault}:{self.seed}")
        if self.step is None:
            self.step = self.rng.randint(2, 6)

    def is_candidate(self, req) -> bool:
        return str(req.rid).startswith(self.rid_prefix)

    def is_reuser(self, req) -> bool:
        if self.reuser_prefix is not None:
            return str(req.rid).startswith(self.reuser_prefix)
        return not any(req is c for c in self.candidates)


def parse_plan(text: str, seed: int | str = 0) -> list[Entry]:
    """The entries of a plan (see the module docstring); PlanError names what is wrong."""
    try:
        seed = int(seed)
    except ValueError:
        raise PlanError(f"{ENV_SEED}: {seed!r} is not an integer") from None
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{ENV_FAULTS}: not valid JSON ({exc})") from None
        keys = {"fault", "seed", "rid_prefix", "reuser_prefix", "step", "min_candidates", "label"}
        if not isinstance(raw, list):
            raise PlanError(f"{ENV_FAULTS}: a JSON list of entries is expected, got {type(raw).__name__}")
        entries = []
        for item in raw:
            if not isinstance(item, dict) or set(item) - keys or "fault" not in item:
                raise PlanError(f"{ENV_FAULTS}: entry {item!r}: needs 'fault'; allowed keys are {sorted(keys)}")
            for key in ("seed", "step", "min_candidates"):
                if item.get(key) is not None and (not isinstance(item[key], int) or isinstance(item[key], bool)
                                                  or item[key] < 0):
                    raise PlanError(f"{ENV_FAULTS}: entry {item!r}: {key} must be an integer >= 0")
            entries.append(Entry(**{"seed": seed, **item}))
        return entries
    return [Entry(fault=name.strip(), seed=seed) for name in text.split(",") if name.strip()]


# ------------------------------------------------------------------------------------------------
# Plugin entry
# ------------------------------------------------------------------------------------------------
class _State:
    plan: list[Entry] = []
    log_path: str = "faultlab_sglang.jsonl"
    lock = threading.Lock()
    last_idle: Any = None
    last_idle_time: float = 0.0
    registered = False
    decode_steps = 0  # decode batches prepared in this process (reported on idle_check lines)


def register(env=None) -> bool:
    """SGLang plugin entry point. True when any hook was registered."""
    env = os.environ if env is None else env
    if env.get(ENV_ROTARY) == "1":
        from . import cpu_rotary

        cpu_rotary.install()
    try:
        plan = parse_plan(env.get(ENV_FAULTS, ""), env.get(ENV_SEED, "0"))
    except PlanError as exc:
        # SystemExit, not an Exception: SGLang's plugin loader swallows exceptions, and a test whose
        # plan was silently dropped would run fault-free and prove nothing.
        raise SystemExit(f"faultlab_inject: {exc}") from None
    accounting = bool(plan) or env.get(ENV_ACCOUNTING) == "1"
    dummy = env.get(ENV_DUMMY)
    if not (plan or accounting or dummy) or _State.registered:
        return _State.registered
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _State.registered = True
    _State.plan = plan
    _State.log_path = env.get(ENV_LOG, _State.log_path)
    if dummy:
        std = float(dummy)
        HookRegistry.register(TARGETS["dummy_load"], lambda model, *a, **k: _reinit(model, std),
                              HookType.AFTER)
    if accounting:
        HookRegistry.register(TARGETS["check_all_pools"], _after_check_all_pools, HookType.AFTER)
    if plan:
        HookRegistry.register(TARGETS["prepare_for_decode"], _before_prepare_for_decode, HookType.BEFORE)
        HookRegistry.register(TARGETS["alloc_for_extend"], _around_alloc_for_extend, HookType.AROUND)
        HookRegistry.register(TARGETS["alloc_for_decode"], _after_alloc_for_decode, HookType.AFTER)
    return True


def _log(event: str, **fields) -> None:
    line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields}) + "\n"
    with _State.lock:  # one O_APPEND write per line: readers never see half of it
        fd = os.open(_State.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------------
# Weights of a tiny dummy model
# ------------------------------------------------------------------------------------------------
def _reinit(model, std: float):
    import zlib

    import torch

    with torch.no_grad():
        for name, param in model.state_dict().items():
            if not torch.is_floating_point(param):
                continue
            if "norm" in name:
                param.fill_(1.0)
                continue
            gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode()))
            fan_in = param.shape[-1] if param.dim() > 1 and "embed" not in name else 1
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * (std / math.sqrt(fan_in))
            param.copy_(values.to(param.device, param.dtype))
    return None


# ------------------------------------------------------------------------------------------------
# Accounting (SGLang's own idle check, observed)
# ------------------------------------------------------------------------------------------------
def _after_check_all_pools(result, checker, *args, **kwargs):
    import torch

    has_leak, messages = result
    rpool = checker.req_to_token_pool
    allocator = checker.token_to_kv_pool_allocator
    free = allocator.free_pages
    dups = int(free.numel() - torch.unique(free).numel()) if free is not None else 0
    req_total = rpool.size + getattr(rpool, "pre_alloc_size", 0)
    state = (bool(has_leak), tuple(messages), len(rpool.free_slots), req_total, dups)
    now = time.time()
    if state != _State.last_idle or now - _State.last_idle_time > 0.3:
        _State.last_idle, _State.last_idle_time = state, now
        _log("idle_check", leak=bool(has_leak), messages=list(messages), req_free=len(rpool.free_slots),
             req_total=req_total, free_dups=dups, decode_steps=_State.decode_steps,
             balanced=not has_leak and len(rpool.free_slots) == req_total and dups == 0)
    return None


# ------------------------------------------------------------------------------------------------
# Strikes
# ------------------------------------------------------------------------------------------------
def _page_size(batch) -> int:
    return int(batch.token_to_kv_pool_allocator.page_size)


def _num_pages(allocator) -> int:
    ps = int(allocator.page_size)
    return int(getattr(allocator, "num_pages", allocator.size // ps))


def _row(req) -> int:
    return int(req.kv.req_pool_idx)


def _seq_len(req) -> int:
    """Entries of the request's row that are written (before this step's prepare_for_decode)."""
    return int(req.kv.kv_committed_len)


def _before_prepare_for_decode(batch, *args, **kwargs):
    if batch.is_empty():
        return None
    _State.decode_steps += 1
    for entry in _State.plan:
        if entry.armed or entry.done:
            continue
        if not entry.decoding and any(entry.is_candidate(r) for r in batch.reqs):
            entry.decoding = True
            _log("decoding", fault=entry.fault, seed=entry.seed, label=entry.label)
        cands = sorted((r for r in batch.reqs if entry.is_candidate(r) and not r.finished()
                        and r.kv.req_pool_idx is not None), key=lambda r: str(r.rid))
        if len(cands) < entry.min_candidates or min(len(r.output_ids) for r in cands) < entry.step:
            continue
        entry.armed, entry.candidates = True, cands
        _log("armed", fault=entry.fault, seed=entry.seed, label=entry.label, step=entry.step,
             candidates=[str(r.rid) for r in cands])
        if entry.fault == CONTROL:
            entry.done = True
        elif entry.fault in DECODE_FAULTS:
            entry.done = True
            _strike_decode(entry, batch)
    return None


def _written_pages(req, ps: int) -> int:
    return -(-_seq_len(req) // ps)


def _strike_decode(entry: Entry, batch) -> None:
    rng, ps = entry.rng, _page_size(batch)
    table = batch.req_to_token_pool.req_to_token
    allocator = batch.token_to_kv_pool_allocator
    cands = entry.candidates
    info: dict[str, Any] = {"page_size": ps}
    if entry.fault == "swapped_entries":
        pairs = [(a, b) for i, a in enumerate(cands) for b in cands[i + 1:]]
        rng.shuffle(pairs)
        for a, b in pairs:
            n = min(_written_pages(a, ps), _written_pages(b, ps))
            ra, rb = table[_row(a), 0:n * ps:ps].tolist(), table[_row(b), 0:n * ps:ps].tolist()
            ks = [k for k in range(n) if ra[k] // ps != rb[k] // ps]
            if ks:
                k = rng.choice(ks)
                span = slice(k * ps, (k + 1) * ps)
                tmp = table[_row(a), span].clone()
                table[_row(a), span] = table[_row(b), span]
                table[_row(b), span] = tmp
                return _log_inject(entry, [a, b], rows=[_row(a), _row(b)], pages=[ra[k] // ps, rb[k] // ps],
                                   entries=[[k * ps, (k + 1) * ps]], **info)
        return _log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                    reason="no two candidates map different pages")
    victim = rng.choice(cands)
    row, n = _row(victim), _seq_len(victim)
    if entry.fault == "in_page_entry":
        if ps == 1:
            return _log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                        reason="page size 1 has no entries inside a page")
        positions = [p for p in range(n - 1) if p % ps]
        p = rng.choice(positions)
        old = int(table[row, p])
        other = [c for c in cands if c is not victim]
        target_page = None
        for c in rng.sample(other, len(other)):
            pages = {int(x) // ps for x in table[_row(c), 0:_written_pages(c, ps) * ps:ps].tolist()}
            pages.discard(old // ps)
            if pages:
                target_page = rng.choice(sorted(pages))
                break
        if target_page is None:  # nobody else: the next page
            target_page = old // ps + 1 if old // ps + 1 <= _num_pages(allocator) else old // ps - 1
        new = target_page * ps + p % ps
        table[row, p] = new
        return _log_inject(entry, [victim], rows=[row], pages=[old // ps, target_page], entries=[[p, p + 1]],
                           slots=[old, new], **info)
    k = rng.randrange(_written_pages(victim, ps))
    lo, hi = k * ps, min((k + 1) * ps, n)
    old = table[row, lo:hi].clone()
    page = int(old[0]) // ps
    if entry.fault == "index_shift":
        delta = ps if page + 1 <= _num_pages(allocator) else -ps
        table[row, lo:hi] = old + delta
        new_page = page + delta // ps
    else:  # out_of_range_entry
        if rng.random() < 0.5:
            new_page = _num_pages(allocator) + 2 + rng.randrange(4)
        else:
            new_page = -1 - rng.randrange(4)
        table[row, lo:hi] = (old % ps) + new_page * ps
    _log_inject(entry, [victim], rows=[row], pages=[page, new_page], entries=[[lo, hi]], **info)


def _log_inject(entry: Entry, victims: list, **fields) -> None:
    _log("inject", fault=entry.fault, seed=entry.seed, label=entry.label, step=entry.step,
         victims=[str(r.rid) for r in victims], **fields)


def _around_alloc_for_extend(original, batch, *args, **kwargs):
    for entry in _State.plan:
        if entry.armed and not entry.done and entry.fault in REUSER_FAULTS:
            if any(entry.is_reuser(r) and not r.kv.holds_kv for r in batch.reqs):
                entry.done = True
                _strike_reuse(entry, batch)
    result = original(batch, *args, **kwargs)
    if any(e.watch for e in _State.plan):
        out_cache_loc = result[0]
        owners, offset = [], 0
        for req, ext in zip(batch.reqs, batch.extend_lens):
            owners.append((req, offset, offset + int(ext)))
            offset += int(ext)
        _watch(batch, out_cache_loc, owners)
    return result


def _after_alloc_for_decode(out_cache_loc, batch, token_per_req=1, *args, **kwargs):
    if any(e.watch for e in _State.plan):
        n = int(token_per_req)
        _watch(batch, out_cache_loc, [(r, i * n, (i + 1) * n) for i, r in enumerate(batch.reqs)])
    return None


def _watch(batch, out_cache_loc, owners) -> None:
    """double_free: who receives the doubly freed page, in allocation order."""
    ps = _page_size(batch)
    allocator = batch.token_to_kv_pool_allocator
    for entry in _State.plan:
        w = entry.watch
        if not w:
            continue
        page = w["page"]
        pages = (out_cache_loc.long() // ps).tolist()
        got = []  # (req, slot index) in allocation order: new pages only (first slot of a page)
        for req, lo, hi in owners:
            for i in range(lo, hi):
                slot = int(out_cache_loc[i])
                if pages[i] == page and (ps == 1 or slot % ps == 0):
                    got.append(req)
        if not got:
            continue
        left = int((allocator.free_pages == page).sum())
        for req in got:
            w["receivers"].append(str(req.rid))
            _log("owner", fault=entry.fault, seed=entry.seed, label=entry.label, page=page, rid=str(req.rid))
        if left == 0:
            victims = w["receivers"][:-1]
            for rid in dict.fromkeys(victims):
                _log("victim", fault=entry.fault, seed=entry.seed, label=entry.label, page=page, rid=rid)
            entry.watch = None


def _free_to_head(allocator, slots) -> None:
    """Free slots through SGLang's allocator.free, leaving their page(s) at the head of the free list."""
    import torch

    ps = int(allocator.page_size)
    allocator.free(slots)
    if ps == 1:  # TokenToKVPoolAllocator appends; a paged allocator prepends already
        free = allocator.free_pages
        n = slots.numel()
        allocator.free_pages = torch.cat((free[-n:], free[:-n]))


def _strike_reuse(entry: Entry, batch) -> None:
    import torch

    rng, ps = entry.rng, _page_size(batch)
    allocator = batch.token_to_kv_pool_allocator
    rpool = batch.req_to_token_pool
    table = rpool.req_to_token
    live = [r for r in entry.candidates if not r.finished() and r.kv.req_pool_idx is not None]
    info: dict[str, Any] = {"page_size": ps,
                            "reusers": [str(r.rid) for r in batch.reqs if entry.is_reuser(r)]}
    if not live:
        return _log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                    reason="every candidate finished before a reuser arrived")
    if entry.fault == "double_free":
        page = int(allocator.free_pages[0])  # free lists hold page ids (slot ids at page size 1)
        _free_to_head(allocator, torch.arange(page * ps, page * ps + ps, device=allocator.free_pages.device))
        entry.watch = {"page": page, "receivers": []}
        return _log_inject(entry, [], pages=[page], note="victims follow as 'victim' lines", **info)
    victim = rng.choice(live)
    row = _row(victim)
    if entry.fault == "stale_row":
        rpool.free_rows([row])
        return _log_inject(entry, [victim], rows=[row], **info)
    # premature_free: a page the victim holds privately (past what the radix tree protects)
    n = _seq_len(victim)
    first = -(-int(victim.kv.cache_protected_len) // ps)
    ks = list(range(first, -(-n // ps)))
    if not ks:
        return _log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                    reason=f"request {victim.rid} holds no private page")
    k = rng.choice(ks)
    page = int(table[row, k * ps]) // ps
    _free_to_head(allocator, torch.arange(page * ps, page * ps + ps, device=table.device))
    _log_inject(entry, [victim], rows=[row], pages=[page], entries=[[k * ps, min((k + 1) * ps, n)]], **info)
