"""Attention TP (2 gloo ranks): the ranks agree on whom to abort, for a stale row before the decode step and
for a broken table entry at the verdict (the device-group all-reduce at launch).

Each rank is a process with SGLang 0.5.23's real pools, allocator, radix tree and ScheduleBatch, kvguard's
hooks applied by SGLang's own plugin loader. The bug happens on rank 1 only (its row pool releases a running
request's row, which a newcomer then gets); rank 0's pools are intact. If the ranks dropped different
requests they would run different batches and hang in the next collective, so both must abort the same
request, each releasing it the right way: rank 1 without touching the row its newcomer owns, rank 0
through SGLang's normal release. Afterwards both ranks' pools balance.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import two_ranks
from two_ranks import load_kvguard, of

pytestmark = pytest.mark.sglang


def _join(rank: int, port: int) -> None:
    """This rank's process group and kvguard's hooks (two_ranks.load_kvguard); kvguard's rig view of its ranks."""
    load_kvguard(rank, port)
    import kvguard.sglang.plugin as plugin  # noqa: F401
    import kvguard.sglang.runtime as runtime

    # kvguard's lookup of the attention-TP groups finds none here (the rig runs no SGLang model-parallel init), in a
    # world of two ranks: it stops, never takes this for one rank. The rig's per-step hooks then run as one rank;
    # each test makes the ranks agree explicitly (the group passed to stale_aborts / resolve, or set in _GROUP).
    try:
        runtime._attn_tp()
        raise AssertionError("a failed attention-TP lookup in a 2-rank world was taken for one rank")
    except SystemExit:
        pass
    runtime._GROUP[:], runtime._ONE_RANK = [(None, None)], True


def _agreement():
    """kvguard's agreement across this process group's ranks (on the CPU: torch.distributed's all-reduce)."""
    from kvguard.sglang.agree import VerdictAgreement

    return VerdictAgreement(dist.group.WORLD, torch.device("cpu"))


def _rank_rig():
    """A fresh rig on this rank's pools, with kvguard installed: (rig, guard)."""
    from faultlab.sglang_live.rig import Rig

    rig = Rig(16)
    return rig, rig.install()


def _stale_row(rank: int) -> dict:
    """A stale row on rank 1 only, before the decode step: what this rank flagged, streamed and released."""
    rig, guard = _rank_rig()
    batch = rig.running(20, 35)
    victim = batch.reqs[0]
    if rank == 1:
        rig.req_to_token_pool.free_rows([victim.kv.req_pool_idx])  # the bug, on this rank only
    newcomer = rig.prefill(24)
    batch = rig.to_decode(batch, newcomer)
    flagged = guard.stale_aborts(batch, group=dist.group.WORLD)
    streamed = []
    guard.abort(flagged, tree_cache=rig.tree, stream=lambda reqs, *a: streamed.extend(reqs))
    batch.filter_batch()
    batch.prepare_for_decode()
    rig.sample(batch)
    for req in batch.reqs:
        rig.release(req)
    free = len(rig.allocator.get_all_free_pages()) + rig.tree.evictable_size() // 16  # tree pages evictable
    return {"flagged": [(str(r.rid), here) for r, _, here in flagged],
            "streamed": [str(r.rid) for r in streamed], "victim": str(victim.rid),
            "finished": victim.finished(), "rows_free": len(rig.req_to_token_pool.free_slots),
            "rows_total": rig.req_to_token_pool.size, "pages_free": free, "pages": rig.allocator.num_pages,
            "locked": rig.tree.protected_size(), "messages": [m for _, m, _ in flagged]}


def _broken_entry(rank: int) -> dict:
    """A broken table entry on rank 1 only, at step 1 of 3: whom each step's verdict aborted on this rank."""
    rig, guard = _rank_rig()
    batch = rig.running(40, 35, 20)
    victim = batch.reqs[1]
    results = []
    for step in range(3):
        if rank == 1 and step == 1:  # the bug, on this rank only: one entry names another request's page
            table = rig.req_to_token_pool.req_to_token
            table[victim.kv.req_pool_idx, 3] = table[batch.reqs[0].kv.req_pool_idx, 3]
        batch.prepare_for_decode()
        pending = guard.launch(batch, agreement=_agreement())  # what the hook does under attention TP
        flagged = guard.resolve(pending, group=dist.group.WORLD)
        results.append([(str(r.rid), m) for r, m, _ in flagged])
        rig.sample(batch)
    return {"victim": str(victim.rid), "steps": results}


def _broken_entry_at_forward(rank: int) -> dict:
    """As :func:`_broken_entry`, with the decode check armed by SGLang's own prepare_for_decode (kvguard's hook)
    and fired by the forward that runs the batch (an eager decode forward: ``fire_armed``), which all-reduces the
    verdict over the ranks right after the launch; the verdict read as the result hook reads it."""
    import kvguard.sglang.plugin as plugin  # noqa: F401
    import kvguard.sglang.runtime as runtime

    # it is given this process group as SGLang's CPU group of the attention-TP ranks (see _join)
    runtime._GROUP[:], runtime._ONE_RANK = [(dist.group.WORLD, _agreement())], False
    try:
        return _at_forward(rank)
    finally:
        runtime._GROUP[:], runtime._ONE_RANK = [(None, None)], True


