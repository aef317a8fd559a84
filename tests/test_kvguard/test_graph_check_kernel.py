"""The captured decode check (``kvguard.kernels.graph_check``, Triton under TRITON_INTERPRET=1 on CPU) against
its torch reference and a plain-loop oracle, on seeded random token tables with random corruption; and the
host's epoch bookkeeping (:class:`GraphCheck`): slots, stamps, padding, owner changes, a missing result.

Launched eagerly here, with the same arguments a capture gives it (the graph's static buffers are plain
tensors); on the H200 it runs inside SGLang's decode graphs (``python3 -m faultlab.sglang_gpu faults``).
"""
import pytest
import torch

from kvguard.kernels.graph_check import PROGRAMS, RING, GraphCheck, graph_check_ref

from test_tag_check_kernel import NUM_PAGES, make_per_token_case, per_token_oracle

PS = 4


def corrupted_case(seed: int, batch: int = 7, max_context: int = 96):
    case, seq = make_per_token_case(seed, batch=batch, page_size=PS, max_context=max_context)
    gen = torch.Generator().manual_seed(seed + 1)
    noise = torch.rand(case.table.shape, generator=gen) < 0.02
    case.table[noise] = torch.randint(-5, NUM_PAGES * PS + 9, (int(noise.sum()),), generator=gen).to(torch.int32)
    return case, seq


def padded(case, seq, pad: int):
    """The batch as a captured graph sees it: ``pad`` padding entries (row 0, length 1, owner -1) at the end."""
    rows = torch.cat([case.table_rows.long(), torch.zeros(pad, dtype=torch.int64)])
    owner = torch.cat([case.expected_rows, torch.full((pad,), -1, dtype=torch.int64)])
    n = torch.cat([seq.long(), torch.ones(pad, dtype=torch.int64)])
    slots = torch.randint(1, NUM_PAGES * PS, (rows.numel(),), generator=torch.Generator().manual_seed(5))
    return rows, owner, n, slots


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_graph_check_matches_reference_and_oracle(seed):
    case, seq = corrupted_case(400 + seed)
    rows, owner, n, slots = padded(case, seq, pad=3)
    g = GraphCheck(case.table, case.tags, case.expected, page_div=PS, batch_cap=16, scratch_slot=0)
    g.set_owner(case.expected_rows)
    out, ref_slots = slots.clone(), slots.clone()
    epoch = g.next()
    g.launch(rows, n, out, rows.numel())
    counts, anything = graph_check_ref(case.table, rows, owner, n, case.tags, case.expected, ref_slots,
                                       page_div=PS)
    got = g.verdict(epoch, rows.numel()).sum(1)
    want = per_token_oracle(case, seq, PS) + [0, 0, 0]  # padding entries are never checked
    assert counts.tolist() == want and got.tolist() == want
    assert sum(want) > 0 and any(w == 0 for w in want[:-3])
    assert rel_err(got, counts) == 0.0
    assert torch.equal(out, ref_slots)  # exactly the flagged requests' write slots went to the scratch slot
    assert [int(s) == 0 for s in out] == [w > 0 for w in want]
    assert g.flagged(epoch) is anything is True


def test_clean_batch_and_the_epoch_ring():
    case, seq = make_per_token_case(410, batch=5, page_size=PS)
    rows, owner, n, slots = padded(case, seq, pad=2)
    g = GraphCheck(case.table, case.tags, case.expected, page_div=PS, batch_cap=8)
    g.set_owner(case.expected_rows)
    for _ in range(RING + 3):  # every slot reused: a clean check never reads as an old flagged one
        epoch = g.next()
        out = slots.clone()
        assert g.clean(epoch) is False  # read before the check ran (the host reads it before any wait): not in
        g.launch(rows, n, out, rows.numel())
        assert g.flagged(epoch) is False and g.clean(epoch) is True and torch.equal(out, slots)
        assert int(g.verdict(epoch, rows.numel()).sum()) == 0
    assert int(g.epoch) == g.host_epoch == RING + 3
    # break one entry: only that epoch flags, and the next clean epoch in the same slot does not
    case.table[int(case.table_rows[2]), 1] += 1
    epoch = g.next()
    g.launch(rows, n, slots.clone(), rows.numel())
    assert g.flagged(epoch) and g.clean(epoch) is False
    assert g.done[epoch % RING].item() == 2 * (epoch + 1) + 1  # one result word: the epoch and its verdict
    case.table[int(case.table_rows[2]), 1] -= 1
    for _ in range(RING):
        epoch = g.next()
        g.launch(rows, n, slots.clone(), rows.numel())
    assert g.flagged(epoch) is False


def test_owner_change_pads_the_rest_and_rows_outside_flag():
    case, seq = make_per_token_case(420, batch=6, page_size=PS)
    rows, owner, n, slots = padded(case, seq, pad=0)
    g = GraphCheck(case.table, case.tags, case.expected, page_div=PS, batch_cap=8)
    g.set_owner(case.expected_rows)
    g.set_owner(case.expected_rows[:3])  # the batch shrank: entries 3.. are padding now
    epoch = g.next()
    case.table[int(case.table_rows[4]), 0] = -1  # broken, in an entry that is padding now: not flagged
    g.launch(rows, n, slots.clone(), rows.numel())
    assert g.flagged(epoch) is False and g.owner[3:6].tolist() == [-1, -1, -1]
    bad = case.expected_rows[:3].clone()
    bad[1] = case.expected.shape[0] + 4  # an expectation row outside the table: flagged without a read
    g.set_owner(bad)
    epoch = g.next()
    g.launch(rows, n, slots.clone(), rows.numel())
    assert g.flagged(epoch) and g.verdict(epoch, 3)[:, 0].tolist()[1] > 0
    assert (g.verdict(epoch, 3).sum(1) > 0).tolist() == [False, True, False]


