"""W4A16 linear layer ``y = x @ W.T`` with INT4 weights, group-wise scale and min, dequantized in-kernel.

Layout (docs/structures.md): ``qweight: uint8 [N, K // 2]`` holds element ``2j`` of a row in the low
nibble of byte ``j`` and element ``2j + 1`` in the high nibble; ``scales, mins: float16 [N, K // G]``;
``W[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]`` (GGUF Q4_1 semantics), ``G`` in {32, 128}.

The kernel never interleaves nibbles: a tile of bytes gives the even columns of W (low nibbles) and
the odd columns (high nibbles), which multiply the even and odd columns of x in two ``tl.dot``s
accumulating in fp32. On bf16 x the dequantized tiles are rounded to bf16 for the dot; on fp32 x the
dot runs in IEEE fp32 (no TF32). When the (M, N) tiles alone would leave SMs idle, K is split over
programs whose fp32 partial sums a second small kernel adds (no host sync: CUDA-graph capturable).

A CUDA-core GEMV path (``launch_int4_linear(..., path="gemv")``, M <= 16, no tl.dot) exists and is tested, but
it measured slower than the tl.dot path on an H200 (table in :func:`_blocks`), so it is not the default.
"""
import torch
import triton
import triton.language as tl

from ._common import dot_f32 as _dot

GROUP_SIZES = (32, 128)
X_DTYPES = (torch.float32, torch.bfloat16)
BLOCK_K = 256  # K elements (BLOCK_K // 2 bytes) per step


