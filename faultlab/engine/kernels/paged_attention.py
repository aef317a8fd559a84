"""Paged decode attention with GQA, dequantizing FP8 K/V as it reads them.

One query token per request. Request ``b`` attends to its first ``seq_lens[b]`` tokens; token ``i`` lives
in slot ``i % page_size`` of page ``block_table[b, i // page_size]`` (page ids are used verbatim: the
tracker has sanitized the table before this runs). Query head ``h`` reads KV head ``h // (H // Hkv)``.

One program per (request, KV head, split) handles the ``H // Hkv`` query heads of its group, so each
K/V tile is read once per group. It walks its range of the sequence in blocks of ``BLOCK_N`` tokens,
gathering page ids per token (any page size), with an online softmax in fp32. When there are too few
(request, KV head) pairs to fill the GPU, the sequence is split across programs and a second small
kernel merges the partial results by their log-sum-exp (flash-decoding).

Optional KV residual (FP8 caches only, written by ``store_kv``): ``res_table[b, j] >= 0`` names the page of
``k_res`` and ``v_res`` holding logical page ``j``'s residual bytes, and those tokens read K as
``(k_cache + k_res / RES_SCALE) * k_scale`` and V likewise (about 4 more significant bits); -1 means no
residual. The sums are formed in fp32 before the cast to the dot dtype. ``res_bounds`` (a, c) says that
only a request's tokens before a and from c on can have one: the unchanged plain kernel then reads the
middle [a, c) (split as usual), and residual programs read the two ends joined, ``res_max_tokens`` at
most, in blocks; the partial results merge by log-sum-exp. A request whose residual covers only its
first and last pages pays for those pages only.

The launchers' argument checks and the torch reference ``paged_decode_attention_ref`` (re-exported here)
live in ``paged_attention_ref.py``.
"""
import torch
import triton
import triton.language as tl

from ._common import dot_f32 as _dot
from .kv_store import RES_SCALE
from .paged_attention_ref import Q_DTYPES, dequant_scales, fail, validate, validate_res  # noqa: F401
from .paged_attention_ref import paged_decode_attention_ref  # noqa: F401  (re-exported: the op's reference)

BLOCK_N = 64  # tokens per inner step
BLOCK_N_FP8 = 128  # tokens per inner step on FP8 caches when the sequence is not split
MIN_SPLIT_TOKENS = 256  # shortest stretch of sequence worth a program of its own
_INV_RES_SCALE = tl.constexpr(1.0 / RES_SCALE)


