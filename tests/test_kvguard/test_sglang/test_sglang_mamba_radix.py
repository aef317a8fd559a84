"""kvguard's radix-tree state follower (kvguard/sglang/mamba_radix.py) on SGLang 0.5.23's real classes, step by step.

A real ``UnifiedRadixCache`` with its mamba component on ``no_buffer`` slots (SGLang's default tree core: the Rust
one) over a real ``HybridReqToTokenPool`` (a tiny NemotronH's mamba2 state, a tiny Qwen3-Next's GDN state), real
``Req`` objects and SGLang's own ``prepare_for_extend`` (which stages the copy out of the tree), kvguard's hooks
applied by SGLang's plugin loader. Shown:

- a finished request's slot, and a running request's checkpoint copy, enter the tree at the generation they carry;
  a request that matches the node copies from it unflagged;
- a tree slot freed while its node still names it and handed to another request: the request that matches the
  node is flagged, alone (another matcher in the same batch is not), and its copy reads the dummy slot 0;
- a finished request whose slot was handed on while it ran gives the tree its own (slot, generation), which the
  slot has moved past: its matcher is flagged;
- the install backstop follows this tree and still refuses the extra-buffer one.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from faultlab.sglang_live.families import FAMILIES

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def model(request, tmp_path_factory):
    """A tiny mamba2 (NemotronH) or GDN (Qwen3-Next) hybrid: its path and SGLang's ModelConfig of it."""
    from sglang.srt.configs.model_config import ModelConfig

    from faultlab.sglang_live.harness import write_model

    path = write_model(str(tmp_path_factory.mktemp(request.param)), FAMILIES[request.param])
    return path, ModelConfig.from_server_args(_args(path))


def _args(path):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=path, device="cpu", load_format="dummy", skip_tokenizer_init=True, page_size=1,
                      disable_overlap_schedule=True, mamba_radix_cache_strategy="no_buffer")


@pytest.fixture
def hybrid(make_rig, model):
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    from kvguard.sglang.plugin import install

    path, model_config = model
    rig = make_rig(1)
    set_global_server_args_for_scheduler(_args(path))  # the mamba component reads the model's chunk size from it
    cfg = mambaish_config(model_config)
    layers = list(getattr(cfg, "mamba_layer_ids", None) or cfg.linear_layer_ids)
    pool = HybridReqToTokenPool(size=8, mamba_size=6, mamba_spec_state_size=0, max_context_len=64, device="cpu",
                                enable_memory_saver=False, cache_params=cfg.mamba2_cache_params,
                                mamba_layer_ids=layers, enable_mamba_extra_buffer=False)
    tree = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=pool, page_size=1,
                                             token_to_kv_pool_allocator=rig.allocator,
                                             tree_components=(ComponentType.FULL, ComponentType.MAMBA),
                                             enable_mamba_extra_buffer=False))
    rig.req_to_token_pool, rig.tree = pool, tree
    guard = install(pool, rig.allocator, tree, registry=rig.registry)
    return SimpleNamespace(rig=rig, pool=pool, tree=tree, state=guard.mamba, allocator=pool.mamba_allocator)


def _tokens(base: int, n: int = 12) -> list[int]:
    return list(range(base, base + n))


