"""Verdict piggyback under TP (CPU, 2 gloo ranks, tiny model): the flags ride on the step's last all-reduce.

Same aborts as the separate verdict all-reduce on every rank under a rank-local fault, logits untouched
by the extra column, no false aborts; plus the ride's layout without a process group.
"""
from dataclasses import replace

import pytest
import torch
from prometheus_client import CollectorRegistry

from faultlab.chaos.tp_run import RunSpec, judge, launch
from kvguard import TrackerConfig
from kvguard.distributed import RankTracker, VerdictRide

SEPARATE = RunSpec(fault="rank_divergent_entry", seeds=(0, 1), collective_timeout_s=30.0, check_logits=False)
PIGGYBACK = replace(SEPARATE, piggyback=True, check_logits=True)


def _launch(spec):
    results, hung = launch(spec, nproc=2, deadline_s=120.0)
    assert not hung, f"ranks {hung} hung"
    assert len(results) == 2 and not any(r["error"] for r in results), [r.get("traceback") for r in results]
    return results


@pytest.fixture(scope="module")
def runs():
    """(separate all-reduce results, piggyback results): one 2-rank launch each, same seeds and fault."""
    return _launch(SEPARATE), _launch(PIGGYBACK)


def test_piggyback_aborts_equal_the_separate_all_reduce_on_every_rank(runs):
    separate, piggyback = runs
    report = judge(PIGGYBACK, piggyback, [], 2)
    assert report["totals"]["ok"], report
    for row in report["seeds"]:
        assert row["injected"] == 1 and row["same_aborts"] and row["aborts"], row
    for sep, pig in zip(separate, piggyback):
        for seed in SEPARATE.seeds:
            a, b = sep["cases"][seed]["fault"], pig["cases"][seed]["fault"]
            assert a["aborts"] and a["aborts"] == b["aborts"], (seed, a["aborts"], b["aborts"])
            assert a["outputs"] == b["outputs"]


def test_piggyback_rides_every_check_and_the_separate_mode_none(runs):
    separate, piggyback = runs
    for r in piggyback:
        for case in r["cases"].values():
            for run in (case["clean"], case["fault"]):
                assert run["checks"] > 0 and run["verdict_rides"] == run["checks"]
    for r in separate:
        for case in r["cases"].values():
            assert case["clean"]["verdict_rides"] == 0 and case["fault"]["verdict_rides"] == 0


def test_piggyback_leaves_logits_bit_identical(runs):
    for r in runs[1]:
        assert r["piggyback_ok"] and r["piggyback_logits_max_abs_diff"] == 0.0, r
        assert r["piggyback_landed"] == [1, 1]  # flagged on rank 0 only: both ranks land it
        assert r["logits_ok"] and r["logits_max_abs_diff"] < 1e-5


def test_piggyback_has_no_false_aborts(runs):
    report = judge(replace(PIGGYBACK, fault=None), runs[1], [], 2)
    assert report["totals"]["ok"] and report["totals"]["false_aborts"] == 0, report
    for r in runs[1]:
        for case in r["cases"].values():
            assert case["clean"]["aborts"] == {}


@pytest.mark.parametrize("rows,batch", [(4, 4), (1, 3), (2, 3), (20, 1)])
def test_ride_layout_round_trips(rows, batch):
    """board/land without a process group (world 1): flags come back, the hidden state is untouched."""
    flags = torch.tensor([0, 2, 0, 5][:batch] if batch <= 4 else [1] * batch, dtype=torch.int32)
    out = torch.full((batch, 1), -1, dtype=torch.int32)
    ride = VerdictRide(flags, out)
    y = torch.randn(rows, 8, dtype=torch.bfloat16)
    wide = ride.board(y)
    assert wide.shape == (rows, 8 + ride.columns(rows)) and ride.columns(rows) == -(-batch // rows)
    back = ride.land(wide * 2)  # a "SUM over 2 ranks" that both flagged what this one flagged
    assert torch.equal(back, y * 2) and ride.landed
    assert out.flatten().tolist() == [2 * int(f > 0) for f in flags.tolist()]


def _tracker(piggyback: bool) -> RankTracker:
    t = RankTracker(TrackerConfig(mode="check", log_violations=False, backend="torch"), CollectorRegistry(),
                    piggyback=piggyback)
    t.attach(num_pages=8, num_rows=2, max_entries=2, device="cpu", page_size=1)
    pages = torch.tensor([1, 2, 3, 4])
    t.on_alloc(pages)
    t.record(0, 0, pages[:2])
    t.record(1, 0, pages[2:])
    return t


def test_unlanded_ride_is_refused_and_combine_lands_it():
    t = _tracker(piggyback=True)
    table = torch.tensor([[1, 2], [3, 7]], dtype=torch.int32)  # request 1's second entry is wrong
    rows, n = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32)
    check = t.validate(table, rows, n, max_entries=2)
    assert check.ride is not None and int(check.verdict.sum()) == 0  # nothing combined yet
    with pytest.raises(RuntimeError, match="never rode"):
        t.resolve(check, check.verdict.cpu(), ["a", "b"])
    check.ride.combine()  # no process group: the local verdict
    found = t.resolve(check, check.verdict.cpu(), ["a", "b"])
    assert [v.violation.request_id for v in found] == ["b"] and found[0].violation.reason == "tag_mismatch"
    plain = _tracker(piggyback=False).validate(table.clone(), rows, n, max_entries=2)
    assert plain.ride is None and plain.verdict.flatten().tolist() == check.verdict.flatten().tolist()
