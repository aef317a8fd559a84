"""int4_linear (Triton W4A16) against its reference; INT4 packing, quantization and GGUF Q4_1 blocks."""
import os

import numpy as np
import pytest
import torch

from faultlab.engine.kernels.int4_gemm import (
    launch_int4_linear, dequantize_int4, int4_linear, int4_linear_ref, pack_int4, quantize_int4, unpack_int4,
)
from faultlab.engine.kernels.testing import assert_close, assert_equal, generator, randn

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _name(value):
    return str(value).removeprefix("torch.")


def _random_q(shape, seed):
    return torch.randint(0, 16, shape, generator=generator(seed), dtype=torch.uint8)


def _weights(n, k, group_size, seed):
    """Quantized random weights (rows with different spreads and offsets), on DEVICE."""
    w = randn((n, k), seed) * torch.linspace(0.02, 0.3, n)[:, None] + 0.01 * randn((n, 1), seed + 1)
    return tuple(t.to(DEVICE) for t in quantize_int4(w, group_size))


def test_pack_layout_low_nibble_first():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[0x21, 0x43], [0x0F, 0xF0]]


def test_pack_unpack_round_trip():
    q = _random_q((6, 96), 1)
    assert_equal(unpack_int4(pack_int4(q)), q, "unpack(pack(q))")
    packed = torch.randint(0, 256, (5, 40), generator=generator(2), dtype=torch.uint8)
    assert_equal(pack_int4(unpack_int4(packed)), packed, "pack(unpack(b))")


