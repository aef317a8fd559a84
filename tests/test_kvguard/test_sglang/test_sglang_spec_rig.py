"""Speculative decoding's reserve, recorded and checked, on SGLang 0.5.23's own classes (CPU rig, no engine).

SGLang's real ``alloc_for_spec_decode`` (hooked by kvguard through SGLang's plugin loader: kvguard.sglang.spec)
reserves each request's ``[kv_allocated_len, nxt)`` with the lengths SGLang's ``page_aligned_decode_alloc_lens``
computes (chain 3/1/4: a reserve of 8 per step); the armed check is launched as the spec worker's forward hook
launches it (``spec.fire``, with the batch's committed lengths). Page size 1 and 16, both kvguard backends. The whole
engine path (draft, verify, abort, streaming) is tests/test_faultlab/test_sglang_live/test_sglang_spec.py.
"""
import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("kvguard_backend")]

RESERVE = 8  # SGLang's get_alloc_reserve_per_decode() for 3 steps, top-k 1, 4 draft tokens: 2 x 4


@pytest.fixture
def spec_rig(rig_ps, monkeypatch):
    from kvguard.sglang import spec

    import sglang.srt.mem_cache.common as common

    monkeypatch.setattr(spec, "_REFUSAL", [None])  # this process's spec configuration: checked (EAGLE 3/1/4)
    # SGLang's release frees the reserve past the committed length only when spec decoding is on (its config bag)
    bag = common.get_spec()
    monkeypatch.setattr(common, "get_spec", lambda: _Spec(bag))
    return rig_ps


class _Spec:
    """SGLang's spec config bag, with EAGLE as its algorithm (what a spec server publishes)."""

    speculative_algorithm = "EAGLE"

    def __init__(self, bag):
        self._bag = bag

    def __getattr__(self, name):
        return getattr(self._bag, name)


def _spec_step(rig, batch):
    """One spec step's reservation through SGLang's own functions, then its check launched: {rid: flagged}."""
    from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
    from sglang.srt.mem_cache.allocation_sizing import page_aligned_decode_alloc_lens

    from kvguard.sglang import spec

    cur, nxt, needed = page_aligned_decode_alloc_lens(batch.reqs, reserve=RESERVE, page_size=rig.page_size)
    cur_cpu, nxt_cpu = torch.tensor(cur, dtype=torch.int32), torch.tensor(nxt, dtype=torch.int32)
    alloc_for_spec_decode(rig.tree, rig.req_to_token_pool, reqs=batch.reqs, req_pool_indices=batch.req_pool_indices,
                          cur_kv_lens=cur_cpu, cur_kv_lens_cpu=cur_cpu, nxt_kv_lens=nxt_cpu, nxt_kv_lens_cpu=nxt_cpu,
                          num_needed_tokens=needed, batch=batch)
    pending = batch.__dict__["_kvguard"]
    assert isinstance(pending.batch, spec.SpecStep)  # armed, not launched: the forward launches it
    spec.fire(pending, batch.seq_lens)
    return rig.verdict(batch)


def _accept(batch, n: int) -> None:
    """Stand-in for verify: ``n`` tokens of each request accepted (what SGLang's result processing commits)."""
    for req in batch.reqs:
        req.kv.kv_committed_len += n
        req.output_ids.extend([7] * n)
    batch.seq_lens = batch.seq_lens + n
    batch.seq_lens_cpu = batch.seq_lens_cpu + n


def test_clean_spec_steps_are_not_flagged(spec_rig):
    rig = spec_rig
    batch = rig.to_decode(rig.prefill(5), rig.prefill(2 * rig.page_size + 3), rig.prefill(1))
    for accepted in (1, 4, 2, 3, 1, 4, 4, 1):
        assert set(_spec_step(rig, batch).values()) == {0}
        assert all(r.kv.kv_allocated_len >= r.kv.kv_committed_len + RESERVE for r in batch.reqs)
        _accept(batch, accepted)


def test_reserved_entry_pointing_at_another_request_is_caught_and_its_writes_guarded(spec_rig):
    rig, ps = spec_rig, spec_rig.page_size
    batch = rig.to_decode(rig.prefill(3 * ps + 1), rig.prefill(2 * ps + 2))
    a, b = batch.reqs
    _spec_step(rig, batch)
    _accept(batch, 2)
    p = a.kv.kv_committed_len + 1  # in A's reserve: this step's draft / verify write there
    other = int(rig.row(b)[ps]) // ps  # a page B holds privately
    rig.row(a)[p] = other * ps + p % ps
    verdict = _spec_step(rig, batch)
    assert verdict == {a.rid: 1, b.rid: 0}
    seq, nxt = int(a.kv.kv_committed_len), int(a.kv.kv_allocated_len)
    assert rig.row(a)[seq:nxt].eq(0).all()  # the write guard: A's step writes land in SGLang's padding slot
    assert other in rig.pages_of(b)  # B's row untouched


