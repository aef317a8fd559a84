"""NEXTN (MTP) speculative decoding on a multi-head-latent-attention model, on the CPU, checked by kvguard.

The target is a tiny DeepSeek-V3 with one MTP layer (faultlab/sglang_live/harness.py ``TINY_DEEPSEEK_MTP``, dummy
weights); SGLang resolves NEXTN to EAGLE, the draft path to the model's own and its architecture to
``DeepseekV3ForCausalLMNextN``: the spec v2 worker kvguard hooks (kvguard/sglang/spec.py), a draft KV pool of
MLA's own layout beside the target's. One engine with the overlap scheduler, built as test_sglang_spec.py builds
its engines (:func:`faultlab.sglang_live.spec_run.engine_spec`): a fault-free episode, then ``draft_slot_reused``
(the draft pool's slot of a request handed to another). In a file of its own so that CI runs it beside the other
spec engines, not after them (interpreted MLA attention makes it the slowest spec engine).
"""
from __future__ import annotations

import pytest
from live_episodes import assert_victims_aborted, by_index, episode
from test_sglang_spec import ENGINE_TIMEOUT, _run

FAULTS = ["draft_slot_reused"]


@pytest.fixture(scope="module")
def spec_mla(tmp_path_factory):
    return _run(tmp_path_factory, "spec_mla", True, FAULTS, "NEXTN")


@pytest.mark.sglang
@pytest.mark.timeout(ENGINE_TIMEOUT)
def test_nextn_clean_spec_steps_have_no_false_abort(spec_mla):
    ep = episode(spec_mla, "clean")
    errors = {r["rid"]: r["error"] for r in ep["requests"] if r["error"]}
    assert not errors, f"NEXTN: false aborts over clean spec steps: {errors}"
    assert ep["idle_check"] and ep["idle_check"]["balanced"], ep["idle_check"]
    assert ep["idle_check"]["decode_steps"] >= 3, ep["idle_check"]


@pytest.mark.sglang
@pytest.mark.timeout(ENGINE_TIMEOUT)
@pytest.mark.parametrize("fault", FAULTS)
def test_nextn_fault_caught_only_victims_aborted(spec_mla, fault):
    clean = by_index(episode(spec_mla, "clean"))
    ep = episode(spec_mla, fault.replace("_", ""))
    victims = assert_victims_aborted(ep, fault, "NEXTN: ")
    for key, req in by_index(ep).items():
        if req["rid"] not in victims:
            assert req["output_ids"] == clean[key]["output_ids"], f"NEXTN {fault}: {req['rid']} differs"
    assert ep["idle_check"] and ep["idle_check"]["balanced"], f"NEXTN {fault}: pools unbalanced: {ep['idle_check']}"
