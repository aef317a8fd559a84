"""The optional FP8 KV residual of store_kv and paged_decode_attention, against their torch references.

store_kv writes a second e4m3 byte ``r = e4m3((y - e4m3(y)) * RES_SCALE)`` per K and V element at
``res_slots``; paged_decode_attention reads K as ``(k_cache + k_res / RES_SCALE) * k_scale`` (V likewise)
where ``res_table >= 0``.
"""
import math
import os

import pytest
import torch

from faultlab.engine.kernels.kv_store import RES_SCALE, store_kv, store_kv_ref
from faultlab.engine.kernels.paged_attention import launch_paged_decode, paged_decode_attention
from faultlab.engine.kernels.paged_attention_ref import paged_decode_attention_ref
from faultlab.engine.kernels.testing import assert_close, assert_equal, generator, randn, rel_error

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.07
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _name(value):
    return str(value).removeprefix("torch.")


def _random_fp8(shape, seed):
    """FP8 tensor of random values (never zeros), so that stray or missing writes show."""
    return (randn(shape, seed, device=DEVICE) * 8.0).to(FP8)


def _perm(n, seed):
    return torch.randperm(n, generator=generator(seed)).to(DEVICE)


# ---------------------------------------------------------------------------------------------- store


def _store_case(n_tokens, page_size, n_kv, head_dim, in_dtype, seed):
    n_pages, n_res_pages = n_tokens // page_size + 3, n_tokens // page_size + 2
    kv = randn((2, n_tokens, n_kv, head_dim), seed, device=DEVICE) * 3.0
    k, v = kv[0].to(in_dtype), kv[1].to(in_dtype)
    shape = (n_pages, page_size, n_kv, head_dim)
    k_cache, v_cache = _random_fp8(shape, seed + 1), _random_fp8(shape, seed + 2)
    k_res = _random_fp8((n_res_pages, page_size, n_kv, head_dim), seed + 3)
    v_res = _random_fp8((n_res_pages, page_size, n_kv, head_dim), seed + 6)
    slots = _perm(n_pages * page_size, seed + 4)[:n_tokens].to(torch.int32)
    res_slots = _perm(n_res_pages * page_size, seed + 5)[:n_tokens].long()
    res_slots[torch.arange(n_tokens, device=DEVICE) % 3 == 1] = -1  # a third of the tokens: no residual
    return k, v, k_cache, v_cache, slots, k_res, v_res, res_slots


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_store_residual_matches_ref(in_dtype, page_size):
    k, v, k_cache, v_cache, slots, k_res, v_res, res_slots = _store_case(19, page_size, 2, 64, in_dtype,
                                                                         7 + page_size)
    if page_size == 1:
        res_slots = res_slots.int()
    outs = [t.clone() for t in (k_cache, v_cache, k_res, v_res)]
    refs = [t.clone() for t in (k_cache, v_cache, k_res, v_res)]
    store_kv(k, v, *outs[:2], slots, K_SCALE, V_SCALE, k_res=outs[2], v_res=outs[3], res_slots=res_slots)
    store_kv_ref(k, v, *refs[:2], slots, K_SCALE, V_SCALE, k_res=refs[2], v_res=refs[3], res_slots=res_slots)
    for name, out, ref in zip(("k_cache", "v_cache", "k_res", "v_res"), outs, refs):
        assert_equal(out, ref, name)

    # the main bytes are what store_kv writes without a residual
    plain_k, plain_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, plain_k, plain_v, slots, K_SCALE, V_SCALE)
    assert_equal(outs[0], plain_k, "k_cache without residual")
    assert_equal(outs[1], plain_v, "v_cache without residual")

    # residual slots not named by res_slots keep their bytes; the named ones changed (random old bytes)
    named = torch.zeros(k_res.shape[0] * page_size, dtype=torch.bool, device=DEVICE)
    named[res_slots[res_slots >= 0].long()] = True
    assert (~named).any() and named.any()
    for name, before, after in (("k_res", k_res, outs[2]), ("v_res", v_res, outs[3])):
        flat_before, flat_after = before.view(torch.uint8).flatten(0, 1), after.view(torch.uint8).flatten(0, 1)
        assert_equal(flat_after[~named], flat_before[~named], f"{name} slots not named")
        assert not torch.equal(flat_after[named], flat_before[named])


