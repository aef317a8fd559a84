"""What ``paged_decode_attention`` accepts and computes: its argument checks (shared by the Triton
launcher in ``paged_attention.py`` and the reference) and its torch reference ``paged_decode_attention_ref``
(per request: gather, dequantize, softmax), the ground truth the kernel's tests compare with.
"""
import torch

from ._common import check_cache_pair, check_residual_pair
from .kv_store import RES_SCALE

Q_DTYPES = (torch.float32, torch.bfloat16)


def fail(name: str, why: str):
    raise ValueError(f"paged_decode_attention: {name} {why}")


def validate(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale):
    if q.dim() != 3 or q.dtype not in Q_DTYPES:
        fail("q", f"must be a 3-D [B, H, D] float32/bfloat16 tensor, got {tuple(q.shape)} {q.dtype}")
    if q.stride(2) != 1:
        fail("q", "must be contiguous along its last dimension")
    check_cache_pair(k_cache, v_cache, fail)
    n_batch, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        fail("k_cache", f"has head_dim {k_cache.shape[3]} but q has {head_dim}")
    if head_dim < 16:
        fail("q", f"head_dim must be >= 16, got {head_dim}")
    if n_heads % n_kv_heads != 0:
        fail("q", f"has {n_heads} heads, not a multiple of the cache's {n_kv_heads} KV heads")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != n_batch:
        fail("block_table", f"must be a 2-D int32 [B={n_batch}, max_pages] tensor, got "
                             f"{tuple(block_table.shape)} {block_table.dtype}")
    if block_table.stride(1) != 1:
        fail("block_table", "must be contiguous along its last dimension")
    if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64) or seq_lens.numel() != n_batch:
        fail("seq_lens", f"must be a 1-D int32/int64 tensor of {n_batch} lengths, got "
                          f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_table, seq_lens)}
    if len(devices) != 1:
        fail("tensors", f"must share one device, got {sorted(map(str, devices))}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (float(s) > 0.0 and float(s) < float("inf")):
            fail(name, f"must be a positive finite number, got {float(s)}")


def validate_res(q, k_cache, block_table, k_res, v_res, res_table, res_bounds=None, res_max_tokens=None) -> bool:
    """Check the optional KV residual arguments (after validate); True when they are given."""
    if not check_residual_pair(k_cache, k_res, v_res, "res_table", res_table, fail):
        if res_bounds is not None:
            fail("res_bounds", "needs k_res, v_res and res_table")
        return False
    if res_table.dtype != torch.int32 or res_table.shape != block_table.shape:
        fail("res_table", f"must be an int32 tensor shaped like block_table {tuple(block_table.shape)}, got "
                           f"{tuple(res_table.shape)} {res_table.dtype}")
    if res_table.stride(1) != 1:
        fail("res_table", "must be contiguous along its last dimension")
    if res_max_tokens is not None and not (isinstance(res_max_tokens, int) and res_max_tokens > 0):
        fail("res_max_tokens", f"must be a positive int, got {res_max_tokens!r}")
    if res_bounds is not None and (res_bounds.dtype != torch.int32 or res_bounds.shape != (block_table.shape[0], 2)
                                   or not res_bounds.is_contiguous()):
        fail("res_bounds", f"must be a contiguous int32 [{block_table.shape[0]}, 2] tensor, got "
                            f"{tuple(res_bounds.shape)} {res_bounds.dtype}")
    tensors = (q, k_res, v_res, res_table) + (() if res_bounds is None else (res_bounds,))
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        fail("k_res", f"v_res, res_table and res_bounds must be on q's device, got {sorted(map(str, devices))}")
    return True


def dequant_scales(cache, k_scale, v_scale) -> tuple[float, float]:
    """Scales apply to FP8 caches only (see store_kv)."""
    if cache.dtype == torch.float8_e4m3fn:
        return float(k_scale), float(v_scale)
    return 1.0, 1.0


def paged_decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, sm_scale,
                               k_scale=1.0, v_scale=1.0, k_res=None, v_res=None, res_table=None, res_bounds=None,
                               res_max_tokens=None):
    """Torch reference of :func:`paged_decode_attention`: per-request gather, dequantize, softmax."""
    validate(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale)
    has_res = validate_res(q, k_cache, block_table, k_res, v_res, res_table, res_bounds, res_max_tokens)
    n_batch, n_heads, head_dim = q.shape
    page_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    ks, vs = dequant_scales(k_cache, k_scale, v_scale)
    out = torch.zeros((n_batch, n_heads, head_dim), dtype=q.dtype, device=q.device)
    for b in range(n_batch):
        n = int(seq_lens[b])
        if n > block_table.shape[1] * page_size:
            fail("seq_lens", f"[{b}] = {n} exceeds max_pages * page_size = "
                              f"{block_table.shape[1] * page_size}")
        if n <= 0:
            continue
        pos = torch.arange(n, device=q.device)
        pages = block_table[b, pos // page_size].long()  # [n]
        k = k_cache[pages, pos % page_size].float()  # [n, Hkv, D]
        v = v_cache[pages, pos % page_size].float()
        if has_res:
            res_pages = res_table[b, pos // page_size].long()  # [n]
            has = res_pages >= 0
            if res_bounds is not None:
                has &= (pos < res_bounds[b, 0]) | (pos >= torch.maximum(res_bounds[b, 1], res_bounds[b, 0]))
            k[has] += k_res[res_pages[has], pos[has] % page_size].float() / RES_SCALE
            v[has] += v_res[res_pages[has], pos[has] % page_size].float() / RES_SCALE
        k, v = k * ks, v * vs
        k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)  # [n, H, D]
        v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * float(sm_scale)  # [H, n]
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out
