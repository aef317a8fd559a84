"""The Triton decode recorder (``kvguard.kernels.record``) against its torch reference and a Python loop.

Random inputs every case (never zeros): expectations pre-filled with random tags, shuffled rows, random
positions of which a random subset starts a page, random slots, fresh tags from a random counter.
"""
import zlib

import pytest
import torch

from kvguard.kernels.record import BLOCK, record_decode, record_decode_ref

ROWS, WIDTH, NUM_PAGES = 300, 24, 4001


def make_case(seed: int, batch: int, page_size: int, *, n_fresh=None, skip=False, outside=False):
    gen = torch.Generator().manual_seed(seed)
    expected = torch.randint(10_000, 1 << 40, (ROWS, WIDTH), generator=gen)
    expected_pages = torch.randint(1, NUM_PAGES, (ROWS, WIDTH), generator=gen).to(torch.int32)
    tags = torch.randperm(NUM_PAGES * 5, generator=gen)[:NUM_PAGES].long() + 77
    rows = torch.randperm(ROWS, generator=gen)[:batch]
    pos = torch.randint(0, WIDTH * page_size, (batch,), generator=gen)
    starts = torch.rand(batch, generator=gen) < 0.5  # about half start a page
    starts[0] = True  # at least one
    pos = torch.where(starts, pos - pos % page_size, pos)
    slots = torch.randint(page_size, NUM_PAGES * page_size, (batch,), generator=gen)
    n_new = int((pos % page_size == 0).sum())
    count = n_new if n_fresh is None else n_fresh
    fresh = torch.arange(count) * 3 + int(torch.randint(1 << 41, 1 << 42, (1,), generator=gen)) if count else None
    skip_mask = (torch.rand(batch, generator=gen) < 0.3) if skip else None
    if outside:
        rows[0], pos[-1] = ROWS + 5, WIDTH * page_size  # a row outside, a column past the width
    return dict(expected=expected, expected_pages=expected_pages, rows=rows, pos=pos, slots=slots, tags=tags,
                fresh=fresh, skip=skip_mask)


def loop_oracle(case, page_size):
    """The spec, one request at a time."""
    exp, pages = case["expected"].clone(), case["expected_pages"].clone()
    k = -1
    for b in range(case["rows"].numel()):
        row, pos, slot = int(case["rows"][b]), int(case["pos"][b]), int(case["slots"][b])
        if pos % page_size:
            continue
        k += 1
        if case["skip"] is not None and bool(case["skip"][b]):
            continue
        col = pos // page_size
        if not (0 <= row < ROWS and col < WIDTH):
            continue
        fresh = case["fresh"]
        exp[row, col] = int(fresh[min(k, fresh.numel() - 1)]) if fresh is not None else int(case["tags"][slot // page_size])
        pages[row, col] = slot // page_size
    return exp, pages


def run(fn, case, page_size):
    exp, pages = case["expected"].clone(), case["expected_pages"].clone()
    fn(exp, pages, case["rows"], case["pos"], case["slots"], case["tags"], page_size=page_size,
       fresh=case["fresh"], skip=case["skip"])
    return exp, pages


def rel_err(out, ref):
    return float(torch.linalg.norm((out - ref).double()) / torch.linalg.norm(ref.double()))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", [1, 37, BLOCK + 45])  # one chunk, a partial chunk, two chunks (carry)
@pytest.mark.parametrize("variant", ["fresh", "no_fresh", "short_fresh", "skip", "outside"])
def test_matches_reference_and_spec(page_size, batch, variant):
    seed = zlib.crc32(f"{page_size}-{batch}-{variant}".encode())
    kwargs = {"no_fresh": dict(n_fresh=0), "short_fresh": dict(n_fresh=2), "skip": dict(skip=True),
              "outside": dict(outside=True)}.get(variant, {})
    case = make_case(seed, batch, page_size, **kwargs)
    want = loop_oracle(case, page_size)
    got_ref = run(record_decode_ref, case, page_size)
    got_tri = run(record_decode, case, page_size)
    for got in (got_ref, got_tri):
        assert rel_err(got[0], want[0]) == 0.0 and torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])
    changed = int((got_tri[0] != case["expected"]).sum())
    assert changed > 0 or variant in ("outside",) and batch == 1  # the case really recorded something


def test_nothing_new_changes_nothing():
    case = make_case(5, 50, 16)
    case["pos"] = case["pos"] | 1  # odd positions: none starts a 16-token page
    case["fresh"] = None
    for fn in (record_decode, record_decode_ref):
        exp, pages = run(fn, case, 16)
        assert torch.equal(exp, case["expected"]) and torch.equal(pages, case["expected_pages"])


@pytest.mark.parametrize("fn", [record_decode, record_decode_ref])
def test_rejects_bad_arguments(fn):
    case = make_case(6, 4, 16)
    with pytest.raises(ValueError, match="expected_pages"):
        fn(case["expected"], case["expected_pages"].long(), case["rows"], case["pos"], case["slots"], case["tags"],
           page_size=16)
    with pytest.raises(ValueError, match="pos"):
        fn(case["expected"], case["expected_pages"], case["rows"], case["pos"][:2], case["slots"], case["tags"],
           page_size=16)
    with pytest.raises(ValueError, match="page_size"):
        fn(case["expected"], case["expected_pages"], case["rows"], case["pos"], case["slots"], case["tags"],
           page_size=0)
