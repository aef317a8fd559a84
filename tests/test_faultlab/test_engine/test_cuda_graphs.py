"""The decode step's CUDA-graph buckets: padding is exact and writes only scratch; graphs on a GPU."""
import dataclasses

import pytest
import torch

from faultlab.chaos.runner import checking_tracker
from faultlab.engine.context import StepContext
from faultlab.engine.cuda_graphs import GraphedDecode, bucket
from faultlab.engine.engine import ConfigError, Engine, EngineConfig
from faultlab.engine.kernels.testing import assert_close
from workloads import clean_outputs, random_requests

TINY = EngineConfig(model="tiny", kv_dtype="fp8", weight_dtype="int4", page_size=16, num_pages=48, max_running=6,
                    batch_invariant=False)


def test_bucket_is_the_next_power_of_two_capped():
    assert [bucket(n, 6) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]
    with pytest.raises(ValueError):
        bucket(7, 6)


def test_cuda_graphs_config_needs_cuda_and_triton():
    with pytest.raises(ConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs=True)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs=True, device="cuda", backend="torch")


def _decode_inputs(engine, batch, width, gen):
    """B rows on distinct random pages at random lengths that need `width` pages for the longest."""
    ps = engine.page_size
    pages = (torch.randperm(engine.num_pages, generator=gen)[:batch * width] + 1).view(batch, width).int()
    lengths = torch.randint(1, width * ps, (batch,), generator=gen)
    lengths[0] = width * ps - 1  # the longest row fills all `width` pages
    positions = lengths.long()  # the token fed now sits at position length (its K/V is written there)
    slots = pages[torch.arange(batch), positions // ps].long() * ps + positions % ps
    tokens = torch.randint(3, 256, (batch,), generator=gen)
    return tokens, positions, pages, slots


def test_padded_buckets_match_plain_decode_and_write_only_their_slots():
    engine = Engine(TINY)
    gen = torch.Generator().manual_seed(3)
    for layer in range(engine.model.config.n_layers):  # random FP8 content in every usable page
        for cache in (engine.kv.k[layer], engine.kv.v[layer]):
            cache.view(torch.uint8)[1:engine.num_pages + 1] = torch.randint(0, 120, cache[1:engine.num_pages + 1].shape,
                                                                            dtype=torch.uint8, generator=gen)
    graphed = GraphedDecode(engine.model, engine.kv, max_batch=6, max_pages=engine.max_pages, capture=False)
    for batch, width in [(5, 3), (3, 2), (1, 1), (6, 5)]:  # a smaller step after a larger one reuses padding
        tokens, positions, block, slots = _decode_inputs(engine, batch, width, gen)
        before = [c.clone() for c in engine.kv.k]
        got = graphed(tokens, StepContext.for_decode(positions, slots, block, torch.arange(batch)))
        after = [c.clone() for c in engine.kv.k]
        for c, b in zip(engine.kv.k, before):
            c.copy_(b)  # the plain decode writes the same slots again from the same state
        want = engine.model.forward(tokens, engine.kv, StepContext.for_decode(positions, slots, block))
        assert got.shape == want.shape == (batch, engine.model.config.vocab)
        assert_close(got, want, 1e-5, f"bucket of B={batch}, W={width}")
        written = set(slots.tolist()) | {GraphedDecode.PAD_SLOT}
        for b, a in zip(before, after):
            changed = (b.view(torch.uint8) != a.view(torch.uint8)).flatten(0, 1).any(-1).any(-1).nonzero().flatten()
            assert set(changed.tolist()) <= written, "a padding row wrote into a page a request could own"
    assert sorted(graphed.buckets) == [(1, 1), (4, 2), (6, 4), (6, 8)]


def _aliasing(graphed):
    """The eager forward writing into one output buffer per bucket, as a replayed graph does."""
    forward = graphed._forward

    def into_static_out(buf):
        out = forward(buf)
        if buf.out is None or buf.out.shape != out.shape:
            return out
        with torch.inference_mode():
            buf.out.copy_(out)
        return buf.out
    return into_static_out


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_engine_outputs_are_the_same_through_eager_buckets(batch_invariant):
    """The engine's decode through GraphedDecode (eager buckets, as on a GPU without the capture)
    streams the same tokens as the plain decode, with the tracker on and no abort; row by row
    (batch-invariant) too, where every row goes through the same bucket."""
    outputs = []
    config = dataclasses.replace(TINY, batch_invariant=batch_invariant)
    for graphs in (False, True):
        engine = Engine(config, tracker=checking_tracker())
        if graphs:
            engine.graphs = GraphedDecode(engine.model, engine.kv, TINY.max_running, engine.max_pages, capture=False)
            engine.graphs._forward = _aliasing(engine.graphs)
        outputs.append(clean_outputs(engine, random_requests(10, seed=4)))
    assert outputs[0] == outputs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)")
def test_captured_graphs_match_eager_engine_on_gpu():
    config = dataclasses.replace(TINY, device="cuda", backend="triton")
    outputs = []
    for graphs in (False, True):
        engine = Engine(dataclasses.replace(config, cuda_graphs=graphs), tracker=checking_tracker())
        outputs.append(clean_outputs(engine, random_requests(10, seed=4)))
        if graphs:
            assert engine.graphs.replays > 0 and engine.graphs.buckets
    same = sum(outputs[0][k] == outputs[1][k] for k in outputs[0])
    assert same >= 8, f"only {same} of 10 greedy outputs identical with graphs"  # split counts differ by bucket
