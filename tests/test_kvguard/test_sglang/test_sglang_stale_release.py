"""Rows that are not a request's own, and every path that releases a running request (issue 47, items 4 to 6).

Each test drives SGLang 0.5.23's real scheduling code on the rig's real pools, allocator and radix tree, kvguard's
hooks applied by SGLang's own plugin loader: ``Scheduler._get_new_batch_prefill_raw`` (the mixed chunked-prefill
step, priority preemption), ``Scheduler.update_running_batch`` and ``Scheduler.pause_generation`` run on a
scheduler shell (:func:`_scheduler`) that holds the rig's pools and stand-ins only for what kvguard does not touch
(grammar, policy ordering, metrics, the admission budget). Each one failed on main (935c1c3).

- **A stale row in a mixed step** (item 4): SGLang relays every request's sampled token through the overlap
  FutureMap's ``output_tokens_buf[row]``; a request whose row went to a newcomer must not run the mixed step beside
  the row's owner, or the owner's next input is the other request's token.
- **A row released under a running request** (item 5): kvguard no longer follows it; the request is a violation,
  never run with 0 entries checked and no write guard (and, under attention TP, with a verdict of another size
  than its peers').
- **Release paths** (item 6): ``pause_generation(mode="retract")`` and priority preemption release running
  requests through their rows, last checked a step before: only the pages a request legitimately holds go back,
  and a row that is not its own is never freed.
"""
from __future__ import annotations

import os
import socket
from types import SimpleNamespace as NS

import pytest
import torch
from sglang_scheduler import scheduler_shell

pytestmark = pytest.mark.sglang
both_backends = pytest.mark.usefixtures("kvguard_backend")  # the torch references and the Triton kernels


def _free_pages(rig) -> list[int]:
    return sorted(rig.allocator.get_all_free_pages().tolist())


def _all_pages(rig) -> list[int]:
    return list(range(1, rig.allocator.num_pages + 1))


def _release_all(rig, reqs) -> None:
    for req in reqs:
        if req.kv.holds_kv:
            rig.release(req)


def _balanced(rig) -> None:
    """Every page and row back exactly once (no double free, no leak), no tree lock held."""
    free, tree = _free_pages(rig), rig.tree.evictable_size() // rig.page_size
    assert len(free) == len(set(free)), "a page is on the free list twice"
    assert len(free) + tree == rig.allocator.num_pages, (len(free), tree, rig.allocator.num_pages)
    rows = rig.req_to_token_pool.free_slots
    assert sorted(rows) == list(range(1, rig.req_to_token_pool.size + 1)), sorted(rows)
    assert rig.tree.protected_size() == 0


def _relay(batch, tokens) -> torch.Tensor:
    """The overlap scheduler's relay after this batch's forward: each request's sampled token stashed at its row of
    the FutureMap (``Scheduler._relay_forward_payload``); the map's output_tokens_buf."""
    from sglang.srt.managers.overlap_utils import FutureMap, RelayPayload
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    future_map = FutureMap(torch.device("cpu"), SpeculativeAlgorithm.NONE, batch.req_to_token_pool,
                           needs_cpu_seq_lens=False)
    future_map.stash(batch.req_pool_indices, RelayPayload(bonus_tokens=tokens))
    return future_map.output_tokens_buf


