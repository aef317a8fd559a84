"""The FP8 KV residual (PagedKVCache.residual, engine.kv_residual): the ring's bookkeeping, the
precision it buys, and the engine running with it (torch and Triton backends)."""
import dataclasses

import pytest
import torch

from faultlab.chaos.runner import checking_tracker
from faultlab.engine.context import StepContext
from faultlab.engine.cuda_graphs import GraphedDecode
from faultlab.engine.engine import ConfigError, Engine, EngineConfig
from faultlab.engine.kvcache import PagedKVCache, ResidualLayout
from faultlab.engine.requests import Request
from workloads import clean_outputs, random_requests

TINY = EngineConfig(model="tiny", kv_dtype="fp8", weight_dtype="int4", page_size=16, num_pages=48, max_running=6,
                    kv_residual=True, kv_residual_sink=16, kv_residual_window=32)


@pytest.mark.parametrize("page_size,sink,window,chunk", [(16, 16, 128, 1), (16, 16, 128, 37), (1, 4, 8, 1),
                                                         (1, 4, 8, 5), (16, 0, 20, 9), (64, 16, 128, 100)])
def test_every_page_read_with_a_residual_reads_its_own(page_size, sink, window, chunk):
    """Grow two requests (rows 0 and 1) by `chunk` tokens at a time; after each write, every token of
    every page the layout names as resident must be the last writer of its residual slot, and the
    resident pages must cover the first `sink` and the last `window` tokens."""
    layout = ResidualLayout.of(2, page_size, sink, window)
    owner = {}  # residual slot -> (row, position) that wrote it last
    length = 0
    while length < 700:
        new = torch.arange(length, min(length + chunk, 700))
        length = int(new[-1]) + 1
        for row in (0, 1):
            slots = layout.write_slots(torch.full_like(new, row), new, torch.full_like(new, length))
            for pos, slot in zip(new.tolist(), slots.tolist()):
                if slot >= 0:
                    assert slot // page_size // layout.pages_per_row == row, "a row wrote outside its pages"
                    owner[slot] = (row, pos)
            width = -(-length // page_size)
            table = layout.table(torch.tensor([row]), width, torch.tensor([length]))[0]
            a, c = layout.bounds(torch.tensor([length]), torch.tensor([0]))[0].tolist()
            for pos in range(length):
                page = int(table[pos // page_size])
                assert page < 0 or pos < a or pos >= c, "the kernel's res_bounds would skip a residual"
                if pos < sink or pos >= length - window:
                    assert page >= 0, f"token {pos} of {length} has no residual"
                if page >= 0:
                    assert owner.get(page * page_size + pos % page_size) == (row, pos)
    assert len({s // page_size for s in owner}) <= 2 * layout.pages_per_row


def _random_kv(n_tokens, n_kv_heads=2, head_dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_tokens, n_kv_heads, head_dim, generator=gen) * 3
    v = torch.randn(n_tokens, n_kv_heads, head_dim, generator=gen)
    return k, v


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_residual_brings_gathered_and_attended_kv_near_bf16(backend):
    """One request of 100 tokens (page size 16, sink 16, window 32): gather returns K and V within 5e-3
    of the exact values on resident tokens and FP8's ~3e-2 elsewhere; decode attention with the residual
    is closer to exact attention than plain FP8 attention."""
    ps, n, hkv, d = 16, 100, 2, 32
    layout = ResidualLayout.of(1, ps, 16, 32)
    caches = {res: PagedKVCache(1, 8, ps, hkv, d, "fp8", backend=backend, residual=layout if res else None)
              for res in (False, True)}
    k, v = _random_kv(n)
    page_row = torch.arange(1, 8, dtype=torch.int32)
    pos = torch.arange(n)
    slots = page_row[pos // ps].long() * ps + pos % ps
    ctx = StepContext.for_prefill(0, slots, page_row, row=0)  # the whole request, written by one forward
    for res, kv in caches.items():
        kv.reset_residual(0)
        kv.store(0, k, v, slots, kv.residual_slots(ctx))
    plain = caches[False].gather(0, page_row, n)
    with_res = caches[True].gather(0, page_row, n, ctx)
    resident = (pos < 16) | (pos >= (n - 1) // ps * ps - 2 * ps)  # sink page + ring of 3 pages
    for exact, got, fp8 in zip((k, v), with_res, plain):
        assert _rel(got[resident], exact[resident]) < 5e-3 < 1e-2 < _rel(fp8[resident], exact[resident])
        assert torch.equal(got[~resident], fp8[~resident])

    q = torch.randn(1, 4, d, generator=torch.Generator().manual_seed(1))
    block, seq = page_row[None], torch.tensor([n], dtype=torch.int32)
    step = StepContext.for_decode(torch.tensor([n - 1]), slots[-1:], block, torch.zeros(1, dtype=torch.long))
    exact = torch.softmax(torch.einsum("hd,nhd->hn", q[0], k.repeat_interleave(2, 1)) / d ** 0.5, -1)
    exact = torch.einsum("hn,nhd->hd", exact, v.repeat_interleave(2, 1))
    plain = caches[False].decode_attention(0, q, block, seq, d ** -0.5, caches[False].decode_plan(step))
    with_res = caches[True].decode_attention(0, q, block, seq, d ** -0.5, caches[True].decode_plan(step))
    assert _rel(with_res[0], exact) < _rel(plain[0], exact) / 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("res", [False, True], ids=["plain", "residual"])
def test_set_scales_rescales_every_later_read(backend, res):
    """PagedKVCache.set_scales (the public hook of the fp8_scales_lost_on_wake fault): pages written
    before are read with the new scales, by gather and decode attention, residual included; other
    layers keep theirs."""
    ps, n, d = 16, 40, 32
    kv = PagedKVCache(2, 4, ps, 2, d, "fp8", backend=backend, k_scale=0.5, v_scale=2.0,
                      residual=ResidualLayout.of(1, ps, 16, 32) if res else None)
    k, v = _random_kv(n)
    page_row = torch.arange(1, 4, dtype=torch.int32)
    pos = torch.arange(n)
    slots = page_row[pos // ps].long() * ps + pos % ps
    ctx = StepContext.for_prefill(0, slots, page_row, row=0)
    kv.reset_residual(0)
    kv.store(1, k, v, slots, kv.residual_slots(ctx))
    q = torch.randn(1, 4, d, generator=torch.Generator().manual_seed(2))
    block, seq = page_row[None], torch.tensor([n], dtype=torch.int32)
    plan = kv.decode_plan(StepContext.for_decode(pos[-1:], slots[-1:], block, torch.zeros(1, dtype=torch.long)))
    k0, v0 = kv.gather(1, page_row, n, ctx)
    out0 = kv.decode_attention(1, q, block, seq, d ** -0.5, plan)
    kv.set_scales(1, 0.5, 2000.0)
    assert kv.scales(1) == (0.5, 2000.0) and kv.scales(0) == (0.5, 2.0)
    k1, v1 = kv.gather(1, page_row, n, ctx)
    assert torch.equal(k1, k0) and _rel(v1, v0 * 1000) < 1e-6
    assert _rel(kv.decode_attention(1, q, block, seq, d ** -0.5, plan), out0 * 1000) < 1e-5
    with pytest.raises(ValueError, match="v_scale"):
        kv.set_scales(1, 1.0, -1.0)
    assert kv.scales(1) == (0.5, 2000.0)


def test_cache_without_rows_fails_loudly():
    kv = PagedKVCache(1, 4, 16, 2, 32, "fp8", residual=ResidualLayout.of(1, 16))
    k, v = _random_kv(3)
    with pytest.raises(ValueError, match="res_slots"):
        kv.store(0, k, v, torch.arange(16, 19))
    no_rows = StepContext.for_decode(torch.tensor([2]), torch.tensor([18]), torch.ones(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="decode needs the step context's request rows"):
        kv.decode_plan(no_rows)
    with pytest.raises(ValueError, match="a forward needs the step context's request rows"):
        kv.residual_slots(no_rows)
    with pytest.raises(ValueError, match="gather needs the step context's request rows"):
        kv.gather(0, torch.ones(1, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="fp8"):
        PagedKVCache(1, 4, 16, 2, 32, "bf16", residual=ResidualLayout.of(1, 16))


def test_config_errors_and_budget():
    with pytest.raises(ConfigError, match="kv_residual"):
        EngineConfig(kv_dtype="bf16", kv_residual=True)
    with pytest.raises(ConfigError, match="kv_residual"):
        EngineConfig(kv_residual=True, phase_split=True)
    with pytest.raises(ConfigError, match="kv_residual_window"):
        EngineConfig(kv_residual=True, kv_residual_window=0)
    budget = dict(model="tiny", kv_budget_mb=1.0, num_pages=0, max_running=8)
    plain = Engine(dataclasses.replace(TINY, kv_residual=False, **budget))
    res = Engine(dataclasses.replace(TINY, **budget))
    layout = res.residual  # sink 1 page + ring 3 pages per row, 9 rows; a residual page is a page's size
    assert plain.num_pages - res.num_pages == layout.num_pages


def test_engine_runs_with_residual_and_tracker_still_aborts():
    """Fault-free: every request finishes, no abort; a remapped page is still caught before streaming."""
    engine = Engine(TINY, tracker=checking_tracker())
    assert len(clean_outputs(engine, random_requests(6, seed=4))) == 6
    assert engine.accounting()["balanced"]

    engine = Engine(TINY, tracker=checking_tracker())
    reqs = random_requests(2, seed=7, shared=0.0)
    for r in reqs:
        engine.add_request(r)
    engine.step()
    engine.table[reqs[0].row, 0] = engine.table[reqs[1].row, 0]
    aborts = [e for e in engine.step() if e.kind == "abort"]
    assert [e.rid for e in aborts] == [reqs[0].rid]


def test_triton_engine_with_residual_matches_torch():
    """The Triton kernels (store with residual, attention reading it) give the torch path's greedy
    tokens; requests long enough that the ring wraps (window 32 tokens = 3 ring pages)."""
    config = dataclasses.replace(TINY, batch_invariant=False)
    outputs = {}
    for backend in ("torch", "triton"):
        requests = [Request("a", list(range(3, 80)), 6), Request("b", list(range(90, 101)), 6)]
        outputs[backend] = clean_outputs(Engine(dataclasses.replace(config, backend=backend)), requests)
    assert outputs["triton"] == outputs["torch"]


def test_stale_residual_of_a_previous_request_never_leaks():
    """Residual pages full of garbage before each request is admitted (what a previous occupant of the
    row leaves) change nothing: admission zeroes the row, and a prefix-cache hit reads plain FP8 for the
    shared pages. Outputs equal those of the same run with clean residual pages."""
    prompt = list(range(3, 43))
    runs = []
    for poison in (False, True):
        engine, outputs = Engine(TINY), {}
        gen = torch.Generator().manual_seed(5)
        for request in (Request("a", prompt, 12), Request("b", prompt + [7, 8], 12)):  # "b" hits "a"'s prefix
            for res in (*engine.kv.k_res, *engine.kv.v_res) if poison else ():
                res.view(torch.uint8).copy_(torch.randint(0, 120, res.shape, dtype=torch.uint8, generator=gen))
            outputs.update(clean_outputs(engine, [request]))
        assert engine.done[-1].n_shared == 2
        runs.append(outputs)
    assert runs[0] == runs[1]


def _kv_of(engine, request, steps):
    """Run `steps` more steps; then request's K/V (main and residual bytes) by logical position."""
    for _ in range(steps):
        engine.step()
    assert request.status == "running"
    kv, row = engine.kv, request.row
    pages = engine.table[row, :request.n_pages].long()
    per_row = kv.residual.pages_per_row
    main = [c.view(torch.uint8)[pages].flatten(0, 1)[:request.kv_len] for c in (*kv.k, *kv.v)]
    res = [r.view(torch.uint8)[row * per_row:(row + 1) * per_row] for r in (*kv.k_res, *kv.v_res)]
    return torch.stack(main), torch.stack(res)


def test_prefix_cache_hits_do_not_change_what_a_request_computes():
    """Request "b" shares 3 prompt pages with "a". Run after "a" (a prefix-cache hit) it must compute,
    bit for bit, the K/V and residual bytes it computes alone (a miss): the sink's residual is
    refreshed on the hit and the shared prompt pages never get a window residual."""
    config = dataclasses.replace(TINY, kv_residual_window=16)
    prefix = list(range(3, 51))
    a, b_prompt = Request("a", prefix + [9, 9, 9], 4), prefix + [7, 8, 5, 5]
    alone = Engine(config)
    b = Request("b", b_prompt, 30)
    alone.add_request(b)
    want = _kv_of(alone, b, 12)
    engine = Engine(config)
    clean_outputs(engine, [a])
    b = Request("b", b_prompt, 30)
    engine.add_request(b)
    got = _kv_of(engine, b, 12)
    assert b.n_shared == 3 and b.kv_len > 60  # the ring has wrapped past the prompt
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_graph_padding_rows_write_only_the_scratch_row():
    engine = Engine(dataclasses.replace(TINY, batch_invariant=False))
    graphed = GraphedDecode(engine.model, engine.kv, max_batch=4, max_pages=engine.max_pages, capture=False)
    gen = torch.Generator().manual_seed(2)
    pages = (torch.randperm(engine.num_pages, generator=gen)[:6] + 1).view(3, 2).int()
    positions = torch.tensor([20, 5, 31])
    slots = pages[torch.arange(3), positions // 16].long() * 16 + positions % 16
    tokens, rows = torch.tensor([5, 6, 7]), torch.tensor([0, 2, 5])
    residuals = [*engine.kv.k_res, *engine.kv.v_res]
    before = [r.clone() for r in residuals]
    got = graphed(tokens, StepContext.for_decode(positions, slots, pages, rows))  # bucket of 4: one padding row
    after = [r.clone() for r in residuals]
    for r, b in zip(residuals, before):
        r.copy_(b)
    want = engine.model.forward(tokens, engine.kv, StepContext.for_decode(positions, slots, pages, rows))
    assert torch.allclose(got, want, atol=1e-5)
    per_row = engine.residual.pages_per_row
    for b, a in zip(before, after):
        changed = (b.view(torch.uint8) != a.view(torch.uint8)).flatten(1).any(-1).nonzero().flatten()
        assert {int(p) // per_row for p in changed} <= {0, 2, 5, engine.residual.rows}


def test_eval_kv_residual_beats_plain_fp8():
    """SmolLM2, 150 positions: the KV residual cuts the mean KL against BF16 KV by more than 3x."""
    from faultlab.engine.evalkv import eval_kv

    plain = eval_kv(n_positions=150, window=192)
    res = eval_kv(n_positions=150, window=192, residual=True)
    assert res["residual"] == {"sink_tokens": 16, "window_tokens": 128}
    assert res["mean_kl"] * 3 < plain["mean_kl"]
    assert res["top1_agreement"] >= plain["top1_agreement"]
