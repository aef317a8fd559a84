"""The per-step launches a server makes (``CheckLaunch``, ``DecodeRecorder`` with its in-launch bump, ``Bumper``)
against the torch references, on fresh random inputs.

On the CPU these run the Triton kernels under the interpreter (the JIT path: the same arguments the direct
path hands to the C launcher). With a GPU (``KVGUARD_TEST_DEVICE=cuda`` on the H200) the same cases run the
direct launches, after the first call of each variant went through the JIT, and the host flag lives in
pinned memory the kernel writes directly.
"""
import os
import zlib

import pytest
import torch

from kvguard.kernels.record import BLOCK, Bumper, DecodeRecorder, bump_ref, record_decode_ref
from kvguard.kernels.tag_check import CheckLaunch, WriteGuard, n_chunks_for, tag_check_ref
from kvguard.tags import UNSET

DEVICE = torch.device(os.environ.get("KVGUARD_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("KVGUARD_TEST_DEVICE=cuda without a GPU", allow_module_level=True)


def rel_err(out, ref):
    return float(torch.linalg.norm((out - ref).double()) / torch.linalg.norm(ref.double()))


def token_case(seed: int, batch: int, ps: int, width: int = 96):
    """A token table with rows recorded as the tracker would, then a random ~quarter of the rows broken."""
    gen = torch.Generator().manual_seed(seed)
    rows_n, pages_n = batch + 7, batch * (width // ps) + 40
    tags = (torch.randperm(pages_n * 3, generator=gen)[:pages_n] + 11).long()
    table = torch.zeros(rows_n, width, dtype=torch.int32)
    expected = torch.full((rows_n, width // ps), UNSET, dtype=torch.int64)
    perm = torch.randperm(pages_n - 1, generator=gen) + 1
    rows = torch.randperm(rows_n - 1, generator=gen)[:batch] + 1
    lens = torch.randint(1, width, (batch,), generator=gen)
    for b in range(batch):
        r, n = int(rows[b]), int(lens[b])
        pages = perm[b * (width // ps):(b + 1) * (width // ps)]
        table[r] = (pages.repeat_interleave(ps) * ps + torch.arange(width) % ps).int()
        expected[r] = tags[pages]
    broken = torch.rand(batch, generator=gen) < 0.25
    broken[0] = True
    for b in broken.nonzero().flatten().tolist():
        r, j = int(rows[b]), int(torch.randint(0, int(lens[b]), (1,), generator=gen))
        table[r, j] = int(table[r, j]) + (ps if ps > 1 else 1)  # another page (or slot)
    return dict(table=table, tags=tags, expected=expected, rows=rows, lens=lens, broken=broken)


def on(device, case):
    return {k: v.to(device) for k, v in case.items()}


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("batch", [1, 23])
@pytest.mark.parametrize("guarded", [False, True])
def test_check_launch_matches_reference_and_flags_exactly_when_bad(ps, batch, guarded):
    case = token_case(zlib.crc32(f"{ps}-{batch}-{guarded}".encode()), batch, ps)
    c = on(DEVICE, case)
    max_entries = int(case["lens"].max())
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=DEVICE.type == "cuda")
    launch = CheckLaunch(c["table"], c["tags"], c["expected"], page_div=ps, per_token=True, quarantine=False)
    buf = torch.full((batch * n_chunks_for(max_entries) + 5,), -7, dtype=torch.int32, device=DEVICE)
    slots = torch.randint(ps, 10_000, (batch,), generator=torch.Generator().manual_seed(batch))
    for stamp in (3, 4, 5):  # the first call of the variant goes through the JIT, later ones direct on CUDA
        guard = WriteGuard(slots.to(DEVICE).clone(), scratch=0) if guarded else None
        got = launch(c["rows"], c["rows"], c["lens"], max_entries=max_entries, verdict=buf, guard=guard, flag=flag,
                     stamp=stamp)
        ref_guard = WriteGuard(slots.clone(), scratch=0) if guarded else None
        want = tag_check_ref(case["table"], case["rows"], case["rows"], case["lens"], case["tags"], case["expected"],
                             max_entries=max_entries, page_div=ps, per_token=True, quarantine=False, guard=ref_guard)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        assert got.shape == want.shape and torch.equal(got.cpu(), want)
        assert rel_err(got.cpu().sum(1), want.sum(1)) == 0.0
        assert torch.equal(got.cpu().sum(1) > 0, case["broken"])  # exactly the broken requests
        assert int(flag[0]) == stamp  # something is broken: this launch's stamp
        if guarded:
            assert torch.equal(guard.slots.cpu(), ref_guard.slots)
            assert torch.equal(guard.slots.cpu() == 0, case["broken"])
    if DEVICE.type == "cuda":
        assert launch.kernel.direct_launches >= 2


def test_check_launch_leaves_the_flag_alone_when_clean():
    case = token_case(99, 9, 16)
    c = on(DEVICE, case)
    keep = ~case["broken"]  # only the requests nothing was done to
    rows, lens = case["rows"][keep].to(DEVICE), case["lens"][keep].to(DEVICE)
    flag = torch.full((1,), 41, dtype=torch.int64, pin_memory=DEVICE.type == "cuda")
    launch = CheckLaunch(c["table"], c["tags"], c["expected"], page_div=16, per_token=True, quarantine=False)
    buf = torch.empty(64 * n_chunks_for(96), dtype=torch.int32, device=DEVICE)
    for stamp in (1, 2):
        got = launch(rows, rows, lens, max_entries=int(lens.max()), verdict=buf, flag=flag, stamp=stamp)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        assert got.shape[0] == int(keep.sum()) > 0
        assert int(got.sum()) == 0 and int(flag[0]) == 41  # nothing bad: never written


def test_check_launch_rejects_a_short_buffer_and_mismatched_batches():
    c = on(DEVICE, token_case(5, 4, 16))
    launch = CheckLaunch(c["table"], c["tags"], c["expected"], page_div=16, per_token=True, quarantine=False)
    with pytest.raises(ValueError, match="verdict"):
        launch(c["rows"], c["rows"], c["lens"], max_entries=90, verdict=torch.empty(1, dtype=torch.int32,
                                                                                       device=DEVICE))
    buf = torch.empty(64, dtype=torch.int32, device=DEVICE)
    launch(c["rows"], c["rows"], c["lens"], max_entries=90, verdict=buf)
    with pytest.raises(ValueError, match="n_entries"):  # the variant is known now: the batch sizes still checked
        launch(c["rows"], c["rows"], c["lens"][:2], max_entries=90, verdict=buf)


def recorder_case(seed: int, batch: int, ps: int, dup: bool):
    gen = torch.Generator().manual_seed(seed)
    rows_n, width, pages_n = 300, 24, 4001
    expected = torch.randint(10_000, 1 << 40, (rows_n, width), generator=gen)
    expected_pages = torch.randint(1, pages_n, (rows_n, width), generator=gen).to(torch.int32)
    tags = (torch.randperm(pages_n * 5, generator=gen)[:pages_n] + 77).long()
    rows = torch.randperm(rows_n, generator=gen)[:batch]
    pos = torch.randint(0, width * ps, (batch,), generator=gen)
    starts = torch.rand(batch, generator=gen) < 0.5
    starts[0] = True
    pos = torch.where(starts, pos - pos % ps, pos)
    n_new = int((pos % ps == 0).sum())
    alloc = torch.randperm(pages_n - 1, generator=gen)[:n_new] + 1
    if dup and n_new > 1:
        alloc[-1] = alloc[0]  # a page handed out twice in one step (a double free before it)
    slots = torch.randint(ps, pages_n * ps, (batch,), generator=gen)
    k = torch.cumsum((pos % ps == 0).long(), 0) - 1
    slots = torch.where(pos % ps == 0, alloc[k.clamp(min=0)] * ps + pos % ps, slots)
    base = int(torch.randint(1 << 41, 1 << 42, (1,), generator=gen))
    return dict(expected=expected, expected_pages=expected_pages, tags=tags, rows=rows, pos=pos, slots=slots,
                alloc=alloc), base


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("batch", [1, 37, BLOCK + 45])
@pytest.mark.parametrize("dup", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
def test_recorder_bumps_and_records_in_one_launch(ps, batch, dup, prefix):
    """``prefix``: the step's pages are the first ``n_alloc`` entries of a longer tensor (a server's old free list,
    read in place), whose other entries must be left alone."""
    case, base = recorder_case(zlib.crc32(f"{ps}-{batch}-{dup}".encode()), batch, ps, dup)
    # reference: the two-step path (bump, then record the fresh tags)
    want = {k: v.clone() for k, v in case.items()}
    fresh = bump_ref(want["tags"], want["alloc"], base)
    record_decode_ref(want["expected"], want["expected_pages"], want["rows"], want["pos"], want["slots"], want["tags"],
                      page_size=ps, fresh=fresh)
    got = {k: v.clone().to(DEVICE) for k, v in case.items()}
    n_alloc = case["alloc"].numel()
    if prefix:  # the rest of the free list: pages that must not be bumped
        rest = torch.randperm(case["tags"].numel(), generator=torch.Generator().manual_seed(batch))[:50]
        got["alloc"] = torch.cat([got["alloc"], rest.to(DEVICE)])
    rec = DecodeRecorder(got["expected"], got["expected_pages"], got["tags"], page_size=ps)
    for call in range(3):  # the variant's first call (JIT), then direct on CUDA
        for name in ("expected", "expected_pages", "tags"):
            got[name].copy_(case[name])
        rec(got["rows"], got["pos"], got["slots"], alloc=got["alloc"], base=base, n_alloc=n_alloc if prefix else None)
        for name in ("expected", "expected_pages", "tags"):
            assert torch.equal(got[name].cpu(), want[name]), (call, name)
        assert rel_err(got["tags"].cpu(), want["tags"]) == 0.0
    assert int((want["tags"] != case["tags"]).sum()) == case["alloc"].unique().numel()  # the bump happened
    if DEVICE.type == "cuda":
        assert rec.kernel.direct_launches == 2  # the later calls went direct


def test_recorder_rejects_an_n_alloc_outside_its_allocation():
    case, base = recorder_case(5, 9, 16, False)
    c = on(DEVICE, case)
    rec = DecodeRecorder(c["expected"], c["expected_pages"], c["tags"], page_size=16)
    before = c["tags"].clone()
    for n_alloc in (c["alloc"].numel() + 1, -1):
        with pytest.raises(ValueError, match="n_alloc"):
            rec(c["rows"], c["pos"], c["slots"], alloc=c["alloc"], base=base, n_alloc=n_alloc)
    with pytest.raises(ValueError, match="n_alloc"):
        rec(c["rows"], c["pos"], c["slots"], base=base, n_alloc=1)  # a count without its allocation
    assert torch.equal(c["tags"], before)  # nothing launched


@pytest.mark.parametrize("kind", ["fresh", "skip", "current"])
def test_recorder_direct_calls_match_reference(kind):
    """Every argument kind a server passes, called repeatedly (JIT first, then the direct launch on CUDA) on fresh
    random inputs each call, against the reference."""
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    ps, batch, rows_n, width, pages_n = 16, 45, 60, 12, 900
    expected = torch.randint(10_000, 1 << 40, (rows_n, width), generator=gen)
    expected_pages = torch.randint(1, pages_n, (rows_n, width), generator=gen).to(torch.int32)
    tags = (torch.randperm(pages_n * 4, generator=gen)[:pages_n] + 5).long()
    got = [t.to(DEVICE) for t in (expected, expected_pages, tags)]
    rec = DecodeRecorder(*got, page_size=ps)
    for call in range(4):
        rows = torch.randperm(rows_n, generator=gen)[:batch]
        pos = torch.randint(0, width * ps, (batch,), generator=gen)
        pos = torch.where(torch.rand(batch, generator=gen) < 0.5, pos - pos % ps, pos)
        slots = torch.randint(ps, pages_n * ps, (batch,), generator=gen)
        n_new = int((pos % ps == 0).sum())
        fresh = torch.arange(n_new) + int(torch.randint(1 << 41, 1 << 42, (1,), generator=gen)) \
            if kind == "fresh" and n_new else None
        skip = torch.rand(batch, generator=gen) < 0.3 if kind == "skip" else None
        record_decode_ref(expected, expected_pages, rows, pos, slots, tags, page_size=ps, fresh=fresh, skip=skip)
        rec(rows.to(DEVICE), pos.to(DEVICE), slots.to(DEVICE), fresh=None if fresh is None else fresh.to(DEVICE),
            skip=None if skip is None else skip.to(DEVICE))
        assert torch.equal(got[0].cpu(), expected) and torch.equal(got[1].cpu(), expected_pages), call
        assert rel_err(got[0].cpu(), expected) == 0.0
    if DEVICE.type == "cuda":
        assert rec.kernel.direct_launches >= 2


@pytest.mark.parametrize("with_fresh", [False, True])
def test_bumper_matches_reference(with_fresh):
    gen = torch.Generator().manual_seed(17 + with_fresh)
    tags = (torch.randperm(5000, generator=gen)[:997] + 3).long()
    pages = torch.randint(0, 997, (300,), generator=gen)  # duplicates included
    base = 1 << 33
    want = tags.clone()
    want_fresh = bump_ref(want, pages, base)
    got = tags.to(DEVICE)
    bumper = Bumper(got)
    fresh = torch.empty(300, dtype=torch.int64, device=DEVICE) if with_fresh else None
    bumper(pages.to(DEVICE), base, fresh)
    assert torch.equal(got.cpu(), want) and rel_err(got.cpu(), want) == 0.0
    if with_fresh:
        assert torch.equal(fresh.cpu(), want_fresh)


@pytest.mark.parametrize("ps", [1, 16])
def test_bound_check_matches_reference_step_after_step(ps):
    """A decode batch's bound launch over several steps (lengths growing, crossing block sizes, a new ring
    slot each step) gives the reference's verdict, flag and write guard every step."""
    from kvguard.kernels.tag_check import BoundCheck

    case = token_case(zlib.crc32(f"bound-{ps}".encode()), 11, ps, width=320)
    c = on(DEVICE, case)
    launch = CheckLaunch(c["table"], c["tags"], c["expected"], page_div=ps, per_token=True, quarantine=False)
    ring = 4
    verdicts = [torch.full((11 * n_chunks_for(320),), -3, dtype=torch.int32, device=DEVICE) for _ in range(ring)]
    host = torch.zeros(ring, dtype=torch.int64, pin_memory=DEVICE.type == "cuda")
    flags = [host[i:i + 1] for i in range(ring)]
    bound = BoundCheck(launch, c["rows"], c["rows"], verdicts, flags, scratch_slot=0, n_dtype=torch.int64,
                       slot_dtype=torch.int64)
    gen = torch.Generator().manual_seed(ps)
    for step, grow in enumerate((0, 9, 60, 150, 200, 230)):  # block sizes 64 .. 256, then two chunks
        lens = (case["lens"] // 3 + grow).clamp(max=319)
        slots = torch.randint(ps, 9_000, (11,), generator=gen)
        got_slots = slots.to(DEVICE).clone()
        slot = step % ring
        cells = bound(slot, c["rows"], lens.to(DEVICE), got_slots, int(lens.max()), step + 1)
        ref_guard = WriteGuard(slots.clone(), scratch=0)
        want = tag_check_ref(case["table"], case["rows"], case["rows"], lens, case["tags"], case["expected"],
                             max_entries=int(lens.max()), page_div=ps, per_token=True, quarantine=False,
                             guard=ref_guard)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        assert cells == want.numel()
        got = verdicts[slot][:cells].view(11, -1).cpu()
        assert torch.equal(got, want), step
        assert torch.equal(got_slots.cpu(), ref_guard.slots)
        assert (int(host[slot]) == step + 1) == bool(want.any())
    assert int(want.sum()) > 0  # the broken requests were in reach
    if DEVICE.type == "cuda":
        assert launch.kernel.direct_launches >= 2  # later steps of a block size went direct


@pytest.mark.parametrize("ps", [1, 16])
def test_bound_check_with_a_row_tail_guard_matches_reference_step_after_step(ps):
    """A spec step's bound launch (kvguard.sglang.spec): the write guard is the tail [starts, n_entries) of each
    flagged request's row of the checked table itself. Step after step (a new ring slot each) the verdict, the flag
    and the whole table equal the reference's (the flagged requests exactly)."""
    from kvguard.kernels.tag_check import BoundCheck

    case = token_case(zlib.crc32(f"tail-{ps}".encode()), 9, ps, width=320)
    c = on(DEVICE, case)
    ref_table = case["table"].clone()
    launch = CheckLaunch(c["table"], c["tags"], c["expected"], page_div=ps, per_token=True, quarantine=False)
    ring = 3
    verdicts = [torch.full((9 * n_chunks_for(320),), -3, dtype=torch.int32, device=DEVICE) for _ in range(ring)]
    host = torch.zeros(ring, dtype=torch.int64, pin_memory=DEVICE.type == "cuda")
    flags = [host[i:i + 1] for i in range(ring)]
    bound = BoundCheck(launch, c["rows"], c["rows"], verdicts, flags, scratch_slot=0, n_dtype=torch.int64,
                       slot_dtype=torch.int64, tail=True)
    gen = torch.Generator().manual_seed(ps)
    for step, grow in enumerate((0, 9, 60, 150, 230)):
        lens = (case["lens"] // 3 + grow).clamp(max=319)
        starts = (lens - torch.randint(1, 9, lens.shape, generator=gen)).clamp(min=0)
        slot = step % ring
        cells = bound(slot, c["rows"], lens.to(DEVICE), starts.to(DEVICE), int(lens.max()), step + 1)
        want = tag_check_ref(ref_table, case["rows"], case["rows"], lens, case["tags"], case["expected"],
                             max_entries=int(lens.max()), page_div=ps, per_token=True, quarantine=False,
                             guard=WriteGuard.row_tail(ref_table, starts))
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        assert cells == want.numel()
        got = verdicts[slot][:cells].view(9, -1).cpu()
        # which requests are flagged is exact; a flagged request's counts may include its own tail, rewritten by
        # an earlier program of its row in the same launch (the reference guards after the whole check)
        assert torch.equal(got.sum(1) > 0, want.sum(1) > 0) and bool((got >= want).all()), step
        assert torch.equal(c["table"].cpu(), ref_table), step
        assert (int(host[slot]) == step + 1) == bool(want.any())
    assert int(want.sum()) > 0 and bool(ref_table.eq(0).any())  # flagged requests' tails were rewritten
