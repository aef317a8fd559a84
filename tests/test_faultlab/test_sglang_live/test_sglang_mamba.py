"""kvguard on a hybrid linear-attention (mamba2) model, through SGLang 0.5.23's real code on the CPU.

kvguard's path registry (kvguard/sglang/paths.py) names this file as the evidence for ``hybrid_linear_attention``.
One ``sglang.Engine`` of a tiny NemotronH (mamba2 layers beside full attention: ``families.NEMOTRON_H``;
SGLang builds it a ``HybridReqToTokenPool`` with a ``MambaPool``) with ``KVGUARD_MODE=check``, in a process of its
own (faultlab.sglang_live.harness, as test_sglang_paths.py), serves a fault-free episode and one per state fault:

* ``mamba_index_swap``: a request's state index (``req_index_to_mamba_index_mapping``, what the linear-attention
  layers read) names another request's slot;
* ``mamba_slot_reuse``: a request's state slot is handed to a second request (a reuser's prefill) while it runs;

and, for a full-attention page fault on the same engine, ``swapped_entries``. Asserted per fault episode: exactly
the injector's victims (its ground truth, never read from kvguard) get a kvguard error, every other request's
output tokens equal the fault-free episode's, and SGLang's idle accounting (its KV, row and state pools) is
balanced afterwards; per fault-free episode: no request aborted.

The engine: SGLang's mamba2 mixer runs its Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``;
faultlab's ``FAULTLAB_SGLANG_CPU_MAMBA=1`` binds its causal-conv1d names as SGLang's XPU branch does), radix cache
off (the registry refuses a hybrid model's state tree), no overlap scheduler (SGLang refuses the ``no_buffer``
state strategy with it), page size 1.

The soak (0 false aborts over >= 1,000 clean decode steps) runs from the command line, on the same engine:
``FAULTLAB_MAMBA_SOAK=3 pytest tests/test_faultlab/test_sglang_live/test_sglang_mamba.py -k clean -s``
(three more fault-free episodes of ~350 decode steps each; the test then asserts >= 1,000).
"""
from __future__ import annotations

import os
import time

import pytest
from live_episodes import (assert_clean as _clean, assert_exact_fault, by_index, engine_run, episode, fault_episodes,
                           label_of, print_run)

from faultlab.sglang_live.families import NEMOTRON_H

SOAKS = int(os.environ.get("FAULTLAB_MAMBA_SOAK", "0"))
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600 + 900 * SOAKS)]

SEED = 1
ENGINE_TIMEOUT = 540 + 900 * SOAKS  # (a soak episode: ~350 decode steps, ~12 minutes on a loaded 2-core CPU)
CLASSES = ["mamba_index_swap", "mamba_slot_reuse", "swapped_entries"]
WORKLOAD = {"n1": 3, "n2": 2, "prefix": 12, "new1": 16, "new2": 8}
SOAK = {"n1": 8, "n2": 4, "new1": 200, "new2": 150, "wave2": "finished"}
SPEC = {
    "log_level": "error", "page_size": 1, "radix": False, "overlap": False, "model": NEMOTRON_H,
    "engine": {"mamba_radix_cache_strategy": "no_buffer"}, "workload": WORKLOAD,
    "env": {"KVGUARD_MODE": "check", "TRITON_INTERPRET": "1", "FAULTLAB_SGLANG_CPU_MAMBA": "1"},
}


def _run(tmp_path_factory, name: str, spec: dict, episodes: list) -> dict:
    from faultlab.sglang_live.harness import spawn

    t0 = time.time()
    rc, result, stderr = spawn({**spec, "episodes": episodes}, str(tmp_path_factory.mktemp(name)), name,
                               ENGINE_TIMEOUT)
    run = engine_run(name, "NemotronH", rc, result, stderr)
    print_run(run, name, t0)
    return run


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    episodes = fault_episodes(CLASSES, SEED)
    episodes += [{"label": f"soak{i}", "fault": None, "seed": SEED, "workload": SOAK} for i in range(SOAKS)]
    return _run(tmp_path_factory, "nemotron_h", SPEC, episodes)


def test_the_hybrid_engine_serves_a_clean_episode_checked(hybrid):
    """Served with KVGUARD_MODE=check (the registry let the hybrid model through; a refusal stops the engine), and
    its first decode step ran on SGLang's own pools (the injector's ``pools`` line)."""
    pools = [e for e in hybrid["events"] if e["event"] == "pools"]
    assert pools, "no decode step ran"
    _clean(hybrid, "clean")


@pytest.mark.parametrize("fault", CLASSES)
def test_state_fault_exactly_victims_aborted(hybrid, fault):
    assert_exact_fault(hybrid, fault, "recurrent-state slot" if fault.startswith("mamba") else None)


def test_clean_episodes_no_false_aborts(hybrid):
    labels = ["clean"] + [f"soak{i}" for i in range(SOAKS)]
    steps = sum(_clean(hybrid, label)["steps"] for label in labels)
    print(f"fault-free decode steps: {steps}, false aborts: 0")
    if SOAKS:
        assert steps >= 1000, f"only {steps} fault-free decode steps"


@pytest.mark.skipif(not SOAKS, reason="the command-line run only (FAULTLAB_MAMBA_SOAK): a second engine")
def test_index_swap_is_real_with_kvguard_off(tmp_path_factory):
    """The same fault with kvguard off: nobody is told, and the state the swap points at is shared for real (the
    victim's or its owner's tokens change)."""
    off = {**SPEC, "env": {**SPEC["env"], "KVGUARD_MODE": "off"}}
    fault = "mamba_index_swap"
    run = _run(tmp_path_factory, "nemotron_h_off", off, [{"label": "clean", "fault": None, "seed": SEED},
                                                         {"label": label_of(fault), "fault": fault, "seed": SEED}])
    clean, ep = episode(run, "clean"), episode(run, label_of(fault))
    assert [r for r in ep["requests"] if r["error"]] == []
    [inject] = [e for e in ep["events"] if e["event"] == "inject"]
    ref = by_index(clean)
    changed = {r["rid"] for i, r in by_index(ep).items() if r["output_ids"] != ref[i]["output_ids"]}
    assert changed, f"{fault} with kvguard off changed nobody's tokens: {inject}"
    print(f"kvguard off, {fault}: victims {inject['victims']}, owner {inject['owner']}, tokens changed {changed}")