def test_reserved_page_freed_while_mapped_is_caught_and_released_safely(spec_rig):
    rig, ps = spec_rig, spec_rig.page_size
    batch = rig.to_decode(rig.prefill(ps + 1), rig.prefill(2 * ps + 5))
    a, b = batch.reqs
    _spec_step(rig, batch)
    last = int(a.kv.kv_allocated_len) - 1
    page = int(rig.row(a)[last]) // ps
    assert page * ps >= a.kv.kv_committed_len  # a page past the committed tokens: a rejected draft token's
    rig.allocator.free(rig.page_slots(page))  # the bug: freed while A's row still maps it
    assert _spec_step(rig, batch) == {a.rid: 1, b.rid: 0}
    free_before = rig.allocator.available_size()
    from kvguard.sglang.guard import mark_aborted

    mark_aborted(a)
    rig.release(a)  # kvguard's safe release: A's legitimate pages go back, the freed one is not freed again
    free = rig.allocator.free_pages.tolist()
    assert len(free) == len(set(free)) and rig.allocator.available_size() > free_before


def spec_sweep(rig, steps: int, seed: int = 0, running: int = 6) -> dict:
    """Clean spec steps on the rig: requests join (sharing a prefix through the radix tree), accept 1..4 tokens
    each per verify step at random, finish into the tree (SGLang's release frees the reserve past the committed
    length); every step's check must pass. Returns the counts (what the command line prints)."""
    import random

    rng = random.Random(seed)
    prefix = [100 + i for i in range(rig.page_size * 2 + 3)]
    batch, flagged, finished, verified = None, 0, 0, 0
    for _ in range(steps):
        while batch is None or len(batch.reqs) < running:
            tokens = prefix + [rng.randrange(200, 30000) for _ in range(rng.randint(1, 2 * rig.page_size))]
            req = rig.make_req(0, tokens=tokens)
            req.kvguard_target = len(tokens) + rng.randint(4, 40)  # (the request's length when it finishes)
            new = rig.prefill(reqs=[req])
            batch = new if batch is None else rig.to_decode(batch, new)
        flagged += sum(_spec_step(rig, batch).values())
        verified += len(batch.reqs)
        for i, req in enumerate(batch.reqs):
            n = rng.randint(1, 4)
            req.kv.kv_committed_len += n
            req.output_ids.extend([7] * n)
            batch.seq_lens[i] += n
            batch.seq_lens_cpu[i] += n
        done = [r for r in batch.reqs if r.kv.kv_committed_len >= r.kvguard_target]
        for req in done:
            rig.release(req, checkpoint=True)
        finished += len(done)
        if done:
            keep = [i for i, r in enumerate(batch.reqs) if r not in done]
            batch.filter_batch(keep_indices=keep)
            batch.seq_lens_cpu = batch.seq_lens.cpu()
            if not batch.reqs:
                batch = None
    free = rig.allocator.free_pages.tolist()
    return {"steps": steps, "request_verifies": verified, "finished": finished, "flagged": flagged,
            "free_list_duplicates": len(free) - len(set(free))}


def test_clean_spec_sweep_has_no_false_flag(spec_rig):
    out = spec_sweep(spec_rig, steps=24)  # (CI; the command line below runs >= 1,000)
    assert out["flagged"] == 0 and out["finished"] > 0 and out["free_list_duplicates"] == 0, out


if __name__ == "__main__":  # python tests/test_kvguard/test_sglang/test_sglang_spec_rig.py [STEPS] [PAGE_SIZE]
    import json
    import sys

    import sglang.srt.mem_cache.common as common

    from faultlab.sglang_live.rig import Rig, apply_check_hooks
    from kvguard.sglang import spec

    apply_check_hooks()
    args = [int(a) for a in sys.argv[1:3]]
    steps, page_size = (args + [1000, 16][len(args):])[:2]
    rig = Rig(page_size, num_tokens=4096, rows=32)
    rig.install()
    spec._REFUSAL[:] = [None]
    bag = common.get_spec()
    common.get_spec = lambda: _Spec(bag)
    print(json.dumps({"page_size": page_size, **spec_sweep(rig, steps)}))


@pytest.mark.parametrize("batch", [1, 7, 64, 65, 300])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_reserved_counts_equal_numpy_on_fresh_random_lengths(batch, page_size):
    """The reserve's (positions reserved, positions that start a page), from lists up to spec.SMALL requests and
    numpy past that: both equal a plain numpy count over fresh random lengths (int32, as SGLang passes them)."""
    import numpy as np

    from kvguard.sglang import spec

    gen = torch.Generator().manual_seed(batch * 131 + page_size)
    for _ in range(20):
        cur = torch.randint(0, 9000, (batch,), dtype=torch.int32, generator=gen)
        nxt = cur + torch.randint(0, 3 * page_size + 9, (batch,), dtype=torch.int32, generator=gen)
        c, n = cur.numpy().astype(np.int64), nxt.numpy().astype(np.int64)
        want = (int((n - c).sum()), int((-(-n // page_size) + (c // -page_size)).sum()))
        assert spec._reserved(cur, nxt, page_size) == want


@pytest.mark.parametrize("batch", [0, 1, 64, 65, 500])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_max_and_sum_of_host_lengths_equal_torch_on_both_branches(batch, dtype):
    """The decode and spec steps' longest row and total entries (kvguard.sglang.guard.max_and_sum: a list up to SMALL
    requests, numpy past that) equal torch's over fresh random lengths; (0, 0) for an empty batch."""
    from kvguard.sglang.guard import max_and_sum

    lens = torch.randint(0, 100_000, (batch,), dtype=dtype, generator=torch.Generator().manual_seed(batch))
    assert max_and_sum(lens) == ((int(lens.max()), int(lens.sum())) if batch else (0, 0))
