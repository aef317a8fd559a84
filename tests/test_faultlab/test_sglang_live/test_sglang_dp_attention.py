"""kvguard under SGLang 0.5.23's attention data parallelism, through SGLang's real code on the CPU.

kvguard's path registry (kvguard/sglang/paths.py) names this file as the evidence for ``dp_attention``. One
``sglang.Engine`` with ``tp_size=2, attn_dp_size=2`` (attention TP 1: two attention-DP ranks, each a scheduler process
with its own pools, its MLP tensor-parallel over both) of a tiny Qwen2 config (its vocabulary embedding follows the
attention-TP group under DP attention, as SGLang's DP-attention models' do), ``KVGUARD_MODE=check``, in a process of
its own (faultlab.sglang_live.harness), serves:

* a fault-free episode: wave 1's first request decodes alone (the other rank runs SGLang's idle batches beside it),
  then both ranks decode batches of different sizes (SGLang pads the smaller to the larger before the MLP sync:
  kvguard/sglang/dp_attention.py), then wave 2;
* ``swapped_entries``: on each rank, once two of its requests decode, two of their table entries are swapped
  (faultlab's injector runs in each scheduler process, so each rank strikes its own requests).

Asserted: both ranks served (each logged decode steps and struck); no false abort; exactly the injector's victims
(its ground truth, from both ranks) get kvguard's error; every other request's tokens equal the fault-free
episode's; and each rank's SGLang idle accounting (its own KV and row pools) is balanced after each episode.

The engine on this CPU: faultlab's ``FAULTLAB_SGLANG_CPU_DP=1`` (faultlab/sglang_live/cpu_dp.py: SGLang's collectives
over gloo, its CPU branches), ``SGLANG_CPU_OMP_THREADS_BIND`` one core per rank, torch_native attention, no graphs.
"""
from __future__ import annotations

import pytest
from live_episodes import (assert_balanced_on_every_rank, assert_clean, assert_others_unchanged, assert_victims_aborted,
                           decoding_ranks, episode, run_dp_engine)


pytestmark = [pytest.mark.sglang, pytest.mark.timeout(420)]

ENGINE_TIMEOUT = 360  # start: 50-95 s on this 2-core machine (95 s beside a running test suite); episodes ~15 s
EPISODES = [{"label": "clean", "fault": None}, {"label": "swap", "fault": "swapped_entries", "seed": 1}]

WORKLOAD = {"n1": 4, "n2": 2}


@pytest.fixture(scope="module")
def dp_engine(tmp_path_factory):
    return run_dp_engine(str(tmp_path_factory.mktemp("dp_attn")), "dp_attn", 2, 2, EPISODES, WORKLOAD,
                         ENGINE_TIMEOUT)


def test_both_dp_ranks_serve_the_clean_episode_checked(dp_engine):
    """Served with KVGUARD_MODE=check (a registry refusal stops the engine at start), on both DP ranks: no false abort,
    every request answered, each rank's pools balanced afterwards."""
    assert len(decoding_ranks(dp_engine)) == 2, f"not both DP ranks decoded: {dp_engine['events'][:20]}"
    assert_clean(dp_engine, "clean")
    assert_balanced_on_every_rank(dp_engine, 0.0)


def test_swapped_entries_on_both_ranks_exactly_victims_aborted(dp_engine):
    clean, ep = episode(dp_engine, "clean"), episode(dp_engine, "swap")
    strikes = [e for e in ep["events"] if e["event"] == "inject"]
    assert {e["pid"] for e in strikes} == decoding_ranks(dp_engine), f"not every DP rank struck: {strikes}"
    victims = assert_victims_aborted(ep, "swapped_entries")
    assert_others_unchanged(clean, ep, victims)
    assert_balanced_on_every_rank(dp_engine, min(e["time"] for e in strikes))
