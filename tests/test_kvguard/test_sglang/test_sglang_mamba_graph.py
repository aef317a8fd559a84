"""The recurrent-state check captured beside the decode KV check in SGLang's decode graphs (kvguard/sglang/mamba.py,
``GraphStateCheck``), on the CPU: SGLang 0.5.23's real ``HybridReqToTokenPool`` (a tiny NemotronH's mamba2 state and a
tiny Qwen3-Next's GDN state), paged allocator, ``UnifiedRadixCache`` and real ``Req`` / ``ScheduleBatch`` objects,
kvguard's hooks as SGLang's plugin loader applied them, and each decode step run as a graph replay runs it: the
replay hook, then the captured checks (KV and state, one launch of the graph's check and its sides, the kernels under
the Triton interpreter; there is no CUDA graph here) on the forward's row buffer, then kvguard's result hook.

A clean step launches nothing of the state check's own and its verdict reads clean from the one result word before
any wait; a state index swapped before the replay, or a slot handed to a second request, aborts exactly the victim,
its index pointed at the dummy slot before the forward reads it; the pools balance. Without the captured side the
same swap goes unseen on this path (what the side is for).
"""
from types import SimpleNamespace

import pytest
import torch

from faultlab.sglang_live.families import FAMILIES

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def model_path(request, tmp_path_factory):
    from faultlab.sglang_live.harness import write_model

    return write_model(str(tmp_path_factory.mktemp(request.param)), FAMILIES[request.param])


@pytest.fixture
def hybrid(check_hooks, model_path, monkeypatch):
    """A one-rank hybrid rig on the graph path: (rig, guard, follower, replay runner)."""
    from kvguard.sglang import runtime
    from test_sglang_graph_path import on_graph
    from test_sglang_mamba_tp import _hybrid_rig

    monkeypatch.setattr(runtime, "_GROUP", [(None, None)])
    monkeypatch.setattr(runtime, "_ONE_RANK", True)
    rig, guard = _hybrid_rig(model_path)
    runner = on_graph(rig)  # the guard's graph buffers on (its enable_graph: the state side made with them)
    assert guard.mamba.side is not None and guard.graph.sides == [guard.mamba.side]
    return SimpleNamespace(rig=rig, guard=guard, state=guard.mamba, runner=runner)


def _slot(req) -> int:
    return int(req.kv.mamba_pool_idx)


def _running(h, *prompt_lens):
    """Prefill (its eager check, resolved as the prefill result hook resolves it), merged into a decode batch."""
    from kvguard.sglang import runtime

    batch = h.rig.prefill(*prompt_lens)
    _, flagged = runtime._flagged(batch, None)
    assert flagged == []
    h.rig.sample(batch)
    return batch


def _step(h, batch, before_replay=None):
    from test_sglang_graph_path import step

    turn = h.state.turn
    ran, processor = step(h.rig, h.runner, batch, before_replay=before_replay)
    assert h.state.turn == turn and not h.state.open  # no eager state launch of its own on the graph path
    batch.filter_batch()
    return ran, processor


def _balance(h, reqs) -> None:
    for req in reqs:
        if req.kv.holds_kv:
            h.rig.release(req)
    pool, mamba = h.rig.pool, h.rig.pool.mamba_allocator
    assert len(pool.free_slots) == pool.size
    assert len(h.rig.allocator.get_all_free_pages()) == h.rig.allocator.num_pages
    assert len(mamba.free_slots) == pool.mamba_pool.size


def test_clean_steps_read_clean_with_no_launch_of_their_own(hybrid):
    h = hybrid
    batch = _running(h, 40, 35, 20)
    reqs = list(batch.reqs)
    epochs = h.guard.graph.host_epoch
    for _ in range(5):
        ran, processor = _step(h, batch)
        assert ran and processor.streamed == [] and not any(r.finished() for r in reqs)
    assert int(h.guard.graph.epoch) == epochs + 5
    assert h.state.side.expected_slot[:3].tolist() == [_slot(r) for r in reqs]
    newcomer = _running(h, 24)  # the composition changes: the side's expectations follow it
    batch.merge_batch(newcomer)
    for _ in range(2):
        ran, _ = _step(h, batch)
        assert ran and not any(r.finished() for r in batch.reqs)
    assert h.state.side.expected_slot[:4].tolist() == [_slot(r) for r in batch.reqs]
    _balance(h, batch.reqs)


def test_a_swapped_state_index_aborts_exactly_its_request(hybrid):
    h = hybrid
    batch = _running(h, 40, 35, 20)
    reqs = list(batch.reqs)
    victim, other = reqs[1], reqs[0]
    table = h.rig.pool.req_index_to_mamba_index_mapping
    _step(h, batch)

    def swap():  # the victim's state index names another running request's slot, after the step was prepared
        table[victim.kv.req_pool_idx] = _slot(other)

    ran, processor = _step(h, batch, before_replay=swap)
    assert victim.finished() and not other.finished() and not reqs[2].finished()
    assert [id(r) for r in processor.streamed] == [id(victim)]  # its error streamed, the others' tokens untouched
    assert "recurrent-state slot" in str(victim.finished_reason.message)
    assert int(table[victim.kv.req_pool_idx]) == 0 if victim.kv.holds_kv else True  # pointed at the dummy slot
    assert ran
    for _ in range(2):
        ran, processor = _step(h, batch)
        assert ran and processor.streamed == [] and not any(r.finished() for r in batch.reqs)
    _balance(h, reqs)


def test_a_slot_handed_to_a_second_request_aborts_its_first_holder(hybrid):
    h = hybrid
    batch = _running(h, 40, 35)
    victim = batch.reqs[0]
    allocator = h.rig.pool.mamba_allocator
    allocator.free_slots = torch.cat((torch.tensor([_slot(victim)]), allocator.free_slots))  # a double free's effect
    newcomer = _running(h, 24)
    assert _slot(newcomer.reqs[0]) == _slot(victim)
    batch.merge_batch(newcomer)
    reqs = list(batch.reqs)
    ran, processor = _step(h, batch)
    assert victim.finished() and not any(r.finished() for r in reqs[1:])
    assert [id(r) for r in processor.streamed] == [id(victim)]
    assert "handed to another request" in str(victim.finished_reason.message)
    _balance(h, reqs)  # the victim did not free the slot its new holder has


def test_without_the_captured_side_the_swap_goes_unseen(hybrid):
    """The control: a decode graph captured without the state side (only the KV check) serves the swapped index."""
    h = hybrid
    batch = _running(h, 40, 35)
    victim, other = batch.reqs
    h.guard.graph.sides.clear()
    table = h.rig.pool.req_index_to_mamba_index_mapping

    def swap():
        table[victim.kv.req_pool_idx] = _slot(other)

    ran, processor = _step(h, batch, before_replay=swap)
    assert ran and not victim.finished() and int(table[victim.kv.req_pool_idx]) == _slot(other)
