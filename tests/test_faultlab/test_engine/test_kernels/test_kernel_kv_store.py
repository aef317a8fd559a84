"""store_kv (Triton) against store_kv_ref: bit-exact on fresh random inputs, any cache dtype."""
import os

import pytest
import torch

from faultlab.engine.kernels.kv_store import store_kv, store_kv_ref
from faultlab.engine.kernels.testing import assert_equal, generator, randn

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def _random_cache(shape, dtype, seed):
    """A cache full of random values (never zeros), so that stray or missing writes show."""
    return randn(shape, seed, device=DEVICE).to(dtype)


def _slots(n_tokens, n_slots, seed, dtype=torch.int32):
    """``n_tokens`` distinct random slots (scattered over pages, in no order)."""
    perm = torch.randperm(n_slots, generator=generator(seed))[:n_tokens]
    return perm.to(dtype).to(DEVICE)


def _run_both(k, v, k_cache, v_cache, slots, k_scale=1.0, v_scale=1.0):
    kc, vc = k_cache.clone(), v_cache.clone()
    store_kv(k, v, kc, vc, slots, k_scale, v_scale)
    store_kv_ref(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert_equal(kc, k_cache, "k_cache")
    assert_equal(vc, v_cache, "v_cache")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8], ids=_name)
def test_store_matches_ref(cache_dtype, in_dtype, page_size):
    n_tokens, n_kv, head_dim, n_pages = 7, 2, 64, 9
    # k, v as strided views of one [T, 2, Hkv, D] buffer; a few large values exercise FP8 saturation
    kv = randn((n_tokens, 2, n_kv, head_dim), 11, device=DEVICE) * 40.0
    k, v = kv[:, 0].to(in_dtype), kv[:, 1].to(in_dtype)
    cache_shape = (n_pages, page_size, n_kv, head_dim)
    k_cache, v_cache = _random_cache(cache_shape, cache_dtype, 1), _random_cache(cache_shape, cache_dtype, 2)
    slots = _slots(n_tokens, n_pages * page_size, 3, torch.int64 if page_size == 1 else torch.int32)
    _run_both(k, v, k_cache, v_cache, slots, k_scale=0.37, v_scale=1.9)


def test_strided_input_fp16_odd_head_dim():
    n_tokens, n_kv, head_dim, page_size = 5, 3, 16, 4
    big = randn((n_tokens, 2 * n_kv, head_dim), 21, dtype=torch.float16, device=DEVICE)
    k, v = big[:, :n_kv], big[:, n_kv:]
    for cache_dtype in (torch.float32, torch.bfloat16, FP8):
        shape = (6, page_size, n_kv, head_dim)
        _run_both(k, v, _random_cache(shape, cache_dtype, 22), _random_cache(shape, cache_dtype, 23),
                  _slots(n_tokens, 6 * page_size, 24), 0.05, 0.11)


def _fp8_rounding_cases(n):
    """Every e4m3 value, every midpoint between neighbours and the floats just beside each midpoint."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    cases = torch.cat([values, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                       torch.tensor([1e-30, -1e-30, 500.0, -1e4, float("inf"), float("-inf")])])
    return torch.cat([cases, randn((n - cases.numel(),), 31)])


def test_fp8_rounding_is_exact_at_ties_and_carries():
    # the cases where rounding carries into the exponent are where a naive cast goes wrong
    n_tokens, n_kv, head_dim = 8, 4, 64
    x = _fp8_rounding_cases(2 * n_tokens * n_kv * head_dim).to(DEVICE)
    k, v = x.view(2, n_tokens, n_kv, head_dim)
    shape = (4, 2, n_kv, head_dim)
    _run_both(k, v, _random_cache(shape, FP8, 32), _random_cache(shape, FP8, 33), _slots(n_tokens, 8, 34))


def test_bf16_rounding_is_exact_at_ties():
    n_tokens, n_kv, head_dim = 4, 2, 64
    base = randn((2, n_tokens, n_kv, head_dim), 41).bfloat16().float()
    half_ulp = torch.ldexp(torch.ones_like(base), torch.frexp(base).exponent - 9)
    step = torch.tensor([1.0, 0.5, 1.5, -1.0])[torch.arange(base.numel()) % 4].view(base.shape)
    x = base + step * half_ulp  # exact ties (+-1/2 ulp) and values just off them (1/4, 3/4 ulp)
    k, v = x.to(DEVICE)
    shape = (2, 2, n_kv, head_dim)
    _run_both(k, v, _random_cache(shape, torch.bfloat16, 42), _random_cache(shape, torch.bfloat16, 43),
              _slots(n_tokens, 4, 44))


def test_no_tokens_is_a_noop():
    k = torch.empty((0, 2, 16), device=DEVICE)
    cache = _random_cache((2, 4, 2, 16), FP8, 51)
    before = cache.clone()
    store_kv(k, k, cache, cache, torch.empty(0, dtype=torch.int32, device=DEVICE))
    assert_equal(cache, before, "cache")


def _valid_args():
    k = randn((3, 2, 16), 61, device=DEVICE)
    cache = _random_cache((4, 4, 2, 16), torch.bfloat16, 62)
    return dict(k=k, v=k.clone(), k_cache=cache, v_cache=cache.clone(),
                slots=_slots(3, 16, 63))


@pytest.mark.parametrize("name,bad", [
    ("k", lambda a: a["k"].double()),
    ("k", lambda a: a["k"][:, :, None]),
    ("v", lambda a: a["v"][:2]),
    ("k_cache", lambda a: a["k_cache"].half()),
    ("k_cache", lambda a: a["k_cache"][:, :, :1]),
    ("k_cache", lambda a: a["k_cache"].transpose(2, 3)),
    ("v_cache", lambda a: a["v_cache"].float()),
    ("slots", lambda a: a["slots"].float()),
    ("slots", lambda a: a["slots"][:2]),
])
def test_launcher_rejects_bad_arguments(name, bad):
    args = _valid_args()
    args[name] = bad(args)
    for op in (store_kv, store_kv_ref):
        with pytest.raises(ValueError, match=name):
            op(**args)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_launcher_rejects_bad_scale(scale):
    with pytest.raises(ValueError, match="v_scale"):
        store_kv(**_valid_args(), v_scale=scale)
