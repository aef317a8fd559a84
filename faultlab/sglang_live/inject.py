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
    (default 2), ``min_reusers`` (late_transfer_write: reusers that must decode; default 1), ``label``
    (free text copied into the log), ``tp_rank`` (the entry arms and strikes only in the scheduler process of
    this SGLang TP rank, e.g. one attention-TP rank of one DP rank: rank ``d * attn_tp_size + t`` under DP
    attention; every process still logs ``decoding``; default: every rank). Each entry fires once.
``FAULTLAB_SGLANG_SEED``
    Seed for the comma-separated form (default 0).
``FAULTLAB_SGLANG_LOG``
    JSON-lines log path (default ``faultlab_sglang.jsonl`` in the working directory).
``FAULTLAB_SGLANG_CPU_ROTARY=1``
    Install the torch rotary op SGLang needs on a plain CPU device (:mod:`.cpu_rotary`); tests only.
``FAULTLAB_SGLANG_CPU_SPEC=1``
    Point SGLang's speculative tree build / greedy verify at its own Triton (XPU) implementations on a plain
    CPU device (:mod:`.cpu_spec`; with ``TRITON_INTERPRET=1``); tests only.
``FAULTLAB_SGLANG_CPU_MAMBA=1``
    Bind SGLang's mamba2 causal-conv1d names to its own Triton implementations (its XPU branch) on a plain CPU
    device (:mod:`.cpu_mamba`; with ``TRITON_INTERPRET=1``); tests only.
``FAULTLAB_SGLANG_CPU_MAMBA_SPEC=1``
    Route SGLang's CUDA-only speculative mamba-state commit scatters to its own portable scatter on a plain CPU
    device (:mod:`.cpu_mamba_spec`); tests only.
``FAULTLAB_SGLANG_CPU_PD=1``
    SGLang's Mooncake prefill send path on a plain CPU device (:mod:`.cpu_pd`); tests only.
``FAULTLAB_SGLANG_SWA_CUDA_FREE=1``
    SGLang's CUDA branch of the SWA free (its Triton kernel) on a CPU device (:mod:`.cpu_swa`); tests only.
``FAULTLAB_SGLANG_PD_SLOW_SEND``, ``FAULTLAB_SGLANG_PD_LATE_LAND``, ``FAULTLAB_SGLANG_PD_PREFILL_SHIFT``
    PD over Mooncake or NIXL (:mod:`.pd_faults`): hold the prefill's next send once a trigger file exists (a
    transfer aborted in flight lands late), land it in a decoding request's pages; ``prefill_index_shift`` on the
    prefill server.
``FAULTLAB_SGLANG_DUMMY_INIT=<std>``
    After SGLang's dummy loader, re-draw every weight from a seeded normal (std ``<std>`` scaled by
    1/sqrt(fan-in); norms 1.0), so that a tiny dummy model's output depends on its KV cache (SGLang's
    own dummy weights, uniform in +-1e-3, give nearly context-free greedy output).
``FAULTLAB_SGLANG_KV_WATCH=1``
    A diagnostic (:mod:`.kvwatch`): every decode step, compare the watched requests' KV contents with the
    step before (``kv_slot_changed``, ``kv_content_changed``, ``kv_not_written`` lines). Reads the device
    every step: never on in a measured run.
``FAULTLAB_SGLANG_PD_WRITER=1``
    PD decode with the fake transfer backend: faultlab plays the prefill side's KV writer (:mod:`.pd`):
    when SGLang commits a transfer, the request's prompt K/V (a pure function of token, position and
    layer) and its handoff token are written, and kvguard's transfer ticket is stamped. Needed by
    ``late_transfer_write`` and by any PD episode whose outputs are compared.
