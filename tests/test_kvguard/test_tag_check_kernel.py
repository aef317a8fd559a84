"""The Triton ``tag_check`` (under TRITON_INTERPRET=1 on CPU) against ``tag_check_ref`` and an oracle.

Every case is built from seeded random data (never zeros): unique random tags, random page tables,
request slots and table rows in shuffled order, random live lengths. Corruptions are placed at known
entries, so the exact entries (hence rows and per-chunk counts) that must be flagged are known by
construction; a plain Python loop over the spec double-checks that ground truth.
"""
import itertools
import random
from dataclasses import dataclass, field

import pytest
import torch

from kvguard.kernels.tag_check import tag_check, tag_check_ref

UNSET = -1
NUM_PAGES = 203  # pool size, scratch page 0 included
KINDS = ("out_of_range", "negative", "swapped", "shift_up", "shift_down", "unrecorded")


@dataclass
class Case:
    """Inputs of one launch plus the entries (b, j) that must fail."""

    table: torch.Tensor
    table_rows: torch.Tensor
    expected_rows: torch.Tensor
    n_entries: torch.Tensor
    tags: torch.Tensor
    expected: torch.Tensor
    entry_step: int = 1
    page_div: int = 1
    bad: set = field(default_factory=set)

    def args(self, table=None):
        """Positional arguments of tag_check / tag_check_ref (optionally on another table copy)."""
        return (self.table if table is None else table, self.table_rows, self.expected_rows,
                self.n_entries, self.tags, self.expected)

    def cell(self, b: int, j: int) -> tuple[int, int]:
        """(table row, column) of entry j of batch entry b."""
        return int(self.table_rows[b]), j * self.entry_step


def random_tags(gen: torch.Generator, num_pages: int = NUM_PAGES) -> torch.Tensor:
    """Unique, non-negative, non-trivial int64 tags (never equal to the page id)."""
    return torch.randperm(num_pages * 7, generator=gen)[:num_pages].long() + 1_000_003


def make_case(seed: int, batch: int, width: int, table_dtype=torch.int32) -> Case:
    """A healthy batch-packed case: every live entry maps a real page whose tag the slot expects."""
    gen = torch.Generator().manual_seed(seed)
    spare = 3  # table rows / request slots not in the batch: must stay untouched
    tags = random_tags(gen)
    table = torch.randint(1, NUM_PAGES, (batch + spare, width), generator=gen).to(table_dtype)
    table_rows = torch.randperm(batch + spare, generator=gen)[:batch].to(torch.int32)
    expected_rows = torch.randperm(batch + spare + 2, generator=gen)[:batch].long()
    n_entries = torch.randint(1, width + 1, (batch,), generator=gen).to(torch.int32)
    n_entries[int(torch.randint(0, batch, (1,), generator=gen))] = width  # one full row
    # dead expected entries (j >= n) hold random junk tags: they must be ignored
    expected = torch.randint(0, 2**40, (batch + spare + 2, width), generator=gen)
    for b in range(batch):
        n, row = int(n_entries[b]), int(table_rows[b])
        expected[expected_rows[b], :n] = tags[table[row, :n].long()]
    return Case(table, table_rows, expected_rows, n_entries, tags, expected)


def live_entries(case: Case) -> list[tuple[int, int]]:
    """All (b, j) with j < n_entries[b]."""
    return [(b, j) for b in range(case.n_entries.numel()) for j in range(int(case.n_entries[b]))]


def corrupt(case: Case, kind: str, b: int, j: int, rng: random.Random, partner=None) -> None:
    """Break entry (b, j) in the way ``kind`` names and record it (and a swap partner) as bad."""
    row, col = case.cell(b, j)
    div = case.page_div
    raw = int(case.table[row, col])
    limit = NUM_PAGES * div
    if kind == "out_of_range":
        case.table[row, col] = rng.choice([limit, limit + rng.randrange(1, 5000)])
    elif kind == "negative":
        case.table[row, col] = rng.choice([-1, -div, -rng.randrange(2, 5000)])
    elif kind == "shift_up":
        case.table[row, col] = raw + div
    elif kind == "shift_down":
        case.table[row, col] = raw - div  # page 1 - 1 = scratch page 0: still a mismatch
    elif kind == "unrecorded":
        case.expected[case.expected_rows[b], j] = UNSET
    elif kind == "swapped":
        (b2, j2) = partner
        row2, col2 = case.cell(b2, j2)
        case.table[row, col], case.table[row2, col2] = int(case.table[row2, col2]), raw
        case.bad.add((b2, j2))
    else:
        raise AssertionError(kind)
    case.bad.add((b, j))


