"""Pieces shared by the kernels: the fp32 ``tl.dot`` wrapper and the K/V cache-pair checks."""
import torch
import triton
import triton.language as tl

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


@triton.jit
def dot_f32(a, b, acc, UPCAST: tl.constexpr):
    """``a @ b (+ acc)`` in fp32; UPCAST widens bf16 operands first (exact), for the interpreter."""
    if UPCAST:  # TRITON_INTERPRET multiplies bf16 operands as raw integers
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc, input_precision="ieee")
    return c


def check_cache_pair(k_cache, v_cache, fail) -> None:
    """Both caches ``[P, page_size, Hkv, D]``, a supported dtype, contiguous in D, and alike.

    ``fail(name, why)`` raises the calling op's ValueError.
    """
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.dtype not in CACHE_DTYPES:
            fail(name, f"must be a 4-D [P, page_size, Hkv, D] float32/bfloat16/float8_e4m3fn tensor, "
                       f"got {tuple(c.shape)} {c.dtype}")
        if c.stride(3) != 1:
            fail(name, "must be contiguous along its last dimension")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        fail("v_cache", f"must match k_cache ({tuple(k_cache.shape)} {k_cache.dtype}), "
                        f"got {tuple(v_cache.shape)} {v_cache.dtype}")


def check_residual_pair(k_cache, k_res, v_res, partner_name: str, partner, fail) -> bool:
    """The optional residual pages k_res/v_res and the index tensor that comes with them (`partner`:
    res_slots or res_table): False when none is given; else all three given, the pages FP8 like the
    cache and shaped like its pages (True). Raises through `fail(name, why)`; the caller checks the
    partner's own shape and dtype."""
    if k_res is None and v_res is None and partner is None:
        return False
    if partner is None:
        fail(partner_name, "must be given together with k_res and v_res")
    for name, res in (("k_res", k_res), ("v_res", v_res)):
        if res is None:
            fail(name, f"must be given together with the other residual arguments ({partner_name})")
        if k_cache.dtype != torch.float8_e4m3fn:
            fail(name, f"needs a float8_e4m3fn cache, got {k_cache.dtype}")
        if res.dim() != 4 or res.dtype != torch.float8_e4m3fn or tuple(res.shape[1:]) != tuple(k_cache.shape[1:]):
            fail(name, f"must be a 4-D float8_e4m3fn [Pr, {', '.join(map(str, k_cache.shape[1:]))}] tensor, "
                       f"got {tuple(res.shape)} {res.dtype}")
        if res.stride(3) != 1:
            fail(name, "must be contiguous along its last dimension")
    if k_res.shape != v_res.shape or k_res.device != v_res.device:
        fail("v_res", f"must match k_res ({tuple(k_res.shape)} on {k_res.device}), got {tuple(v_res.shape)} "
                      f"on {v_res.device}")
    return True
