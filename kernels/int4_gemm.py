"""W4A16 linear layer ``y = x @ W.T`` with INT4 weights, group-wise scale and min, dequantized in-kernel.

Layout (docs/structures.md): ``qweight: uint8 [N, K // 2]`` holds element ``2j`` of a row in the low
nibble of byte ``j`` and element ``2j + 1`` in the high nibble; ``scales, mins: float16 [N, K // G]``;
``W[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]`` (GGUF Q4_1 semantics), ``G`` in {32, 128}.

The kernel never interleaves nibbles: a tile of bytes gives the even columns of W (low nibbles) and
the odd columns (high nibbles), which multiply the even and odd columns of x in two ``tl.dot``s
accumulating in fp32. On bf16 x the dequantized tiles are rounded to bf16 for the dot; on fp32 x the
dot runs in IEEE fp32 (no TF32).
"""
import torch
import triton
import triton.language as tl

GROUP_SIZES = (32, 128)
X_DTYPES = (torch.float32, torch.bfloat16)
BLOCK_K = 256  # K elements (BLOCK_K // 2 bytes) per step


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``a @ b + acc`` in fp32; UPCAST widens bf16 operands first (exact), for the interpreter."""
    if UPCAST:  # TRITON_INTERPRET multiplies bf16 operands as raw integers
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc, input_precision="ieee")
    return c


@triton.jit
def _dequant(q, scale, w_min, N_GROUPS: tl.constexpr, HALF_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """q: [N_GROUPS * HALF_G, BLOCK_N] 4-bit codes; scale, w_min: [N_GROUPS, BLOCK_N] -> fp32 weights."""
    q = tl.reshape(q.to(tl.float32), [N_GROUPS, HALF_G, BLOCK_N])
    w = q * scale.to(tl.float32)[:, None, :] + w_min.to(tl.float32)[:, None, :]
    return tl.reshape(w, [N_GROUPS * HALF_G, BLOCK_N])


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, mins_ptr, y_ptr, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_mn, stride_ym,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # x: [M, K]; qweight: [N, K // 2] uint8; scales, mins: [N, K // G] fp16; y: [M, N]
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_mask = rows < M
    n_mask = cols < N
    half_k = K // 2
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    HALF_G: tl.constexpr = GROUP_SIZE // 2  # bytes per group
    N_GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE  # groups per step (BLOCK_K % GROUP_SIZE == 0)
    for j0 in range(0, half_k, BLOCK_K // 2):
        j = j0 + tl.arange(0, BLOCK_K // 2)  # byte index = K index // 2, [BLOCK_K // 2]
        w_mask = (j[:, None] < half_k) & n_mask[None, :]  # [BLOCK_K // 2, BLOCK_N]
        packed = tl.load(qweight_ptr + cols[None, :] * stride_qn + j[:, None], mask=w_mask, other=0)
        # one scale and min per (group, column), broadcast over the group's bytes
        g = j0 // HALF_G + tl.arange(0, N_GROUPS)  # [N_GROUPS]
        g_mask = (g[:, None] < half_k // HALF_G) & n_mask[None, :]
        scale = tl.load(scales_ptr + cols[None, :] * stride_sn + g[:, None], mask=g_mask, other=0.0)
        w_min = tl.load(mins_ptr + cols[None, :] * stride_mn + g[:, None], mask=g_mask, other=0.0)
        w_even = _dequant(packed & 0xF, scale, w_min, N_GROUPS, HALF_G, BLOCK_N)  # W[n, 2j].T
        w_odd = _dequant(packed >> 4, scale, w_min, N_GROUPS, HALF_G, BLOCK_N)  # W[n, 2j+1].T
        w_even = w_even.to(x_ptr.dtype.element_ty)
        w_odd = w_odd.to(x_ptr.dtype.element_ty)
        x_mask = m_mask[:, None] & (j[None, :] < half_k)  # [BLOCK_M, BLOCK_K // 2]
        x_even = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * j[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * j[None, :] + 1, mask=x_mask, other=0.0)
        acc = _dot(x_even, w_even, acc, UPCAST)
        acc = _dot(x_odd, w_odd, acc, UPCAST)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _fail(name: str, why: str):
    raise ValueError(f"int4_linear: {name} {why}")


def _validate(x, qweight, scales, mins, group_size):
    if group_size not in GROUP_SIZES:
        _fail("group_size", f"must be one of {GROUP_SIZES}, got {group_size}")
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        _fail("x", f"must be a 2-D [M, K] float32/bfloat16 tensor, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        _fail("x", "must be contiguous along its last dimension")
    k = x.shape[1]
    if k % group_size != 0:
        _fail("x", f"K = {k} is not a multiple of group_size {group_size}")
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or qweight.shape[1] * 2 != k:
        _fail("qweight", f"must be a 2-D uint8 [N, K // 2 = {k // 2}] tensor, got "
                         f"{tuple(qweight.shape)} {qweight.dtype}")
    n = qweight.shape[0]
    for name, t in (("scales", scales), ("mins", mins)):
        if t.dim() != 2 or t.dtype != torch.float16 or tuple(t.shape) != (n, k // group_size):
            _fail(name, f"must be a float16 [N, K // G] = {[n, k // group_size]} tensor, got "
                        f"{tuple(t.shape)} {t.dtype}")
    for name, t in (("qweight", qweight), ("scales", scales), ("mins", mins)):
        if t.stride(1) != 1:
            _fail(name, "must be contiguous along its last dimension")
    devices = {t.device for t in (x, qweight, scales, mins)}
    if len(devices) != 1:
        _fail("tensors", f"must share one device, got {sorted(map(str, devices))}")


def _blocks(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N), from a sweep on an H200 (bf16 x, N = 14336, K = 4096)."""
    if m <= 16:
        return 16, 64
    if m <= 64:
        return 16, 128
    return 64, 128