def apply_random_corruptions(case: Case, seed: int) -> None:
    """A few corruptions of every kind at distinct random live entries (swaps need distinct pages)."""
    rng = random.Random(seed)
    free = live_entries(case)
    rng.shuffle(free)
    for kind in itertools.islice(itertools.cycle(KINDS), rng.randint(1, min(8, len(free)))):
        if not free:
            break
        b, j = free.pop()
        partner = None
        if kind == "swapped":
            partner = next((e for e in free if case.table[case.cell(*e)] // case.page_div
                            != case.table[case.cell(b, j)] // case.page_div), None)
            if partner is None:
                kind = "out_of_range"
            else:
                free.remove(partner)
        corrupt(case, kind, b, j, rng, partner)


def oracle_bad(case: Case) -> set:
    """The failing entries, straight from the spec, one Python loop per entry."""
    bad = set()
    limit = case.tags.numel() * case.page_div
    for b, j in live_entries(case):
        raw = int(case.table[case.cell(b, j)])
        want = int(case.expected[case.expected_rows[b], j])
        if raw < 0 or raw >= limit or int(case.tags[raw // case.page_div]) != want:
            bad.add((b, j))
    return bad


def verdict_from(bad: set, batch: int, max_entries: int, block: int) -> torch.Tensor:
    """Per-chunk bad-entry counts for a set of failing entries."""
    n_chunks = max(1, -(-max_entries // block))
    verdict = torch.zeros((batch, n_chunks), dtype=torch.int32)
    for b, j in bad:
        verdict[b, j // block] += 1
    return verdict


def quarantined(case: Case, scratch_page: int) -> torch.Tensor:
    """The table expected after quarantine: exactly the bad entries set to ``scratch_page``."""
    table = case.table.clone()
    for b, j in case.bad:
        table[case.cell(b, j)] = scratch_page
    return table


def run_both(case: Case, **kwargs):
    """Run Triton and reference on separate table copies; return (verdicts, tables)."""
    t_tri, t_ref = case.table.clone(), case.table.clone()
    v_tri = tag_check(*case.args(t_tri), **kwargs)
    v_ref = tag_check_ref(*case.args(t_ref), **kwargs)
    return v_tri, v_ref, t_tri, t_ref


def assert_exact(case: Case, block: int, max_entries: int, scratch_page: int = 0, quarantine=True):
    """Both backends give the exact verdict, flagged rows and quarantined table the truth predicts."""
    inputs = (case.tags.clone(), case.expected.clone(), case.n_entries.clone())
    assert oracle_bad(case) == case.bad
    v_tri, v_ref, t_tri, t_ref = run_both(
        case, max_entries=max_entries, block=block, scratch_page=scratch_page, quarantine=quarantine,
        entry_step=case.entry_step, page_div=case.page_div)
    batch = case.n_entries.numel()
    want = verdict_from(case.bad, batch, max_entries, block)
    assert v_tri.dtype == v_ref.dtype == torch.int32
    assert torch.equal(v_tri, v_ref)
    assert torch.equal(v_tri, want)
    assert v_tri.sum(1).nonzero().flatten().tolist() == sorted({b for b, _ in case.bad})
    assert torch.equal(t_tri, t_ref)
    assert torch.equal(t_tri, quarantined(case, scratch_page) if quarantine else case.table)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (case.tags, case.expected, case.n_entries)))


@pytest.mark.parametrize("batch", [1, 3, 7])
@pytest.mark.parametrize("width", [1, 5, 37, 130])
@pytest.mark.parametrize("block", [16, 32])
def test_random_corruptions_match_reference(batch, width, block):
    seed = batch * 1000 + width * 10 + block
    case = make_case(seed, batch, width)
    apply_random_corruptions(case, seed)
    assert case.bad
    assert_exact(case, block, max_entries=width)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_each_corruption_kind_alone(kind, table_dtype):
    seed = 50 + KINDS.index(kind) * 2 + (table_dtype == torch.int64)
    case = make_case(seed, batch=3, width=37, table_dtype=table_dtype)
    rng = random.Random(7)
    b, j = 1, min(int(case.n_entries[1]) - 1, 20)
    partner = None
    if kind == "swapped":  # between two different rows
        partner = next(e for e in live_entries(case) if e[0] != b and
                       int(case.table[case.cell(*e)]) != int(case.table[case.cell(b, j)]))
    corrupt(case, kind, b, j, rng, partner)
    assert_exact(case, block=16, max_entries=37, scratch_page=0)


def test_healthy_batch_flags_nothing():
    case = make_case(11, batch=7, width=130)
    assert_exact(case, block=32, max_entries=130)


def test_nonzero_scratch_page_and_no_quarantine():
    case = make_case(12, batch=3, width=37)
    apply_random_corruptions(case, 12)
    assert_exact(case, block=16, max_entries=37, scratch_page=5)
    assert_exact(case, block=16, max_entries=37, quarantine=False)


def test_max_entries_larger_than_live_and_default_block():
    case = make_case(13, batch=3, width=130)
    case.n_entries.clamp_(max=40)
    apply_random_corruptions(case, 13)
    assert_exact(case, block=128, max_entries=130)  # two chunks, the second one all dead
    v_tri, v_ref, t_tri, t_ref = run_both(case, max_entries=130)  # default block: 256, one chunk
    assert v_tri.shape == (3, 1) and torch.equal(v_tri, v_ref) and torch.equal(t_tri, t_ref)
    assert v_tri[:, 0].tolist() == [sum(1 for b, _ in case.bad if b == i) for i in range(3)]


def make_token_case(seed: int, batch: int, page_size: int = 4) -> Case:
    """A token-level table like SGLang's req_to_token: one slot per token, slot = page * size + offset."""
    gen = torch.Generator().manual_seed(seed)
    max_context = 64
    tags = random_tags(gen)
    rows = batch + 2
    table = torch.randint(0, NUM_PAGES * page_size, (rows, max_context), generator=gen).to(torch.int32)
    table_rows = torch.randperm(rows, generator=gen)[:batch].to(torch.int32)
    expected_rows = torch.randperm(rows, generator=gen)[:batch].long()
    seq_lens = torch.randint(1, max_context + 1, (batch,), generator=gen)
    n_entries = (seq_lens + page_size - 1) // page_size
    width = max_context // page_size
    expected = torch.randint(0, 2**40, (rows, width), generator=gen)
    for b in range(batch):
        pages = torch.randperm(NUM_PAGES - 1, generator=gen)[:int(n_entries[b])] + 1
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:int(seq_lens[b])]
        table[table_rows[b], :slots.numel()] = slots.to(torch.int32)
        expected[expected_rows[b], :pages.numel()] = tags[pages]
    return Case(table, table_rows, expected_rows, n_entries, tags, expected,
                entry_step=page_size, page_div=page_size)


@pytest.mark.parametrize("seed", [0, 1])
def test_token_level_table(seed):
    case = make_token_case(100 + seed, batch=7)
    apply_random_corruptions(case, seed)
    assert case.bad
    assert_exact(case, block=16, max_entries=16, quarantine=False)


def test_token_level_slot_shifted_into_previous_page():
    case = make_token_case(5, batch=3)
    row, col = case.cell(0, 0)
    case.table[row, col] -= 1  # last slot of the previous page
    case.bad.add((0, 0))
    assert_exact(case, block=16, max_entries=16, quarantine=False)


def test_token_level_checks_the_first_slot_of_each_page_only():
    """Documents the design: entry j is the slot at token j * entry_step; other slots are not read."""
    case = make_token_case(6, batch=3)
    row, col = case.cell(0, 0)
    case.table[row, col + 1] = -7  # token 1 of page 0 is not an entry of the check
    assert_exact(case, block=16, max_entries=16, quarantine=False)


def test_empty_batch():
    case = make_case(14, batch=3, width=5)
    empty = torch.zeros(0, dtype=torch.int32)
    for fn in (tag_check, tag_check_ref):
        verdict = fn(case.table, empty, empty, empty, case.tags, case.expected, max_entries=5)
        assert verdict.shape[0] == 0


@pytest.mark.parametrize("fn", [tag_check, tag_check_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("name,mutate", [
    ("table", lambda a: a.update(table=a["table"].float())),
    ("table", lambda a: a.update(table=a["table"][0])),
    ("tags", lambda a: a.update(tags=a["tags"].to(torch.int32))),
    ("tags", lambda a: a.update(tags=a["tags"].float())),
    ("expected", lambda a: a.update(expected=a["expected"].to(torch.int32))),
    ("n_entries", lambda a: a.update(n_entries=a["n_entries"].float())),
    ("expected_rows", lambda a: a.update(expected_rows=a["expected_rows"][:1])),
    ("table_rows", lambda a: a.update(table_rows=a["table_rows"].float())),
])
def test_launcher_rejects_bad_arguments(fn, name, mutate):
    case = make_case(15, batch=3, width=5)
    args = dict(zip(["table", "table_rows", "expected_rows", "n_entries", "tags", "expected"],
                    case.args()))
    mutate(args)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        fn(*args.values(), max_entries=5)


@pytest.mark.parametrize("fn", [tag_check, tag_check_ref], ids=["triton", "ref"])
def test_launcher_rejects_bad_step(fn):
    case = make_case(16, batch=1, width=5)
    with pytest.raises(ValueError, match="entry_step"):
        fn(*case.args(), max_entries=5, entry_step=0)


# -- every token entry (per_token), rows outside the tables, entries past the launch ----------------------
def make_per_token_case(seed: int, batch: int, page_size: int = 16, max_context: int = 96):
    """A token table whose every entry is consistent: token j at slot page(j // ps) * ps + j % ps.

    Returns the case (``n_entries`` = tokens) and the per-request token counts.
    """
    gen = torch.Generator().manual_seed(seed)
    tags = random_tags(gen)
    rows = batch + 2
    table = torch.randint(0, NUM_PAGES * page_size, (rows, max_context), generator=gen).to(torch.int32)
    table_rows = torch.randperm(rows, generator=gen)[:batch].to(torch.int32)
    expected_rows = torch.randperm(rows, generator=gen)[:batch].long()
    seq = torch.randint(2, max_context + 1, (batch,), generator=gen).to(torch.int32)
    expected = torch.randint(0, 2**40, (rows, -(-max_context // page_size)), generator=gen)
    for b in range(batch):
        n_pages = -(-int(seq[b]) // page_size)
        pages = torch.randperm(NUM_PAGES - 1, generator=gen)[:n_pages] + 1
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:int(seq[b])]
        table[table_rows[b], :slots.numel()] = slots.to(torch.int32)
        expected[expected_rows[b], :n_pages] = tags[pages]
    return Case(table, table_rows, expected_rows, seq, tags, expected, page_div=page_size), seq


def per_token_oracle(case, seq, page_size):
    """Plain loop: flagged entries per request, reading every token entry."""
    flags = []
    for b in range(case.table_rows.numel()):
        row, erow, bad = int(case.table_rows[b]), int(case.expected_rows[b]), 0
        for j in range(int(seq[b])):
            raw = int(case.table[row, j])
            if raw < 0 or raw >= case.tags.numel() * page_size:
                bad += 1
            elif int(case.tags[raw // page_size]) != int(case.expected[erow, j // page_size]) \
                    or raw % page_size != j % page_size:
                bad += 1
        flags.append(bad)
    return flags


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_token_catches_an_entry_inside_a_page(seed):
    ps = 16
    case, seq = make_per_token_case(200 + seed, batch=6, page_size=ps)
    rng = random.Random(seed)
    # break one entry that is NOT the first of its page in three requests (in-page entries)
    victims = rng.sample([b for b in range(6) if int(seq[b]) > 2], 3)
    for k, b in enumerate(victims):
        row = int(case.table_rows[b])
        j = rng.choice([t for t in range(int(seq[b])) if t % ps != 0])
        if k == 0:
            case.table[row, j] += 1  # same page, wrong offset (reads a neighbour token's KV)
        elif k == 1:
            case.table[row, j] = int(case.table[row, j]) % ps + ps * (1 + (int(case.table[row, j]) // ps) % 50)
        else:
            case.table[row, j] = -3
    want = per_token_oracle(case, seq, ps)
    assert sum(1 for w in want if w) >= 2
    for fn in (tag_check, tag_check_ref):
        verdict = fn(*case.args(case.table.clone()), max_entries=int(seq.max()), page_div=ps, per_token=True,
                     quarantine=False, block=32)
        assert verdict.sum(1).tolist() == want
    # the page-granular check (first entry of each page only) misses the in-page ones
    page_v = tag_check_ref(case.table, case.table_rows, case.expected_rows, (seq + ps - 1) // ps, *case.args()[4:],
                           max_entries=int(((seq + ps - 1) // ps).max()), entry_step=ps, page_div=ps,
                           quarantine=False)
    assert page_v.sum(1).tolist() != want


def test_per_token_triton_matches_reference_on_random_corruption():
    ps = 4
    case, seq = make_per_token_case(300, batch=9, page_size=ps)
    gen = torch.Generator().manual_seed(301)
    noise = torch.rand(case.table.shape, generator=gen) < 0.03
    case.table[noise] = torch.randint(-5, NUM_PAGES * ps + 9, (int(noise.sum()),), generator=gen).to(torch.int32)
    v_tri = tag_check(*case.args(), max_entries=int(seq.max()), page_div=ps, per_token=True, quarantine=False)
    v_ref = tag_check_ref(*case.args(), max_entries=int(seq.max()), page_div=ps, per_token=True,
                          quarantine=False)
    assert torch.equal(v_tri, v_ref)
    assert v_ref.sum(1).tolist() == per_token_oracle(case, seq, ps)
    assert int(v_ref.sum()) > 0


@pytest.mark.parametrize("fn", [tag_check, tag_check_ref], ids=["triton", "ref"])
def test_rows_outside_the_tables_flag_without_reading(fn):
    case = make_case(17, batch=4, width=6)
    table_rows = case.table_rows.clone()
    expected_rows = case.expected_rows.clone()
    table_rows[1] = -1  # would wrap to the last row in torch indexing
    expected_rows[2] = case.expected.shape[0] + 3
    verdict = fn(case.table, table_rows, expected_rows, case.n_entries, case.tags, case.expected,
                 max_entries=6, quarantine=False)
    flags = (verdict.sum(1) > 0).tolist()
    assert flags == [False, True, True, False]


@pytest.mark.parametrize("fn", [tag_check, tag_check_ref], ids=["triton", "ref"])
def test_entries_past_max_entries_are_counted_not_skipped(fn):
    case = make_case(18, batch=3, width=8)
    full = int((case.n_entries == 8).nonzero()[0])  # a healthy row with all 8 entries live
    n = case.n_entries.clone()
    clean = fn(*case.args(), max_entries=8, block=4, quarantine=False)
    assert int(clean.sum()) == 0
    # a bound smaller than a row's live entries: the 4 entries past the one 4-wide chunk are counted
    verdict = fn(*case.args(), max_entries=4, block=4, quarantine=False)
    assert verdict.sum(1).tolist() == (n - 4).clamp(min=0).tolist() and verdict.sum(1)[full] == 4
    # live entries past the table's width (8) are counted too
    n[full] = 40
    verdict = fn(case.table, case.table_rows, case.expected_rows, n, case.tags, case.expected,
                 max_entries=40, block=16, quarantine=False)
    assert verdict.sum(1)[full] == 32


@pytest.mark.parametrize("fn", [tag_check, tag_check_ref], ids=["triton", "ref"])
def test_per_token_needs_entry_step_one(fn):
    case = make_case(19, batch=1, width=5)
    with pytest.raises(ValueError, match="entry_step"):
        fn(*case.args(), max_entries=5, entry_step=2, per_token=True)


# -- the write guard riding on the check --------------------------------------------------------------------
def _guard_case(seed: int, segments: bool):
    from kvguard.kernels.tag_check import WriteGuard

    ps = 16
    case, seq = make_per_token_case(seed, batch=7, page_size=ps)
    gen = torch.Generator().manual_seed(seed)
    b = int(torch.randint(0, 7, (1,), generator=gen))
    j = int(torch.randint(0, int(seq[b]), (1,), generator=gen))
    case.table[int(case.table_rows[b]), j] += 1 if int(case.table[int(case.table_rows[b]), j]) % ps < ps - 1 else -1
    if segments:
        lens = torch.randint(1, 9, (7,), generator=gen)
        starts = torch.cumsum(lens, 0) - lens
        slots = torch.randint(100, 10_000, (int(lens.sum()),), generator=gen)
        return case, seq, b, lambda s: WriteGuard(s, starts, lens, scratch=3), slots, (starts, lens)
    slots = torch.randint(100, 10_000, (7,), generator=gen)
    return case, seq, b, lambda s: WriteGuard(s, scratch=3), slots, None


@pytest.mark.parametrize("segments", [False, True], ids=["one_slot", "segments"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_write_guard_redirects_exactly_the_flagged_requests_slots(segments, seed):
    case, seq, bad_b, make_guard, slots, seg = _guard_case(900 + seed, segments)
    outs = {}
    for fn in (tag_check, tag_check_ref):
        out = slots.clone()
        verdict = fn(*case.args(case.table.clone()), max_entries=int(seq.max()), page_div=16, per_token=True,
                     quarantine=False, guard=make_guard(out), block=16)
        flagged = (verdict.sum(1) > 0).nonzero().flatten().tolist()
        assert flagged == [bad_b]
        outs[fn.__name__] = out
    want = slots.clone()
    if seg is None:
        want[bad_b] = 3
    else:
        first, length = int(seg[0][bad_b]), int(seg[1][bad_b])
        want[first:first + length] = 3
    assert torch.equal(outs["tag_check"], want) and torch.equal(outs["tag_check_ref"], want)
    assert float(torch.linalg.norm((outs["tag_check"] - want).double())) / float(torch.linalg.norm(want.double())) == 0.0


@pytest.mark.parametrize("fn", [tag_check, tag_check_ref])
def test_write_guard_rejects_a_mismatched_slot_count(fn):
    from kvguard.kernels.tag_check import WriteGuard

    case, seq = make_per_token_case(950, batch=4, page_size=16)
    with pytest.raises(ValueError, match="guard.slots"):
        fn(*case.args(), max_entries=int(seq.max()), page_div=16, per_token=True, quarantine=False,
           guard=WriteGuard(torch.zeros(3, dtype=torch.int64)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_tail_guard_rewrites_exactly_the_flagged_rows_tails(seed):
    """A spec step's guard (WriteGuard.row_tail): entries [starts[b], n_entries[b]) of each flagged request's row of
    the checked table itself become the scratch slot; every other entry of the table is unchanged. One request's
    row index lies outside the table: flagged, nothing written for it."""
    from kvguard.kernels.tag_check import WriteGuard

    case, seq, bad_b, _, _, _ = _guard_case(960 + seed, segments=False)
    gen = torch.Generator().manual_seed(seed)
    starts = (seq - torch.randint(1, 9, seq.shape, generator=gen)).clamp(min=0)
    off = (bad_b + 1) % seq.numel()  # a second flagged request: its row is not in the table
    case.table_rows[off] = case.table.shape[0] + 3
    tables = {}
    for fn in (tag_check, tag_check_ref):
        table = case.table.clone()
        verdict = fn(*case.args(table), max_entries=int(seq.max()), page_div=16, per_token=True, quarantine=False,
                     guard=WriteGuard.row_tail(table, starts, scratch=3), block=16)
        assert (verdict.sum(1) > 0).nonzero().flatten().tolist() == sorted([bad_b, off])
        tables[fn.__name__] = table
    want = case.table.clone()
    want[int(case.table_rows[bad_b]), int(starts[bad_b]):int(seq[bad_b])] = 3
    assert torch.equal(tables["tag_check"], want) and torch.equal(tables["tag_check_ref"], want)


@pytest.mark.parametrize("fn", [tag_check, tag_check_ref])
def test_row_tail_guard_must_guard_the_checked_table(fn):
    from kvguard.kernels.tag_check import WriteGuard

    case, seq = make_per_token_case(961, batch=4, page_size=16)
    with pytest.raises(ValueError, match="guard"):
        fn(*case.args(), max_entries=int(seq.max()), page_div=16, per_token=True, quarantine=False,
           guard=WriteGuard.row_tail(case.table.clone(), seq))
    with pytest.raises(ValueError, match="guard.starts"):
        fn(*case.args(), max_entries=int(seq.max()), page_div=16, per_token=True, quarantine=False,
           guard=WriteGuard.row_tail(case.table, seq[:3]))
