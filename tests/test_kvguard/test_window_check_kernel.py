"""The Triton window check (under TRITON_INTERPRET=1 on CPU) against ``window_check_ref`` and a Python oracle.

Seeded random SWA pools (a full→SWA pairing, random unique tags), random rows, lengths and windows, odd shapes;
corruptions placed inside and outside each request's window: only those inside are flagged.
"""
import random

import pytest
import torch

from kvguard.kernels.tag_check import WriteGuard
from kvguard.kernels.window_check import WindowCheck, window_check_ref

KINDS = ("cleared", "foreign", "released", "full_out_of_range", "swa_out_of_range")


def make_pools(seed: int, batch: int, width: int, ps: int, table_dtype=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    full_slots, swa_slots = 157 * ps, 131 * ps
    pair = torch.full((full_slots,), -1, dtype=torch.int64)
    paired = torch.randperm(full_slots - ps, generator=gen)[: min(swa_slots - ps, full_slots - ps)] + ps
    pair[paired] = torch.randperm(swa_slots - ps, generator=gen)[: paired.numel()] + ps
    tags = torch.randperm(7 * swa_slots, generator=gen)[: swa_slots // ps].long() + 1_000_003
    index_map = torch.zeros(full_slots + ps + 1, dtype=torch.int64)
    index_map[:full_slots] = pair.clamp(min=0)
    index_map[-1] = -1
    pair_tag = torch.where(pair > 0, tags[pair.clamp(min=0) // ps], torch.full_like(pair, -1))
    rows = 3 + batch
    # each row maps distinct full slots (as a request's row does)
    table = torch.stack([paired[torch.randperm(paired.numel(), generator=gen)[:width]] for _ in range(rows)])
    table = table.to(table_dtype)
    table_rows = torch.randperm(rows, generator=gen)[:batch].to(torch.int32)
    n_entries = torch.randint(1, width + 1, (batch,), generator=gen).long()
    return dict(table=table, index_map=index_map, pair=pair, pair_tag=pair_tag, tags=tags,
                table_rows=table_rows, n_entries=n_entries, swa_limit=swa_slots, paired=paired)


def oracle(p, window, ps, q) -> list[int]:
    counts = []
    for b in range(p["table_rows"].numel()):
        row, n = int(p["table_rows"][b]), int(p["n_entries"][b])
        lo = max(n - window - (1 if q is None else int(q[b])), 0)
        c = 0
        for j in range(lo, n):
            full = int(p["table"][row, j])
            if not 0 <= full < p["pair"].numel():
                c += 1
                continue
            swa = int(p["index_map"][full])
            ok = 0 < swa < p["swa_limit"] and swa == int(p["pair"][full]) \
                and int(p["tags"][swa // ps]) == int(p["pair_tag"][full])
            c += not ok
        counts.append(c)
    return counts


def corrupt(p, rng: random.Random, kind: str, ps: int) -> None:
    b = rng.randrange(p["table_rows"].numel())
    row, n = int(p["table_rows"][b]), int(p["n_entries"][b])
    j = rng.randrange(n)
    full = int(p["table"][row, j])
    if kind == "cleared":
        p["index_map"][full] = 0
    elif kind == "foreign":
        p["index_map"][full] = int(p["pair"][int(p["paired"][rng.randrange(p["paired"].numel())])])
    elif kind == "released":
        p["tags"][int(p["pair"][full]) // ps] += 1
    elif kind == "full_out_of_range":
        p["table"][row, j] = p["pair"].numel() + rng.randrange(5)
    else:
        p["index_map"][full] = p["swa_limit"] + rng.randrange(3)


def run_both(p, window, ps, q=None, guard_of=None):
    verdicts = []
    for reference in (False, True):
        verdict = torch.randint(0, 3, (p["table_rows"].numel(), 3), dtype=torch.int32)
        base = verdict.clone()
        flag = torch.zeros(1, dtype=torch.int64)
        guard = guard_of() if guard_of is not None else None
        check = WindowCheck(p["table"], p["index_map"], p["pair"], p["pair_tag"], p["tags"], page_div=ps,
                            window=window, swa_limit=p["swa_limit"], reference=reference)
        check(p["table_rows"], p["n_entries"], verdict, q=q, guard=guard, flag=flag, stamp=7)
        verdicts.append((verdict - base, flag, guard))
    return verdicts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ps", [1, 4])
def test_kernel_matches_reference_and_oracle(seed, ps):
    rng = random.Random(seed * 31 + ps)
    batch, width = rng.choice([1, 3, 5, 9]), rng.choice([7, 33, 70])
    p = make_pools(seed, batch, width, ps, table_dtype=rng.choice([torch.int32, torch.int64]))
    for _ in range(rng.randint(0, 6)):
        corrupt(p, rng, rng.choice(KINDS), ps)
    window = rng.choice([0, 3, 15, 64])
    q = None if rng.random() < 0.5 else torch.randint(1, 5, (batch,), dtype=torch.int64)
    (kv, kflag, _), (rv, rflag, _) = run_both(p, window, ps, q)
    want = oracle(p, window, ps, q)
    assert kv[:, 0].tolist() == rv[:, 0].tolist() == want, (kv[:, 0].tolist(), rv[:, 0].tolist(), want)
    assert not kv[:, 1:].any() and not rv[:, 1:].any()
    assert int(kflag) == int(rflag) == (7 if any(want) else 0)


@pytest.mark.parametrize("kind", KINDS)
def test_each_corruption_in_window_is_flagged_and_outside_is_not(kind):
    ps, window = 2, 5
    p = make_pools(11, 4, 40, ps)
    p["n_entries"][:] = 30
    row = int(p["table_rows"][2])
    rng = random.Random(kind)
    corrupt_at(p, kind, row, rng.randrange(0, 24), ps)  # not read: a decode step reads [30 - 5 - 1, 30)
    (kv, kflag, _), (rv, _, _) = run_both(p, window, ps)
    assert kv[:, 0].tolist() == rv[:, 0].tolist() == [0, 0, 0, 0] and int(kflag) == 0
    corrupt_at(p, kind, row, rng.randrange(24, 30), ps)
    (kv, kflag, _), (rv, _, _) = run_both(p, window, ps)
    assert kv[:, 0].tolist() == rv[:, 0].tolist() == oracle(p, window, ps, None)
    assert kv[2, 0] >= 1 and int(kflag) == 7


def corrupt_at(p, kind, row, j, ps):
    full = int(p["table"][row, j])
    if kind == "cleared":
        p["index_map"][full] = 0
    elif kind == "foreign":
        others = [int(p["pair"][int(f)]) for f in p["paired"][:50] if int(p["pair"][int(f)]) != int(p["pair"][full])]
        p["index_map"][full] = others[0]
    elif kind == "released":
        p["tags"][int(p["pair"][full]) // ps] += 1
    elif kind == "full_out_of_range":
        p["table"][row, j] = -3
    else:
        p["index_map"][full] = p["swa_limit"]


@pytest.mark.parametrize("segments", [False, True])
def test_write_guard_redirects_flagged_requests_only(segments):
    ps, window = 1, 4
    p = make_pools(5, 3, 20, ps)
    p["n_entries"][:] = 12
    row = int(p["table_rows"][1])
    p["index_map"][int(p["table"][row, 11])] = 0  # request 1's newest entry cleared
    if segments:
        lens = torch.tensor([2, 3, 1])
        starts = torch.tensor([0, 2, 5])

        def guard_of():
            return WriteGuard(torch.arange(100, 106), starts, lens, scratch=0)
    else:
        def guard_of():
            return WriteGuard(torch.tensor([100, 101, 102]), scratch=0)
    for verdict, flag, guard in run_both(p, window, ps, q=lens if segments else None, guard_of=guard_of):
        assert verdict[:, 0].tolist() == [0, 1, 0]
        want = [100, 101, 0, 0, 0, 105] if segments else [100, 0, 102]
        assert guard.slots.tolist() == want


def test_bad_row_flags_without_reading():
    p = make_pools(3, 2, 10, 1)
    p["table_rows"][0] = 99
    (kv, _, _), (rv, _, _) = run_both(p, 3, 1)
    assert kv[0, 0] >= 1 and rv[0, 0] >= 1 and kv[1, 0] == rv[1, 0] == 0


def test_rejects_bad_arguments():
    p = make_pools(1, 2, 10, 1)
    check = WindowCheck(p["table"], p["index_map"], p["pair"], p["pair_tag"], p["tags"], page_div=1, window=3,
                        swa_limit=p["swa_limit"])
    with pytest.raises(ValueError, match="verdict"):
        check(p["table_rows"], p["n_entries"], torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="n_entries"):
        check(p["table_rows"], p["n_entries"][:1], torch.zeros(2, 3, dtype=torch.int32))


def test_warm_up_changes_nothing():
    p = make_pools(2, 2, 10, 4)
    before = {k: v.clone() for k, v in p.items() if isinstance(v, torch.Tensor)}
    check = WindowCheck(p["table"], p["index_map"], p["pair"], p["pair_tag"], p["tags"], page_div=4, window=3,
                        swa_limit=p["swa_limit"])
    check.warm_up()
    assert all(torch.equal(before[k], p[k]) for k in before)
