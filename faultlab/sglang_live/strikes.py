"""The strikes of faultlab's SGLang plugin: the hook bodies that arm a plan's entries and corrupt SGLang's
request rows, page tables and free lists (what each class does and who is a victim:
faultlab/sglang_live/inject.py). The strikes of the plain serving path are here; those on the pools only the
spec, sliding-window and mamba paths build are in :mod:`.path_strikes` (PD's late write: :mod:`.pd`), and the
helpers every strike uses in :mod:`.strike_tools`. torch is imported inside the functions that need it.
"""
from __future__ import annotations

from typing import Any

from .path_strikes import _strike_spec, _strike_state_index, _strike_state_reuse, _strike_swa
from .plan import (ABORT_CONTROL, CONTROL, DECODE_FAULTS, MAMBA_FAULTS, PD_FAULTS, REUSER_FAULTS, ROW_FAULTS,
                   SPEC_FAULTS, SPEC_MAMBA_FAULTS, SWA_FAULTS, Entry)
from .runtime import State, label_of, log
from .strike_tools import (_free_to_head, _log_inject, _num_pages, _page_size, _row, _seq_len, _written_pages, here,
                          ranks)


def before_prepare_for_decode(batch, *args, **kwargs):
    if batch.is_empty():
        return None
    State.decode_steps += 1
    if State.decode_steps == 1:  # what this engine runs on, once (a test names the path it exercised)
        allocator = batch.token_to_kv_pool_allocator
        log("pools", kv_pool=type(allocator.get_kvcache()).__name__, allocator=type(allocator).__name__,
            page_size=_page_size(batch), **ranks())
    for entry in State.plan:
        if entry.clobbered:
            _restore_rows(entry, batch)
    rows = [r.kv.req_pool_idx for r in batch.reqs]
    if len(set(rows)) < len(rows):  # two requests of one decode step on one req_to_token row
        shared = [str(r.rid) for r, row in zip(batch.reqs, rows) if rows.count(row) > 1]
        log("shared_row", label=label_of(shared[0]), rids=shared,
            rows=sorted({row for row in rows if rows.count(row) > 1}))
    for entry in State.plan:
        if entry.abort is not None and any(r is entry.abort for r in batch.reqs):
            _abort_as_sglang_does(entry)
        if entry.armed and not entry.done and entry.fault in PD_FAULTS:
            reusers = [r for r in batch.reqs if entry.is_reuser(r) and not r.finished()]
            if len(reusers) >= entry.min_reusers and min(len(r.output_ids) for r in reusers) >= entry.reuser_step:
                from .pd import strike_late_write

                entry.done = True
                strike_late_write(entry, batch)
        if entry.armed or entry.done:
            continue
        if not entry.decoding and any(entry.is_candidate(r) for r in batch.reqs):
            entry.decoding = True
            log("decoding", fault=entry.fault, seed=entry.seed, label=entry.label)
        cands = sorted((r for r in batch.reqs if entry.is_candidate(r) and not r.finished()
                        and r.kv.req_pool_idx is not None), key=lambda r: str(r.rid))
        if len(cands) < entry.min_candidates or min(len(r.output_ids) for r in cands) < entry.step \
                or not here(entry):
            continue
        entry.armed, entry.candidates = True, cands
        log("armed", fault=entry.fault, seed=entry.seed, label=entry.label, step=entry.step,
            candidates=[str(r.rid) for r in cands])
        if entry.fault == CONTROL:
            entry.done = True
        elif entry.fault in DECODE_FAULTS:
            entry.done = True
            _strike_decode(entry, batch)
        elif entry.fault in ROW_FAULTS:
            entry.pending = True  # strikes once SGLang prepared this step (after_prepare_for_decode)
        elif entry.fault in SPEC_FAULTS:
            entry.done = True
            _strike_spec(entry, batch)
        elif entry.fault in ("mamba_index_swap", SPEC_MAMBA_FAULTS[0]):
            entry.done = True
            _strike_state_index(entry, batch)
        elif entry.fault in SWA_FAULTS:
            entry.done = True
            _strike_swa(entry, batch)
    return None


def after_prepare_for_decode(result, batch, *args, **kwargs):
    """stale_batch_row: the step is prepared (its slots written into req_to_token, kvguard's bookkeeping
    done); its device row indices are clobbered before the forward (and kvguard's check) reads them."""
    for entry in State.plan:
        if entry.pending and not batch.is_empty():
            entry.pending, entry.done = False, True
            _strike_rows(entry, batch)
    return None


def _strike_rows(entry: Entry, batch) -> None:
    """Two or more candidates' entries of ``batch.req_pool_indices`` rotated (a clobbered staging buffer,
    TensorRT-LLM PR #15546's class); ``req_pool_indices_cpu`` and every Req keep the true rows."""
    import torch

    table = batch.req_to_token_pool.req_to_token
    where = {id(r): i for i, r in enumerate(batch.reqs)}
    cands = [r for r in entry.candidates if id(r) in where and not r.finished()]
    if len(cands) < 2:
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                   reason="fewer than two candidates in the batch")
    rng = entry.rng
    chosen = rng.sample(cands, rng.randint(2, max(2, len(cands) - 1)))  # at least one candidate left alone
    rows = batch.req_pool_indices.clone()
    true = [int(rows[where[id(r)]]) for r in chosen]
    given = true[1:] + true[:1]
    seq_lens = batch.seq_lens_cpu.tolist()
    victims = []
    for r, t, g in zip(chosen, true, given):
        i = where[id(r)]
        rows[i] = g
        n = int(seq_lens[i])
        if not torch.equal(table[t, :n], table[g, :n]):
            victims.append(r)
    batch.req_pool_indices = rows  # a new tensor: an in-flight batch keeps its own
    entry.clobbered = True
    _log_inject(entry, victims, rows=true, given=given, rids=[str(r.rid) for r in chosen])


