"""Speculative decoding on a hybrid linear-attention (mamba2) model, through SGLang 0.5.23's real code on the CPU.

kvguard's path registry (kvguard/sglang/paths.py) names this file as the evidence for ``hybrid_linear_speculative``.
One ``sglang.Engine`` of a tiny NemotronH with one MTP layer (``families.NEMOTRON_H_MTP``: mamba2 layers beside full
attention, SGLang builds a ``HybridReqToTokenPool`` with a ``MambaPool`` and its speculative buffers) with NEXTN
speculative decoding, chain 3/1/4 (SGLang's spec v2 worker; the draft is the target's own MTP layer,
``NemotronHForCausalLMMTP``), ``KVGUARD_MODE=check``, in a process of its own (faultlab.sglang_live.harness; built by
:func:`faultlab.sglang_live.spec_run.engine_spec`), serves a fault-free episode and one per fault, each struck by
faultlab's live injector between two spec steps:

* ``spec_mamba_index_swap``: a request's state index (``req_index_to_mamba_index_mapping``) names another running
  request's slot: unchecked, the next verify reads and rewrites that slot's state and the commit
  (``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify``) scatters the victim's accepted state into it;
* ``spec_mamba_slot_reuse``: a running request's state slot is handed to a new request (its prefill writes it).

Asserted per fault episode: exactly the injector's victims (its ground truth, never read from kvguard) get a kvguard
error naming the recurrent-state slot, every other request's output tokens equal the fault-free episode's, and
SGLang's idle accounting (KV, row and state pools) is balanced afterwards; fault-free: no request aborted.

The engine: SGLang's mamba2 kernels and its Triton attention / spec tree ops under Triton's interpreter
(``TRITON_INTERPRET=1``; faultlab's ``FAULTLAB_SGLANG_CPU_MAMBA=1``, ``FAULTLAB_SGLANG_CPU_SPEC=1``), the commit's
CUDA-only scatters routed to SGLang's portable scatter (``FAULTLAB_SGLANG_CPU_MAMBA_SPEC=1``,
faultlab/sglang_live/cpu_mamba_spec.py), radix cache off, no overlap scheduler (SGLang refuses the ``no_buffer``
state strategy with it), page size 1.
"""
from __future__ import annotations

import time

import pytest
from live_episodes import assert_clean, assert_exact_fault, engine_run, fault_episodes, print_run

from faultlab.sglang_live.cpu_mamba import ENV_VAR as ENV_CPU_MAMBA
from faultlab.sglang_live.cpu_mamba_spec import ENV_VAR as ENV_CPU_MAMBA_SPEC
from faultlab.sglang_live.harness import spawn
from faultlab.sglang_live.spec_run import engine_spec
from kvguard.sglang.paths import BY_NAME, CHECKED, Facts, refusal

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1200)]

SEED = 1
ENGINE_TIMEOUT = 1140
FAULTS = ["spec_mamba_index_swap", "spec_mamba_slot_reuse"]
WORKLOAD = {"n1": 3, "n2": 2, "prefix": 12, "new1": 10, "new2": 6}


@pytest.fixture(scope="module")
def hybrid_spec(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mamba_spec"))
    spec = engine_spec(folder, overlap=False, mode="check", episodes=fault_episodes(FAULTS, SEED), algorithm="NEXTN",
                       workload=WORKLOAD, target="nemotron_h")
    spec.update(log_level="error")
    assert spec["env"][ENV_CPU_MAMBA] == spec["env"][ENV_CPU_MAMBA_SPEC] == "1" and not spec["radix"]  # (engine_spec)
    t0 = time.time()
    rc, result, stderr = spawn(spec, folder, "mamba_spec", ENGINE_TIMEOUT)
    run = engine_run("nemotron_h_spec", "NemotronH with NEXTN", rc, result, stderr)
    print_run(run, "nemotron_h spec", t0, "spec")
    return run


def test_clean_spec_steps_on_a_hybrid_have_no_false_abort(hybrid_spec):
    pools = [e for e in hybrid_spec["events"] if e["event"] == "pools"]
    assert pools, "no decode step ran"
    ep = assert_clean(hybrid_spec, "clean")
    assert ep["idle_check"]["decode_steps"] >= 3, ep["idle_check"]  # spec steps ran, each with its commit


@pytest.mark.parametrize("fault", FAULTS)
def test_spec_state_fault_exactly_victims_aborted(hybrid_spec, fault):
    assert_exact_fault(hybrid_spec, fault, "recurrent-state slot")


def test_registry_checks_hybrid_spec_chain_and_refuses_the_rest():
    chain = Facts(hybrid_linear=True, speculative_algorithm="NEXTN", radix=False, overlap=False)
    assert BY_NAME["hybrid_linear_speculative"].status == CHECKED and refusal(chain) is None
    replay = Facts(hybrid_linear=True, speculative_algorithm="NEXTN", radix=False, overlap=False,
                   linear_replayssm=True)
    assert "hybrid_linear_spec_own_state" in (refusal(replay) or "")
    standalone = Facts(hybrid_linear=True, speculative_algorithm="STANDALONE", radix=False, overlap=False)
    assert "hybrid_linear_spec_own_state" in (refusal(standalone) or "")  # the draft's own state: not followed
    assert refusal(Facts(hybrid_linear=True, speculative_algorithm="EAGLE", radix=False, overlap=False)) is None
    tree = Facts(hybrid_linear=True, speculative_algorithm="EAGLE", spec_topk=4, radix=False, overlap=False)
    assert "speculative_tree_drafting" in (refusal(tree) or "")
    other = Facts(hybrid_linear=True, speculative_algorithm="NGRAM", radix=False, overlap=False)
    assert refusal(other) is not None