@pytest.mark.parametrize("group_size", [32, 128])
def test_quantize_dequantize_round_trip(group_size):
    n, k = 8, 256
    w = randn((n, k), 3) * torch.linspace(0.01, 2.0, n)[:, None] + 0.5 * randn((n, 1), 4)
    qweight, scales, mins = quantize_int4(w, group_size)
    assert qweight.shape == (n, k // 2) and qweight.dtype == torch.uint8
    assert scales.shape == mins.shape == (n, k // group_size)
    assert scales.dtype == mins.dtype == torch.float16
    w_dq = dequantize_int4(qweight, scales, mins, group_size)
    assert w_dq.dtype == torch.float32 and w_dq.shape == (n, k)
    # within half a step, plus what rounding scale and min to float16 can add
    step = scales.float().repeat_interleave(group_size, dim=1)
    slack = 16 * step * 2.0 ** -10 + mins.float().abs().repeat_interleave(group_size, dim=1) * 2.0 ** -10
    excess = (w - w_dq).abs() - (0.5 * step + slack + 1e-7)
    assert excess.max() <= 0, f"quantization error exceeds half a step by {excess.max():.3e}"
    # a dequantized weight is a fixed point: quantizing it again gives the same codes
    assert_equal(unpack_int4(quantize_int4(w_dq, group_size)[0]), unpack_int4(qweight), "requantized q")


def test_constant_group_quantizes_exactly():
    w = torch.full((2, 32), 0.75)
    qweight, scales, mins = quantize_int4(w, 32)
    assert_equal(dequantize_int4(qweight, scales, mins, 32), w, "constant group")


def _q4_1_blocks(n_blocks, seed):
    """Raw GGUF Q4_1 blocks: fp16 d, fp16 m, 16 bytes holding 32 nibbles (j low, j + 16 high)."""
    gen = generator(seed)
    d = (torch.rand(n_blocks, generator=gen) * 0.1 + 1e-3).to(torch.float16)
    m = (torch.randn(n_blocks, generator=gen) * 0.2).to(torch.float16)
    qs = torch.randint(0, 256, (n_blocks, 16), generator=gen, dtype=torch.uint8)
    raw = torch.cat([d.view(torch.uint8).view(n_blocks, 2), m.view(torch.uint8).view(n_blocks, 2), qs], dim=1)
    return raw, d, m, qs


def _ggml_dequantize_q4_1(raw):
    """GGUF Q4_1 semantics, written from the format (numpy float32): y = q * d + m."""
    raw = raw.numpy()
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = raw[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # [n, 32]
    return torch.from_numpy(q * d + m)


def test_gguf_q4_1_blocks_dequantize_exactly():
    n, k = 3, 64  # two Q4_1 blocks of 32 per row
    raw, d, m, qs = _q4_1_blocks(n * k // 32, 5)
    expected = _ggml_dequantize_q4_1(raw).reshape(n, k)
    # repack without re-quantization: GGUF's nibble order -> ours, d -> scales, m -> mins
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).reshape(n, k)
    qweight, scales, mins = pack_int4(q), d.view(n, k // 32), m.view(n, k // 32)
    w = dequantize_int4(qweight, scales, mins, 32)
    assert_equal(w, expected, "Q4_1 dequantized")
    d_k, m_k = (t.float().repeat_interleave(32, dim=1) for t in (scales, mins))  # [n, k]
    assert_equal(w, q.float() * d_k + m_k, "q*d+m")
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType
    theirs = gguf_quants.dequantize(raw.numpy().reshape(-1), GGMLQuantizationType.Q4_1)
    assert_equal(w, torch.from_numpy(np.asarray(theirs, dtype=np.float32)).reshape(n, k), "gguf.quants Q4_1")
    # and the kernel multiplies by exactly that matrix
    x = randn((3, k), 6, device=DEVICE)
    y = int4_linear(x, qweight.to(DEVICE), scales.to(DEVICE), mins.to(DEVICE), 32)
    assert_close(y, x.cpu() @ expected.T, 1e-5, "int4_linear on Q4_1 weights")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("group_size,k", [(32, 160), (128, 384)])  # K % BLOCK_K (256) != 0
@pytest.mark.parametrize("m", [1, 5])
def test_linear_matches_ref(m, group_size, k, dtype):
    n = 48  # not a multiple of BLOCK_N
    qweight, scales, mins = _weights(n, k, group_size, seed=k + m)
    x = randn((m, k), 10 + m, dtype, DEVICE)
    y = int4_linear(x, qweight, scales, mins, group_size)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_close(y, int4_linear_ref(x, qweight, scales, mins, group_size), TOL[dtype],
                 f"int4_linear M={m} G={group_size} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_prefill_tiles_and_strided_x(dtype):
    # M = 33 takes the prefill tiles; x is a column slice of a wider buffer (row stride > K)
    m, n, k, group_size = 33, 40, 96, 32
    qweight, scales, mins = _weights(n, k, group_size, seed=20)
    x = randn((m, k + 32), 21, dtype, DEVICE)[:, 16:16 + k]
    ref = int4_linear_ref(x, qweight, scales, mins, group_size)
    assert_close(int4_linear(x, qweight, scales, mins, group_size), ref, TOL[dtype], "int4_linear M=33")
    y = launch_int4_linear(x, qweight, scales, mins, group_size, block_m=16, block_n=16, block_k=64)
    assert_close(y, ref, TOL[dtype], "int4_linear M=33 small tiles")


def _valid_args():
    qweight, scales, mins = _weights(16, 64, 32, seed=30)
    return dict(x=randn((2, 64), 31, device=DEVICE), qweight=qweight, scales=scales, mins=mins, group_size=32)


@pytest.mark.parametrize("name,bad", [
    ("group_size", lambda a: 64),
    ("x", lambda a: a["x"].half()),
    ("x", lambda a: a["x"][0]),
    ("x", lambda a: a["x"].t().contiguous().t()),
    ("qweight", lambda a: a["qweight"][:, :16]),
    ("qweight", lambda a: a["qweight"].to(torch.int8)),
    ("scales", lambda a: a["scales"].float()),
    ("mins", lambda a: a["mins"][:8]),
])
def test_launcher_rejects_bad_arguments(name, bad):
    args = _valid_args()
    args[name] = bad(args)
    for op in (int4_linear, int4_linear_ref):
        with pytest.raises(ValueError, match=name):
            op(**args)


def test_k_not_multiple_of_group_rejected():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.ones(2, 48), 32)
    qweight, scales, mins = _weights(4, 64, 32, seed=40)
    with pytest.raises(ValueError, match="x"):
        int4_linear(randn((1, 48), 41, device=DEVICE), qweight[:, :24], scales, mins, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("group_size,n,k", [(32, 40, 96), (128, 24, 384), (128, 33, 640)])  # odd multiples of G
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_path_matches_ref(m, group_size, n, k, dtype):
    # the small-M CUDA-core path, whole K in one program and split over K (fp32 partials + a sum kernel)
    qweight, scales, mins = _weights(n, k, group_size, seed=50 + m + n)
    x = randn((m, k), 60 + m, dtype, DEVICE)
    ref = int4_linear_ref(x, qweight, scales, mins, group_size)
    y = int4_linear(x, qweight, scales, mins, group_size)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_close(y, ref, TOL[dtype], f"int4_linear M={m} N={n} K={k} G={group_size}")
    for split_k in (1, 3):
        y = launch_int4_linear(x, qweight, scales, mins, group_size, path="gemv", split_k=split_k, block_n=16)
        assert_close(y, ref, TOL[dtype], f"int4_linear gemv M={m} N={n} K={k} G={group_size} split {split_k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("m", [5, 33])
def test_dot_path_split_k(m, dtype):
    # the tl.dot path (forced for small M too) with K split over programs
    n, k, group_size = 40, 384, 128
    qweight, scales, mins = _weights(n, k, group_size, seed=70 + m)
    x = randn((m, k), 71 + m, dtype, DEVICE)
    ref = int4_linear_ref(x, qweight, scales, mins, group_size)
    y = launch_int4_linear(x, qweight, scales, mins, group_size, path="dot", split_k=3, block_k=128)
    assert_close(y, ref, TOL[dtype], f"int4_linear dot M={m} split 3")


def test_gemv_path_rejects_large_m():
    qweight, scales, mins = _weights(8, 64, 32, seed=80)
    with pytest.raises(ValueError, match="x"):
        launch_int4_linear(randn((17, 64), 81, device=DEVICE), qweight, scales, mins, 32, path="gemv")
