"""kvguard vs SGLang 0.5.23's own checks, on SGLang's real bookkeeping classes, on the CPU.

Same injected faults for every detector (double free, premature free, swapped entries, out-of-range entry,
stale row, leak), each on a fresh rig (faultlab.sglang_live.rig.Rig: real ReqToTokenPool,
PagedTokenToKVPoolAllocator over an FP8 MHATokenToKVPool, RadixCache, Req/ScheduleBatch driven by
SGLang's prepare_for_extend / prepare_for_decode). Detectors, each evaluated where it runs in a server:

- debug_mode (SGLANG_DEBUG_MEMORY_POOL): the real asserts inside the allocator's alloc/free calls.
- kv_page_invariants (SGLANG_CHECK_KV_PAGE_INVARIANTS): the REAL
  SchedulerInvariantChecker._check_kv_page_invariants, called with a minimal self (the real pools, tree
  and the running requests) right after the iteration in which the fault happened.
- idle_accounting (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, default on): the REAL _check_req_pool, and
  _check_full_pool's token conservation `available + evictable + protected == total` REPRODUCED (its
  PoolStats plumbing needs a Scheduler), once every request has finished.
- kvguard: the check launched by the hooks from prepare_for_decode at the next decode step.

Usage: python bench/sglang_compare.py [--steps N] ; prints a markdown table, writes
bench/results/sglang_compare.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from pathlib import Path

import torch

from faultlab.sglang_live.rig import Rig, apply_check_hooks

PS = 16
FAULTS = ["double_free", "premature_free", "swapped_entries", "out_of_range", "stale_row", "leak"]
OUT = Path(__file__).resolve().parent / "results" / "sglang_compare.json"


def _checker_self(rig, reqs):
    """The attributes SchedulerInvariantChecker._check_kv_page_invariants / _check_req_pool read."""
    return types.SimpleNamespace(
        req_to_token_pool=rig.req_to_token_pool, token_to_kv_pool_allocator=rig.allocator,
        tree_cache=rig.tree, _requests_owning_rows=lambda: [r for r in reqs if r.kv.holds_kv],
        pool_stats_observer=types.SimpleNamespace(session_held_req_count=lambda: 0),
    )


def kv_page_invariants(rig, reqs) -> str | None:
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

    try:
        SchedulerInvariantChecker._check_kv_page_invariants(_checker_self(rig, reqs))
    except ValueError as err:  # strict mode (the idle-check default): raise_error_or_warn raises
        return str(err).split(",")[0][:60]
    return None


def idle_accounting(rig) -> str | None:
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

    try:
        SchedulerInvariantChecker._check_req_pool(_checker_self(rig, []))
    except ValueError as err:
        return str(err)[:60]
    total = rig.allocator.size
    counted = rig.allocator.available_size() + rig.tree.evictable_size() + rig.tree.protected_size()
    if counted != total:
        return f"token pool leak: {total - counted} tokens unaccounted"
    return None


def run_fault(fault: str) -> dict:
    rig = Rig(PS)
    rig.allocator.debug_mode = True  # what SGLANG_DEBUG_MEMORY_POOL=1 sets in the allocator's __init__
    rig.install()
    res = {"fault": fault, "debug_mode": None, "kv_page_invariants": None, "idle_accounting": None,
           "kvguard": None}

    def guarded(fn):
        try:
            fn()
        except AssertionError as err:
            res["debug_mode"] = res["debug_mode"] or f"AssertionError {str(err)[:40]}".strip()

    batch = rig.to_decode(rig.prefill(2 * PS + 3), rig.prefill(PS + 5), rig.prefill(3 * PS))
    rig.decode(batch)
    rig.sample(batch)
    a, b, c = batch.reqs
    table = rig.req_to_token_pool.req_to_token
    extra = []
    if fault == "double_free":
        gone = rig.prefill(PS)
        page = rig.pages_of(gone.reqs[0])[0]
        rig.release(gone.reqs[0])
        guarded(lambda: rig.allocator.free(rig.page_slots(page)))
        res["kv_page_invariants"] = kv_page_invariants(rig, batch.reqs)
        earlier, later = rig.prefill(PS), rig.prefill(PS)
        extra = [earlier, later]
    elif fault == "premature_free":
        guarded(lambda: rig.allocator.free(rig.page_slots(rig.pages_of(b)[0])))
        res["kv_page_invariants"] = kv_page_invariants(rig, batch.reqs)
    elif fault == "swapped_entries":
        ra, rc = a.kv.req_pool_idx, c.kv.req_pool_idx
        saved = table[ra, PS:2 * PS].clone()
        table[ra, PS:2 * PS] = table[rc, PS:2 * PS]
        table[rc, PS:2 * PS] = saved
        res["kv_page_invariants"] = kv_page_invariants(rig, batch.reqs)
    elif fault == "out_of_range":
        table[b.kv.req_pool_idx, 0] = (rig.allocator.num_pages + 7) * PS
        res["kv_page_invariants"] = kv_page_invariants(rig, batch.reqs)
    elif fault == "stale_row":
        stale_row = a.kv.req_pool_idx
        alen = int(a.kv.kv_allocated_len)
        rig.release(a)
        newcomer = rig.prefill(3 * PS)
        a.kv.req_pool_idx = stale_row  # the released request is still scheduled on its old row
        a.kv.kv_allocated_len = a.kv.kv_committed_len = alen
        extra = [newcomer]
        res["kv_page_invariants"] = kv_page_invariants(rig, batch.reqs + newcomer.reqs)
    elif fault == "leak":
        guarded(lambda: rig.allocator.alloc(PS))  # pages taken and never owned nor freed
        res["kv_page_invariants"] = kv_page_invariants(rig, batch.reqs)
    if extra:
        batch = rig.to_decode(batch, *extra)
    guarded(lambda: rig.decode(batch))
    pending = batch.__dict__.get("_kvguard")
    if pending is not None:
        flagged = rig.guard.resolve(pending)
        if flagged:
            res["kvguard"] = f"aborts {len(flagged)} req ({flagged[0][1].split('(')[-1].split(')')[0].split(', ')[-1]})"
    # every request finishes; then the idle checks run (debug_mode off from here: with it on, the owner's
    # legitimate release of a prematurely freed page trips its duplicate assert, a second-order effect)
    rig.allocator.debug_mode = False
    if fault not in ("out_of_range", "swapped_entries"):
        for req in batch.reqs:
            if req.kv.holds_kv and not (fault == "stale_row" and req is a):
                try:
                    rig.release(req)
                except Exception as err:  # noqa: BLE001 - a corrupted state may break release itself
                    res["idle_accounting"] = f"release failed: {type(err).__name__}"
        res["idle_accounting"] = res["idle_accounting"] or idle_accounting(rig)
    else:
        res["idle_accounting"] = "n/a (release would free the corrupted entries)"
    return res


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def costs(steps: int, batch_size: int = 32, prompt: int = 1000) -> dict:
    """CPU cost per decode step of each detector, same state: batch_size requests of ~prompt tokens."""
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

    rig = Rig(PS, num_tokens=batch_size * (prompt + 4 * PS + steps) + 64 * PS, rows=batch_size + 4,
              context=prompt + 4 * PS + steps + PS)
    rig.install()
    batch = rig.to_decode(*[rig.prefill(prompt + i) for i in range(batch_size)])
    guard = rig.guard
    check_us = _median_us(lambda: guard.resolve(guard.launch(batch)), steps)
    table, rows = rig.req_to_token_pool.req_to_token, batch.req_pool_indices
    n_pages = (batch.seq_lens_cpu + PS - 1) // PS
    rids = [r.rid for r in batch.reqs]

    def page_granular():  # the earlier check: the first entry of each page only (for comparison)
        check = guard.tracker.validate(table, rows, n_pages, max_entries=int(n_pages.max()), table_rows=rows,
                                       entry_step=PS, page_div=PS)
        guard.tracker.resolve(check, check.verdict, rids)

    page_us = _median_us(page_granular, steps)
    step_checked = []
    for i in range(steps):  # one real prepare_for_decode each; the check is inside it
        t0 = time.perf_counter()
        rig.decode(batch)
        step_checked.append(time.perf_counter() - t0)
        rig.sample(batch)
    rig.allocator.debug_mode = True
    debug_us = _median_us(lambda: rig.allocator._debug_check_no_duplicate_pages(), steps)
    inv_self = _checker_self(rig, batch.reqs)
    inv_us = _median_us(lambda: SchedulerInvariantChecker._check_kv_page_invariants(inv_self), steps)
    idle_us = _median_us(lambda: idle_accounting(rig), steps)
    pages = sum(-(-int(n) // PS) for n in batch.seq_lens_cpu.tolist())
    return {"batch_size": batch_size, "tokens_per_request": prompt, "pages_checked": pages,
            "tokens_checked": int(batch.seq_lens_cpu.sum()), "page_size": PS, "steps": steps,
            "kvguard_check_us": check_us, "page_granular_check_us": page_us,
            "prepare_for_decode_with_kvguard_us": statistics.median(step_checked) * 1e6,
            "debug_mode_dup_check_per_free_us": debug_us,
            "kv_page_invariants_us": inv_us, "idle_accounting_us": idle_us}


ACTION = {
    "debug_mode": "AssertionError in the allocator call: scheduler dies, server down (SIGQUIT)",
    "kv_page_invariants": "ValueError (strict) or throttled warning; no request is stopped",
    "idle_accounting": "ValueError (default strict) / warning, only once the server is idle",
    "kvguard": "aborts only the flagged requests (HTTP 500 error streamed); KV never published",
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    apply_check_hooks()
    rows = [run_fault(f) for f in FAULTS]
    cost = costs(args.steps)
    detectors = ["debug_mode", "kv_page_invariants", "idle_accounting", "kvguard"]
    lines = ["| fault | " + " | ".join(detectors) + " |", "|---" * (len(detectors) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['fault']} | " + " | ".join(("**yes**: " + r[d]) if r[d] and not r[d].startswith("n/a")
                                                       else (r[d] or "no") for d in detectors) + " |")
    lines.append("| on detection | " + " | ".join(ACTION[d] for d in detectors) + " |")
    lines.append(f"| CPU cost (median) | {cost['debug_mode_dup_check_per_free_us']:.0f} µs per free/alloc "
                 f"call | {cost['kv_page_invariants_us']:.0f} µs per loop iteration | "
                 f"{cost['idle_accounting_us']:.0f} µs per idle pass | {cost['kvguard_check_us']:.0f} µs "
                 f"per decode step (launch + verdict) |")
    table = "\n".join(lines)
    print(table)
    print(f"\ncost setup: {cost['batch_size']} requests x ~{cost['tokens_per_request']} tokens, page size "
          f"{PS}, every one of {cost['tokens_checked']} token entries checked per step (page-granular: "
          f"{cost['pages_checked']} entries, {cost['page_granular_check_us']:.0f} µs); real prepare_for_decode "
          f"with kvguard: {cost['prepare_for_decode_with_kvguard_us']:.0f} µs (median of {cost['steps']})")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"faults": rows, "costs": cost, "actions": ACTION, "table": table}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