def test_store_residual_all_minus_one_writes_nothing():
    k, v, k_cache, v_cache, slots, k_res, v_res, res_slots = _store_case(5, 4, 2, 16, torch.float32, 17)
    before = k_res.clone(), v_res.clone()
    store_kv(k, v, k_cache, v_cache, slots, K_SCALE, V_SCALE, k_res=k_res, v_res=v_res,
             res_slots=torch.full_like(res_slots, -1))
    assert_equal(k_res, before[0], "k_res")
    assert_equal(v_res, before[1], "v_res")


@pytest.mark.parametrize("scale", [0.05, 0.3])
def test_residual_reconstruction_precision(scale):
    # x / scale stays inside +-448 (std 60 / 10); the residual adds ~4 significant bits to e4m3's 4
    n_tokens, n_kv, head_dim, page_size = 32, 2, 64, 16
    x = randn((2, n_tokens, n_kv, head_dim), 200, device=DEVICE) * 3.0
    assert float(x.abs().max()) / scale < 448
    shape = (n_tokens // page_size, page_size, n_kv, head_dim)
    k_cache, v_cache = _random_fp8(shape, 201), _random_fp8(shape, 202)
    k_res, v_res = _random_fp8(shape, 203), _random_fp8(shape, 204)
    slots = torch.arange(n_tokens, dtype=torch.int32, device=DEVICE)
    store_kv(x[0], x[1], k_cache, v_cache, slots, scale, scale, k_res=k_res, v_res=v_res, res_slots=slots.flip(0))
    for exact, cache, res in ((x[0], k_cache, k_res), (x[1], v_cache, v_res)):
        m = cache.flatten(0, 1).float()
        r = res.flatten(0, 1).flip(0).float()
        main_err = rel_error(m * scale, exact)
        res_err = rel_error((m + r / RES_SCALE) * scale, exact)
        assert res_err < 5e-3, f"main + residual: relative error {res_err:.2e}"
        assert main_err > 1e-2, f"main alone: relative error {main_err:.2e}"
        assert res_err < main_err / 20, (res_err, main_err)


# ------------------------------------------------------------------------------------------ attention


def make_res_case(seq_lens, page_size, n_heads, n_kv, head_dim, q_dtype, seed=0, res_fraction=0.5):
    """q, FP8 caches written by store_kv_ref from randn K/V, a block table and residual pages.

    A ``res_fraction`` of the physical pages get a residual page (a shuffled id in ``k_res``/``v_res``,
    one spare page never referenced), the others -1. Returns ``(case, res, res_table, kv_exact)`` where
    ``case`` is ``(q, k_cache, v_cache, block_table, seq_lens)``, ``res = {"k_res", "v_res"}`` and
    ``kv_exact`` the unquantized K and V per slot.
    """
    max_pages = max(-(-n // page_size) for n in seq_lens) + 1
    n_pages = len(seq_lens) * max_pages + 1
    n_with = max(1, round(res_fraction * n_pages))
    shape = (n_pages, page_size, n_kv, head_dim)
    k_cache, v_cache = torch.empty(shape, dtype=FP8, device=DEVICE), torch.empty(shape, dtype=FP8, device=DEVICE)
    res = {"k_res": _random_fp8((n_with + 1, page_size, n_kv, head_dim), seed + 1),
           "v_res": _random_fp8((n_with + 1, page_size, n_kv, head_dim), seed + 7)}
    res_of_page = torch.full((n_pages,), -1, dtype=torch.int64, device=DEVICE)
    res_of_page[_perm(n_pages, seed + 2)[:n_with]] = _perm(n_with + 1, seed + 3)[:n_with]
    kv = randn((2, n_pages * page_size, n_kv, head_dim), seed + 4, device=DEVICE)
    slots = torch.arange(n_pages * page_size, device=DEVICE)
    res_pages = res_of_page[slots // page_size]
    res_slots = torch.where(res_pages >= 0, res_pages * page_size + slots % page_size, -1)
    store_kv_ref(kv[0], kv[1], k_cache, v_cache, slots, K_SCALE, V_SCALE, **res, res_slots=res_slots)
    ids = _perm(n_pages - 1, seed + 5)[: len(seq_lens) * max_pages] + 1
    block_table = ids.view(len(seq_lens), max_pages).to(torch.int32)
    res_table = res_of_page[block_table.long()].to(torch.int32)
    q = randn((len(seq_lens), n_heads, head_dim), seed + 6, q_dtype, DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return (q, k_cache, v_cache, block_table, lens), res, res_table, kv.view(2, *shape)


def _check(case, res, res_table, sm_scale, name, res_max_tokens=None, **launch):
    """Kernel vs reference (res may hold res_bounds too); extra keywords go to the explicit launcher."""
    q = case[0]
    if launch:
        out = launch_paged_decode(*case, sm_scale, K_SCALE, V_SCALE, **res, res_table=res_table,
                            res_max_tokens=res_max_tokens, **launch)
    else:
        out = paged_decode_attention(*case, sm_scale, K_SCALE, V_SCALE, **res, res_table=res_table)
    ref = paged_decode_attention_ref(*case, sm_scale, K_SCALE, V_SCALE, **res, res_table=res_table)
    assert out.dtype == q.dtype and out.shape == q.shape
    err = assert_close(out, ref, TOL[q.dtype], name)
    # bf16's tolerance alone would pass a kernel that skipped the residual: it must be nearer the
    # residual reference than the plain FP8 one
    plain = paged_decode_attention_ref(*case, sm_scale, K_SCALE, V_SCALE)
    assert err < rel_error(out, plain) / 1.5, (name, err, rel_error(out, plain))
    return err


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_attention_residual_matches_ref(q_dtype, page_size):
    # GQA 8 over 2; lengths not multiples of the page size; about half the pages with a residual
    case, res, res_table, _ = make_res_case([1, 23, 45], page_size, 8, 2, 64, q_dtype, seed=300 + page_size)
    used = torch.cat([res_table[b, : -(-int(n) // page_size)] for b, n in enumerate(case[4])])
    assert (used >= 0).any() and (used < 0).any()
    _check(case, res, res_table, 64 ** -0.5, f"residual attention {q_dtype} page {page_size}")


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("n_splits", [1, 2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_attention_residual_every_mode_and_split(q_dtype, n_splits, mode):
    case, res, res_table, _ = make_res_case([1, 17, 70], 16, 8, 2, 32, q_dtype, seed=310 + mode)
    _check(case, res, res_table, 32 ** -0.5, f"residual mode {mode} {q_dtype} x{n_splits}",
           n_splits=n_splits, mode=mode, block_n=32)


@pytest.mark.parametrize("exact_max", [False, True])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_attention_residual_bounds(q_dtype, n_splits, mode, exact_max):
    """res_bounds (a, c): residuals only before a and from c on; the plain launch over the middle and
    the residual programs over the joined ends partition the sequence (also when c < a, and a or c
    past the end); res_max_tokens just large enough (32, the last request's sink) or None."""
    case, res, res_table, _ = make_res_case([1, 40, 70, 95], 16, 8, 2, 32, q_dtype, seed=330 + mode,
                                            res_fraction=1.0)
    bounds = torch.tensor([[16, 0], [16, 32], [0, 48], [32, 200]], dtype=torch.int32, device=DEVICE)
    full = paged_decode_attention_ref(*case, 32 ** -0.5, K_SCALE, V_SCALE, **res, res_table=res_table)
    bounded = paged_decode_attention_ref(*case, 32 ** -0.5, K_SCALE, V_SCALE, **res, res_table=res_table,
                                         res_bounds=bounds)
    assert rel_error(bounded[1:], full[1:]) > 1e-3  # the bounds drop residuals the table names
    assert_close(bounded[:1], full[:1], 0.0, "one token, inside the sink")
    lens = case[4].long()
    needed = int((bounds[:, 0] + (lens - torch.maximum(bounds[:, 0], bounds[:, 1])).clamp(min=0)).max())
    assert needed == 32
    extra = {"res_max_tokens": needed} if exact_max else {}
    _check(case, {**res, "res_bounds": bounds}, res_table, 32 ** -0.5,
           f"residual bounds mode {mode} {q_dtype} x{n_splits}", n_splits=n_splits, mode=mode, block_n=16, **extra)


def test_attention_residual_matters():
    case, res, res_table, (k_exact, v_exact) = make_res_case([30, 47], 16, 8, 2, 32, torch.float32, seed=320,
                                                             res_fraction=1.0)
    sm_scale = 32 ** -0.5
    ref_res = paged_decode_attention_ref(*case, sm_scale, K_SCALE, V_SCALE, **res, res_table=res_table)
    none = torch.full_like(res_table, -1)
    ref_none = paged_decode_attention_ref(*case, sm_scale, K_SCALE, V_SCALE, **res, res_table=none)
    assert rel_error(ref_none, ref_res) > 1e-2
    # without residual pages (or with all -1) the kernel gives the plain FP8 attention
    assert_close(paged_decode_attention(*case, sm_scale, K_SCALE, V_SCALE, **res, res_table=none),
                 ref_none, 1e-5, "residual attention, all -1")
    assert_close(paged_decode_attention_ref(*case, sm_scale, K_SCALE, V_SCALE), ref_none, 0.0, "no residual")
    # the residual brings the output much closer to the attention over the unquantized K and V
    q, _, _, block_table, seq_lens = case
    exact = paged_decode_attention_ref(q, k_exact, v_exact, block_table, seq_lens, sm_scale)
    err_res, err_none = rel_error(ref_res, exact), rel_error(ref_none, exact)
    assert err_res < err_none / 10, (err_res, err_none)


# ---------------------------------------------------------------------------------------- bad inputs


def _attention_args():
    case, res, res_table, _ = make_res_case([3, 5], 4, 4, 2, 16, torch.float32, seed=400)
    q, k_cache, v_cache, block_table, seq_lens = case
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                sm_scale=0.25, **res, res_table=res_table)


def _bf16_caches(a):
    a["k_cache"], a["v_cache"] = a["k_cache"].to(torch.bfloat16), a["v_cache"].to(torch.bfloat16)


@pytest.mark.parametrize("name,bad", [
    ("k_res", lambda a: a.update(k_res=None)),
    ("res_table", lambda a: a.update(res_table=None)),
    ("k_res", _bf16_caches),
    ("k_res", lambda a: a.update(k_res=a["k_res"].to(torch.bfloat16))),
    ("k_res", lambda a: a.update(k_res=a["k_res"][:, :2])),
    ("k_res", lambda a: a.update(k_res=a["k_res"][..., :8])),
    ("v_res", lambda a: a.update(v_res=None)),
    ("v_res", lambda a: a.update(v_res=a["v_res"][:1])),
    ("res_bounds", lambda a: a.update(res_bounds=torch.zeros(2, 2, dtype=torch.int64, device=DEVICE))),
    ("res_max_tokens", lambda a: a.update(res_max_tokens=0)),
    ("res_bounds", lambda a: a.update(res_bounds=torch.zeros(3, 2, dtype=torch.int32, device=DEVICE))),
    ("res_bounds", lambda a: a.update(k_res=None, v_res=None, res_table=None,
                                      res_bounds=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE))),
    ("res_table", lambda a: a.update(res_table=a["res_table"][:, :1])),
    ("res_table", lambda a: a.update(res_table=a["res_table"][:1])),
    ("res_table", lambda a: a.update(res_table=a["res_table"].long())),
    ("res_table", lambda a: a.update(res_table=a["res_table"].t().contiguous().t())),
])
def test_attention_rejects_bad_residual(name, bad):
    args = _attention_args()
    bad(args)
    for op in (paged_decode_attention, paged_decode_attention_ref):
        with pytest.raises(ValueError, match=name):
            op(**args)
    with pytest.raises(ValueError, match=name):
        launch_paged_decode(**{**args, "k_scale": K_SCALE, "v_scale": V_SCALE}, n_splits=2)


def _store_args():
    k, v, k_cache, v_cache, slots, k_res, v_res, res_slots = _store_case(3, 4, 2, 16, torch.float32, 410)
    return dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slots=slots, k_res=k_res, v_res=v_res,
                res_slots=res_slots)


@pytest.mark.parametrize("name,bad", [
    ("k_res", lambda a: a.update(k_res=None)),
    ("res_slots", lambda a: a.update(res_slots=None)),
    ("k_res", lambda a: a.update(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float())),
    ("k_res", lambda a: a.update(k_res=a["k_res"].to(torch.bfloat16))),
    ("k_res", lambda a: a.update(k_res=a["k_res"][:, :2])),
    ("k_res", lambda a: a.update(k_res=a["k_res"][0])),
    ("v_res", lambda a: a.update(v_res=None)),
    ("v_res", lambda a: a.update(v_res=a["v_res"].to(torch.bfloat16))),
    ("res_slots", lambda a: a.update(res_slots=a["res_slots"][:2])),
    ("res_slots", lambda a: a.update(res_slots=a["res_slots"].float())),
    ("res_slots", lambda a: a.update(res_slots=a["res_slots"][:, None])),
])
def test_store_rejects_bad_residual(name, bad):
    args = _store_args()
    bad(args)
    for op in (store_kv, store_kv_ref):
        with pytest.raises(ValueError, match=name):
            op(**args)


def test_res_scale():
    assert RES_SCALE == 16.0 and math.log2(RES_SCALE).is_integer()