def _int4_linear(x, qweight, scales, mins, group_size, block_m=None, block_n=None, block_k=BLOCK_K):
    """:func:`int4_linear` with explicit tile sizes (``None``: chosen from M)."""
    _validate(x, qweight, scales, mins, group_size)
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    auto_m, auto_n = _blocks(m)
    block_m, block_n = block_m or auto_m, block_n or auto_n
    if block_k % group_size != 0:
        _fail("block_k", f"{block_k} must be a multiple of group_size {group_size}")
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x, qweight, scales, mins, y, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), mins.stride(0), y.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=not isinstance(_int4_gemm_kernel, triton.runtime.JITFunction), num_warps=8,
    )
    return y


def int4_linear(x, qweight, scales, mins, group_size):
    """``y = x @ W.T`` with ``W`` stored as INT4 (see module docstring for the layout).

    Args:
        x: ``[M, K]`` float32/bfloat16 (M = 1 for decode GEMV, larger for prefill).
        qweight: uint8 ``[N, K // 2]``, two 4-bit values per byte (even column in the low nibble).
        scales, mins: float16 ``[N, K // group_size]``.
        group_size: 32 or 128; ``K`` must be a multiple of it.
    Returns:
        ``[M, N]`` in ``x.dtype``, accumulated in fp32.
    """
    return _int4_linear(x, qweight, scales, mins, group_size)


def int4_linear_ref(x, qweight, scales, mins, group_size):
    """Torch reference of :func:`int4_linear`: ``x.float() @ dequantize_int4(...).T`` cast back."""
    _validate(x, qweight, scales, mins, group_size)
    return (x.float() @ dequantize_int4(qweight, scales, mins, group_size).T).to(x.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` values in 0..15 -> uint8 ``[N, K // 2]`` (column 2j low nibble, 2j+1 high)."""
    if q.dim() != 2 or q.dtype != torch.uint8 or q.shape[1] % 2 != 0:
        raise ValueError(f"pack_int4: q must be a 2-D uint8 [N, K] tensor with K even, got "
                         f"{tuple(q.shape)} {q.dtype}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"pack_int4: q values must be in 0..15, got max {int(q.max())}")
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K // 2]`` -> uint8 ``[N, K]`` in 0..15 (inverse of :func:`pack_int4`)."""
    if qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(f"unpack_int4: qweight must be a 2-D uint8 tensor, got "
                         f"{tuple(qweight.shape)} {qweight.dtype}")
    low, high = qweight & 0xF, qweight >> 4
    return torch.stack((low, high), dim=-1).reshape(qweight.shape[0], -1)


def dequantize_int4(qweight, scales, mins, group_size) -> torch.Tensor:
    """``W[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]`` as float32 ``[N, K]``."""
    q = unpack_int4(qweight).float()  # [N, K]
    if scales.shape != mins.shape or q.shape[1] != scales.shape[1] * group_size:
        raise ValueError(f"dequantize_int4: scales/mins {tuple(scales.shape)}/{tuple(mins.shape)} do not "
                         f"fit qweight {tuple(qweight.shape)} with group_size {group_size}")
    scale = scales.float().repeat_interleave(group_size, dim=1)  # [N, K]
    w_min = mins.float().repeat_interleave(group_size, dim=1)
    return q * scale + w_min


def quantize_int4(w: torch.Tensor, group_size: int):
    """Asymmetric 4-bit quantization per group of ``group_size`` along K.

    Args:
        w: ``[N, K]`` float weights, ``K`` a multiple of ``group_size`` (32 or 128).
    Returns:
        ``(qweight uint8 [N, K // 2], scales float16 [N, K // G], mins float16 [N, K // G])`` with
        ``min`` the group minimum and ``scale = (max - min) / 15``, both rounded to float16 before ``q``
        is computed, so that :func:`dequantize_int4` reproduces ``w`` to half a step.
    """
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantize_int4: group_size must be one of {GROUP_SIZES}, got {group_size}")
    if w.dim() != 2 or not w.dtype.is_floating_point or w.shape[1] % group_size != 0:
        raise ValueError(f"quantize_int4: w must be a 2-D float [N, K] tensor with K a multiple of "
                         f"{group_size}, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)  # [N, K // G, G]
    w_min = groups.amin(dim=-1).to(torch.float16)  # [N, K // G]
    scale = ((groups.amax(dim=-1) - w_min.float()) / 15.0).to(torch.float16)
    step = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = torch.round((groups - w_min.float()[..., None]) / step[..., None]).clamp(0, 15)
    return pack_int4(q.to(torch.uint8).reshape(n, k)), scale, w_min
