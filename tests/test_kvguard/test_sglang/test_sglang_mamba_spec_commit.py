"""kvguard's state check of a speculative step and its commit guard (kvguard/sglang/mamba_spec.py), on SGLang 0.5.23's
real classes, without an engine.

A real ``HybridReqToTokenPool`` with speculative buffers (a tiny NemotronH's mamba2 state, chain 3/1/4: 4 draft
tokens per request) and real ``Req`` objects; kvguard's hooks applied by SGLang's own plugin loader; SGLang's own
commit, ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`` (hooked), run on the CPU with its scatters
routed to SGLang's portable scatter (faultlab/sglang_live/cpu_mamba_spec.py). The step is driven in SGLang's order:
the state check launched where kvguard/sglang/spec.py's ``fire`` launches it, the verify's state indices computed from
the table afterwards (as ``_forward_metadata`` does: ``get_mamba_indices`` of the rows, translated), the commit.
The engine-level evidence is tests/test_faultlab/test_sglang_live/test_sglang_mamba_spec.py. Shown here:

- a clean step commits each request's accepted state into its own slot and flags nobody;
- a state index naming another request's slot, set before the step: the check flags that request alone and points
  its index at the dummy slot before the verify reads it, so the commit writes its state into the dummy slot and the
  other request's slot gets its own accepted state;
- a commit destination changed after the check (the backstop): pointed at the dummy slot on the device, its request
  flagged alone, the other slot untouched by it;
- a commit with no state check of its step stops the scheduler (fail closed).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from faultlab.sglang_live.families import NEMOTRON_H

pytestmark = pytest.mark.sglang

DRAFT_TOKENS = 4


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    from faultlab.sglang_live.harness import write_model

    path = write_model(str(tmp_path_factory.mktemp("nemotron_h")), NEMOTRON_H)
    return ModelConfig.from_server_args(ServerArgs(model_path=path, device="cpu", load_format="dummy",
                                                   skip_tokenizer_init=True))


@pytest.fixture
def step(make_rig, model_config, check_hooks):
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend, Mamba2AttnBackend
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from faultlab.sglang_live import cpu_mamba_spec
    from kvguard.sglang.plugin import install

    cpu_mamba_spec.install()
    rig = make_rig(1)
    cfg = mambaish_config(model_config)
    pool = HybridReqToTokenPool(size=8, mamba_size=6, mamba_spec_state_size=8, max_context_len=64, device="cpu",
                                enable_memory_saver=False, cache_params=cfg.mamba2_cache_params,
                                mamba_layer_ids=list(cfg.mamba_layer_ids), enable_mamba_extra_buffer=False,
                                speculative_num_draft_tokens=DRAFT_TOKENS, speculative_eagle_topk=1,
                                enable_overlap_schedule=False)
    guard = install(pool, rig.allocator, None, registry=rig.registry)
    # SGLang's hybrid backend and its mamba2 backend, holding only what the commit reads (no model runner)
    linear = Mamba2AttnBackend.__new__(Mamba2AttnBackend)
    linear.req_to_token_pool = pool
    backend = HybridLinearAttnBackend.__new__(HybridLinearAttnBackend)
    backend.linear_attn_backend = linear
    reqs = [rig.make_req(8) for _ in range(3)]
    assert pool.alloc(reqs) is not None
    caches = pool.get_speculative_mamba2_params_all_layers()
    caches.temporal.copy_(torch.arange(caches.temporal.shape[1]).view(1, -1, *[1] * (caches.temporal.dim() - 2)))
    # the verify's per-step states: request i's step j holds 100 * (i + 1) + j
    inter = caches.intermediate_ssm
    n, s = inter.shape[1], inter.shape[2]
    inter.copy_((100 * (torch.arange(n).view(-1, 1) + 1) + torch.arange(s).view(1, -1))
                .view(1, n, s, *[1] * (inter.dim() - 3)))
    rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
    return SimpleNamespace(pool=pool, guard=guard, backend=backend, linear=linear, reqs=reqs, rows=rows,
                           temporal=caches.temporal, pending=SimpleNamespace(guard=guard, reqs=list(reqs),
                                                                             table_rows=rows))


def _check(h) -> None:
    """The step's state check, where kvguard/sglang/spec.py's fire launches it (one rank)."""
    from kvguard.sglang import mamba_spec

    assert mamba_spec.launch(h.pending, h.rows) is None


def _verify_metadata(h) -> None:
    """The verify forward's state indices, as SGLang's ``_forward_metadata`` computes them from the table."""
    from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata

    indices = h.linear._translate_mamba_indices(h.pool.get_mamba_indices(h.rows))
    h.linear.forward_metadata = ForwardMetadata(query_start_loc=torch.zeros(len(h.reqs) + 1, dtype=torch.int32),
                                                mamba_cache_indices=indices)


def _commit(h, steps) -> set:
    """SGLang's commit of the accepted steps (hooked), then the step's verdict: the flagged requests' ids."""
    h.backend.update_mamba_state_after_mtp_verify(last_correct_step_indices=torch.tensor(steps),
                                                  mamba_track_indices=None, mamba_steps_to_track=None, model=None,
                                                  req_pool_indices=h.rows)
    return {item[0].rid for item in h.guard.mamba.flagged(h.pending)}


def _state(h, slot: int) -> int:
    return int(h.temporal[0, slot].flatten()[0])


def _slot(req) -> int:
    return int(req.kv.mamba_pool_idx)


def test_a_clean_step_commits_each_accepted_state_into_its_own_slot(step):
    _check(step)
    _verify_metadata(step)
    assert _commit(step, [1, 0, 2]) == set()
    assert [_state(step, _slot(r)) for r in step.reqs] == [101, 200, 302]


def test_an_index_naming_another_slot_before_the_step_commits_into_the_dummy_slot(step):
    a, b, c = step.reqs
    table = step.pool.req_index_to_mamba_index_mapping
    table[a.kv.req_pool_idx] = _slot(b)
    _check(step)
    assert int(table[a.kv.req_pool_idx]) == 0  # before the verify computes its indices from the table
    _verify_metadata(step)
    assert _commit(step, [1, 0, 2]) == {a.rid}
    assert _state(step, _slot(b)) == 200 and _state(step, _slot(c)) == 302  # b's own accepted state, not a's
    assert _state(step, 0) == 101  # a's went to the dummy slot


def test_a_destination_changed_after_the_check_is_redirected_and_flagged(step):
    a, b, c = step.reqs
    _check(step)
    _verify_metadata(step)
    step.linear.forward_metadata.mamba_cache_indices[0] = _slot(b)  # a's destination names b's slot
    assert _commit(step, [1, 0, 2]) == {a.rid}
    assert _state(step, _slot(b)) == 200 and _state(step, _slot(c)) == 302
    assert _state(step, _slot(a)) == _slot(a)  # a's own slot kept its old state: a is aborted
    assert int(step.linear.forward_metadata.mamba_cache_indices[0]) == 0


def test_a_commit_without_its_steps_state_check_stops(step):
    _verify_metadata(step)
    with pytest.raises(RuntimeError, match="without the state check"):
        _commit(step, [0, 0, 0])