@triton.jit
def _add_res(x, r_ptrs, r_mask, dtype: tl.constexpr):
    """A K or V tile (already in the dot dtype) plus its residual, summed in fp32, back in `dtype`
    (masked-off tokens load nothing and add 0)."""
    res = tl.load(r_ptrs, mask=r_mask, other=0.0)
    return (x.to(tl.float32) + res.to(tl.float32) * _INV_RES_SCALE).to(dtype)


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, q_t, tok0, hi, b, kv_head, d, d_mask,
    k_cache_ptr, v_cache_ptr, block_table_ptr, k_res_ptr, v_res_ptr, res_table_ptr,
    qk_scale, page_size, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
    stride_krp, stride_krs, stride_krh, stride_vrp, stride_vrs, stride_vrh, stride_rt,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, MODE: tl.constexpr, RES: tl.constexpr,
):
    """One online-softmax step over tokens tok0 .. tok0 + BLOCK_N - 1 (those < hi): (acc, m_i, l_i).

    RES: add each token's residual where res_table names one (masked loads: none for the others).
    """
    tok = tok0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    t_mask = tok < hi
    page = tl.load(block_table_ptr + b * stride_bt + tok // page_size, mask=t_mask, other=0).to(tl.int64)
    offset = tok % page_size
    k_rows = page * stride_kp + offset * stride_ks + kv_head * stride_kh  # [BLOCK_N]
    v_rows = page * stride_vp + offset * stride_vs + kv_head * stride_vh
    if RES:
        res_page = tl.load(res_table_ptr + b * stride_rt + tok // page_size, mask=t_mask, other=-1).to(tl.int64)
        r_tok = t_mask & (res_page >= 0)  # tokens without a residual load nothing
        kr_rows = res_page * stride_krp + offset * stride_krs + kv_head * stride_krh
        vr_rows = res_page * stride_vrp + offset * stride_vrs + kv_head * stride_vrh
    if MODE == 0:
        k_t = tl.load(k_cache_ptr + k_rows[None, :] + d[:, None],
                      mask=t_mask[None, :] & d_mask[:, None], other=0.0).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        if RES:
            k_t = _add_res(k_t, k_res_ptr + kr_rows[None, :] + d[:, None], r_tok[None, :] & d_mask[:, None], q.dtype)
        scores = _dot(q, k_t, None, UPCAST) * qk_scale  # [BLOCK_H, BLOCK_N]
    elif MODE == 1:
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :],
                    mask=t_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        if RES:
            k = _add_res(k, k_res_ptr + kr_rows[:, None] + d[None, :], r_tok[:, None] & d_mask[None, :], q.dtype)
        scores = tl.trans(_dot(k, q_t, None, UPCAST)) * qk_scale  # [BLOCK_H, BLOCK_N]
    else:
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :],
                    mask=t_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        if RES:
            k = _add_res(k, k_res_ptr + kr_rows[:, None] + d[None, :], r_tok[:, None] & d_mask[None, :], tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale  # [BLOCK_H, BLOCK_N]
    scores = tl.where(t_mask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MODE == 1:
        v_t = tl.load(v_cache_ptr + v_rows[None, :] + d[:, None],
                      mask=t_mask[None, :] & d_mask[:, None], other=0.0).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        if RES:
            v_t = _add_res(v_t, v_res_ptr + vr_rows[None, :] + d[:, None], r_tok[None, :] & d_mask[:, None], q.dtype)
        acc = _dot(v_t, tl.trans(p.to(q.dtype)), acc * alpha[None, :], UPCAST)
    else:
        v_dtype = q.dtype if MODE == 0 else tl.float32
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :],
                    mask=t_mask[:, None] & d_mask[None, :], other=0.0).to(v_dtype)  # [BLOCK_N, BLOCK_D]
        if RES:
            v = _add_res(v, v_res_ptr + vr_rows[:, None] + d[None, :], r_tok[:, None] & d_mask[None, :], v_dtype)
        if MODE == 0:
            acc = _dot(p.to(q.dtype), v, acc * alpha[:, None], UPCAST)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return acc, m_new, l_i


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    k_res_ptr, v_res_ptr, res_table_ptr, res_bounds_ptr,
    q_scale, qk_scale, v_scale, head_dim, page_size, split_tokens, n_parts, slot0,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    stride_krp, stride_krs, stride_krh, stride_vrp, stride_vrs, stride_vrh, stride_rt,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP16_DOT: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, MODE: tl.constexpr,
    PART: tl.constexpr,
):
    # q: [B, H, D]; caches: [P, page_size, Hkv, D]; block_table: [B, max_pages]; seq_lens: [B]
    # PART 0: all tokens, no residual. With a KV residual, two launches split each request's tokens:
    #   PART 1 reads the middle [a, c) the plain way; PART 2 reads [0, a) and [c, seq_len) (joined, in
    #   programs of split_tokens tokens) adding residuals: k_res, v_res [Pr, page_size, Hkv, D] FP8, res_table
    #   [B, max_pages] residual page ids (-1: none), res_bounds [B, 2] int32 (a, c). Both write partials
    #   (split slot `slot0 + split`), merged with the reduce kernel.
    # out: [B, H, D] (SPLIT=False) or partial [B, H, n_parts, D] fp32 + lse [B, H, n_parts]
    # MODE 0: heads fill the MMA rows (padded to BLOCK_H >= 16): s = q @ K^T, acc += p @ V.
    # MODE 1: tokens fill the MMA rows: s^T = K @ q^T, acc^T += V^T @ p^T (acc kept transposed).
    # MODE 2: no tl.dot; the BLOCK_H (>= GROUP, any power of two) heads multiply-and-sum on CUDA cores.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_H)  # query head within the group (padded to BLOCK_H)
    heads = kv_head * GROUP + g  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)
    h_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    q = q.to(tl.float32) * q_scale
    if MODE == 2:
        pass  # fp32 on CUDA cores
    elif FP16_DOT:  # dot operands in fp16, else in q's dtype
        q = q.to(tl.float16)
    else:
        q = q.to(q_ptr.dtype.element_ty)
    q_t = q
    if MODE == 1:
        q_t = tl.trans(q)  # [BLOCK_D, BLOCK_H]
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * split_tokens
    end = tl.minimum(seq_len, start + split_tokens)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if MODE == 1:
        acc = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    lo, hi = start, end  # PART 0: the whole stretch, no residual
    if PART == 1:  # the middle [a, c) of the request, no residual
        sink_end = tl.load(res_bounds_ptr + 2 * b)
        win_lo = tl.maximum(tl.load(res_bounds_ptr + 2 * b + 1), sink_end)
        lo, hi = tl.maximum(start, sink_end), tl.minimum(end, win_lo)
    if PART == 2:  # [0, a) and [c, seq_len) with residuals, split like one sequence [0, a) + [c, seq_len)
        sink_end = tl.load(res_bounds_ptr + 2 * b)
        win_lo = tl.maximum(tl.load(res_bounds_ptr + 2 * b + 1), sink_end)
        v_lo = split * split_tokens  # this program's stretch of the joined sequence
        v_hi = v_lo + split_tokens
        sink_hi = tl.minimum(tl.minimum(v_hi, sink_end), seq_len)
        for tok0 in range(v_lo, sink_hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, q_t, tok0, sink_hi, b, kv_head, d, d_mask,
                k_cache_ptr, v_cache_ptr, block_table_ptr, k_res_ptr, v_res_ptr, res_table_ptr,
                qk_scale, page_size, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                stride_krp, stride_krs, stride_krh, stride_vrp, stride_vrs, stride_vrh, stride_rt,
                BLOCK_N, UPCAST, MODE, True)
        lo = win_lo + tl.maximum(v_lo, sink_end) - sink_end
        hi = tl.minimum(seq_len, win_lo + v_hi - sink_end)
    for tok0 in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, q_t, tok0, hi, b, kv_head, d, d_mask,
            k_cache_ptr, v_cache_ptr, block_table_ptr, k_res_ptr, v_res_ptr, res_table_ptr,
            qk_scale, page_size, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
            stride_krp, stride_krs, stride_krh, stride_vrp, stride_vrs, stride_vrh, stride_rt,
            BLOCK_N, UPCAST, MODE, PART == 2)
    has = l_i > 0
    inv_l = v_scale / tl.where(has, l_i, 1.0)
    if MODE == 1:
        o = acc * inv_l[None, :]  # [BLOCK_D, BLOCK_H]
        o_mask = h_mask[None, :] & d_mask[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[None, :] * stride_oh + (slot0 + split) * stride_os + d[:, None]
    else:
        o = acc * inv_l[:, None]
        o_mask = h_mask[:, None] & d_mask[None, :]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + (slot0 + split) * stride_os + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    if SPLIT:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + slot0 + split, lse, mask=h_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    part_ptr, lse_ptr, out_ptr, n_heads, head_dim, n_splits, stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # part: [B, H, n_splits, D] fp32; lse: [B, H, n_splits]; out: [B, H, D]
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = b * n_heads + h
    lse = tl.load(lse_ptr + row * n_splits + s, mask=s < n_splits, other=float("-inf"))  # [BLOCK_S]
    live = lse > float("-inf")
    top = tl.max(tl.where(live, lse, -3.0e38), axis=0)
    w = tl.where(live, tl.exp(lse - top), 0.0)  # [BLOCK_S]
    part = tl.load(part_ptr + (row * n_splits + s[:, None]) * head_dim + d[None, :],
                   mask=(s[:, None] < n_splits) & (d[None, :] < head_dim), other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, axis=0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def auto_splits(q, n_kv_heads: int, max_tokens: int) -> int:
    """Sequence splits of a launch: more than one when (request, KV head) pairs alone would leave most SMs
    idle (always 1 off CUDA)."""
    if q.device.type != "cuda":
        return 1
    n_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    programs = q.shape[0] * n_kv_heads
    if programs >= n_sms:
        return 1
    return max(1, min(triton.cdiv(2 * n_sms, programs), triton.cdiv(max_tokens, MIN_SPLIT_TOKENS)))


def _dot_setup(q, k_cache, sm_scale: float, k_scale: float):
    """(fp16 dots?, factor on q before the cast, factor on q . k after the dot).

    fp32 q: fp32 dots (IEEE). bf16 q: bf16 dots, except on FP8 caches, whose values convert to fp16
    exactly and faster: there q is pre-scaled by sm_scale (keeps it in fp16 range) and cast to fp16.
    """
    if q.dtype == torch.bfloat16 and k_cache.dtype == torch.float8_e4m3fn:
        return True, sm_scale, k_scale
    return False, 1.0, sm_scale * k_scale


def _choose(cache_dtype, group: int, n_splits: int) -> tuple[int, int, int, int]:
    """(MODE, BLOCK_N, num_warps, num_stages) from a sweep on an H200 (H=32, Hkv=8, D=128, context 8192).

    Timed from CUDA graphs with L2 flushed. FP8 K/V: tokens in the MMA rows (MODE 1) when the sequence is
    not split (batch 64: 504 vs 573 us); split (batch 1, 8): heads in the rows as before (19-21 us, 94 us).
    BF16: heads in the rows; 8 warps and 2 stages when split (batch 8: 91 vs 94 us, batch 1: 20 vs 22 us).
    MODE 2 (CUDA cores) measured 5-10x slower at these shapes (do_bench sweep) and is never chosen.
    """
    if group >= 16:
        return 0, (BLOCK_N_FP8 if cache_dtype == torch.float8_e4m3fn and n_splits == 1 else BLOCK_N), 4, 3
    if cache_dtype == torch.float8_e4m3fn:
        if n_splits == 1:
            return 1, 64, 4, 2
        return 0, 64, 4, 3
    if n_splits == 1:
        return 0, 64, 4, 3
    return 0, 64, 8, 2


def launch_paged_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale, k_scale, v_scale,
                  n_splits=None, block_n=None, mode=None, num_warps=None, num_stages=None,
                  k_res=None, v_res=None, res_table=None, res_bounds=None, res_max_tokens=None):
    """:func:`paged_decode_attention` with explicit launch settings (benches and tests tune them here).

    ``n_splits``: sequence splits (``None``: chosen from the GPU's size by :func:`auto_splits`).

    ``mode``: 0 (heads fill the MMA rows), 1 (tokens fill them) or 2 (CUDA cores, no tl.dot); it,
    ``block_n``, ``num_warps`` and ``num_stages`` are chosen from the cache dtype and GQA group when None.
    ``k_res``/``v_res``/``res_table``/``res_bounds``/``res_max_tokens``: optional KV residual (see
    :func:`paged_decode_attention`).
    """
    validate(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    has_res = validate_res(q, k_cache, block_table, k_res, v_res, res_table, res_bounds, res_max_tokens)
    n_batch, n_heads, head_dim = q.shape
    page_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    ks, vs = dequant_scales(k_cache, k_scale, v_scale)
    out = torch.empty((n_batch, n_heads, head_dim), dtype=q.dtype, device=q.device)
    if n_batch == 0:
        return out
    max_tokens = max(1, block_table.shape[1] * page_size)
    if n_splits is None:
        n_splits = auto_splits(q, n_kv_heads, max_tokens)
    auto_mode, auto_n, auto_warps, auto_stages = _choose(k_cache.dtype, group, n_splits)
    mode = auto_mode if mode is None else mode
    if mode not in (0, 1, 2):
        fail("mode", f"must be 0, 1 or 2, got {mode}")
    block_n = block_n or auto_n
    num_warps, num_stages = num_warps or auto_warps, num_stages or auto_stages
    split_tokens = triton.cdiv(triton.cdiv(max_tokens, n_splits), block_n) * block_n
    n_splits = triton.cdiv(max_tokens, split_tokens)
    block_d = triton.next_power_of_2(head_dim)
    block_h = triton.next_power_of_2(group)
    if mode != 2:
        block_h = max(16, block_h)  # tl.dot needs >= 16 rows
    # NOTE: with a KV residual the request's tokens go to two launches: the plain kernel over the middle
    # (split as usual) and a residual one over the first and last stretches (one more partial slot). A
    # single kernel running both kinds of loop measured 40-70% slower on its plain loop (H200).
    n_res = triton.cdiv(min(res_max_tokens or max_tokens, max_tokens), block_n) if has_res else 0
    n_parts = n_splits + n_res
    if n_parts > 1:
        part = torch.empty((n_batch, n_heads, n_parts, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((n_batch, n_heads, n_parts), dtype=torch.float32, device=q.device)
        target, strides = part, (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    else:
        lse = out  # not written
        target, strides = out, (out.stride(0), out.stride(1), 0, 0, 0)
    fp16_dot, q_scale, qk_scale = _dot_setup(q, k_cache, float(sm_scale), ks)
    if has_res:
        if res_bounds is None:  # every token may have a residual
            res_bounds = torch.zeros((n_batch, 2), dtype=torch.int32, device=q.device)
        res_args = (k_res, v_res, res_table, res_bounds)
        res_strides = (k_res.stride(0), k_res.stride(1), k_res.stride(2), v_res.stride(0), v_res.stride(1),
                       v_res.stride(2), res_table.stride(0))
    else:
        res_args, res_strides = (k_cache, v_cache, block_table, block_table), (0,) * 7  # not read

    def launch(n_programs, tokens_each, slot0, part_kind):
        _paged_decode_kernel[(n_batch, n_kv_heads, n_programs)](
            q, k_cache, v_cache, block_table, seq_lens, target, lse, *res_args,
            q_scale, qk_scale, vs, head_dim, page_size, tokens_each, n_parts, slot0,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), *strides, *res_strides,
            GROUP=group, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, FP16_DOT=fp16_dot, SPLIT=n_parts > 1,
            UPCAST=not isinstance(_paged_decode_kernel, triton.runtime.JITFunction), MODE=mode, PART=part_kind,
            num_warps=num_warps, num_stages=num_stages,
        )

    launch(n_splits, split_tokens, 0, 1 if has_res else 0)
    if has_res:
        launch(n_res, block_n, n_splits, 2)
    if n_parts > 1:
        _paged_decode_reduce_kernel[(n_batch, n_heads)](
            part, lse, out, n_heads, head_dim, n_parts, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(n_parts), BLOCK_D=block_d,
        )
    return out


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale, k_scale=1.0, v_scale=1.0,
                           k_res=None, v_res=None, res_table=None, res_bounds=None, res_max_tokens=None):
    """Decode attention of one query token per request over its paged K/V.

    Args:
        q: ``[B, H, D]`` float32/bfloat16 (``D >= 16``).
        k_cache, v_cache: ``[P, page_size, Hkv, D]`` float32/bfloat16/float8_e4m3fn, ``H % Hkv == 0``.
        block_table: int32 ``[B, max_pages]`` page ids, used verbatim.
        seq_lens: int32/int64 ``[B]``, ``1 <= seq_lens[b] <= max_pages * page_size`` (0 gives zeros).
        sm_scale: softmax scale applied to ``q . k``.
        k_scale, v_scale: FP8 dequantization scales (``read = stored * scale``); ignored otherwise.
        k_res, v_res: optional float8_e4m3fn ``[Pr, page_size, Hkv, D]`` K and V residual pages (FP8 caches only).
        res_table: int32 ``[B, max_pages]`` with them (block_table's shape): residual page id of each
            logical page, or -1 for none; K reads ``(k_cache + k_res / RES_SCALE) * k_scale`` there, V likewise.
        res_bounds: optional int32 ``[B, 2]`` with them, ``(a, c)`` per request: only its tokens ``< a`` or
            ``>= c`` read a residual (the kernel runs its plain loop over ``[a, c)``); None = every token.
        res_max_tokens: optional host int, at least ``a + max(0, seq_len - max(a, c))`` for every request: the
            residual stretches are spread over that many tokens' worth of programs (None: the table's
            width in tokens, always enough). A smaller value drops tokens: the caller must know it.
    Returns:
        ``[B, H, D]`` in ``q.dtype``; softmax and accumulation in fp32.
    """
    return launch_paged_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale, k_scale, v_scale,
                         k_res=k_res, v_res=v_res, res_table=res_table, res_bounds=res_bounds,
                         res_max_tokens=res_max_tokens)
