"""The KV cache's torch backend: store and decode attention as batched torch ops, bit-equal to the kernels'
references (``store_kv_ref``, ``paged_decode_attention_ref``), plus the FP8 byte helpers they share.

``PagedKVCache`` (kvcache.py) calls these on ``backend="torch"`` and the Triton kernels on ``"triton"``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels.kv_store import FP8_MAX, RES_SCALE as RESIDUAL_SCALE  # written once, beside the kernel


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """What decode attention needs from (block_table, seq_lens, rows), computed once per step."""

    pages: torch.Tensor | None  # long [B, np]: pages of each row's live tokens, scratch 0 past them (torch)
    mask: torch.Tensor | None  # bool [B, 1, 1, np * page_size]: token j of row b is live (torch)
    res_table: torch.Tensor | None = None  # int32 [B, P]: residual page per logical page, -1 = none
    res_bounds: torch.Tensor | None = None  # int32 [B, 2]: only tokens < [:, 0] or >= [:, 1] have one


def decode_plan(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> DecodePlan:
    """Cut block_table [B, P] to the longest row; entries past a row's own length become scratch 0."""
    n_pages = -(-int(seq_lens.max()) // page_size)
    pages = block_table[:, :n_pages].long()  # [B, np]
    live = torch.arange(n_pages, device=pages.device) < (seq_lens[:, None] + page_size - 1) // page_size
    tokens = torch.arange(n_pages * page_size, device=pages.device) < seq_lens[:, None]  # [B, n]
    return DecodePlan(torch.where(live, pages, 0), tokens[:, None, None, :])


def fp8_table(scale: float, device) -> torch.Tensor:
    """float32 [256]: the value of every e4m3 byte times `scale`."""
    codes = torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return codes.float() * scale


def raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The tensor to index: FP8 caches as their uint8 bytes (index/index_put lack fp8 on some devices)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def dequantize(x: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """Cache contents (FP8 as fp8 or as its uint8 bytes) -> float32; FP8 is `x.float() * scale`
    through `table = fp8_table(scale)`."""
    if x.dtype not in (torch.float8_e4m3fn, torch.uint8):
        return x.float()
    # NOTE: looking every byte up in a 256-entry table gives the same bits as `x.float() * scale`
    # (NaN included) and is ~2.5x faster on a CPU than torch's fp8 cast.
    return torch.take(table, x.view(torch.uint8).long())


def with_residual(x: torch.Tensor, res: torch.Tensor, res_pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x float32 [..., page_size, Hkv, D] plus the residual of res_pages [...] (long, -1 = none: plus 0),
    dequantized through `table` (fp8_table(scale / RESIDUAL_SCALE))."""
    values = dequantize(raw_bytes(res)[res_pages.clamp_min(0)], table)
    return x + torch.where((res_pages >= 0).view(*res_pages.shape, 1, 1, 1), values, 0.0)


def attend(q, k_cache, v_cache, plan: DecodePlan, k_table, v_table, sm_scale: float,
            residual: tuple | None = None) -> torch.Tensor:
    """`residual`: (k_res, v_res, k_res_table, v_res_table) when plan.res_table is set."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    k = dequantize(raw_bytes(k_cache)[plan.pages], k_table)  # [B, np, ps, Hkv, D]
    v = dequantize(raw_bytes(v_cache)[plan.pages], v_table)
    if plan.res_table is not None:
        k_res, v_res, k_res_table, v_res_table = residual
        res_pages = plan.res_table[:, :plan.pages.shape[1]].long()  # [B, np]
        k = with_residual(k, k_res, res_pages, k_res_table)
        v = with_residual(v, v_res, res_pages, v_res_table)
    k = k.flatten(1, 2).transpose(1, 2)  # [B, Hkv, n, D]
    v = v.flatten(1, 2).transpose(1, 2)
    qh = q.float().reshape(b, hkv, h // hkv, d)  # [B, Hkv, G, D]: head i uses KV head i // G
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=plan.mask, scale=sm_scale)
    return out.reshape(b, h, d).to(q.dtype)


def batched_decode_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale, k_scale=1.0, v_scale=1.0):
    """`paged_decode_attention_ref`'s math (gather, dequantize, masked softmax), whole batch at once.

    q [B, H, D], caches [pages, page_size, Hkv, D], block_table int32 [B, P], seq_lens [B] >= 1
    -> out [B, H, D] in q's dtype. Reads exactly the pages the reference reads.
    """
    # NOTE: the reference loops over requests (a dozen small ops each); on a CPU that costs more than
    # the GEMMs at batch 16, so the torch backend pads to the longest row and masks instead.
    plan = decode_plan(block_table, seq_lens, k_cache.shape[1])
    return attend(q, k_cache, v_cache, plan, fp8_table(k_scale, q.device), fp8_table(v_scale, q.device),
                   sm_scale)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as the cache stores it (FP8 as uint8 bytes): `clamp(x / scale)` in e4m3, or a cast."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    x = x.float() if scale == 1.0 else x.float() / scale  # x / 1.0 == x: skip the division
    return x.clamp(-FP8_MAX, FP8_MAX).to(dtype).view(torch.uint8)


def store_kv_torch(k, v, k_cache, v_cache, slots, k_scale=1.0, v_scale=1.0, k_res=None, v_res=None,
                   res_slots=None) -> None:
    """`store_kv_ref`'s bits with one flat index_put per cache; k, v [T, Hkv, D], slots [T].

    With `k_res`/`v_res` (FP8 residual pages), tokens whose res_slots [T] is >= 0 also store their
    residual `e4m3((y - e4m3(y)) * RESIDUAL_SCALE)`, y = clamp(x / scale) (ResidualLayout).
    """
    for x, cache, scale, res in ((k, k_cache, k_scale, k_res), (v, v_cache, v_scale, v_res)):
        stored = quantize(x, cache.dtype, scale)
        raw_bytes(cache).view(-1, *cache.shape[2:])[slots] = stored  # [P * ps, Hkv, D]
        if res is not None:
            keep = res_slots >= 0
            y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
            residual = quantize((y - stored.view(torch.float8_e4m3fn).float()) * RESIDUAL_SCALE, res.dtype, 1.0)
            raw_bytes(res).view(-1, *res.shape[2:])[res_slots[keep]] = residual[keep]
