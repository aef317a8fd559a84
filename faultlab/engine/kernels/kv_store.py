"""Store new keys/values into the paged KV cache, quantizing to FP8 e4m3 or copying to BF16/FP32.

Token ``t`` goes to flat slot ``slots[t] = page * page_size + offset`` of both caches. FP8 caches hold
``clamp(x / scale, -448, 448)`` rounded to e4m3 (round to nearest even); other caches hold ``x`` cast
to the cache dtype (round to nearest even); the scales apply to FP8 caches only.

The stores are bit-exact with :func:`store_kv_ref` on GPUs and under ``TRITON_INTERPRET=1``. For that
the kernel rounds FP32 to e4m3 and to bf16 itself, with integer operations on the bits, and stores the
bits: the interpreter's float casts do not round to nearest even (bf16 truncates; e4m3 goes wrong when
rounding carries into the exponent), while the GPU casts do. Same bits either way.

Optional KV residual (FP8 caches only): with ``y = clamp(x / scale, -448, 448)`` and main byte ``m = e4m3(y)``,
a token whose ``res_slots[t] >= 0`` also gets the byte ``r = e4m3(clamp((y - m) * RES_SCALE, -448, 448))`` at that
flat slot of the separate FP8 tensors ``k_res`` (for K) and ``v_res`` (for V); ``(m + r / RES_SCALE) * scale``
reads the value back with about 4 more significant bits. The main bytes are the same with or without it.
"""
import torch
import triton
import triton.language as tl

from ._common import check_cache_pair, check_residual_pair

FP8_MAX = 448.0  # largest finite float8_e4m3fn
RES_SCALE = 16.0  # residual byte = e4m3((y - e4m3(y)) * RES_SCALE); read back as r / RES_SCALE
_RES_SCALE = tl.constexpr(RES_SCALE)
_FP8_MAX = tl.constexpr(FP8_MAX)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# cache kinds (constexpr OUT_KIND)
_OUT_F32, _OUT_BF16, _OUT_FP8 = 0, 1, 2


@triton.jit
def _f32_to_bf16_bits(x):
    """fp32 -> bf16 bits (int16), round to nearest even; NaN -> 0x7FC0 like torch."""
    u = x.to(tl.int32, bitcast=True)
    rounded = u + 0x7FFF + ((u >> 16) & 1)
    bits = tl.where(x != x, 0x7FC0, rounded >> 16)
    return bits.to(tl.int16)


