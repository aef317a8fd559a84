"""kvguard on a hybrid linear-attention (mamba2) model with SGLang's radix cache on, through SGLang 0.5.23's real code.

The engine of tests/test_faultlab/test_sglang_live/test_sglang_mamba.py (a tiny NemotronH, ``KVGUARD_MODE=check``,
``TRITON_INTERPRET=1``, no overlap scheduler, page size 1), with the radix cache on: SGLang builds a
``UnifiedRadixCache`` with its mamba component (``mamba_radix_cache_strategy=no_buffer``, the strategy SGLang picks
on a platform without extra-buffer support). A chunked prefill of 8 tokens makes the tree keep a state at each chunk
boundary of wave 1's first request (``stash_chunked_request`` -> ``checkpoint``: a fresh slot, a copy), inside the
12-token prefix every request shares: the later requests match it and copy the tree's state into their own slot
(kvguard/sglang/mamba_radix.py checks each copy's source). Asserted:

* fault-free: SGLang's scheduler reports cached prefix tokens (its ``#cached-token`` log line: the copies ran), no
  request is aborted, and SGLang's idle accounting (KV, row and state pools) is balanced;
* per fault (``mamba_index_swap``, ``mamba_slot_reuse``, ``swapped_entries``): exactly the injector's victims get a
  kvguard error, every other request's tokens equal the fault-free episode's, the pools balance.

A fault on the tree's own slots (a node's slot freed and handed to another request) is shown step by step on SGLang's
real tree: tests/test_kvguard/test_sglang/test_sglang_mamba_radix.py, which CI runs. This engine (a second NemotronH
engine: 2-5 minutes on the 2-core machine) runs from the command line:
``FAULTLAB_MAMBA_RADIX_LIVE=1 pytest tests/test_faultlab/test_sglang_live/test_sglang_mamba_radix_engine.py -s``.
"""
from __future__ import annotations

import os
import re
import time

import pytest
from live_episodes import assert_clean as _clean, assert_exact_fault, engine_run, fault_episodes, print_run

from faultlab.sglang_live.families import NEMOTRON_H

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900),
              pytest.mark.skipif(os.environ.get("FAULTLAB_MAMBA_RADIX_LIVE") != "1",
                                 reason="a command-line run (FAULTLAB_MAMBA_RADIX_LIVE=1): a second hybrid engine")]

SEED = 1
ENGINE_TIMEOUT = 840
CLASSES = ["mamba_index_swap", "mamba_slot_reuse", "swapped_entries"]
WORKLOAD = {"n1": 3, "n2": 2, "prefix": 12, "new1": 16, "new2": 8}
SPEC = {
    "log_level": "info", "page_size": 1, "radix": True, "overlap": False, "model": NEMOTRON_H,
    "engine": {"mamba_radix_cache_strategy": "no_buffer", "chunked_prefill_size": 8}, "workload": WORKLOAD,
    "env": {"KVGUARD_MODE": "check", "TRITON_INTERPRET": "1", "FAULTLAB_SGLANG_CPU_MAMBA": "1"},
}
CACHED = re.compile(r"#cached-token: (\d+)")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from faultlab.sglang_live.harness import spawn

    episodes = fault_episodes(CLASSES, SEED)
    t0 = time.time()
    rc, result, stderr = spawn({**SPEC, "episodes": episodes}, str(tmp_path_factory.mktemp("radix")), "radix",
                               ENGINE_TIMEOUT)
    run = engine_run("nemotron_h_radix", "NemotronH, radix cache", rc, result, stderr)
    print_run(run, "nemotron_h_radix", t0)
    return run


def test_the_radix_engine_copies_tree_states_and_serves_a_clean_episode(hybrid):
    cached = [int(n) for n in CACHED.findall(hybrid["stderr"])]
    print(f"prefill batches with cached tokens: {sum(n > 0 for n in cached)} of {len(cached)}")
    assert any(n > 0 for n in cached), "no prefill matched the tree (no state was copied out of it)"
    _clean(hybrid, "clean")


@pytest.mark.parametrize("fault", CLASSES)
def test_state_fault_exactly_victims_aborted(hybrid, fault):
    assert_exact_fault(hybrid, fault)