def _at_forward(rank: int) -> dict:
    import kvguard.sglang.plugin as plugin  # noqa: F401
    import kvguard.sglang.runtime as runtime

    rig, guard = _rank_rig()
    guard.defer = True  # as on a scheduler whose decode forwards all go through a runner kvguard hooks
    batch = rig.running(40, 35, 20)
    victim = batch.reqs[1]
    results, fired = [], []
    for step in range(3):
        if rank == 1 and step == 1:
            table = rig.req_to_token_pool.req_to_token
            table[victim.kv.req_pool_idx, 3] = table[batch.reqs[0].kv.req_pool_idx, 3]
        batch.prepare_for_decode()  # kvguard's alloc_for_decode hook arms the check (attention TP: 2 ranks)
        pending = batch._kvguard
        fired.append([pending.slot, pending.group is runtime._GROUP[0][1]])  # slot -1: armed, not launched
        guard.fire_armed(SimpleNamespace(req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                                         out_cache_loc=batch.out_cache_loc, batch_size=len(batch.reqs)))
        # what the result hook reads before any wait: every rank's verdict in, and clean
        clean = guard._ring.agreed_clean(pending.slot, pending.cells)
        flagged = guard.resolve(pending, group=dist.group.WORLD)
        results.append([(str(r.rid), m) for r, m, _ in flagged])
        fired[-1] += [pending.slot >= 0, pending.agreed is not None, clean]
        rig.sample(batch)
    return {"victim": str(victim.rid), "steps": results, "armed": fired}


def _agree_stale(rank: int) -> dict:
    """The agreement itself: rank 1 counts request 1's row stale (its own check passed on every rank), rank 0 nothing;
    what each rank reads back, and whether it reads the step clean before any wait."""
    from kvguard.sglang.guard import VerdictRing

    ring = VerdictRing(None, torch.device("cpu"))
    ring.verdict(0, 3, 2048)
    ring.buffers()[0][:6] = torch.zeros(6, dtype=torch.int32)  # 3 requests x 2 chunks, nothing bad here
    clean = [ring.agree(0, 6, 3, None, _agreement()).tolist(), bool(ring.agreed_clean(0, 6))]
    stale = [False, rank == 1, False] if rank == 1 else None
    flagged = [ring.agree(0, 6, 3, stale, _agreement()).tolist(), bool(ring.agreed_clean(0, 6))]
    return {"clean": clean, "flagged": flagged}


SCENARIOS = {"stale_row": _stale_row, "broken_entry": _broken_entry, "broken_entry_at_forward": _broken_entry_at_forward,
             "agree_stale": _agree_stale}


@pytest.fixture(scope="module")
def ranks() -> dict:
    """{scenario: {rank: what that rank reported}}: one 2-rank launch runs every scenario."""
    return two_ranks.run(_join, SCENARIOS, timeout=240)


def test_ranks_agree_on_a_broken_entry_seen_by_one_rank(ranks):
    r0, r1 = of(ranks, "broken_entry")
    assert r0["victim"] == r1["victim"]
    for r in (r0, r1):
        assert r["steps"][0] == []  # clean before the bug
        assert [rid for rid, _ in r["steps"][1]] == [r["victim"]]  # the same one request on both ranks
        assert [rid for rid, _ in r["steps"][2]] in ([], [r["victim"]])  # still broken, or already gone
    assert "tag_mismatch" in r1["steps"][1][0][1] or "page" in r1["steps"][1][0][1]  # explained where it broke
    assert "peer tensor-parallel rank" in r0["steps"][1][0][1]  # the other rank aborts it too


def test_ranks_agree_on_a_broken_entry_when_the_forward_fires_the_check(ranks):
    r0, r1 = of(ranks, "broken_entry_at_forward")
    for r in (r0, r1):
        # armed by the hook over the 2 ranks, launched by the forward, its verdict all-reduced on the device group
        assert [a[:4] for a in r["armed"]] == [[-1, True, True, True]] * 3
        # clean before the bug; after it, not clean on either rank (rank 0's own check passed)
        assert [a[4] for a in r["armed"]] == [True, False, r["steps"][2] == []]
        assert r["steps"][0] == []
        assert [rid for rid, _ in r["steps"][1]] == [r["victim"]]
        assert [rid for rid, _ in r["steps"][2]] in ([], [r["victim"]])
    assert "peer tensor-parallel rank" in r0["steps"][1][0][1] and "peer" not in r1["steps"][1][0][1]


def test_the_agreement_carries_one_ranks_stale_row_to_every_rank(ranks):
    for r in of(ranks, "agree_stale"):
        assert r["clean"] == [[0] * 6, True]
        assert r["flagged"] == [[0, 0, 1, 0, 0, 0], False]  # request 1's first cell, on both ranks


def test_ranks_agree_on_a_stale_row_seen_by_one_rank(ranks):
    r0, r1 = of(ranks, "stale_row")
    assert r0["victim"] == r1["victim"]
    assert r1["flagged"] == [(r1["victim"], True)]  # stale here: released without touching the row
    assert r0["flagged"] == [(r0["victim"], False)]  # stale on the peer only: released normally here
    assert "stale row" in r1["messages"][0] and "peer tensor-parallel rank" in r0["messages"][0]
    for r in (r0, r1):
        assert r["streamed"] == [r["victim"]] and r["finished"]
        assert r["rows_free"] == r["rows_total"], r  # every row back, the newcomer's included
        assert r["pages_free"] == r["pages"] and r["locked"] == 0, r  # every page back, the victim's included
