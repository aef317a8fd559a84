# temporary tuning script (deleted after use)
import itertools, sys, torch, triton, triton.language as tl, triton.testing
from kvguard.kernels.int4_gemm import quantize_int4, int4_linear_ref, _int4_gemm_kernel
from kvguard.kernels.paged_attention import paged_decode_attention_ref, _paged_decode_reduce_kernel, _auto_splits
from kvguard.kernels.testing import rel_error


def tm(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=[0.5, 0.2, 0.8])[0]


@triton.jit
def _int4_v(x_ptr, qweight_ptr, scales_ptr, mins_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_mn,
            stride_ym, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SUM: tl.constexpr, BCAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rows < M
    n_mask = cols < N
    half_k = K // 2
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    HG: tl.constexpr = GROUP_SIZE // 2
    NG: tl.constexpr = BLOCK_K // GROUP_SIZE
    for j0 in range(0, half_k, BLOCK_K // 2):
        j = j0 + tl.arange(0, BLOCK_K // 2)
        w_mask = (j[:, None] < half_k) & n_mask[None, :]
        packed = tl.load(qweight_ptr + cols[None, :] * stride_qn + j[:, None], mask=w_mask, other=0)
        if BCAST:
            g = j0 // HG + tl.arange(0, NG)
            gm = (g[:, None] < half_k // HG) & n_mask[None, :]
            s = tl.load(scales_ptr + cols[None, :] * stride_sn + g[:, None], mask=gm, other=0.0).to(tl.float32)
            mn = tl.load(mins_ptr + cols[None, :] * stride_mn + g[:, None], mask=gm, other=0.0).to(tl.float32)
            lo = tl.reshape((packed & 0xF).to(tl.float32), [NG, HG, BLOCK_N])
            hi = tl.reshape((packed >> 4).to(tl.float32), [NG, HG, BLOCK_N])
            w_even = tl.reshape(lo * s[:, None, :] + mn[:, None, :], [BLOCK_K // 2, BLOCK_N])
            w_odd = tl.reshape(hi * s[:, None, :] + mn[:, None, :], [BLOCK_K // 2, BLOCK_N])
        else:
            group = j // HG
            s = tl.load(scales_ptr + cols[None, :] * stride_sn + group[:, None], mask=w_mask, other=0.0).to(tl.float32)
            mn = tl.load(mins_ptr + cols[None, :] * stride_mn + group[:, None], mask=w_mask, other=0.0).to(tl.float32)
            w_even = (packed & 0xF).to(tl.float32) * s + mn
            w_odd = (packed >> 4).to(tl.float32) * s + mn
        x_mask = m_mask[:, None] & (j[None, :] < half_k)
        x_even = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * j[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * j[None, :] + 1, mask=x_mask, other=0.0)
        if SUM:
            w_even = w_even.to(x_ptr.dtype.element_ty).to(tl.float32)
            w_odd = w_odd.to(x_ptr.dtype.element_ty).to(tl.float32)
            prod = x_even.to(tl.float32)[:, :, None] * w_even[None, :, :] + x_odd.to(tl.float32)[:, :, None] * w_odd[None, :, :]
            acc += tl.sum(prod, axis=1)
        else:
            acc = tl.dot(x_even, w_even.to(x_ptr.dtype.element_ty), acc)
            acc = tl.dot(x_odd, w_odd.to(x_ptr.dtype.element_ty), acc)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def run_int4(x, qw, s, mn, G, bm, bn, bk, warps, stages, SUM=False, BCAST=False):
    m, k = x.shape
    n = qw.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int4_v[grid](x, qw, s, mn, y, m, n, k, x.stride(0), qw.stride(0), s.stride(0), mn.stride(0), y.stride(0),
                  GROUP_SIZE=G, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SUM=SUM, BCAST=BCAST,
                  num_warps=warps, num_stages=stages)
    return y


def int4_sweep():
    for (n, k), G in [((14336, 4096), 32), ((14336, 4096), 128), ((4096, 4096), 32)]:
        w = torch.randn((n, k), device="cuda") * 0.02
        qw, s, mn = quantize_int4(w, G)
        wb = (qw.numel() + 4 * s.numel())
        for m in ((1, 64) if n > 4096 else (1,)):
            x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
            ref = int4_linear_ref(x, qw, s, mn, G)
            res = []
            bms = [16] if m <= 16 else [16, 64]
            sums = [False, True] if m <= 8 else [False]
            for SUM, BCAST, bm, bn, bk, warps, stages in itertools.product(sums, [False, True], bms, [32, 64, 128], [256, 512], [4, 8], [3, 4]):
                if SUM and (bn > 64 or bk > 256 or stages > 3):
                    continue
                bmx = triton.next_power_of_2(m) if SUM else bm
                if SUM and bm != bms[0]:
                    continue
                try:
                    y = run_int4(x, qw, s, mn, G, bmx, bn, bk, warps, stages, SUM, BCAST)
                    err = rel_error(y, ref)
                    t = tm(lambda: run_int4(x, qw, s, mn, G, bmx, bn, bk, warps, stages, SUM, BCAST))
                except Exception as e:  # noqa
                    print("fail", SUM, BCAST, bmx, bn, bk, warps, stages, type(e).__name__, str(e)[:100])
                    continue
                res.append((t, SUM, BCAST, bmx, bn, bk, warps, stages, err))
            res.sort()
            print(f"int4 N={n} K={k} G={G} M={m}: weights {wb/1e6:.1f} MB", flush=True)
            for r in res[:6]:
                print(f"   {r[0]*1e3:7.1f} us {wb / r[0] / 1e6:7.0f} GB/s SUM={r[1]} BCAST={r[2]} BM={r[3]} BN={r[4]} BK={r[5]} w={r[6]} st={r[7]} err={r[8]:.1e}")
            base = [r for r in res if not r[1] and not r[2] and r[3] == bms[0] and r[4] == (32 if m <= 16 else 64) and r[5] == 256 and r[6] == 4 and r[7] == 3]
            if base:
                print(f"   current-config {base[0][0]*1e3:7.1f} us")


@triton.jit
def _attn_v(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, lse_ptr,
            qk_scale, v_scale, head_dim, page_size, split_tokens, n_splits,
            stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            SPLIT: tl.constexpr, F16: tl.constexpr, KTRANS: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    h_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if F16:
        q = q.to(tl.float16)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * split_tokens
    end = tl.minimum(seq_len, start + split_tokens)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for tok0 in range(start, end, BLOCK_N):
        tok = tok0 + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        page = tl.load(block_table_ptr + b * stride_bt + tok // page_size, mask=t_mask, other=0).to(tl.int64)
        offset = tok % page_size
        k_rows = page * stride_kp + offset * stride_ks + kv_head * stride_kh
        v_rows = page * stride_vp + offset * stride_vs + kv_head * stride_vh
        if KTRANS:
            k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
            k_t = tl.trans(k.to(q.dtype))
        else:
            k_t = tl.load(k_cache_ptr + k_rows[None, :] + d[:, None], mask=t_mask[None, :] & d_mask[:, None], other=0.0).to(q.dtype)
        scores = tl.dot(q, k_t) * qk_scale
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
        m_i = m_new
    has = l_i > 0
    o = acc * v_scale / tl.where(has, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    if SPLIT:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


def run_attn(q, kc, vc, bt, sl, sm, ks, vs, bn, warps, stages, F16, KTRANS, splits):
    B, H, D = q.shape
    ps, Hkv = kc.shape[1], kc.shape[2]
    group = H // Hkv
    out = torch.empty_like(q)
    max_tokens = bt.shape[1] * ps
    split_tokens = triton.cdiv(triton.cdiv(max_tokens, splits), bn) * bn
    splits = triton.cdiv(max_tokens, split_tokens)
    if splits > 1:
        part = torch.empty((B, H, splits, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
        target, strides = part, (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    else:
        lse = out
        target, strides = out, (out.stride(0), out.stride(1), 0, 0, 0)
    _attn_v[(B, Hkv, splits)](q, kc, vc, bt, sl, target, lse, sm * ks, vs, D, ps, split_tokens, splits,
                              q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
                              vc.stride(0), vc.stride(1), vc.stride(2), bt.stride(0), *strides,
                              GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=bn, BLOCK_D=D,
                              SPLIT=splits > 1, F16=F16, KTRANS=KTRANS, num_warps=warps, num_stages=stages)
    if splits > 1:
        _paged_decode_reduce_kernel[(B, H)](part, lse, out, H, D, splits, out.stride(0), out.stride(1),
                                            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=D)
    return out


def attn_sweep():
    H, Hkv, D, ps, ctx = 32, 8, 128, 16, 8192
    for B in (64, 8, 1):
        for cdt in (torch.bfloat16, torch.float8_e4m3fn):
            npg = B * ctx // ps + 1
            kc = torch.randn((npg, ps, Hkv, D), device="cuda").to(cdt)
            vc = torch.randn((npg, ps, Hkv, D), device="cuda").to(cdt)
            bt = (torch.randperm(npg - 1, device="cuda") + 1).view(B, -1).int()
            sl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn((B, H, D), device="cuda", dtype=torch.bfloat16)
            ref = paged_decode_attention_ref(q, kc, vc, bt, sl, D ** -0.5, 0.5, 0.5)
            nbytes = 2 * kc[0].numel() * kc.element_size() * (npg - 1)
            auto = _auto_splits(q, Hkv, ctx)
            res = []
            f16s = [False, True] if cdt != torch.bfloat16 else [False]
            for F16, KT, bn, warps, stages, splits in itertools.product(f16s, [False, True], [32, 64, 128], [4, 8], [3], sorted({auto, max(1, auto // 2), auto * 2}) if B < 64 else [1]):
                try:
                    o = run_attn(q, kc, vc, bt, sl, D ** -0.5, 0.5, 0.5, bn, warps, stages, F16, KT, splits)
                    err = rel_error(o, ref)
                    t = tm(lambda: run_attn(q, kc, vc, bt, sl, D ** -0.5, 0.5, 0.5, bn, warps, stages, F16, KT, splits))
                except Exception as e:  # noqa
                    print("fail", F16, KT, bn, warps, stages, splits, type(e).__name__, str(e)[:100])
                    continue
                res.append((t, F16, KT, bn, warps, stages, splits, err))
            res.sort()
            print(f"attn B={B} {cdt} auto_splits={auto}: {nbytes/1e6:.0f} MB", flush=True)
            for r in res[:6]:
                print(f"   {r[0]*1e3:7.1f} us {nbytes / r[0] / 1e6:7.0f} GB/s F16={r[1]} KT={r[2]} BN={r[3]} w={r[4]} st={r[5]} splits={r[6]} err={r[7]:.1e}")
            base = [r for r in res if not r[1] and not r[2] and r[3] == 64 and r[4] == 4 and r[5] == 3 and r[6] == auto]
            if base:
                print(f"   current-config {base[0][0]*1e3:7.1f} us")


if __name__ == "__main__":
    which = sys.argv[1:] or ["int4", "attn"]
    if "int4" in which:
        int4_sweep()
    if "attn" in which:
        attn_sweep()