# -- item 4: a stale row in a mixed chunked-prefill step -----------------------------------------------------
@both_backends
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_stale_row_in_a_mixed_chunk_step_is_aborted_before_the_step(make_rig, page_size):
    rig = make_rig(page_size)
    rig.install(registry=rig.registry)
    running = rig.running(20, 2 * page_size + 3)
    victim, other = running.reqs
    row = victim.kv.req_pool_idx
    rig.req_to_token_pool.free_rows([row])  # the bug: its row is released under it
    owner = rig.make_req(24)  # the next prefill takes that row (SGLang's row pool is LIFO)
    s = scheduler_shell(rig, mixed=True, running=running)
    s.waiting_queue = [owner]
    batch, s.running_batch = s._get_new_batch_prefill_raw(None, running)  # SGLang's mixed step, as scheduled
    assert owner.kv.req_pool_idx == row  # the row changed hands inside this very step
    rows = batch.req_pool_indices.tolist()
    tokens = torch.arange(len(rows)) + 1000  # this step's sampled token of each batch entry
    buf = _relay(batch, tokens)
    # the owner's next input is its own sampled token, never the stale request's
    assert int(buf[owner.kv.req_pool_idx]) == int(tokens[batch.reqs.index(owner)])
    assert len(rows) == len(set(rows)), f"two requests on one row in the mixed step: {rows}"
    assert victim not in batch.reqs and victim.finished() and s.streamed == [victim]
    assert "stale row" in victim.finished_reason.message
    from kvguard.sglang.runtime import _flagged

    assert _flagged(batch, None)[1] == []  # the owner's prefill and the other request's decode: clean
    rig.sample(batch)
    _release_all(rig, batch.reqs)
    _balanced(rig)  # the victim's pages came back too, its old row once (with its owner)


@both_backends
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_stale_row_is_aborted_before_a_decode_step_through_update_running_batch(make_rig, page_size):
    rig = make_rig(page_size)
    rig.install(registry=rig.registry)
    batch = rig.running(20, 2 * page_size + 3)
    victim, other = batch.reqs
    rig.req_to_token_pool.free_rows([victim.kv.req_pool_idx])
    newcomer = rig.prefill(24)
    owner = newcomer.reqs[0]
    assert owner.kv.req_pool_idx == victim.kv.req_pool_idx
    newcomer.prefill_input_ids_cpu = None
    batch = rig.to_decode(newcomer, batch)
    s = scheduler_shell(rig, running=batch)
    batch = s.update_running_batch(batch)  # SGLang's own: filter, retract if full, prepare_for_decode
    assert batch.reqs == [owner, other] and s.streamed == [victim] and "stale row" in victim.finished_reason.message
    assert rig.verdict(batch) == {owner.rid: 0, other.rid: 0}
    rig.sample(batch)
    _release_all(rig, batch.reqs)
    _balanced(rig)


# -- item 5: a row kvguard no longer follows --------------------------------------------------------------------
@both_backends
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_row_released_under_a_running_request_is_aborted_before_its_step(make_rig, page_size):
    rig = make_rig(page_size)
    rig.install(registry=rig.registry)
    batch = rig.running(20, 2 * page_size + 3)
    victim, other = batch.reqs
    row = victim.kv.req_pool_idx
    rig.req_to_token_pool.free_rows([row])  # the bug: released under it; nobody took the row yet
    s = scheduler_shell(rig, running=batch)
    batch = s.update_running_batch(batch)
    assert s.streamed == [victim] and victim.finished(), "a request kvguard no longer follows ran its step"
    assert "released" in victim.finished_reason.message and str(row) in victim.finished_reason.message
    assert batch.reqs == [other] and rig.verdict(batch) == {other.rid: 0}
    counts = {labels: c._value.get() for labels, c in rig.guard.tracker.metrics.violations._metrics.items()}
    assert counts[("unknown_row",)] == 1, counts
    rig.sample(batch)
    _release_all(rig, batch.reqs)
    _balanced(rig)  # its pages came back; its row (already free) was not freed twice


@both_backends
@pytest.mark.parametrize("page_size", [1, 16])
def test_an_unknown_row_in_a_prepared_batch_is_flagged_and_its_write_guarded(make_rig, page_size):
    """The check's own backstop (a decode batch prepared without the scheduler's abort before the step): the request
    whose row kvguard no longer follows is flagged by the verdict and writes the padding slot, never its old row."""
    rig = make_rig(page_size)
    guard = rig.install(registry=rig.registry)
    batch = rig.running(20, 2 * page_size + 3)
    victim, other = batch.reqs
    row = victim.kv.req_pool_idx
    rig.req_to_token_pool.free_rows([row])
    before = rig.req_to_token_pool.req_to_token[row].clone()
    rig.decode(batch)  # SGLang's prepare_for_decode (kvguard's alloc_for_decode hook arms the check)
    assert rig.verdict(batch) == {victim.rid: 1, other.rid: 0}
    assert batch.out_cache_loc.tolist()[0] == 0  # its write goes to the padding slot
    assert torch.equal(rig.req_to_token_pool.req_to_token[row], before)  # nothing written into the freed row
    flagged = guard.resolve(batch.__dict__.pop("_kvguard"))
    assert [(r.rid, "released" in m) for r, m, _ in flagged] == [(victim.rid, True)]
    guard.abort(flagged, tree_cache=rig.tree, stream=None)
    rig.sample(batch)
    batch.filter_batch()
    _release_all(rig, batch.reqs)
    _balanced(rig)


