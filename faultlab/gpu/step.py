"""The decode step faultlab's GPU benchmarks time: B requests at one context on scattered pages, with a
tracker's expectations recorded, one step with or without the check (``faultlab bench``,
bench/layout_cost.py, bench/tp_bench.py), and the validation kernel alone.
"""
import statistics

import torch

from faultlab.chaos.runner import checking_tracker
from faultlab.engine.config import get_preset
from faultlab.engine.context import StepContext
from faultlab.engine.kvcache import PagedKVCache, ResidualLayout, token_bytes
from faultlab.engine.model import LlamaModel
from faultlab.engine.weights import Int4Weight, random_weights
from faultlab.gpu.timing import capture, interleaved, pct, timed


class DecodeState:
    """B requests at context ``ctx`` on scattered pages, with their expected tags recorded."""

    def __init__(self, model, batch, ctx, page_size, kv_dtype, dev, backend, seed=0, rotate_k=None, residual=False):
        c = model.config
        self.ps, self.batch = page_size, batch
        self.width = -(-(ctx + 1) // page_size)
        num_pages = batch * self.width
        layout = ResidualLayout.of(batch, page_size) if residual else None  # first 16, last 128 tokens
        self.kv = PagedKVCache(c.n_layers, num_pages, page_size, c.n_kv_heads, c.head_dim, dtype=kv_dtype,
                               device=dev, backend=backend, rotate_k=rotate_k, residual=layout)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        pages = (torch.randperm(num_pages, generator=gen) + 1).view(batch, self.width)  # scattered pages
        self.table = pages.to(dev, torch.int32)
        self.rows = torch.arange(batch, dtype=torch.int32, device=dev)
        self.n_entries = torch.full((batch,), self.width, dtype=torch.int32, device=dev)
        self.positions = torch.full((batch,), ctx, dtype=torch.int64, device=dev)
        self.tokens = torch.randint(3, c.vocab, (batch,), generator=gen).to(dev)
        self.page_idx = (self.positions // page_size)[:, None]
        self.offs = self.positions % page_size
        for layer in range(c.n_layers):  # random KV content (what a prefill would have left)
            for cache in (self.kv.k[layer], self.kv.v[layer]):
                cache.view(torch.uint8 if cache.dtype == torch.float8_e4m3fn else cache.dtype)[1:num_pages + 1] \
                    .copy_(_noise(cache, num_pages))
            if self.kv.residual is not None:
                for res in (self.kv.k_res[layer], self.kv.v_res[layer]):
                    res.view(torch.uint8).copy_(_noise(res, res.shape[0]))
        self.tracker = checking_tracker()
        self.tracker.attach(num_pages=num_pages + 1, num_rows=batch, max_entries=self.width, device=dev,
                            page_size=page_size)
        flat = self.table.flatten().long()
        self.tracker.on_alloc(flat)
        self.tracker.record_many(self.rows.long().repeat_interleave(self.width),
                                 torch.arange(self.width, device=dev).repeat(batch), flat)

    def step(self, model, tracker):
        block = self.table.index_select(0, self.rows)  # [B, W] the kernel-visible copy
        check = tracker.validate(block, self.rows, self.n_entries, max_entries=self.width,
                                 source=self.table, source_rows=self.rows)
        slots = block.gather(1, self.page_idx).squeeze(1).long() * self.ps + self.offs
        rows = None if self.kv.residual is None else self.rows
        logits = model.forward(self.tokens, self.kv, StepContext.for_decode(self.positions, slots, block, rows))
        return logits.argmax(-1), (None if check is None else check.verdict)


def _noise(cache, num_pages):
    shape = (num_pages, *cache.shape[1:])
    if cache.dtype == torch.float8_e4m3fn:
        return torch.randint(0, 120, shape, dtype=torch.uint8, device=cache.device)  # |x| < ~1 in e4m3
    return (torch.randn(shape, device=cache.device) * 0.5).to(cache.dtype)


def weight_bytes(model) -> int:
    total = model.embedding.numel() * model.embedding.element_size() // model.config.vocab  # one row
    mats = [model.output] + [w for layer in model.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    for w in mats:
        if isinstance(w, Int4Weight):
            total += w.qweight.numel() + 2 * w.scales.numel() * w.scales.element_size()
        else:
            total += w.numel() * w.element_size()
    return total


def bench_step(model, batch, ctx, ps, kv_dtype, dev, backend, pairs, dry):
    state = DecodeState(model, batch, ctx, ps, kv_dtype, dev, backend)
    noop, check = checking_tracker(on=False), state.tracker
    if dry:
        a, _ = state.step(model, noop)
        b, verdict = state.step(model, check)
        assert torch.equal(a, b) and int(verdict.sum()) == 0, "check changed a clean step"
        return {"dry_run": True}, state
    g_a, _ = capture(lambda: state.step(model, noop))
    g_a2, _ = capture(lambda: state.step(model, noop))
    g_b, (_, verdict) = capture(lambda: state.step(model, check))
    t = interleaved({"noop": g_a, "noop2": g_a2, "check": g_b}, pairs)
    assert int(verdict.sum()) == 0, "false positive in the benchmark"
    med = {k: statistics.median(v) for k, v in t.items()}
    p99 = {k: pct(v, 99) for k, v in t.items()}
    kv_bytes = batch * (ctx + 1) * token_bytes(model.config.n_layers, model.config.n_kv_heads,
                                               model.config.head_dim, kv_dtype)
    row = {
        "concurrency": batch, "page_size": ps, "context": ctx, "kv_dtype": kv_dtype,
        "step_ms_median_noop": med["noop"] * 1e3, "step_ms_median_check": med["check"] * 1e3,
        "step_ms_p99_noop": p99["noop"] * 1e3, "step_ms_p99_check": p99["check"] * 1e3,
        "overhead_median_pct": 100 * (med["check"] / med["noop"] - 1),
        "overhead_p99_pct": 100 * (p99["check"] / p99["noop"] - 1),
        "aa_spread_median_pct": 100 * (med["noop2"] / med["noop"] - 1),
        "aa_spread_p99_pct": 100 * (p99["noop2"] / p99["noop"] - 1),
        "tokens_per_s_noop": batch / med["noop"], "tokens_per_s_check": batch / med["check"],
        "kv_bytes_read": kv_bytes, "replays_per_variant": pairs,
    }
    del g_a, g_a2, g_b
    return row, state


def bench_kernel_alone(state, dev):
    """The validation kernel alone (eager launches, do_bench-style) against its sector floor."""
    from kvguard.kernels.tag_check import tag_check

    tr = state.tracker
    block = state.table.clone()
    fn = lambda: tag_check(block, state.rows, state.rows, state.n_entries, tr.tags.tags, tr.expected,  # noqa: E731
                           max_entries=state.width)
    reps = 50  # NOTE: 50 back-to-back launches in one graph: per-launch time without the replay's own latency
    g, _ = capture(lambda: [fn() for _ in range(reps)])
    g1, _ = capture(fn)
    t_graph = statistics.median(timed(g.replay, reps=50)) / reps
    t_single = statistics.median(timed(g1.replay, reps=200))
    t_eager = statistics.median(timed(fn, reps=200))
    n = state.batch * state.width
    sectors = n * 32 + n * 4 + n * 8  # one 32-byte sector per random tag gather; table + expected rows
    return {"concurrency": state.batch, "page_size": state.ps, "entries": n, "kernel_us_graph": t_graph * 1e6,
            "single_launch_graph_replay_us": t_single * 1e6, "kernel_us_eager": t_eager * 1e6,
            "sector_bytes": sectors}


class CheckOnly:
    """Just what the validation kernel reads: a scattered page table, tags and expected tags."""

    def __init__(self, batch, ctx, page_size, dev):
        self.batch, self.ps = batch, page_size
        self.width = -(-(ctx + 1) // page_size)
        num_pages = batch * self.width
        self.table = (torch.randperm(num_pages) + 1).view(batch, self.width).to(dev, torch.int32)
        self.rows = torch.arange(batch, dtype=torch.int32, device=dev)
        self.n_entries = torch.full((batch,), self.width, dtype=torch.int32, device=dev)
        self.tracker = checking_tracker()
        self.tracker.attach(num_pages=num_pages + 1, num_rows=batch, max_entries=self.width, device=dev)
        flat = self.table.flatten().long()
        self.tracker.on_alloc(flat)
        self.tracker.record_many(self.rows.long().repeat_interleave(self.width),
                                 torch.arange(self.width, device=dev).repeat(batch), flat)


def build(name, weights, dev, backend, dry):
    """A model of preset ``name`` with random ``weights`` (INT4 group 128; 32 for a dry run)."""
    config = get_preset(name)
    w = random_weights(config, seed=0, weight_dtype=weights, group_size=128 if not dry else 32, device=dev)
    return LlamaModel(config, w, backend=backend)