def _restore_rows(entry: Entry, batch) -> None:
    """Before the next step is prepared: every request's true row again, rebuilt from the requests (the
    truth for any batch, whether or not it still holds the clobbered requests)."""
    import torch

    rows = batch.req_pool_indices
    batch.req_pool_indices = torch.tensor([int(r.kv.req_pool_idx) for r in batch.reqs], dtype=rows.dtype,
                                          device=rows.device)
    entry.clobbered = False
    log("restored", fault=entry.fault, seed=entry.seed, label=entry.label)


def _abort_as_sglang_does(entry: Entry) -> None:
    """SGLang's own abort of a running request (``Scheduler.abort_request``: set ``to_finish``; the
    request runs this decode step, then its result processing finishes and releases it), at the step
    where kvguard would flag a stale row: the same batches, the victim aborted, nothing corrupted."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req, entry.abort = entry.abort, None
    if not req.finished():
        req.to_finish = FINISH_ABORT(f"faultlab: {entry.fault} control")
        log("control_abort", fault=entry.fault, seed=entry.seed, label=entry.label, rid=str(req.rid))


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
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                   reason="no two candidates map different pages")
    victim = rng.choice(cands)
    row, n = _row(victim), _seq_len(victim)
    if entry.fault == "in_page_entry":
        if ps == 1:
            return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
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


STATE_REUSE = (MAMBA_FAULTS[1], SPEC_MAMBA_FAULTS[1])  # struck at a reuser's prefill, as the reuser faults


def around_alloc_for_extend(original, batch, *args, **kwargs):
    State.chunk_continuations += sum(bool(r.kv.holds_kv) for r in batch.reqs)
    for entry in State.plan:
        if entry.armed and not entry.done and entry.fault in REUSER_FAULTS + (ABORT_CONTROL,) + STATE_REUSE:
            if any(entry.is_reuser(r) and not r.kv.holds_kv for r in batch.reqs):
                entry.done = True
                _strike_state_reuse(entry, batch) if entry.fault in STATE_REUSE else _strike_reuse(entry, batch)
    result = original(batch, *args, **kwargs)
    if any(e.watch for e in State.plan):
        out_cache_loc = result[0]
        owners, offset = [], 0
        for req, ext in zip(batch.reqs, batch.extend_lens):
            owners.append((req, offset, offset + int(ext)))
            offset += int(ext)
        _watch(batch, out_cache_loc, owners)
    return result


def after_mix_with_running(result, batch, *args, **kwargs):
    State.mixed_batches += 1
    return None


def after_alloc_for_decode(out_cache_loc, batch, token_per_req=1, *args, **kwargs):
    if any(e.watch for e in State.plan):
        n = int(token_per_req)
        _watch(batch, out_cache_loc, [(r, i * n, (i + 1) * n) for i, r in enumerate(batch.reqs)])
    return None


def _watch(batch, out_cache_loc, owners) -> None:
    """double_free: who receives the doubly freed page, in allocation order."""
    ps = _page_size(batch)
    allocator = batch.token_to_kv_pool_allocator
    for entry in State.plan:
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
            log("owner", fault=entry.fault, seed=entry.seed, label=entry.label, page=page, rid=str(req.rid))
        if left == 0:
            victims = w["receivers"][:-1]
            for rid in dict.fromkeys(victims):
                log("victim", fault=entry.fault, seed=entry.seed, label=entry.label, page=page, rid=rid)
            entry.watch = None


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
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                   reason="every candidate finished before a reuser arrived")
    if entry.fault == "double_free":
        page = int(allocator.free_pages[0])  # free lists hold page ids (slot ids at page size 1)
        _free_to_head(allocator, torch.arange(page * ps, page * ps + ps, device=allocator.free_pages.device))
        entry.watch = {"page": page, "receivers": []}
        return _log_inject(entry, [], pages=[page], note="victims follow as 'victim' lines", **info)
    victim = rng.choice(live)
    row = _row(victim)
    if entry.fault == ABORT_CONTROL:  # nothing corrupted: SGLang aborts it at its next decode step
        entry.abort = victim
        return _log_inject(entry, [victim], rows=[row], note="aborted by SGLang at its next decode step", **info)
    if entry.fault == "stale_row":
        rpool.free_rows([row])
        return _log_inject(entry, [victim], rows=[row], **info)
    # premature_free: a page the victim holds privately (past what the radix tree protects)
    n = _seq_len(victim)
    first = -(-int(victim.kv.cache_protected_len) // ps)
    ks = list(range(first, -(-n // ps)))
    if not ks:
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                   reason=f"request {victim.rid} holds no private page")
    k = rng.choice(ks)
    page = int(table[row, k * ps]) // ps
    _free_to_head(allocator, torch.arange(page * ps, page * ps + ps, device=table.device))
    _log_inject(entry, [victim], rows=[row], pages=[page], entries=[[k * ps, min((k + 1) * ps, n)]], **info)