@triton.jit
def _f32_to_e4m3_bits(y):
    """fp32 -> float8_e4m3fn bits (uint8), round to nearest even; |y| must be <= 448 or NaN."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # normal e4m3 (|y| >= 2**-6): drop 20 mantissa bits with RNE, rebias the exponent 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal e4m3: round |y| * 2**9 to an integer 0..8 (8 encodes 2**-6, the smallest normal)
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - (a >> 23), 30)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(a >= 0x3C800000, normal, sub)
    code = tl.where(y != y, 0x7F, code) | sign
    return code.to(tl.uint8)


@triton.jit
def _e4m3_bits_to_f32(code):
    """float8_e4m3fn bits (uint8) -> fp32, exact (NaN codes come out as NaN)."""
    c = code.to(tl.int32) & 0xFF
    e = (c >> 3) & 0xF
    man = c & 0x7
    normal = (((e + (127 - 7)) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2**-9
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def _clamp_fp8(y):
    """Saturate to [-FP8_MAX, FP8_MAX], keeping NaN."""
    return tl.where(y != y, y, tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX))


@triton.jit
def _load_f32(x_ptrs, mask, IN_BF16: tl.constexpr):
    """Load a tile as fp32; bf16 inputs arrive as int16 bits (exact widening, subnormals kept)."""
    if IN_BF16:
        bits = tl.load(x_ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_one(x_ptrs, c_ptrs, mask, scale, IN_BF16: tl.constexpr, OUT_KIND: tl.constexpr):
    """Convert one [BLOCK_H, BLOCK_D] tile of x and store it into the cache tile."""
    if OUT_KIND == 0:
        tl.store(c_ptrs, _load_f32(x_ptrs, mask, IN_BF16), mask=mask)
    elif OUT_KIND == 1:
        if IN_BF16:  # bf16 -> bf16: copy the bits
            tl.store(c_ptrs, tl.load(x_ptrs, mask=mask, other=0), mask=mask)
        else:
            tl.store(c_ptrs, _f32_to_bf16_bits(_load_f32(x_ptrs, mask, IN_BF16)), mask=mask)
    else:
        y = _clamp_fp8(tl.math.div_rn(_load_f32(x_ptrs, mask, IN_BF16), scale))
        tl.store(c_ptrs, _f32_to_e4m3_bits(y), mask=mask)


@triton.jit
def _store_with_res(x_ptrs, c_ptrs, r_ptrs, mask, r_mask, scale, IN_BF16: tl.constexpr):
    """FP8 K or V tile: the main bytes as _store_one writes them, plus the residual bytes where r_mask."""
    y = _clamp_fp8(tl.math.div_rn(_load_f32(x_ptrs, mask, IN_BF16), scale))
    m = _f32_to_e4m3_bits(y)
    tl.store(c_ptrs, m, mask=mask)
    r = _clamp_fp8((y - _e4m3_bits_to_f32(m)) * _RES_SCALE)  # both steps exact in fp32
    tl.store(r_ptrs, _f32_to_e4m3_bits(r), mask=r_mask)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_res_ptr, v_res_ptr, res_slots_ptr,
    k_scale, v_scale, n_heads, head_dim, page_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    stride_krp, stride_krs, stride_krh, stride_vrp, stride_vrs, stride_vrh,
    IN_BF16: tl.constexpr, OUT_KIND: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    # program (token t, block of heads); k, v: [T, Hkv, D]; caches: [P, page_size, Hkv, D]
    # HAS_RES (FP8 only): k_res, v_res [Pr, page_size, Hkv, D], res_slots [T] (flat residual slot or -1)
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads[:, None] < n_heads) & (d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    slot = tl.load(slots_ptr + t).to(tl.int64)
    page = slot // page_size
    offset = slot % page_size
    k_ptrs = k_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :]
    v_ptrs = v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :]
    kc_ptrs = k_cache_ptr + page * stride_kcp + offset * stride_kcs + heads[:, None] * stride_kch + d[None, :]
    vc_ptrs = v_cache_ptr + page * stride_vcp + offset * stride_vcs + heads[:, None] * stride_vch + d[None, :]
    if HAS_RES:
        res_slot = tl.load(res_slots_ptr + t).to(tl.int64)
        res_page = res_slot // page_size
        res_offset = res_slot % page_size
        kr_ptrs = k_res_ptr + res_page * stride_krp + res_offset * stride_krs + heads[:, None] * stride_krh + d[None, :]
        vr_ptrs = v_res_ptr + res_page * stride_vrp + res_offset * stride_vrs + heads[:, None] * stride_vrh + d[None, :]
        r_mask = mask & (res_slot >= 0)
        _store_with_res(k_ptrs, kc_ptrs, kr_ptrs, mask, r_mask, k_scale, IN_BF16)
        _store_with_res(v_ptrs, vc_ptrs, vr_ptrs, mask, r_mask, v_scale, IN_BF16)
    else:
        _store_one(k_ptrs, kc_ptrs, mask, k_scale, IN_BF16, OUT_KIND)
        _store_one(v_ptrs, vc_ptrs, mask, v_scale, IN_BF16, OUT_KIND)


def _fail(name: str, why: str):
    raise ValueError(f"store_kv: {name} {why}")


def _check_scale(name: str, scale) -> float:
    value = float(scale)
    if not (value > 0.0 and value < float("inf")):
        _fail(name, f"must be a positive finite number, got {value}")
    return value


def _validate(k, v, k_cache, v_cache, slots):
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.dtype not in INPUT_DTYPES:
            _fail(name, f"must be a 3-D [T, Hkv, D] float32/bfloat16/float16 tensor, got "
                        f"{tuple(t.shape)} {t.dtype}")
        if t.stride(2) != 1:
            _fail(name, "must be contiguous along its last dimension")
    if v.shape != k.shape or v.dtype != k.dtype:
        _fail("v", f"must match k ({tuple(k.shape)} {k.dtype}), got {tuple(v.shape)} {v.dtype}")
    check_cache_pair(k_cache, v_cache, _fail)
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        _fail("k_cache", f"has [Hkv, D] = {list(k_cache.shape[2:])} but k has {list(k.shape[1:])}")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64) or slots.numel() != k.shape[0]:
        _fail("slots", f"must be a 1-D int32/int64 tensor of {k.shape[0]} slots, got "
                       f"{tuple(slots.shape)} {slots.dtype}")
    devices = {t.device for t in (k, v, k_cache, v_cache, slots)}
    if len(devices) != 1:
        _fail("tensors", f"must share one device, got {sorted(map(str, devices))}")


def _validate_res(k, k_cache, k_res, v_res, res_slots) -> bool:
    """Check the optional KV residual arguments (after _validate); True when they are given."""
    if not check_residual_pair(k_cache, k_res, v_res, "res_slots", res_slots, _fail):
        return False
    if res_slots.dim() != 1 or res_slots.dtype not in (torch.int32, torch.int64) or res_slots.numel() != k.shape[0]:
        _fail("res_slots", f"must be a 1-D int32/int64 tensor of {k.shape[0]} slots (or -1), got "
                           f"{tuple(res_slots.shape)} {res_slots.dtype}")
    devices = {t.device for t in (k, k_res, res_slots)}
    if len(devices) != 1:
        _fail("k_res", f"and res_slots must be on k's device, got {sorted(map(str, devices))}")
    return True


def _cache_view(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cache as the kernel writes it (bits for bf16/fp8) and its OUT_KIND."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8), _OUT_FP8
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16), _OUT_BF16
    return cache, _OUT_F32


def store_kv(k, v, k_cache, v_cache, slots, k_scale=1.0, v_scale=1.0, k_res=None, v_res=None,
             res_slots=None) -> None:
    """Write ``k``/``v`` into ``k_cache``/``v_cache`` at ``slots`` (in place).

    Args:
        k, v: ``[T, Hkv, D]`` float32/bfloat16/float16.
        k_cache, v_cache: ``[P, page_size, Hkv, D]`` float32/bfloat16/float8_e4m3fn.
        slots: int32/int64 ``[T]``, flat slot ``page * page_size + offset`` of each token (unique).
        k_scale, v_scale: FP8 scales (``stored = clamp(x / scale, +-448)`` in e4m3); ignored otherwise.
        k_res, v_res: optional float8_e4m3fn ``[Pr, page_size, Hkv, D]`` K and V residual pages (FP8
            caches only).
        res_slots: int32/int64 ``[T]`` with them: flat residual slot ``res_page * page_size + offset``
            of each token, or -1 for none; gets ``e4m3(clamp((y - e4m3(y)) * RES_SCALE, +-448))``.
    """
    _validate(k, v, k_cache, v_cache, slots)
    has_res = _validate_res(k, k_cache, k_res, v_res, res_slots)
    k_scale, v_scale = _check_scale("k_scale", k_scale), _check_scale("v_scale", v_scale)
    n_tokens, n_heads, head_dim = k.shape
    if n_tokens == 0:
        return
    in_bf16 = k.dtype == torch.bfloat16
    k_in, v_in = (k.view(torch.int16), v.view(torch.int16)) if in_bf16 else (k, v)
    kc, out_kind = _cache_view(k_cache)
    vc, _ = _cache_view(v_cache)
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(n_heads), max(1, 1024 // block_d))
    grid = (n_tokens, triton.cdiv(n_heads, block_h))
    if has_res:
        kr, vr = k_res.view(torch.uint8), v_res.view(torch.uint8)
        res_args = (kr, vr, res_slots)
        res_strides = (kr.stride(0), kr.stride(1), kr.stride(2), vr.stride(0), vr.stride(1), vr.stride(2))
    else:
        res_args, res_strides = (kc, vc, slots), (0,) * 6  # not read
    _store_kv_kernel[grid](
        k_in, v_in, kc, vc, slots, *res_args,
        k_scale, v_scale, n_heads, head_dim, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), *res_strides,
        IN_BF16=in_bf16, OUT_KIND=out_kind, BLOCK_H=block_h, BLOCK_D=block_d, HAS_RES=has_res,
    )


def _quantize_ref(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    if cache_dtype == torch.float8_e4m3fn:
        scale32 = torch.tensor(scale, dtype=torch.float32, device=x.device)
        return (x.float() / scale32).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def store_kv_ref(k, v, k_cache, v_cache, slots, k_scale=1.0, v_scale=1.0, k_res=None, v_res=None,
                 res_slots=None) -> None:
    """Torch reference of :func:`store_kv` (same arguments, same bits, in place)."""
    _validate(k, v, k_cache, v_cache, slots)
    has_res = _validate_res(k, k_cache, k_res, v_res, res_slots)
    k_scale, v_scale = _check_scale("k_scale", k_scale), _check_scale("v_scale", v_scale)
    page_size = k_cache.shape[1]
    pages = torch.div(slots.long(), page_size, rounding_mode="floor")  # [T]
    offsets = slots.long() % page_size  # [T]
    k_cache[pages, offsets] = _quantize_ref(k, k_cache.dtype, k_scale)
    v_cache[pages, offsets] = _quantize_ref(v, v_cache.dtype, v_scale)
    if has_res:
        valid = res_slots >= 0
        res = res_slots[valid].long()
        for x, scale, res_cache in ((k, k_scale, k_res), (v, v_scale, v_res)):
            scale32 = torch.tensor(scale, dtype=torch.float32, device=x.device)
            y = (x.float() / scale32).clamp(-FP8_MAX, FP8_MAX)  # the values the main bytes round
            m = y.to(torch.float8_e4m3fn)
            r = ((y - m.float()) * RES_SCALE).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            res_cache[torch.div(res, page_size, rounding_mode="floor"), res % page_size] = r[valid]
