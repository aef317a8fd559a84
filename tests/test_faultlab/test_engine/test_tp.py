"""Tensor parallelism on CPU: 2 gloo ranks, tiny model; TP == single process, rank-local faults abort everywhere."""
from dataclasses import replace

import pytest
import torch

from faultlab.engine.tp import shard_cols, shard_rows
from faultlab.engine.weights import Int4Weight
from faultlab.faults.catalog import FAULTS
from faultlab.chaos.scenario import available_faults
from faultlab.engine.engine import EngineConfig
from faultlab.chaos.tp_run import RunSpec, judge, launch, main, resolve_backend
from kvguard.distributed import combine_verdict
from faultlab.engine.kernels.int4_gemm import quantize_int4

SPEC = RunSpec(fault="rank_divergent_entry", seeds=(0, 1), collective_timeout_s=30.0)


@pytest.fixture(scope="module")
def tp_results():
    """One 2-rank launch: the logits check, then per seed a fault-free and a faulty case on each rank."""
    results, hung = launch(SPEC, nproc=2, deadline_s=120.0)
    assert not hung, f"ranks {hung} hung"
    assert len(results) == 2 and not any(r["error"] for r in results), [r.get("traceback") for r in results]
    return results


def test_tp_logits_equal_single_process(tp_results):
    for r in tp_results:
        assert r["logits_max_abs_diff"] < 1e-5


def test_fault_free_tp_has_no_aborts_and_matches_single_process(tp_results):
    report = judge(replace(SPEC, fault=None), tp_results, [], 2)
    assert report["totals"]["ok"], report
    for r in tp_results:
        for case in r["cases"].values():
            assert case["clean"]["aborts"] == {}


def test_rank_local_fault_aborts_the_same_request_on_every_rank(tp_results):
    report = judge(SPEC, tp_results, [], 2)
    assert report["totals"]["ok"], report
    for row in report["seeds"]:
        assert row["injected"] == 1 and row["same_aborts"] and row["aborts"], row
        assert row["false_aborts"] == 0 and row["missed_victims"] == 0
    ranks = {rank for row in report["seeds"] for rank in row["fault_rank"]}
    faulty = [c["fault"] for r in tp_results for c in r["cases"].values()]
    assert all(f["aborts"] for f in faulty)  # the clean rank aborts too (its oracle sees no victim there)
    assert ranks <= {0, 1}


def test_int4_shards_reassemble_exactly(group_size=32):
    w = torch.randn(64, 128)
    q, s, m = quantize_int4(w, group_size)
    full = Int4Weight(q, s, m, group_size)
    rows = torch.cat([shard_rows(full, r, 2).dequantize() for r in range(2)])
    cols = torch.cat([shard_cols(full, r, 2).dequantize() for r in range(2)], dim=1)
    assert torch.equal(rows, full.dequantize()) and torch.equal(cols, full.dequantize())
    assert shard_cols(full, 3, 4).shape == (64, 32)  # one whole group per rank
    with pytest.raises(ValueError):
        shard_cols(full, 0, 8)  # 16 columns: half a group


def test_fault_is_registered_for_tp_only():
    assert FAULTS["rank_divergent_entry"].requires == "tp"
    assert "rank_divergent_entry" not in available_faults(EngineConfig())


def test_combine_verdict_without_a_group_is_identity():
    v = torch.tensor([0, 3, 0], dtype=torch.int32)
    assert combine_verdict(v.clone()).tolist() == [0, 3, 0]


def test_dist_backend_choice():
    assert resolve_backend("cpu", "auto", 2) == "gloo" and resolve_backend("cpu", "gloo", 8) == "gloo"
    with pytest.raises(ValueError, match="needs --device cuda"):
        resolve_backend("cpu", "nccl", 2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_backend("cuda", "auto", 2)


def test_tp_run_bad_input_exits_2(capsys):
    assert main(["--dist-backend", "nccl"]) == 2  # NCCL on CPU
    assert main(["--model", "no-such-model"]) == 2
    assert main(["--model", "smollm2"]) == 2  # GGUF weights are single-process
    assert "error:" in capsys.readouterr().err


def test_tp_with_kv_residual_aborts_the_same_request_and_equals_single_process():
    """engine.kv_residual on 2 ranks (each keeps the residual of its KV-head shard): rank-local faults
    still abort the same request everywhere, and the fault-free outputs equal the single process's."""
    spec = replace(SPEC, seeds=(0,), check_logits=False,
                   engine=replace(SPEC.engine, kv_dtype="fp8", kv_residual=True, kv_residual_window=32))
    results, hung = launch(spec, nproc=2, deadline_s=180.0)
    totals = judge(spec, results, hung, nproc=2)["totals"]
    assert totals["ok"] and totals["same_aborts_all_ranks"] == 1 and totals["tp_equals_single_process"] == 1, totals