def _finish_into_tree(h, tokens) -> int:
    """Prefill a request of ``tokens``, finish it and release it into the tree (which keeps its slot); the slot."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    [req] = h.rig.prefill(reqs=[h.rig.make_req(0, tokens=tokens)]).reqs
    slot = int(req.kv.mamba_pool_idx)
    req.output_ids.append(7)
    req.finished_reason = FINISH_LENGTH(length=1)
    h.rig.release(req, checkpoint=True)
    return slot


def _prefill_matching(h, *token_lists):
    """Requests that match the tree (each copies a node's state), prefilled together; (reqs, batch, flagged rids)."""
    reqs = [h.rig.make_req(0, tokens=tokens) for tokens in token_lists]
    sources = [r.kv.mamba_cow_src_index for r in reqs]
    assert all(s is not None for s in sources), "a request did not match a tree state"
    batch = h.rig.prefill(reqs=reqs)
    flagged = {item[0].rid: item[1] for item in h.state.flagged(batch.__dict__["_kvguard"])}
    return reqs, batch, flagged


def _hand_out(h, slot: int):
    """``slot`` put at the head of the state free list (a free while the tree still names it) and handed to a new
    request (that matches nothing in the tree)."""
    free = h.allocator.free_slots
    h.allocator.free_slots = torch.cat((torch.tensor([slot], dtype=free.dtype), free))
    [other] = h.rig.prefill(reqs=[h.rig.make_req(0, tokens=_tokens(900))]).reqs
    assert int(other.kv.mamba_pool_idx) == slot
    return other


def test_finished_slot_enters_the_tree_and_a_matching_request_copies_it_unflagged(hybrid):
    a = _tokens(200)
    slot = _finish_into_tree(hybrid, a)
    assert int(hybrid.state.tree.taken[slot]) == int(hybrid.state.gens[slot]) >= 1
    reqs, batch, flagged = _prefill_matching(hybrid, a + [5, 6], a + [8])
    assert flagged == {}
    assert batch.mamba_cow_src_indices.tolist() == [slot, slot]  # the copies read the tree's slot, untouched
    assert sorted(int(r.kv.mamba_pool_idx) for r in reqs) == sorted(set(int(r.kv.mamba_pool_idx) for r in reqs))


def test_a_running_requests_checkpoint_copy_enters_the_tree_and_is_matched_unflagged(hybrid):
    a = _tokens(300)
    [req] = hybrid.rig.prefill(reqs=[hybrid.rig.make_req(0, tokens=a)]).reqs
    own = int(req.kv.mamba_pool_idx)
    hybrid.tree.checkpoint(req, up_to=len(a))  # SGLang's unfinished-request checkpoint: a fresh slot, a copy
    taken = [s for s in range(1, hybrid.pool.mamba_pool.size + 1) if int(hybrid.state.tree.taken[s]) >= 0]
    assert taken and own not in taken
    assert all(int(hybrid.state.tree.taken[s]) == int(hybrid.state.gens[s]) for s in taken)
    _, batch, flagged = _prefill_matching(hybrid, a + [5])
    assert flagged == {} and batch.mamba_cow_src_indices.tolist() == taken


def test_a_tree_slot_handed_to_another_request_flags_exactly_the_request_that_matches_it(hybrid):
    a, b = _tokens(200), _tokens(400)
    slot_a, slot_b = _finish_into_tree(hybrid, a), _finish_into_tree(hybrid, b)
    other = _hand_out(hybrid, slot_a)  # the tree's node for a still names slot_a
    reqs, batch, flagged = _prefill_matching(hybrid, a + [5], b + [5])
    assert set(flagged) == {reqs[0].rid}, flagged
    assert "recurrent-state slot" in flagged[reqs[0].rid] and "radix tree" in flagged[reqs[0].rid]
    assert batch.mamba_cow_src_indices.tolist() == [0, slot_b]  # the bad copy reads the dummy slot, never other's
    assert int(other.kv.mamba_pool_idx) == slot_a


def test_a_finished_request_whose_slot_was_handed_on_gives_the_tree_a_slot_no_match_passes(hybrid):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    a = _tokens(200)
    [req] = hybrid.rig.prefill(reqs=[hybrid.rig.make_req(0, tokens=a)]).reqs
    _hand_out(hybrid, int(req.kv.mamba_pool_idx))  # while req runs (it is flagged at its next check: not run here)
    req.output_ids.append(7)
    req.finished_reason = FINISH_LENGTH(length=1)
    hybrid.rig.release(req, checkpoint=True)
    reqs, _, flagged = _prefill_matching(hybrid, a + [5])
    assert set(flagged) == {reqs[0].rid} and "radix tree" in flagged[reqs[0].rid], flagged


def test_the_install_backstop_follows_this_tree_and_refuses_the_extra_buffer_one(hybrid):
    from kvguard.sglang.model_facts import pool_refusal

    assert pool_refusal(hybrid.pool, hybrid.rig.allocator, None, hybrid.tree) is None
    hybrid.tree.enable_mamba_extra_buffer = True  # the ping-pong tracking slots' tree (not followed)
    try:
        assert pool_refusal(hybrid.pool, hybrid.rig.allocator, None, hybrid.tree) == "hybrid_linear_radix_cache"
    finally:
        hybrid.tree.enable_mamba_extra_buffer = False
