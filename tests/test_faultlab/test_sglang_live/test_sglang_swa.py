"""kvguard on a sliding-window hybrid (GPT-OSS shaped), through SGLang 0.5.23's real code on the CPU.

kvguard's path registry (kvguard/sglang/paths.py) names this file as the evidence for ``sliding_window``.
One ``sglang.Engine`` of a tiny GPT-OSS (``families.GPT_OSS``: sliding window 16 beside full attention;
``ModelConfig.is_hybrid_swa``, so SGLang builds ``SWAKVPool`` and ``SWATokenToKVPoolAllocator``) with
``KVGUARD_MODE=check``, in a process of its own (faultlab.sglang_live.harness), serves a fault-free episode and one
per SWA fault (faultlab/sglang_live/inject.py):

* ``swa_cleared_entry``: a full slot inside a request's window maps to SWA slot 0 (a cleared entry);
* ``swa_foreign_entry``: it maps to another request's SWA page;
* ``swa_freed_slot``: its SWA page is freed while in the window, and handed to the next SWA allocation;

Asserted per fault episode: exactly the injector's victims (its ground truth, never read from kvguard) get a
kvguard error, every other request's output tokens equal the fault-free episode's, and SGLang's idle accounting
(full and SWA pools, rows) is balanced afterwards; per fault-free episode: no request aborted although SGLang
slides every request's window (its sequences outgrow the window: out-of-window SWA pages are freed as it decodes).

The engine: SGLang's Triton attention under Triton's interpreter (``TRITON_INTERPRET=1``; the torch-native backend
does not read SWA layers through the map), one KV split, page size 16, radix cache and overlap scheduler on (SGLang's
defaults). SGLang frees SWA pages through its CUDA branch, as on a GPU (its ``get_and_clear_swa_pages`` kernel clears
the map without ``clear_full_to_swa_mapping``: faultlab/sglang_live/cpu_swa.py). That is what an H100 ran when
kvguard, following only ``clear_full_to_swa_mapping``, over-freed SWA pages; here, on the code before the fix, the
clean episode's request got a false ``swa_mapping`` abort at page size 16 (page size 1 passed).

The soak (0 false aborts over >= 1,000 clean decode steps) runs from the command line, on the same engine:
``FAULTLAB_SWA_SOAK=4 pytest tests/test_faultlab/test_sglang_live/test_sglang_swa.py -s`` (four more fault-free
episodes of ~320 decode steps each; the clean test then asserts >= 1,000). ``FAULTLAB_SWA_PAGE_SIZE=1`` runs the
same at page size 1.
"""
from __future__ import annotations

import os
import time

import pytest
from live_episodes import assert_clean as _clean, assert_exact_fault, engine_run, fault_episodes

from faultlab.sglang_live.families import GPT_OSS
from faultlab.sglang_live.plan import SWA_FAULTS

SOAKS = int(os.environ.get("FAULTLAB_SWA_SOAK", "0"))
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600 + 900 * SOAKS)]

SEED = 1
ENGINE_TIMEOUT = 560
CLASSES = list(SWA_FAULTS)
WORKLOAD = {"n1": 3, "n2": 1, "prefix": 12, "new1": 20, "new2": 6}
SOAK = {"n1": 8, "n2": 4, "new1": 200, "new2": 120, "wave2": "finished"}
PAGE_SIZE = int(os.environ.get("FAULTLAB_SWA_PAGE_SIZE", "16"))
SPEC = {
    "log_level": "error", "page_size": PAGE_SIZE, "radix": True, "overlap": True, "model": GPT_OSS,
    "attention_backend": "triton", "workload": WORKLOAD,
    "engine": {"disable_cuda_graph": True, "triton_attention_num_kv_splits": 1},
    "env": {"KVGUARD_MODE": "check", "TRITON_INTERPRET": "1", "FAULTLAB_SGLANG_SWA_CUDA_FREE": "1"},
}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from faultlab.sglang_live.harness import spawn

    episodes = fault_episodes(CLASSES, SEED)
    episodes += [{"label": f"soak{i}", "fault": None, "seed": SEED, "workload": SOAK} for i in range(SOAKS)]
    t0 = time.time()
    rc, result, stderr = spawn({**SPEC, "episodes": episodes}, str(tmp_path_factory.mktemp("swa")), "swa",
                               ENGINE_TIMEOUT + 900 * SOAKS)
    run = engine_run("gpt_oss", "GPT-OSS", rc, result, stderr)
    eps = run["episodes"]
    print(f"gpt_oss: startup {run['startup_s']:.0f} s, {time.time() - t0:.0f} s in all; "
          + ", ".join(f"{label}: {ep['steps']} steps" for label, ep in eps.items()))
    return run


def test_swa_pools_followed(hybrid):
    pools = [e for e in hybrid["events"] if e["event"] == "pools"]
    assert pools and pools[0]["allocator"] == "SWATokenToKVPoolAllocator", pools
    _clean(hybrid, "clean")


@pytest.mark.parametrize("fault", CLASSES)
def test_swa_fault_exactly_victims_aborted(hybrid, fault):
    assert_exact_fault(hybrid, fault, "swa_mapping")


def test_clean_episodes_no_false_aborts(hybrid):
    labels = ["clean"] + [f"soak{i}" for i in range(SOAKS)]
    steps = sum(_clean(hybrid, label)["steps"] for label in labels)
    print(f"fault-free decode steps: {steps}, false aborts: 0")
    if SOAKS:
        assert steps >= 1000, f"only {steps} fault-free decode steps"