@both_backends
def test_finished_requests_still_in_the_batch_are_not_flagged(make_rig):
    """The legitimate unknown row: a request finished and released by the last result, still in the running batch
    until SGLang's filter drops it. Nobody is aborted; the step runs clean."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    rig = make_rig(16)
    rig.install(registry=rig.registry)
    batch = rig.running(20, 35, 40)
    done = batch.reqs[1]
    done.finished_reason = FINISH_LENGTH(length=1)
    rig.release(done, checkpoint=True)  # what the result processing does with a finished request
    s = scheduler_shell(rig, running=batch)
    batch = s.update_running_batch(batch)
    assert s.streamed == [] and done not in batch.reqs and len(batch.reqs) == 2
    assert set(rig.verdict(batch).values()) == {0}


# -- item 6: every release path frees only what a request legitimately holds --------------------------------------
def _broken_pair(rig):
    """Three running requests; A's second page's entries name C's first page (broken since its last check):
    (batch, A, C, C's page, A's own second page)."""
    ps = rig.page_size
    batch = rig.running(2 * ps + 3, 2 * ps + 3, 2 * ps + 3)
    a, _, c = batch.reqs
    c_page, a_page1 = rig.pages_of(c)[0], rig.pages_of(a)[1]
    rig.row(a)[ps:2 * ps] = rig.page_slots(c_page).to(torch.int32)
    return batch, a, c, c_page, a_page1


@both_backends
def test_pause_generation_retract_frees_only_legitimate_pages(make_rig):
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    rig = make_rig(16)
    rig.install(registry=rig.registry)
    batch, a, c, c_page, a_page1 = _broken_pair(rig)
    reqs = list(batch.reqs)
    s = scheduler_shell(rig, running=batch)
    s.pause_generation(PauseGenerationReqInput(mode="retract"))  # SGLang's /pause_generation, mode=retract
    assert s.waiting_queue == reqs and s.running_batch.reqs == []  # all retracted, re-queued
    _balanced(rig)  # A's release did not free C's page (C freed it once) and did not leak its own second page


@both_backends
def test_priority_preemption_frees_only_legitimate_pages(make_rig):
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    batch, a, c, c_page, a_page1 = _broken_pair(rig)
    for req, priority in zip(batch.reqs, (0, 5, 5)):
        req.priority = priority
    urgent = rig.make_req(30)
    urgent.priority = 10
    s = scheduler_shell(rig, priority=True, running=batch)
    s.waiting_queue, s.budget = [urgent], 0  # no row free for it: a running request must make room
    new, running = s._get_new_batch_prefill_raw(None, batch)
    assert new is not None and new.reqs == [urgent] and a in s.waiting_queue  # A was preempted for it
    assert c_page not in rig.pages_of(urgent) and c_page not in _free_pages(rig), "C's page was freed under C"
    assert a_page1 in rig.pages_of(urgent) + _free_pages(rig)  # A's own page came back
    assert rig.verdict(new) == {urgent.rid: 0}
    rig.sample(new)
    rig.decode(running)
    assert rig.verdict(running) == {r.rid: 0 for r in running.reqs}
    rig.sample(running)
    _release_all(rig, running.reqs + new.reqs)
    _balanced(rig)


@both_backends
def test_a_retraction_never_frees_a_row_that_is_not_the_requests(make_rig):
    """pause_generation(retract) right after a prefill gave a running request's row to a newcomer (the stale
    request had not run since): the stale request is released without touching that row (its owner frees it once),
    and its own pages come back."""
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    rig = make_rig(16)
    rig.install(registry=rig.registry)
    batch = rig.running(20, 35)
    victim = batch.reqs[0]
    rig.req_to_token_pool.free_rows([victim.kv.req_pool_idx])
    newcomer = rig.prefill(24)
    assert newcomer.reqs[0].kv.req_pool_idx == victim.kv.req_pool_idx
    batch = rig.to_decode(batch, newcomer)
    s = scheduler_shell(rig, running=batch)
    s.pause_generation(PauseGenerationReqInput(mode="retract"))
    _balanced(rig)


def test_release_paths_are_in_the_registry():
    from kvguard.sglang.paths import BY_NAME, CHECKED, active, facts_of

    args = NS(enable_priority_scheduling=True)
    assert BY_NAME["priority_scheduling"] in active(facts_of(args))
    assert BY_NAME["priority_scheduling"] not in active(facts_of(NS()))
    for name in ("priority_scheduling", "pause_generation_retract", "retraction"):
        p = BY_NAME[name]
        assert p.status == CHECKED and os.path.exists(p.evidence.split(" ")[0]), p
    assert BY_NAME["pause_generation_retract"] in active(facts_of(NS()))  # any server: per call, at runtime


# -- item 5 under attention TP: the ranks agree, on verdicts of one size ------------------------------------------
def _tp_rank(rank: int, port: int, out) -> None:
    """Rank 1 releases the victim's row (kvguard no longer follows it there); both ranks run the decode step with
    the check armed by SGLang's prepare_for_decode and fired by the forward, over both ranks."""
    import torch.distributed as dist

    try:
        os.environ.update({"SGLANG_PLUGINS": "kvguard", "KVGUARD_MODE": "check", "KVGUARD_BACKEND": "torch"})
        import sglang.srt.managers.scheduler  # noqa: F401
        import sglang.srt.plugins as plugins

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        plugins._plugins_loaded = False
        plugins.load_plugins()
        import kvguard.sglang.plugin as plugin  # noqa: F401
        import kvguard.sglang.runtime as runtime
        from faultlab.sglang_live.rig import Rig
        from kvguard.sglang.agree import VerdictAgreement

        # SGLang's attention-TP group is this process group (the rig runs no SGLang model-parallel init)
        runtime._GROUP[:], runtime._ONE_RANK = [(dist.group.WORLD, VerdictAgreement(dist.group.WORLD,
                                                                                   torch.device("cpu")))], False
        rig = Rig(16)
        guard = rig.install()
        batch = rig.running(40, 300, 20)  # the victim is the longest: its entries size the verdict (2 chunks)
        guard.defer = True  # as on a scheduler whose decode forwards all go through a runner kvguard hooks
        victim = batch.reqs[1]
        if rank == 1:
            rig.req_to_token_pool.free_rows([victim.kv.req_pool_idx])
        batch.prepare_for_decode()
        pending = batch._kvguard
        guard.fire_armed(NS(req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                            out_cache_loc=batch.out_cache_loc, batch_size=len(batch.reqs)))
        flagged = guard.resolve(pending, group=dist.group.WORLD)
        cells = pending.cells if pending.check is None else pending.check.verdict.numel()  # (bound, or general)
        out.put({"rank": rank, "cells": cells, "victim": str(victim.rid),
                 "flagged": [str(r.rid) for r, _, _ in flagged]})
    except BaseException as exc:
        out.put({"rank": rank, "error": repr(exc)})
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_ranks_agree_on_a_row_released_on_one_rank():
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            r = out.get(timeout=150)  # (on main the ranks hung in an all-reduce of two verdict sizes)
            got[r["rank"]] = r
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all("error" not in r for r in got.values()), got
    assert got[0]["cells"] == got[1]["cells"], got  # one verdict size on every rank
    assert got[0]["flagged"] == got[1]["flagged"] == [got[0]["victim"]], got