def test_entries_past_the_table_are_counted():
    case, seq = make_per_token_case(430, batch=3, page_size=PS, max_context=32)
    rows, owner, n, slots = padded(case, seq, pad=0)
    n[0] = 40  # 8 entries past the table's width: counted, never skipped
    within = seq.clone()
    within[0] = 32
    g = GraphCheck(case.table, case.tags, case.expected, page_div=PS, batch_cap=4)
    g.set_owner(case.expected_rows)
    epoch = g.next()
    g.launch(rows, n, slots.clone(), 3)
    assert g.verdict(epoch, 3).sum(1).tolist()[0] == per_token_oracle(case, within, PS)[0] + 8
    assert g.flagged(epoch)


def test_a_missing_or_foreign_result_is_refused():
    case, seq = make_per_token_case(440, batch=2, page_size=PS)
    rows, owner, n, slots = padded(case, seq, pad=0)
    g = GraphCheck(case.table, case.tags, case.expected, page_div=PS, batch_cap=4)
    g.set_owner(case.expected_rows)
    g.next()  # counted on the host, never run on the device
    epoch = g.next()
    g.launch(rows, n, slots.clone(), 2)  # ran as the device's epoch 0, the host's 1
    with pytest.raises(RuntimeError, match="cannot be trusted"):
        g.flagged(epoch)
    assert g.clean(epoch) is False  # the steady state's test never passes a result that is not its epoch's
    with pytest.raises(ValueError, match="batch 5"):
        g.launch(rows, n, slots.clone(), 5)
    g.reset()
    assert g.host_epoch == 0 and int(g.epoch) == 0 and g.owner.tolist() == [-1] * 4


def test_programs_split_a_long_row():
    width = PROGRAMS * 256 + 40  # 17 chunks: program 0 takes chunks 0 and 16
    gen = torch.Generator().manual_seed(450)
    tags = torch.randperm(NUM_PAGES * 7, generator=gen)[:NUM_PAGES].long() + 1_000_003
    page = torch.randint(1, NUM_PAGES, (width // PS + 1,), generator=gen)
    j = torch.arange(width)
    table = (page[j // PS] * PS + j % PS).to(torch.int32)[None, :].repeat(2, 1)
    expected = tags[page][None, :].repeat(2, 1)
    for t in (3, 256 * 5 + 7, 256 * 9 + 1, width - 1):  # programs 0, 5, 9 and 0 again
        table[1, t] += 1 if t % PS != PS - 1 else -1
    g = GraphCheck(table, tags, expected, page_div=PS, batch_cap=1)
    g.set_owner(torch.tensor([1]))
    epoch = g.next()
    g.launch(torch.tensor([1]), torch.tensor([width]), torch.tensor([77]), 1)
    per_program = g.verdict(epoch, 1)[0]
    assert int(per_program.sum()) == 4 and (per_program > 0).nonzero().flatten().tolist() == [0, 5, 9]


def test_a_capture_while_serving_is_counted_again():
    case, seq = make_per_token_case(460, batch=2, page_size=PS)
    rows, owner, n, slots = padded(case, seq, pad=0)
    g = GraphCheck(case.table, case.tags, case.expected, page_div=PS, batch_cap=4)
    g.set_owner(case.expected_rows)
    epoch = g.next()
    g.launch(rows, n, slots.clone(), 2)
    for _ in range(3):  # a recapture's warm-up runs: on the device only
        g.launch(rows, n, slots.clone(), 2)
    g.recaptured = True
    g.resync()
    assert g.host_epoch == int(g.epoch) == 4 and not g.recaptured
    with pytest.raises(RuntimeError, match="cannot be trusted"):
        g.flagged(epoch + RING)  # an epoch the host never counted reads as missing, never as clean
    epoch = g.next()
    g.launch(rows, n, slots.clone(), 2)
    assert epoch == 4 and g.flagged(epoch) is False


def test_self_test_passes_on_a_device_that_writes_the_result_cells():
    case, seq = make_per_token_case(470, batch=2, page_size=PS)
    expected = case.expected.clone()
    expected[0] = -1  # row 0, SGLang's padding row: nothing recorded there
    g = GraphCheck(case.table, case.tags, expected, page_div=PS, batch_cap=4)
    assert g.self_test(0)
    assert g.host_epoch == int(g.epoch) == 0 and g.owner.tolist() == [-1] * 4  # ends reset
    g.flag.fill_(0)
    g.done.fill_(0)
    # a device whose writes never reach the cells the host reads: every result is missing, the test fails
    g.flag, g.done = torch.zeros(RING, dtype=torch.int64), torch.zeros(RING, dtype=torch.int64)
    assert not g.self_test(0)
