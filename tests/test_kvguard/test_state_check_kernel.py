"""The Triton state-slot check (under TRITON_INTERPRET=1 on CPU) against ``state_check_ref`` and a Python oracle.

Seeded random slot tables and generations, odd batch sizes; corruptions of each kind (another request's slot,
a slot handed out again, an expected slot off the pool): exactly those entries are flagged and pointed at the
scratch slot, every other table entry is left as it was.
"""
import random

import pytest
import torch

from kvguard.kernels.state_check import StateCheck, state_check_ref

KINDS = ("foreign", "reissued", "off_pool")


def make(seed: int, batch: int, table_dtype):
    rng = random.Random(seed)
    n_slots, n_rows = 3 * batch + 5, 2 * batch + 3
    slots = rng.sample(range(1, n_slots), batch)
    rows = rng.sample(range(1, n_rows), batch)
    table = torch.zeros(n_rows, dtype=table_dtype)
    table[torch.tensor(rows)] = torch.tensor(slots, dtype=table_dtype)
    gens = torch.tensor([rng.randrange(1, 9) for _ in range(n_slots)], dtype=torch.int64)
    exp_slot = torch.tensor(slots, dtype=torch.int64)
    exp_gen = gens[exp_slot].clone()
    return rng, table, torch.tensor(rows, dtype=torch.int64), exp_slot, exp_gen, gens


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batch", [1, 3, 130])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_state_check_matches_ref_and_oracle(seed, batch, table_dtype):
    rng, table, rows, exp_slot, exp_gen, gens = make(seed, batch, table_dtype)
    bad_at = set(rng.sample(range(batch), min(batch, 1 + batch // 4))) if seed else set()
    for b in sorted(bad_at):
        kind = KINDS[b % len(KINDS)]
        if kind == "foreign":
            table[rows[b]] = int(exp_slot[(b + 1) % batch]) if batch > 1 else int(exp_slot[b]) + 1
        elif kind == "reissued":
            gens[exp_slot[b]] += 1
        else:
            exp_slot[b] = gens.numel() + b if b % 2 else -1 - b
    before = table.clone()
    ref_table = table.clone()
    want = state_check_ref(ref_table, rows, exp_slot, exp_gen, gens, 0)
    bad = torch.full((batch + 7,), -5, dtype=torch.int32)
    got = StateCheck(table, gens, 0)(rows, exp_slot, exp_gen, bad)
    assert got.tolist() == want.tolist() == [int(b in bad_at) for b in range(batch)]
    assert bad[batch:].tolist() == [-5] * 7  # nothing past the batch written
    assert torch.equal(table, ref_table)
    flagged_rows = {int(rows[b]) for b in bad_at}
    for r in range(table.numel()):
        assert int(table[r]) == (0 if r in flagged_rows else int(before[r])), f"row {r}"


def test_state_check_empty_batch():
    table = torch.tensor([0, 3, 4], dtype=torch.int32)
    gens = torch.zeros(6, dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int64)
    assert StateCheck(table, gens)(empty, empty, empty, torch.zeros(4, dtype=torch.int32)).numel() == 0
    assert table.tolist() == [0, 3, 4]