``FAULTLAB_SGLANG_ACCOUNTING=1``
    Log SGLang's own idle accounting check (``SchedulerInvariantChecker._check_all_pools``) as
    ``{"event": "idle_check", ...}`` lines (on change, after the scheduler received anything, or at most every
    0.3 s), with the request-row pool
    counts, the number of duplicate pages in the allocator's free list, and what the scheduler ran so far
    (``decode_steps``; ``chunk_continuations``: extends of a request that already held KV, i.e. a chunked
    prefill's later chunks; ``mixed_batches``: prefill batches mixed with the running decodes); and every
    request SGLang retracts (``ScheduleBatch.retract_decode``) as ``{"event": "retract", "rid", "label", "aborted"}``,
    and every request finished through SGLang's ``prepare_abort`` (kvguard's aborts and SGLang's own) as
    ``{"event": "abort", "rid", "label", "message"}``. Implied by a fault plan.

When the faults strike
----------------------
An entry *arms* at the first decode step (``ScheduleBatch.prepare_for_decode``, BEFORE hook, i.e.
between two decode steps, before this step's write slot is chosen from the row) whose batch holds at
least ``min_candidates`` candidates, all with at least ``step`` output tokens. The choice of requests,
pages and entries is a pure function of the seed, the candidates sorted by rid and their rows; it
logs ``{"event": "armed"}``. A driver that needs a reuser sends it after reading that line.

* Decode-time classes strike when armed; ``stale_batch_row`` strikes later in the same step (AFTER
  ``prepare_for_decode``) and is undone at the next step's BEFORE hook.
* ``late_transfer_write`` (PD decode) strikes between two decode steps, once ``min_reusers`` reusers
  decode with ``reuser_step`` (1 or 2, from the seed) output tokens each; a driver sends the reusers
  after the candidates finished, so that SGLang hands them the candidates' freed pages.
* ``premature_free``, ``double_free`` and ``stale_row`` strike when a reuser request's prefill is
  allocated (AROUND ``alloc_for_extend``, before SGLang allocates), so the reuse is deterministic.

Classes, and who counts as a victim
-----------------------------------
A victim is a request whose own mapping (its ``req_to_token`` row, or a page it legitimately holds)
the fault broke. Requests that merely receive a page or row through SGLang's normal allocation are
NOT victims: their mapping is correct, and they are hurt only if a victim later writes into what they
now own (the victim's write slot is ``last_loc + 1`` from its broken row), which a guard must prevent.

``none``             a control: arms and logs ``armed``, corrupts nothing.
``sglang_abort``     a control with a victim: at a reuser's prefill it picks the request ``stale_row`` would
    (same seed, same draws) and SGLang aborts it at its next decode step through its own path
    (``to_finish``, as ``Scheduler.abort_request`` does), corrupting nothing: the batches a
    ``stale_row`` episode runs, without the fault. Victim: that request.
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

``stale_batch_row``  for one decode step, after SGLang prepared it (its slots written into the rows),
    the batch's device row indices ``batch.req_pool_indices`` of two or more candidates (not all) are
    rotated among them (a clobbered staging buffer, TensorRT-LLM PR #15546's class), while
    ``req_pool_indices_cpu`` and every Req keep the true rows; the forward reads the wrong rows. The true
    rows are rebuilt from the requests before the next step is prepared. Victims: the candidates whose
    row index now names a row with different content.
``late_transfer_write``  PD decode only (needs ``FAULTLAB_SGLANG_PD_WRITER=1``): the transfer of a
    candidate A that already finished lands late: faultlab writes A's K/V into A's destination slots
    (pages SGLang freed and handed to later requests since) and stamps A's kvguard ticket, as a late
    writer does. A is drawn from the finished candidates whose pages are held now. Victims: every request
    of the decode batch that holds one of A's pages (A is not: it finished; nor is a request whose own
    transfer has not landed yet: that transfer overwrites the late write and stamps its own ticket).

``mamba_index_swap``  hybrid linear-attention / mamba models (a ``HybridReqToTokenPool``): when armed, candidate
    A's state index (``req_index_to_mamba_index_mapping[A's row]``, what the forward's linear-attention layers
    read) is set to candidate B's state slot; every Req keeps its own ``mamba_pool_idx``. Victim: A (B is not: a
    guard must keep A's forward off B's state).
``mamba_slot_reuse``  hybrid models, at a reuser's prefill (before SGLang allocates): candidate A's state slot is
    put at the head of the slot allocator's free list (``MambaSlotAllocator.free_slots``) while A still holds it,
    so the reuser's ``HybridReqToTokenPool.alloc`` receives it. Victim: A (the reuser, the slot's new holder, is
    not).
