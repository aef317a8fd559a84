"""A spec step's reserve recorded in one launch (``kvguard.kernels.record.ReserveRecorder``) against its torch
reference (:func:`record_reserve_ref`) and a Python loop over the reserved positions, on fresh random inputs:
random expectations and tags, shuffled rows, random committed lengths and reserve widths (some empty, some
crossing several pages), random allocation slots; fresh tags given, taken from an allocation the same launch bumps,
or read from the tags."""
import zlib

import pytest
import torch

from kvguard.kernels.record import BLOCK, ReserveRecorder, bump_ref

ROWS, WIDTH, NUM_PAGES = 300, 40, 4001


def make_case(seed: int, batch: int, page_size: int):
    gen = torch.Generator().manual_seed(seed)
    expected = torch.randint(10_000, 1 << 40, (ROWS, WIDTH), generator=gen)
    expected_pages = torch.randint(1, NUM_PAGES, (ROWS, WIDTH), generator=gen).to(torch.int32)
    tags = torch.randperm(NUM_PAGES * 5, generator=gen)[:NUM_PAGES].long() + 77
    rows = torch.randperm(ROWS, generator=gen)[:batch]
    cur = torch.randint(0, (WIDTH - 6) * page_size, (batch,), generator=gen)
    width = torch.randint(0, 3 * page_size + 4, (batch,), generator=gen)
    width[0] = max(int(width[0]), page_size + 1)  # at least one request crosses into a new page
    nxt = torch.minimum(cur + width, torch.full_like(cur, WIDTH * page_size + page_size))  # may pass the row's width
    slots = torch.randint(page_size, NUM_PAGES * page_size, (int((nxt - cur).sum()),), generator=gen)
    return dict(expected=expected, expected_pages=expected_pages, tags=tags, rows=rows, cur=cur.to(torch.int32),
                nxt=nxt.to(torch.int32), slots=slots, gen=gen)


def loop_oracle(case, page_size, fresh):
    """The spec, one reserved position at a time (``fresh``: the tags in allocation order, or None)."""
    exp, pages = case["expected"].clone(), case["expected_pages"].clone()
    i, k = 0, 0
    for b in range(case["rows"].numel()):
        row = int(case["rows"][b])
        for pos in range(int(case["cur"][b]), int(case["nxt"][b])):
            slot = int(case["slots"][i])
            i += 1
            if pos % page_size:
                continue
            tag = int(fresh[min(k, fresh.numel() - 1)]) if fresh is not None else int(case["tags"][slot // page_size])
            k += 1
            if pos // page_size < WIDTH:
                exp[row, pos // page_size], pages[row, pos // page_size] = tag, slot // page_size
    return exp, pages, k


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("batch", [1, 37, BLOCK + 45])  # one chunk, a partial chunk, two chunks (the carries)
@pytest.mark.parametrize("mode", ["fresh", "alloc", "tags"])
def test_matches_reference_and_loop(page_size, batch, mode):
    case = make_case(zlib.crc32(f"{page_size}-{batch}-{mode}".encode()), batch, page_size)
    n_new = loop_oracle(case, page_size, None)[2]
    alloc = torch.randint(1, NUM_PAGES, (n_new,), generator=case["gen"])
    base = int(case["tags"].max()) + 1 + int(torch.randint(0, 1000, (1,), generator=case["gen"]))
    fresh = torch.arange(n_new) * 7 + (1 << 41) if mode == "fresh" else None
    results = []
    for reference in (True, False):
        exp, pages, tags = case["expected"].clone(), case["expected_pages"].clone(), case["tags"].clone()
        rec = ReserveRecorder(exp, pages, tags, page_size=page_size, reference=reference)
        rec(case["rows"], case["cur"], case["nxt"], case["slots"], fresh=fresh,
            alloc=alloc if mode == "alloc" else None, base=base)
        results.append((exp, pages, tags))
    want_tags = case["tags"].clone()
    want_fresh = bump_ref(want_tags, alloc, base) if mode == "alloc" else fresh
    want_exp, want_pages, _ = loop_oracle(case, page_size, want_fresh)
    for exp, pages, tags in results:
        assert torch.equal(exp, want_exp) and torch.equal(pages, want_pages)
        assert torch.equal(tags, want_tags if mode == "alloc" else case["tags"])
    assert int((results[1][0] != case["expected"]).sum()) > 0  # the case really recorded something


def test_a_reserve_inside_the_last_page_changes_nothing():
    case = make_case(11, 50, 16)
    case["cur"] = (case["cur"] // 16) * 16 + 1  # every request past its page's start
    case["nxt"] = case["cur"] + 10  # and its reserve inside the same page
    case["slots"] = case["slots"][:500]
    exp, pages, tags = case["expected"].clone(), case["expected_pages"].clone(), case["tags"].clone()
    ReserveRecorder(exp, pages, tags, page_size=16)(case["rows"], case["cur"], case["nxt"], case["slots"])
    assert torch.equal(exp, case["expected"]) and torch.equal(pages, case["expected_pages"])


def test_rejects_bad_arguments():
    case = make_case(12, 4, 16)
    rec = ReserveRecorder(case["expected"], case["expected_pages"], case["tags"], page_size=16)
    with pytest.raises(ValueError, match="nxt"):
        rec(case["rows"], case["cur"], case["nxt"][:2], case["slots"])
    with pytest.raises(ValueError, match="cur"):
        rec(case["rows"], case["cur"].float(), case["nxt"], case["slots"])
    with pytest.raises(ValueError, match="fresh or alloc"):
        rec(case["rows"], case["cur"], case["nxt"], case["slots"], fresh=case["tags"][:2], alloc=case["slots"][:2])
