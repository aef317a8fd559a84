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


def corrupt(rng, seed: int, batch: int, table, rows, exp_slot, gens) -> set:
    """Corrupt a random quarter of the entries (none for seed 0), each of one kind (in place): the entries."""
    bad_at = set(rng.sample(range(batch), min(batch, 1 + batch // 4))) if seed else set()
    for b in sorted(bad_at):
        kind = KINDS[b % len(KINDS)]
        if kind == "foreign":
            table[rows[b]] = int(exp_slot[(b + 1) % batch]) if batch > 1 else int(exp_slot[b]) + 1
        elif kind == "reissued":
            gens[exp_slot[b]] += 1
        else:
            exp_slot[b] = gens.numel() + b if b % 2 else -1 - b
    return bad_at


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batch", [1, 3, 130])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_state_check_matches_ref_and_oracle(seed, batch, table_dtype):
    rng, table, rows, exp_slot, exp_gen, gens = make(seed, batch, table_dtype)
    bad_at = corrupt(rng, seed, batch, table, rows, exp_slot, gens)
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



@pytest.mark.parametrize("seed,batch,pad", [(0, 1, 0), (1, 1, 0), (0, 5, 3), (1, 5, 3), (2, 5, 3), (2, 130, 2)])
def test_captured_state_check_beside_the_kv_check(seed, batch, pad):
    """GraphStateCheck as a side of GraphCheck (one launch enqueues the KV check, the state check, then the epoch's
    bump, on the graph's one row buffer): its flags match the reference, padding entries (owner -1) are never
    checked, the epoch's one result word carries its verdict, and every ring slot is reused clean first."""
    from kvguard.kernels.graph_check import RING, GraphCheck
    from kvguard.kernels.state_check import GraphStateCheck, graph_state_check_ref

    rng, table, rows, exp_slot, exp_gen, gens = make(seed, batch, table_dtype=torch.int32)
    size = batch + pad
    # a KV check with nothing to read (length 0 everywhere): only the state side can flag
    kv = GraphCheck(torch.zeros(table.numel(), 8, dtype=torch.int32), torch.zeros(4, dtype=torch.int64),
                    torch.zeros(1, 2, dtype=torch.int64), page_div=4, batch_cap=size)
    side = GraphStateCheck(table, gens, kv, 0)
    assert kv.sides == [side]
    graph_rows = torch.cat([rows, torch.zeros(pad, dtype=torch.int64)])  # padding entries read row 0
    lengths = torch.zeros(size, dtype=torch.int64)
    owner = torch.zeros(batch, dtype=torch.int64)
    kv.set_owner(owner)
    side.expect(exp_slot.clone(), exp_gen.clone())
    for _ in range(RING + 1 if batch < 100 else 1):  # clean: every ring slot written and read clean (interpreter time)
        epoch = kv.next()
        kv.launch(graph_rows, lengths, torch.zeros(size, dtype=torch.int64), size)
        assert kv.clean(epoch) and side.flags(epoch, size).tolist() == [0] * size
    bad_at = corrupt(rng, seed, batch, table, rows, exp_slot, gens)
    side.expect(exp_slot, exp_gen)  # (new tensors: copied into the buffers)
    table[0] = 99  # row 0 (the padding entries' row) holds a slot no one expects: padding is never checked
    ref_table = table.clone()
    epoch = kv.next()
    kv.launch(graph_rows, lengths, torch.zeros(size, dtype=torch.int64), size)
    live = torch.cat([owner, torch.full((pad,), -1, dtype=torch.int64)])
    want = graph_state_check_ref(ref_table, graph_rows, live, side.expected_slot[:size],
                                 side.expected_gen[:size], gens, 0)
    got = side.flags(epoch, size)
    assert got.tolist() == want.tolist() == [int(b in bad_at) for b in range(batch)] + [0] * pad
    assert torch.equal(table, ref_table) and int(table[0]) == 99  # the same entries pointed at the scratch slot
    assert all(int(table[rows[b]]) == 0 for b in bad_at)
    assert kv.flagged(epoch) is bool(bad_at) and kv.clean(epoch) is not bool(bad_at)