``spec_mamba_index_swap``, ``spec_mamba_slot_reuse``  the same two on a hybrid model with speculative decoding (a spec
    engine), between two spec steps: A's next verify would read and rewrite B's state (its commit scatter A's accepted
    state into B's slot), or the reuser's prefill writes A's slot. Skipped (logged) on an engine without speculative
    decoding. Victim: A.

``swa_cleared_entry``  sliding-window hybrids (``SWATokenToKVPoolAllocator``): when armed, candidate A's full slot at a
    position its next decode step reads through the sliding window gets its ``full_to_swa_index_mapping`` entry
    cleared (0, SGLang's padding slot). Victim: A.
``swa_foreign_entry``  the same entry pointed at candidate B's SWA page (at an in-window position of B's). Victim: A
    (B is not: a guard must keep A's sliding-window layers off B's slot).
``swa_freed_slot``  the SWA page behind that entry freed through the SWA sub-allocator to the head of its free list
    (the entry left as it is), so the next SWA allocation reuses it. Victim: A (the page's next holder is not).

``spec_region_entry``, ``draft_slot_reused``, ``rejected_page_freed``  speculative decoding only (a spec engine),
    when armed, between two spec steps, in candidate A's region ``[kv_committed_len, kv_allocated_len)`` that
    ``alloc_for_spec_decode`` reserved (the step's draft and verify forwards read and write there): an entry of it
    points at a page another candidate B holds privately; or at a slot of B's reserved region (both requests'
    draft forwards address one draft-pool slot); or A's last reserved slot is freed to the head of the free list
    while A's row still maps it (the step's allocation hands it out again). Victim: A (B and the slot's new holder
    are not). See ``path_strikes._strike_spec``.

``shared_row`` lines (``rids``, ``rows``) name every decode step that SGLang is about to prepare with two
requests on one ``req_to_token`` row (a stale row still scheduled next to its new owner).

Log lines (one JSON object each): ``{"event": "inject", "fault", "seed", "label", "step", "victims":
[rid...], "rows", "pages", "entries", "page_size", "time"}``; ``decoding`` (a first candidate is in a
decode batch: its prompt is in the radix tree now, so a driver can send the others to share its prefix
pages); ``armed``, ``owner``, ``victim``, ``idle_check``, ``retract``, ``abort``; ``pools`` (once, at the first
decode step: the KV pool's and the allocator's class names, and the process's ranks: ``tp_rank``, ``attn_tp_ranks``
(SGLang's attention-TP group) and ``kvguard_agrees_with`` (the ranks of kvguard's verdict agreement; [] for one
rank, None where kvguard has not looked them up)); ``transfer`` (the PD writer wrote a request's prompt KV: ``rid``,
``row``, ``fill_len``, ``pages``, ``ticket``); ``restored`` (stale_batch_row undone); ``skipped`` when a
fault found nothing to corrupt (e.g. no private page).

Used by tests/test_faultlab/test_sglang_live/test_sglang_engine.py and test_sglang_paths.py (through
:mod:`.harness`) and :mod:`.sweep`.
"""
from __future__ import annotations

import math
import os
import time

from . import strikes
from .plan import (
    ENV_ACCOUNTING,
    ENV_CPU_MAMBA,
    ENV_CPU_SPEC,
    ENV_DUMMY,
    ENV_FAULTS,
    ENV_KV_WATCH,
    ENV_KV_WATCH_RIDS,
    ENV_LOG,
    ENV_PD_WRITER,
    ENV_ROTARY,
    ENV_SEED,
    PlanError,
    parse_plan,
)
from .runtime import State, label_of, log

_SRT = "sglang.srt"
TARGETS = {
    "prepare_for_decode": f"{_SRT}.managers.schedule_batch.ScheduleBatch.prepare_for_decode",
    "alloc_for_extend": f"{_SRT}.mem_cache.allocation.alloc_for_extend",
    "alloc_for_decode": f"{_SRT}.mem_cache.allocation.alloc_for_decode",
    "mix_with_running": f"{_SRT}.managers.schedule_batch.ScheduleBatch.mix_with_running",
    "dummy_load": f"{_SRT}.model_loader.loader.DummyModelLoader.load_model",
    "commit_transfer": f"{_SRT}.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
    "check_all_pools": f"{_SRT}.managers.scheduler_components.invariant_checker."
                       "SchedulerInvariantChecker._check_all_pools",
    "retract_decode": f"{_SRT}.managers.schedule_batch.ScheduleBatch.retract_decode",
    "process_input_requests": f"{_SRT}.managers.scheduler.Scheduler.process_input_requests",
    "prepare_abort": f"{_SRT}.disaggregation.utils.prepare_abort",
}


# ------------------------------------------------------------------------------------------------
# Plugin entry
# ------------------------------------------------------------------------------------------------
def register(env=None) -> bool:
    """SGLang plugin entry point. True when any hook was registered."""
    env = os.environ if env is None else env
    if env.get(ENV_ROTARY) == "1":
        from . import cpu_rotary

        cpu_rotary.install()
    if env.get(ENV_CPU_SPEC) == "1":
        from . import cpu_spec

        cpu_spec.install()
    if env.get(ENV_CPU_MAMBA) == "1":
        from . import cpu_mamba

        cpu_mamba.install()
    if env.get("FAULTLAB_SGLANG_CPU_MAMBA_SPEC") == "1":  # (faultlab/sglang_live/cpu_mamba_spec.py: ENV_VAR)
        from . import cpu_mamba_spec

        cpu_mamba_spec.install()
    if env.get("FAULTLAB_SGLANG_CPU_DP") == "1":  # (faultlab/sglang_live/cpu_dp.py: ENV_VAR)
        from . import cpu_dp

        cpu_dp.install()
    if env.get("FAULTLAB_SGLANG_CPU_PD") == "1":  # (faultlab/sglang_live/cpu_pd.py: ENV_VAR)
        from . import cpu_pd

        cpu_pd.install()
    if env.get("FAULTLAB_SGLANG_SWA_CUDA_FREE") == "1":  # (faultlab/sglang_live/cpu_swa.py: ENV_VAR)
        from . import cpu_swa

        cpu_swa.install()
    from . import pd_faults  # PD over Mooncake or NIXL: a held send, its late landing, a prefill-side fault

    if any(env.get(name) for name in pd_faults.ENVS):
        pd_faults.install(env)
    try:
        plan = parse_plan(env.get(ENV_FAULTS, ""), env.get(ENV_SEED, "0"))
    except PlanError as exc:
        # SystemExit, not an Exception: SGLang's plugin loader swallows exceptions, and a test whose
        # plan was silently dropped would run fault-free and prove nothing.
        raise SystemExit(f"faultlab_inject: {exc}") from None
    accounting = bool(plan) or env.get(ENV_ACCOUNTING) == "1"
    dummy = env.get(ENV_DUMMY)
    watch = env.get(ENV_KV_WATCH) == "1"
    writer = env.get(ENV_PD_WRITER) == "1"
    if not (plan or accounting or dummy or watch or writer) or State.registered:
        return State.registered
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    State.registered = True
    State.plan = plan
    State.log_path = env.get(ENV_LOG, State.log_path)
    if dummy:
        std = float(dummy)
        HookRegistry.register(TARGETS["dummy_load"], lambda model, *a, **k: _reinit(model, std),
                              HookType.AFTER)
    if accounting:
        HookRegistry.register(TARGETS["check_all_pools"], _after_check_all_pools, HookType.AFTER)
        HookRegistry.register(TARGETS["retract_decode"], _after_retract_decode, HookType.AFTER)
        HookRegistry.register(TARGETS["process_input_requests"], _after_process_input_requests, HookType.AFTER)
        HookRegistry.register(TARGETS["prepare_abort"], _after_prepare_abort, HookType.AFTER)
    if plan:
        HookRegistry.register(TARGETS["prepare_for_decode"], strikes.before_prepare_for_decode, HookType.BEFORE)
        HookRegistry.register(TARGETS["alloc_for_extend"], strikes.around_alloc_for_extend, HookType.AROUND)
        HookRegistry.register(TARGETS["alloc_for_decode"], strikes.after_alloc_for_decode, HookType.AFTER)
        # NOTE: registered before kvguard's hooks (SGLang loads faultlab_inject first), so this AFTER hook
        # runs inside kvguard's: after SGLang and kvguard prepared the step, before kvguard's check.
        HookRegistry.register(TARGETS["prepare_for_decode"], strikes.after_prepare_for_decode, HookType.AFTER)
        HookRegistry.register(TARGETS["mix_with_running"], strikes.after_mix_with_running, HookType.AFTER)
    if writer:
        from . import pd

        HookRegistry.register(TARGETS["commit_transfer"], pd.after_commit_transfer, HookType.AFTER)
    if watch:
        from . import kvwatch

        kvwatch.Watch.rids_with = env.get(ENV_KV_WATCH_RIDS, kvwatch.Watch.rids_with)
        HookRegistry.register(TARGETS["prepare_for_decode"], kvwatch.before_prepare_for_decode, HookType.BEFORE)
        HookRegistry.register(TARGETS["alloc_for_decode"], kvwatch.after_alloc_for_decode, HookType.AFTER)
    return True


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
def _after_retract_decode(result, batch, *args, **kwargs):
    retracted, _, aborted = result
    for req in list(retracted) + list(aborted):  # one line per request, under its episode's label
        log("retract", rid=str(req.rid), label=label_of(str(req.rid)), aborted=req in aborted)
    return None


def _after_prepare_abort(result, req, error_message, *args, **kwargs):
    log("abort", rid=str(req.rid), label=label_of(str(req.rid)), message=str(error_message)[:200])
    return None


def _after_process_input_requests(result, scheduler, recv_reqs, *args, **kwargs):
    # NOTE: a scheduler that sleeps on idle runs its idle check once per wake-up; the line after a driver's
    # message (the harness asks for the server's info once an episode's clients have their answers) is
    # written even within 0.3 s of the last one, so the driver need not wait for the next wake-up.
    if recv_reqs:
        State.idle_wanted = True
    return None


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
    if state != State.last_idle or now - State.last_idle_time > 0.3 or State.idle_wanted:
        State.last_idle, State.last_idle_time, State.idle_wanted = state, now, False
        log("idle_check", leak=bool(has_leak), messages=list(messages), req_free=len(rpool.free_slots),
            req_total=req_total, free_dups=dups, decode_steps=State.decode_steps,
            chunk_continuations=State.chunk_continuations, mixed_batches=State.mixed_batches,
            balanced=not has_leak and len(rpool.free_slots) == req_total and dups == 0)
    return None
