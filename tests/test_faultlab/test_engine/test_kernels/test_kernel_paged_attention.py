"""paged_decode_attention (Triton) against its torch reference on fresh random paged K/V."""
import os

import pytest
import torch

from faultlab.engine.kernels.paged_attention import launch_paged_decode, paged_decode_attention
from faultlab.engine.kernels.paged_attention_ref import paged_decode_attention_ref
from faultlab.engine.kernels.testing import assert_close, generator, randn

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.07  # FP8 scales (ignored by float caches)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _name(value):
    return str(value).removeprefix("torch.")


def _cache(shape, dtype, scale, seed):
    """Random K or V cache; FP8 holds x / scale like store_kv writes it."""
    x = randn(shape, seed, device=DEVICE)
    return (x / scale).clamp(-448, 448).to(dtype) if dtype == FP8 else x.to(dtype)


def make_case(seq_lens, page_size, n_heads, n_kv, head_dim, q_dtype, cache_dtype, seed=0):
    """Random q and caches; each request's pages are distinct, shuffled ids (never page 0).

    The block table has spare columns past each request's last page, holding other random ids.
    """
    max_pages = max(-(-n // page_size) for n in seq_lens) + 1
    n_pages = len(seq_lens) * max_pages + 1
    shape = (n_pages, page_size, n_kv, head_dim)
    k_cache = _cache(shape, cache_dtype, K_SCALE, seed + 1)
    v_cache = _cache(shape, cache_dtype, V_SCALE, seed + 2)
    ids = torch.randperm(n_pages - 1, generator=generator(seed + 3))[: len(seq_lens) * max_pages] + 1
    block_table = ids.view(len(seq_lens), max_pages).to(torch.int32).to(DEVICE)
    q = randn((len(seq_lens), n_heads, head_dim), seed + 4, q_dtype, DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, block_table, lens


def _check(case, sm_scale, tol, name, n_splits=None):
    if n_splits is None:
        out = paged_decode_attention(*case, sm_scale, K_SCALE, V_SCALE)
    else:
        out = launch_paged_decode(*case, sm_scale, K_SCALE, V_SCALE, n_splits=n_splits)
    ref = paged_decode_attention_ref(*case, sm_scale, K_SCALE, V_SCALE)
    assert out.dtype == case[0].dtype and out.shape == case[0].shape
    return assert_close(out, ref, tol, name)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("q_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, FP8), (torch.bfloat16, FP8),
], ids=_name)
def test_gqa_matches_ref(q_dtype, cache_dtype, page_size):
    # H=6 query heads over Hkv=2 KV heads; lengths not multiples of the page size
    case = make_case([1, 37, 83], page_size, 6, 2, 64, q_dtype, cache_dtype, seed=page_size)
    _check(case, 64 ** -0.5, TOL[q_dtype], f"attention {q_dtype}/{cache_dtype} page {page_size}")


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(4, 4, 16), (8, 1, 32), (6, 3, 48)])
def test_head_layouts(n_heads, n_kv, head_dim):
    # MHA, one KV head for 8 query heads, and a head_dim that is not a power of two
    case = make_case([5, 29], 16, n_heads, n_kv, head_dim, torch.float32, torch.float32, seed=head_dim)
    _check(case, head_dim ** -0.5, 1e-5, f"attention H={n_heads} Hkv={n_kv} D={head_dim}")


@pytest.mark.parametrize("n_splits", [2, 3])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, FP8), (torch.bfloat16, torch.bfloat16)],
                         ids=_name)
def test_split_sequence_merges_exactly(q_dtype, cache_dtype, n_splits):
    # the length-1 request leaves later splits empty (no tokens): they must merge with weight 0
    case = make_case([1, 70, 130], 16, 6, 2, 64, q_dtype, cache_dtype, seed=n_splits)
    _check(case, 0.125, TOL[q_dtype], f"split attention x{n_splits}", n_splits=n_splits)


def test_strided_q_and_large_scores():
    # q sliced out of a wider [B, 3H, D] buffer; sm_scale large enough that exp() would overflow
    # without the running max
    q_big = randn((2, 18, 32), 71, device=DEVICE) * 4.0
    case = list(make_case([40, 9], 16, 6, 2, 32, torch.float32, torch.float32, seed=72))
    case[0] = q_big[:, 6:12]
    _check(tuple(case), 3.0, 1e-5, "attention strided q")


def test_zero_length_request_gives_zeros():
    case = make_case([0, 20], 16, 4, 2, 16, torch.float32, torch.float32, seed=81)
    for n_splits in (1, 2):
        out = launch_paged_decode(*case, 0.25, K_SCALE, V_SCALE, n_splits=n_splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert_close(out[1:], paged_decode_attention_ref(*case, 0.25)[1:], 1e-5, "attention after empty")


def _valid_args():
    q, k_cache, v_cache, block_table, seq_lens = make_case([3, 5], 4, 4, 2, 16, torch.float32,
                                                           torch.bfloat16, seed=91)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                sm_scale=0.25)


@pytest.mark.parametrize("name,bad", [
    ("q", lambda a: a["q"].half()),
    ("q", lambda a: a["q"][:, :3]),  # 3 heads over 2 KV heads
    ("q", lambda a: a["q"][0]),
    ("k_cache", lambda a: a["k_cache"].half()),
    ("k_cache", lambda a: a["k_cache"][..., :8]),
    ("v_cache", lambda a: a["v_cache"].float()),
    ("block_table", lambda a: a["block_table"].long()),
    ("block_table", lambda a: a["block_table"][:1]),
    ("seq_lens", lambda a: a["seq_lens"][:1]),
    ("seq_lens", lambda a: a["seq_lens"].float()),
])
def test_launcher_rejects_bad_arguments(name, bad):
    args = _valid_args()
    args[name] = bad(args)
    for op in (paged_decode_attention, paged_decode_attention_ref):
        with pytest.raises(ValueError, match=name):
            op(**args)


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("n_splits", [1, 2])
@pytest.mark.parametrize("q_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, FP8), (torch.bfloat16, FP8),
], ids=_name)
def test_every_mode_matches_ref(q_dtype, cache_dtype, n_splits, mode):
    # heads-in-MMA-rows (0), tokens-in-MMA-rows (1) and CUDA-core (2) kernels; 4 query heads per KV head
    # like the 8B model (H=8 over Hkv=2), lengths across page and block boundaries
    case = make_case([1, 17, 150], 16, 8, 2, 32, q_dtype, cache_dtype, seed=100 + mode)
    out = launch_paged_decode(*case, 32 ** -0.5, K_SCALE, V_SCALE, n_splits=n_splits, mode=mode, block_n=32)
    ref = paged_decode_attention_ref(*case, 32 ** -0.5, K_SCALE, V_SCALE)
    assert out.dtype == q_dtype and out.shape == case[0].shape
    assert_close(out, ref, TOL[q_dtype], f"attention mode {mode} {q_dtype}/{cache_dtype} x{n_splits}")


@pytest.mark.parametrize("mode", [1, 2])
def test_modes_odd_group_and_head_dim(mode):
    # GROUP = 3 (padded to 4 or 16 rows) and head_dim 48 (padded to 64)
    case = make_case([5, 29], 16, 6, 2, 48, torch.float32, torch.float32, seed=110 + mode)
    out = launch_paged_decode(*case, 48 ** -0.5, K_SCALE, V_SCALE, mode=mode)
    assert_close(out, paged_decode_attention_ref(*case, 48 ** -0.5), 1e-5, f"attention mode {mode} G=3 D=48")
