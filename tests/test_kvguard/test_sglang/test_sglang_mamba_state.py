"""kvguard's recurrent-state follower (kvguard/sglang/mamba.py) on SGLang 0.5.23's real classes, step by step.

A real ``HybridReqToTokenPool`` (its ``MambaPool`` and ``MambaSlotAllocator``; a tiny NemotronH's mamba2 state and a
tiny Qwen3-Next's GDN state) and
real ``Req`` objects, with kvguard's hooks applied by SGLang's own plugin loader; the check launched as the guard
launches it beside a KV check. The engine-level evidence (faults injected into a running ``sglang.Engine``) is
tests/test_faultlab/test_sglang_live/test_sglang_mamba.py; here each rule is shown on its own:

- each request records its own (slot, generation) where SGLang gives it its row; a clean batch is not flagged;
- a request whose state index names another request's slot is flagged, alone, and its index is pointed at the
  dummy slot 0 before the forward would read it;
- a slot handed to a second request flags its first holder, alone; the first holder, aborted or retracted, does
  not free the slot (its new holder does), and the slot allocator balances;
- a request with no record is flagged (never run on a slot kvguard did not see it given).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from faultlab.sglang_live.families import FAMILIES

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def model_config(request, tmp_path_factory):
    """SGLang's ModelConfig of a tiny mamba2 (NemotronH) or GDN (Qwen3-Next) hybrid: the state pool SGLang builds
    for each (the hybrid backend reads both through ``get_mamba_indices``)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    from faultlab.sglang_live.harness import write_model

    path = write_model(str(tmp_path_factory.mktemp(request.param)), FAMILIES[request.param])
    args = ServerArgs(model_path=path, device="cpu", load_format="dummy", skip_tokenizer_init=True)
    return ModelConfig.from_server_args(args)


@pytest.fixture
def hybrid(make_rig, model_config):
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from kvguard.sglang.plugin import install

    rig = make_rig(1)  # (publishes SGLang's runtime config, which the cache params read)
    cfg = mambaish_config(model_config)
    params = cfg.mamba2_cache_params
    layers = list(getattr(cfg, "mamba_layer_ids", None) or cfg.linear_layer_ids)
    pool = HybridReqToTokenPool(size=8, mamba_size=6, mamba_spec_state_size=0, max_context_len=64, device="cpu",
                                enable_memory_saver=False, cache_params=params, mamba_layer_ids=layers,
                                enable_mamba_extra_buffer=False)
    guard = install(pool, rig.allocator, None, registry=rig.registry)
    return SimpleNamespace(rig=rig, pool=pool, guard=guard, state=guard.mamba)


def _admit(h, n: int) -> list:
    reqs = [h.rig.make_req(8) for _ in range(n)]
    assert h.pool.alloc(reqs) is not None  # SGLang's own row + state slot allocation (hooked)
    return reqs


def _check(h, reqs) -> set:
    """The state check as the guard launches it beside a KV check (the batch's rows), then its verdict."""
    rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
    pending = SimpleNamespace(reqs=list(reqs), table_rows=rows)
    h.state.launch(pending, rows)
    return {item[0].rid for item in h.state.flagged(pending)}


def _slot(req) -> int:
    return int(req.kv.mamba_pool_idx)


def test_each_request_records_its_own_slot_and_a_clean_batch_passes(hybrid):
    reqs = _admit(hybrid, 3)
    assert len({_slot(r) for r in reqs}) == 3
    for r in reqs:
        slot, gen = r.kvguard_state
        assert int(slot) == _slot(r) and int(gen) == int(hybrid.state.gens[_slot(r)]) >= 1
    assert _check(hybrid, reqs) == set()


def test_a_state_index_naming_another_requests_slot_flags_that_request_alone(hybrid):
    a, b, c = _admit(hybrid, 3)
    table = hybrid.pool.req_index_to_mamba_index_mapping
    table[a.kv.req_pool_idx] = _slot(b)
    assert _check(hybrid, [a, b, c]) == {a.rid}
    assert int(table[a.kv.req_pool_idx]) == 0  # the forward reads the dummy slot for a, never b's state
    assert int(table[b.kv.req_pool_idx]) == _slot(b) and int(table[c.kv.req_pool_idx]) == _slot(c)


@pytest.mark.parametrize("how", ["aborted", "retracted"])
def test_a_slot_given_to_a_second_request_flags_its_first_holder_who_never_frees_it(hybrid, how):
    allocator = hybrid.pool.mamba_allocator
    a, b = _admit(hybrid, 2)
    free_before = allocator.available_size()
    taken = _slot(a)
    allocator.free_slots = torch.cat((torch.tensor([taken]), allocator.free_slots))  # a double-free's effect
    [c] = _admit(hybrid, 1)
    assert _slot(c) == taken
    assert _check(hybrid, [a, b, c]) == {a.rid}
    if how == "aborted":
        a.kvguard_aborted = True
        hybrid.pool.free_mamba_cache(a)
    else:
        hybrid.guard.retracting = True
        try:
            hybrid.pool.free_mamba_cache(a)
        finally:
            hybrid.guard.retracting = False
    assert a.kv.mamba_pool_idx is None and hybrid.state.kept == 1
    assert allocator.available_size() == free_before  # the slot stayed with c (a freed nothing)
    for r in (b, c):
        hybrid.pool.free_mamba_cache(r)
    assert allocator.available_size() == free_before + 2 == hybrid.pool.mamba_pool.size
    assert sorted(allocator.free_slots.tolist()) == list(range(1, hybrid.pool.mamba_pool.size + 1))


def test_a_clean_release_frees_its_slot_and_a_request_with_no_record_is_flagged(hybrid):
    a, b = _admit(hybrid, 2)
    free_before = hybrid.pool.mamba_allocator.available_size()
    a.kvguard_aborted = True  # aborted for another reason: its slot is its own, freed as usual
    hybrid.pool.free_mamba_cache(a)
    assert hybrid.pool.mamba_allocator.available_size() == free_before + 1 and hybrid.state.kept == 0
    del b.__dict__["kvguard_state"]
    assert _check(hybrid, [b]) == {b.rid}
