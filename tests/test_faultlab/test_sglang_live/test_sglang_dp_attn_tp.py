"""kvguard under SGLang 0.5.23's attention data parallelism with attention TP inside each DP rank, on the CPU: a fault
on one attention-TP rank of one DP rank is agreed by that DP rank's TP ranks, and no other rank is touched.

kvguard's path registry (kvguard/sglang/paths.py) names this file as the evidence for ``dp_attention_attn_tp``. One
``sglang.Engine`` with ``tp_size=4, attn_dp_size=2``: two attention-DP ranks, each run by two attention-TP scheduler
processes (TP ranks 0, 1: DP rank 0; 2, 3: DP rank 1), each process with its own pools; the same engine set-up as
tests/test_faultlab/test_sglang_live/test_sglang_dp_attention.py (which says what it needs on this CPU), with
``SGLANG_CPU_OMP_THREADS_BIND`` putting two ranks on each of the 2 cores. It serves:

* a fault-free episode;
* ``swapped_entries`` in ONE scheduler process only (the plan entry's ``tp_rank``: faultlab's injector arms there and
  nowhere else), once on TP rank 3 (DP rank 1's attention-TP rank 1: its peer, TP rank 2, is the one that streams
  the DP rank's outputs, so a victim's client gets kvguard's error only if the peer aborted it too) and once on TP
  rank 0 (DP rank 0's streaming rank: its peer must drop the victims as well, or the two run different batches).

Asserted: each process's kvguard agrees over SGLang's attention-TP group, which is its own DP rank's two TP ranks
(the ``pools`` line: ``attn_tp_ranks``, ``kvguard_agrees_with``); the fault-free episode has no abort; in each fault
episode the injector struck in the named process only; exactly its victims (its ground truth) got kvguard's error;
both TP ranks of the struck DP rank aborted exactly the victims (SGLang's ``prepare_abort``, logged per process), the
peer with kvguard's "on a peer tensor-parallel rank" error (its own check passed: the verdict came through the
agreement); the other DP rank's ranks aborted nothing; the server kept serving (no death, every process logged its
idle check afterwards); every other request's tokens equal the fault-free episode's; and every process's SGLang
idle accounting is balanced afterwards.
"""
from __future__ import annotations

import pytest
from live_episodes import (assert_balanced_on_every_rank, assert_clean, assert_others_unchanged, assert_victims_aborted,
                           decoding_ranks, episode, run_dp_engine)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(480)]

ENGINE_TIMEOUT = 420  # start 27-46 s on this 2-core machine (2026-12-06; 46 s beside other engines), 63-83 s in all
ATTN_TP = 2  # tp_size / attn_dp_size
STRUCK = {"swap3": 3, "swap0": 0}  # episode -> the TP rank its fault strikes in
EPISODES = [{"label": "clean", "fault": None}] + [
    {"label": label, "fault": "swapped_entries", "seed": 1, "tp_rank": rank} for label, rank in STRUCK.items()]
WORKLOAD = {"n1": 4, "n2": 2, "new1": 16, "new2": 8}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return run_dp_engine(str(tmp_path_factory.mktemp("dp_attn_tp")), "dp_attn_tp", 4, 2, EPISODES, WORKLOAD,
                         ENGINE_TIMEOUT)


def _tp_rank_of(run: dict) -> dict:
    """pid -> SGLang TP rank, from each scheduler process's ``pools`` line."""
    return {e["pid"]: e["tp_rank"] for e in run["events"] if e["event"] == "pools"}


def test_kvguard_agrees_over_its_dp_ranks_attention_tp_group(engine):
    pools = sorted((e for e in engine["events"] if e["event"] == "pools"), key=lambda e: e["tp_rank"])
    assert [e["tp_rank"] for e in pools] == [0, 1, 2, 3], f"not every scheduler process decoded: {pools}"
    for e in pools:
        own = [e["tp_rank"] // ATTN_TP * ATTN_TP + t for t in range(ATTN_TP)]
        assert e["attn_tp_ranks"] == own and e["kvguard_agrees_with"] == own, e


def test_clean_episode_no_false_abort(engine):
    ep = assert_clean(engine, "clean")
    assert [e for e in ep["events"] if e["event"] == "abort"] == []
    assert_balanced_on_every_rank(engine, 0.0)


@pytest.mark.parametrize("label", list(STRUCK))
def test_one_rank_fault_agreed_by_its_dp_rank_only(engine, label):
    clean, ep, tp_rank = episode(engine, "clean"), episode(engine, label), _tp_rank_of(engine)
    strikes = [e for e in ep["events"] if e["event"] == "inject"]
    assert [tp_rank[e["pid"]] for e in strikes] == [STRUCK[label]], f"not struck in TP rank {STRUCK[label]} only: " \
                                                                    f"{strikes}"
    victims = assert_victims_aborted(ep, "swapped_entries")
    dp_rank = STRUCK[label] // ATTN_TP
    aborts = [e for e in ep["events"] if e["event"] == "abort"]
    aborted = {r: sorted(e["rid"] for e in aborts if tp_rank[e["pid"]] == r) for r in sorted(tp_rank.values())}
    expected = {r: sorted(victims) if r // ATTN_TP == dp_rank else [] for r in aborted}
    assert aborted == expected, f"aborts by TP rank {aborted}, expected {expected} (DP rank {dp_rank} struck)"
    told = {r: {"on a peer tensor-parallel rank" in e["message"] for e in aborts if tp_rank[e["pid"]] == r}
            for r in expected if expected[r]}
    assert told == {r: {r != STRUCK[label]} for r in told}, f"who saw the fault (True: told by its peer): {told}"
    assert_others_unchanged(clean, ep, victims)
    assert label not in engine["deaths"], engine["deaths"][label]
    assert len(decoding_ranks(engine)) == 4
    assert_balanced_on_every_rank(engine, strikes[0]["time"])