@triton.jit
def _code_to_float(q):
    """Small non-negative integer codes (< 2**23) -> exact fp32, by bits: ``float(2**23 | q) - 2**23``.

    Cheaper on the GPU than an int-to-float conversion (those issue at a quarter of the FMA rate).
    """
    return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dequant(q, scale, w_min, N_GROUPS: tl.constexpr, HALF_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """q: [N_GROUPS * HALF_G, BLOCK_N] 4-bit codes; scale, w_min: [N_GROUPS, BLOCK_N] -> fp32 weights."""
    q = tl.reshape(_code_to_float(q), [N_GROUPS, HALF_G, BLOCK_N])
    w = q * scale.to(tl.float32)[:, None, :] + w_min.to(tl.float32)[:, None, :]
    return tl.reshape(w, [N_GROUPS * HALF_G, BLOCK_N])


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, mins_ptr, y_ptr, M, N, K, k_split,
    stride_xm, stride_qn, stride_sn, stride_mn, stride_ym, stride_ys,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # x: [M, K]; qweight: [N, K // 2] uint8; scales, mins: [N, K // G] fp16
    # y: [M, N] (one split) or fp32 partial sums [n_splits, M, N] (stride_ys apart); split s covers
    # K in [s * k_split, (s + 1) * k_split), k_split a multiple of BLOCK_K
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    split = tl.program_id(2)
    m_mask = rows < M
    n_mask = cols < N
    half_k = K // 2
    j_start = split * (k_split // 2)
    j_end = tl.minimum(half_k, j_start + k_split // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    HALF_G: tl.constexpr = GROUP_SIZE // 2  # bytes per group
    N_GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE  # groups per step (BLOCK_K % GROUP_SIZE == 0)
    for j0 in range(j_start, j_end, BLOCK_K // 2):
        j = j0 + tl.arange(0, BLOCK_K // 2)  # byte index = K index // 2, [BLOCK_K // 2]
        w_mask = (j[:, None] < j_end) & n_mask[None, :]  # [BLOCK_K // 2, BLOCK_N]
        packed = tl.load(qweight_ptr + cols[None, :] * stride_qn + j[:, None], mask=w_mask, other=0)
        # one scale and min per (group, column), broadcast over the group's bytes
        g = j0 // HALF_G + tl.arange(0, N_GROUPS)  # [N_GROUPS]
        g_mask = (g[:, None] < j_end // HALF_G) & n_mask[None, :]
        scale = tl.load(scales_ptr + cols[None, :] * stride_sn + g[:, None], mask=g_mask, other=0.0)
        w_min = tl.load(mins_ptr + cols[None, :] * stride_mn + g[:, None], mask=g_mask, other=0.0)
        w_even = _dequant(packed & 0xF, scale, w_min, N_GROUPS, HALF_G, BLOCK_N)  # W[n, 2j].T
        w_odd = _dequant(packed >> 4, scale, w_min, N_GROUPS, HALF_G, BLOCK_N)  # W[n, 2j+1].T
        w_even = w_even.to(x_ptr.dtype.element_ty)
        w_odd = w_odd.to(x_ptr.dtype.element_ty)
        x_mask = m_mask[:, None] & (j[None, :] < j_end)  # [BLOCK_M, BLOCK_K // 2]
        x_even = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * j[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * j[None, :] + 1, mask=x_mask, other=0.0)
        acc = _dot(x_even, w_even, acc, UPCAST)
        acc = _dot(x_odd, w_odd, acc, UPCAST)
    y_ptrs = y_ptr + split * stride_ys + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_gemv_kernel(
    x_ptr, qweight_ptr, scales_ptr, mins_ptr, y_ptr, M, N, K, k_split,
    stride_xm, stride_qn, stride_sn, stride_mn, stride_ym, stride_ys,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Small-M path on CUDA cores (no tl.dot): one program per (BLOCK_N rows of W, split of K).

    The tile of bytes is held as [BLOCK_N, groups, bytes per group] so that a group's scale and min
    broadcast without reshapes; low nibbles (even K columns) multiply x[0::2] and high nibbles (odd K
    columns) x[1::2]. Products accumulate elementwise in fp32 registers over the program's K range and
    are reduced across threads once at the end (no shuffles in the loop).
    """
    HALF_G: tl.constexpr = GROUP_SIZE // 2  # bytes per group
    N_GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE  # groups per step
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    split = tl.program_id(1)
    n_mask = cols < N
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    half_k = K // 2
    j_start = split * (k_split // 2)
    j_end = tl.minimum(half_k, j_start + k_split // 2)
    grp = tl.arange(0, N_GROUPS)  # [N_GROUPS]
    byte = grp[:, None] * HALF_G + tl.arange(0, HALF_G)[None, :]  # [N_GROUPS, HALF_G] byte in the step
    pair = tl.arange(0, 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N, N_GROUPS, HALF_G], dtype=tl.float32)
    for j0 in range(j_start, j_end, BLOCK_K // 2):
        j = j0 + byte  # [N_GROUPS, HALF_G] byte index = K index // 2
        g = j0 // HALF_G + grp  # [N_GROUPS] group index
        g_mask = g < j_end // HALF_G  # whole groups: K and k_split are multiples of GROUP_SIZE
        w_mask = n_mask[:, None, None] & g_mask[None, :, None]
        packed = tl.load(qweight_ptr + cols[:, None, None] * stride_qn + j[None, :, :], mask=w_mask, other=0)
        packed = packed.to(tl.int32)  # [BLOCK_N, N_GROUPS, HALF_G]
        s_mask = n_mask[:, None] & g_mask[None, :]
        scale = tl.load(scales_ptr + cols[:, None] * stride_sn + g[None, :], mask=s_mask, other=0.0)
        w_min = tl.load(mins_ptr + cols[:, None] * stride_mn + g[None, :], mask=s_mask, other=0.0)
        scale = scale.to(tl.float32)[:, :, None]  # [BLOCK_N, N_GROUPS, 1]
        w_min = w_min.to(tl.float32)[:, :, None]
        w_even = _code_to_float(packed & 0xF) * scale + w_min  # W[n, 2j]
        w_odd = _code_to_float(packed >> 4) * scale + w_min  # W[n, 2j + 1]
        # x[2j] and x[2j + 1] in one contiguous (vectorizable) load, split in registers
        x_mask = m_mask[:, None, None, None] & g_mask[None, :, None, None]
        x_pair = tl.load(x_ptr + rows[:, None, None, None] * stride_xm + 2 * j[None, :, :, None]
                         + pair[None, None, None, :], mask=x_mask, other=0.0)  # [BLOCK_M, N_GROUPS, HALF_G, 2]
        x_even, x_odd = tl.split(x_pair.to(tl.float32))
        acc += w_even[None, :, :, :] * x_even[:, None, :, :] + w_odd[None, :, :, :] * x_odd[:, None, :, :]
    y = tl.sum(tl.sum(acc, axis=3), axis=2)  # [BLOCK_M, BLOCK_N]
    y_ptrs = y_ptr + split * stride_ys + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, total, n_splits, BLOCK: tl.constexpr):
    """y.flat[i] = sum_s part[s].flat[i] (fp32), cast to y's dtype; part: [n_splits, M, N] contiguous."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(n_splits):
        acc += tl.load(part_ptr + s * total + i, mask=mask, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=mask)


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


GEMV_MAX_M = 0  # M up to this takes the CUDA-core GEMV path by default (see _blocks: it measured slower)
TARGET_PROGRAMS = 1024  # split K until about this many programs (132 SMs, several programs each)


def _blocks(m: int, n: int) -> tuple[int, int, int, int, int | None]:
    """tl.dot path (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, split_k or None for auto), from an H200 run.

    Timed from CUDA graphs with L2 flushed, bf16 x, G = 128 (us; GEMV path = ``path="gemv"``):

    ========================  =====  ===============  ====================  ====  ========
    N x K, M                  bf16   16x64x256 w8      16x32x128 w4 split-K  GEMV  64x64x128
    ========================  =====  ===============  ====================  ====  ========
    4096 x 4096, M=1          16.8   31.0             17.5                  24.3
    14336 x 4096, M=1         38.0   46.3             49.7                  64.8
    4096 x 14336, M=1         39.8   103.9            47.5                  64.0
    128256 x 4096, M=1        257    314              334                   446
    14336 x 4096, M=8         38.1   57.3             76.0                  119
    4096 x 14336, M=8         40.0   142              66.8                  126
    14336 x 4096, M=64        39.6   269 (16x128)                                 151
    128256 x 4096, M=64       289    2014 (16x128)                                1226
    ========================  =====  ===============  ====================  ====  ========
    """
    if m <= 16:
        if n >= 8192:  # enough column tiles to fill the GPU without splitting K
            return 16, 64, 256, 8, 1
        return 16, 32, 128, 4, None
    if m <= 32:
        return 32, 64, 128, 4, None
    return 64, 64, 128, 8, None


def _gemv_blocks(m: int, k: int, group_size: int) -> tuple[int, int, int]:
    """GEMV path (BLOCK_N, BLOCK_K, num_warps): about 8 to 32 bytes of weights and 64 accumulators a thread."""
    if m <= 2:
        return 32, 256, 4
    if m <= 4:
        return 16, 256, 4
    if m <= 8:
        return 16, 128, 4
    return 8, 128, 4


def _n_splits(k: int, block_k: int, tiles: int, target: int) -> tuple[int, int]:
    """(K elements per split, number of splits) so that tiles * splits reaches about ``target``."""
    steps = triton.cdiv(k, block_k)
    want = max(1, min(steps, triton.cdiv(target, tiles)))
    k_split = triton.cdiv(steps, want) * block_k
    return k_split, triton.cdiv(k, k_split)


def launch_int4_linear(x, qweight, scales, mins, group_size, block_m=None, block_n=None, block_k=None,
                 split_k=None, num_warps=None, path=None, target_programs=TARGET_PROGRAMS):
    """:func:`int4_linear` with explicit tile sizes (``None``: chosen from M).

    ``path``: "gemv" (CUDA cores, M <= 16) or "dot" (tl.dot); ``split_k``: number of K splits (their
    fp32 partial sums are added by a second small kernel); both chosen from the shape when None.
    """
    _validate(x, qweight, scales, mins, group_size)
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if path is None:
        path = "gemv" if m <= GEMV_MAX_M else "dot"
    if path == "gemv":
        if m > 16:
            _fail("x", f"has M = {m} rows; the GEMV path takes at most 16")
        auto_n, auto_k, auto_warps = _gemv_blocks(m, k, group_size)
        block_m = triton.next_power_of_2(m)
    elif path == "dot":
        auto_m, auto_n, auto_k, auto_warps, auto_split = _blocks(m, n)
        block_m = block_m or auto_m
        if split_k is None and block_n is None and block_k is None:
            split_k = auto_split
    else:
        _fail("path", f"must be 'gemv' or 'dot', got {path!r}")
    block_n, block_k, num_warps = block_n or auto_n, block_k or auto_k, num_warps or auto_warps
    block_k = max(block_k, group_size)
    if block_k % group_size != 0:
        _fail("block_k", f"{block_k} must be a multiple of group_size {group_size}")
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:
        k_split, n_splits = _n_splits(k, block_k, tiles, target_programs if x.is_cuda else 1)
    else:
        k_split, n_splits = _n_splits(k, block_k, 1, split_k)
    target = y if n_splits == 1 else torch.empty((n_splits, m, n), dtype=torch.float32, device=x.device)
    stride_ys = 0 if n_splits == 1 else target.stride(0)
    args = (x, qweight, scales, mins, target, m, n, k, k_split,
            x.stride(0), qweight.stride(0), scales.stride(0), mins.stride(0), n, stride_ys)
    if path == "gemv":
        _int4_gemv_kernel[(triton.cdiv(n, block_n), n_splits)](
            *args, GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps,
        )
    else:
        _int4_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), n_splits)](
            *args, GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            UPCAST=not isinstance(_int4_gemm_kernel, triton.runtime.JITFunction), num_warps=num_warps,
        )
    if n_splits > 1:
        total = m * n
        _split_sum_kernel[(triton.cdiv(total, 512),)](target, y, total, n_splits, BLOCK=512)
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
    return launch_int4_linear(x, qweight, scales, mins, group_size)


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
