"""kvguard's SWA side (kvguard.sglang.swa) on SGLang 0.5.23's real ``SWATokenToKVPoolAllocator`` and ``SWAKVPool``,
driven step by step on the CPU (fast; the live engine is tests/test_faultlab/test_sglang_live/test_sglang_swa.py).

One request row grows by SGLang's own allocator calls (``alloc`` at page size 1; ``alloc_extend`` / ``alloc_decode``
at page size 4), its window slides through SGLang's ``free_swa_segment`` as ``ScheduleBatch.maybe_evict_swa``
frees it, and kvguard's window check (the torch reference, as on a CPU server) must: pass the healthy row at every
step, never read what slid out, and flag a cleared, foreign or released in-window entry. A broken map entry that
slides out frees the request's own SWA page, never slot 0 or another request's page.
"""
from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.sglang

WINDOW = 7


class SWARig:
    def __init__(self, ps: int, rows: int = 4):
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        from faultlab.sglang_live.rig import publish_server_args
        from kvguard.sglang.plugin import install

        publish_server_args(ps)
        self.ps = ps
        kv = SWAKVPool(size=512, size_swa=256, page_size=ps, dtype=torch.float32, head_num=1, head_dim=4,
                       swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
        self.a = SWATokenToKVPoolAllocator(512, 256, ps, torch.float32, "cpu", kv, need_sort=False)
        self.pool = ReqToTokenPool(size=rows, max_context_len=256, device="cpu", enable_memory_saver=False)
        self.guard = install(self.pool, self.a, types.SimpleNamespace(sliding_window_size=WINDOW))
        self.table = self.pool.req_to_token
        self.lens: dict[int, int] = {}
        self.evicted: dict[int, int] = {}

    def extend(self, row: int, n: int) -> None:
        if self.ps == 1:
            out = self.a.alloc(n)
        else:
            z = torch.zeros(1, dtype=torch.int64)
            out = self.a.alloc_extend(z, z, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n)
        self.table[row, :n] = out.to(self.table.dtype)
        self.lens[row], self.evicted[row] = n, 0

    def decode(self, row: int) -> None:
        n = self.lens[row]
        if self.ps == 1:
            out = self.a.alloc(1)
        else:
            out = self.a.alloc_decode(torch.tensor([n + 1]), torch.tensor([n + 1]), self.table[row, n - 1:n].long())
        self.table[row, n] = int(out[0])
        self.lens[row] = n + 1
        self.slide(row)

    def slide(self, row: int) -> None:
        """SGLang's out-of-window free (free_swa_out_of_window_slots, no prefix sharing), page-aligned."""
        pre, ps = self.lens[row] - 1, self.ps
        new = max(self.evicted[row], (pre - WINDOW) // ps * ps)
        if new > self.evicted[row]:
            self.a.free_swa_segment(self.table[row, self.evicted[row]:new], start_pos=self.evicted[row])
            self.evicted[row] = new

    def check(self, rows: list[int]) -> list[int]:
        verdict = torch.zeros((len(rows), 1), dtype=torch.int32)
        table_rows = torch.tensor(rows, dtype=torch.int64)
        n = torch.tensor([self.lens[r] for r in rows], dtype=torch.int64)
        self.guard.swa.check(table_rows, n, verdict)
        return verdict[:, 0].tolist()


@pytest.fixture(params=[(1, "cpu"), (4, "cpu"), (1, "cuda"), (4, "cuda")],
                ids=["page1", "page4", "page1-cuda-free", "page4-cuda-free"])
def rig(request, monkeypatch):
    """``cuda-free``: SGLang's SWA free takes its CUDA branch, as on a GPU (its ``get_and_clear_swa_pages`` kernel,
    under the Triton interpreter, zeroes the map without ``clear_full_to_swa_mapping``: faultlab/sglang_live/cpu_swa.py)."""
    ps, branch = request.param
    if branch == "cuda":
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator as A

        monkeypatch.setattr(A, "_free_swa_pages_none_cuda", A._free_swa_pages_cuda)
    return SWARig(ps)


def _grown(rig: SWARig) -> SWARig:
    rig.extend(1, 10)
    rig.extend(2, 12)
    for _ in range(30):
        rig.decode(1)
        rig.decode(2)
        assert rig.check([1, 2]) == [0, 0]
    return rig


def test_healthy_rows_pass_while_the_window_slides(rig):
    _grown(rig)
    assert rig.evicted[1] > 0 and rig.evicted[2] > 0  # SGLang freed out-of-window SWA pages
    out_of_window = int(rig.table[1, 0])
    assert int(rig.a.full_to_swa_index_mapping[out_of_window]) == 0  # cleared by SGLang, and never read


@pytest.mark.parametrize("fault", ["cleared", "foreign", "released", "in_page"])
def test_a_broken_in_window_entry_flags_only_its_request(rig, fault):
    _grown(rig)
    n = rig.lens[1]
    full = int(rig.table[1, n - 2])
    mapping = rig.a.full_to_swa_index_mapping
    if fault == "cleared":
        mapping[full] = 0
    elif fault == "foreign":
        mapping[full] = int(mapping[int(rig.table[2, rig.lens[2] - 2])])
    elif fault == "released":
        swa = int(mapping[full])
        rig.a.swa_attn_allocator.free(torch.arange(swa - swa % rig.ps, swa - swa % rig.ps + rig.ps))
    else:
        if rig.ps == 1:
            pytest.skip("no entry inside a page at page size 1")
        mapping[full] = int(mapping[full]) ^ 1  # the right page, another slot in it
    flagged = rig.check([1, 2])
    assert flagged[0] >= 1 and flagged[1] == 0, flagged


def test_a_broken_entry_that_slides_out_frees_the_requests_own_page(rig):
    _grown(rig)
    lo = rig.evicted[1]
    full = int(rig.table[1, lo])  # the oldest in-window entry: the next slide frees it
    mapping = rig.a.full_to_swa_index_mapping
    own = int(mapping[full])
    theirs = int(mapping[int(rig.table[2, rig.lens[2] - 1])])
    mapping[full] = theirs  # foreign: SGLang's slide would free row 2's page
    for _ in range(rig.ps):
        rig.decode(1)
    assert rig.evicted[1] > lo
    free = set(rig.a.swa_attn_allocator.free_pages.tolist())  # page ids (slots at page size 1)
    assert own // rig.ps in free and theirs // rig.ps not in free  # its own page went back, never row 2's
    assert rig.check([2]) == [0]


def test_a_safe_release_frees_only_the_swa_pages_its_request_holds(rig):
    """While kvguard releases an aborted request (the main guard's ``_holds``: the full pages it legitimately holds),
    SGLang's composite ``free`` of its broken row frees the SWA pages paired with those full pages, clears only their
    map entries, and never frees or clears what a foreign entry names."""
    _grown(rig)
    ps, mapping = rig.ps, rig.a.full_to_swa_index_mapping
    n1, n2 = rig.lens[1], rig.lens[2]
    lo = rig.evicted[1]
    row = rig.table[1, lo:n1].clone()
    own = {int(mapping[int(s)]) // ps for s in row.tolist()}
    theirs_full = int(rig.table[2, n2 - 1])
    theirs = int(mapping[theirs_full])
    victim_full = int(rig.table[1, n1 - 1])
    mapping[victim_full] = theirs  # a foreign entry in the aborted request's row
    rig.table[1, lo] = theirs_full  # and a foreign full slot in it
    pages = sorted({int(s) // ps for s in row.tolist()})
    rig.guard._holds = list(pages)  # what PoolFollower.releasing holds for the request
    try:
        rig.a.free(rig.table[1, lo:n1])
        left = list(rig.guard._holds)
    finally:
        rig.guard._holds = None
    if left:  # the legitimate pages its broken row no longer names (as PoolFollower.releasing's end does)
        rig.guard._raw["free_page_ids"](torch.tensor(left, dtype=torch.int64))
    free = set(rig.a.swa_attn_allocator.free_pages.tolist())
    assert own <= free and theirs // ps not in free
    assert int(mapping[theirs_full]) == theirs and rig.check([2]) == [0]
