"""Speculative decoding on a sliding-window hybrid (GPT-OSS shaped), through SGLang 0.5.23's real code on the CPU.

kvguard's path registry (kvguard/sglang/paths.py) names this file as the evidence for ``sliding_window_spec``.
One ``sglang.Engine`` of a tiny GPT-OSS (``families.GPT_OSS``: sliding window 16 beside full attention; SGLang builds
``SWAKVPool`` and ``SWATokenToKVPoolAllocator``) with STANDALONE speculative decoding, chain 3/1/4 (SGLang's spec v2
worker; a draft of the target's own config and dummy weights, its own sliding-window layers, whose drafts are
accepted: steps commit up to 4 tokens) and the overlap scheduler, ``KVGUARD_MODE=check``, in a process of its own
(faultlab.sglang_live.harness; built by :func:`faultlab.sglang_live.spec_run.engine_spec`), serves a fault-free
episode and one per fault, each struck by faultlab's live injector between two spec steps:

* ``swa_cleared_entry`` / ``swa_foreign_entry``: a full slot inside the victim's window maps to SWA slot 0 / to
  another request's SWA page (read only by the sliding-window layers: the spec step's SWA window check catches it);
* ``swa_freed_slot``: that full slot's SWA page is freed to the head of the SWA free list while in the window (the
  next spec reserve's allocation takes it);
* ``spec_region_entry``: an entry of the region ``alloc_for_spec_decode`` reserved names another request's page.

Asserted per fault episode: exactly the injector's victims (its ground truth, never read from kvguard) get a kvguard
error, every other request's output tokens equal the fault-free episode's, and SGLang's idle accounting (full and SWA
pools, rows) is balanced afterwards; per fault-free episode: spec steps ran, no request aborted although every
request outgrows the window (SGLang frees out-of-window SWA pages as it decodes) and each request's over-allocated
spec region is freed at its end. Page size 16; SGLang frees SWA pages through its CUDA branch, as on a GPU
(faultlab/sglang_live/cpu_swa.py). SGLang's Triton attention and spec-tree ops under Triton's interpreter
(faultlab/sglang_live/cpu_spec.py). ``FAULTLAB_SWA_PAGE_SIZE=1`` runs the same at page size 1,
``FAULTLAB_SWA_SPEC_ALGORITHM=EAGLE`` with a one-layer Llama EAGLE draft (no sliding-window layers of its own).
"""
from __future__ import annotations

import os
import time

import pytest
from live_episodes import assert_clean, assert_exact_fault, engine_run, fault_episodes

from faultlab.sglang_live.cpu_swa import ENV_VAR as ENV_SWA_CUDA_FREE
from faultlab.sglang_live.families import GPT_OSS
from faultlab.sglang_live.harness import spawn
from faultlab.sglang_live.spec_run import engine_spec
from kvguard.sglang.paths import BY_NAME, CHECKED, REFUSED, Facts, refusal

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

SEED = 1
ENGINE_TIMEOUT = 840
PAGE_SIZE = int(os.environ.get("FAULTLAB_SWA_PAGE_SIZE", "16"))
ALGORITHM = os.environ.get("FAULTLAB_SWA_SPEC_ALGORITHM", "STANDALONE")  # EAGLE: a one-layer Llama draft (rejected)
FAULTS = ["swa_cleared_entry", "swa_foreign_entry", "swa_freed_slot", "spec_region_entry"]
# three requests of 12 prompt tokens (4 past the window's 16 after one spec step) and 20 new ones each
WORKLOAD = {"n1": 3, "n2": 0, "prefix": 12, "new1": 20, "new2": 4}


@pytest.fixture(scope="module")
def hybrid_spec(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("swa_spec"))
    episodes = fault_episodes(FAULTS, SEED)
    spec = engine_spec(folder, overlap=True, mode="check", episodes=episodes, algorithm=ALGORITHM,
                       workload=WORKLOAD, model=GPT_OSS)
    spec.update(page_size=PAGE_SIZE, log_level="error")
    spec["env"][ENV_SWA_CUDA_FREE] = "1"
    t0 = time.time()
    rc, result, stderr = spawn(spec, folder, "swa_spec", ENGINE_TIMEOUT)
    run = engine_run("gpt_oss_spec", "GPT-OSS with STANDALONE", rc, result, stderr)
    print(f"gpt_oss spec: startup {run['startup_s']:.0f} s, {time.time() - t0:.0f} s in all; "
          + ", ".join(f"{label}: {ep['steps']} steps" for label, ep in run["episodes"].items()))
    return run


def test_clean_spec_steps_on_swa_have_no_false_abort(hybrid_spec):
    pools = [e for e in hybrid_spec["events"] if e["event"] == "pools"]
    assert pools and pools[0]["allocator"] == "SWATokenToKVPoolAllocator", pools
    ep = assert_clean(hybrid_spec, "clean")
    assert all(len(r["output_ids"]) == WORKLOAD["new1"] for r in ep["requests"]), ep["requests"]
    assert ep["idle_check"]["decode_steps"] >= 3, ep["idle_check"]  # spec steps ran (every request outgrew the window)
    if ALGORITHM == "STANDALONE":  # its drafts are accepted: fewer verify steps than tokens
        assert ep["idle_check"]["decode_steps"] < WORKLOAD["new1"] - 1, ep["idle_check"]


@pytest.mark.parametrize("fault", FAULTS)
def test_swa_spec_fault_exactly_victims_aborted(hybrid_spec, fault):
    # (an SWA fault is named by the window check, not by the spec guard's rewrite of the victim's row)
    assert_exact_fault(hybrid_spec, fault, "swa_mapping" if fault.startswith("swa_") else None)


def test_registry_checks_swa_spec_and_refuses_swa_pd():
    spec = Facts(hybrid_swa=True, speculative_algorithm="STANDALONE")
    assert BY_NAME["sliding_window_spec"].status == CHECKED and BY_NAME["sliding_window_spec"].applies(spec)
    assert refusal(spec) is None
    pd = Facts(hybrid_swa=True, disaggregation_mode="decode")
    assert BY_NAME["sliding_window_pd"].status == REFUSED and BY_NAME["sliding_window_pd"].applies(pd)
    assert "sliding_window_pd" in (refusal(pd) or "")
    tree = Facts(hybrid_swa=True, speculative_algorithm="EAGLE", spec_topk=4)
    assert not BY_NAME["sliding_window_spec"].applies(tree) and "speculative_tree_drafting" in (refusal(tree) or "")
