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
