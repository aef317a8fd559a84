"""Weight containers (dense or INT4 per matrix) and seeded random weights for any `ModelConfig`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from faultlab.engine.choices import check_choice
from faultlab.engine.kernels.int4_gemm import GROUP_SIZES
from faultlab.engine.shapes import ModelConfig

WEIGHT_DTYPES = ("int4", "bf16", "fp32")
_DENSE = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """A W4A16 matrix W [N, K] in the layout of docs/structures.md (GGUF Q4_1 semantics).

    `W[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]`.
    """

    qweight: torch.Tensor  # uint8 [N, K // 2]: element 2j low nibble, 2j+1 high nibble of byte j
    scales: torch.Tensor  # float16 [N, K // G]
    mins: torch.Tensor  # float16 [N, K // G]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the matrix it stands for."""
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K] (the kernels' `dequantize_int4`)."""
        from faultlab.engine.kernels.int4_gemm import dequantize_int4

        return dequantize_int4(self.qweight, self.scales, self.mins, self.group_size)

    def to(self, device) -> "Int4Weight":
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.mins.to(device),
                          self.group_size)


Linear = Union[torch.Tensor, Int4Weight]


def concat_rows(parts: list[Linear]) -> Linear:
    """Stack matrices that share K along N ([N1, K] + [N2, K] -> [N1 + N2, K]); exact for INT4."""
    if all(isinstance(p, Int4Weight) for p in parts):
        sizes = {p.group_size for p in parts}
        assert len(sizes) == 1, f"mixed group sizes {sizes}"
        return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.mins for p in parts]), sizes.pop())
    assert not any(isinstance(p, Int4Weight) for p in parts), "cannot mix INT4 and dense rows"
    return torch.cat(parts)


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder block. Linear layers compute y = x @ W.T with W [out, in]."""

    attn_norm: torch.Tensor  # float32 [hidden]
    wq: Linear  # [n_heads * head_dim, hidden]
    wk: Linear  # [n_kv_heads * head_dim, hidden]
    wv: Linear  # [n_kv_heads * head_dim, hidden]
    wo: Linear  # [hidden, n_heads * head_dim]
    ffn_norm: torch.Tensor  # float32 [hidden]
    w_gate: Linear  # [ffn, hidden]
    w_up: Linear  # [ffn, hidden]
    w_down: Linear  # [hidden, ffn]


@dataclass(frozen=True, eq=False)
class ModelWeights:
    """All weights of a model; `output is embedding` when the config ties embeddings."""

    embedding: torch.Tensor  # dense [vocab, hidden] (float32 or bfloat16)
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # float32 [hidden]
    output: Linear  # [vocab, hidden]
    weight_dtype: str  # one of WEIGHT_DTYPES


def check_weight_args(weight_dtype: str, group_size: int = 32) -> None:
    """Raise ValueError on an unknown weight dtype or group size."""
    check_choice("weight_dtype", weight_dtype, WEIGHT_DTYPES)
    check_choice("group_size", group_size, GROUP_SIZES)


def dense_dtype_for(weight_dtype: str, device) -> torch.dtype:
    """Dtype of the dense tensors (embedding, tied head): fp32 on CPU, bf16 on an accelerator for int4."""
    if weight_dtype in _DENSE:
        return _DENSE[weight_dtype]
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


class _Sampler:
    """Seeded random matrices on one device, drawn in a fixed order."""

    def __init__(self, seed: int, device, weight_dtype: str, group_size: int):
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.device, self.weight_dtype, self.group_size = torch.device(device), weight_dtype, group_size

    def normal(self, shape, std: float, dtype=torch.float32) -> torch.Tensor:
        x = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (x * std).to(dtype)

    def norm(self, n: int) -> torch.Tensor:
        return 1.0 + self.normal((n,), 0.05)  # float32 [n], ~1

    def linear(self, n: int, k: int) -> Linear:
        """W [n, k] with std ~ 1/sqrt(k)."""
        std = k ** -0.5
        if self.weight_dtype != "int4":
            return self.normal((n, k), std, _DENSE[self.weight_dtype])
        return self.int4(n, k, std)

    def int4(self, n: int, k: int, std: float) -> Int4Weight:
        # NOTE: q is drawn directly as random bytes (two uniform nibbles), never as a float matrix:
        # uniform q in 0..15 has mean 7.5 and std ~4.61, so scale = std / 4.61 and min = -7.5 * scale
        # give W mean ~0 and std ~`std`. Fast for an 8B model on a GPU.
        g = self.group_size
        q = torch.randint(0, 256, (n, k // 2), generator=self.gen, device=self.device, dtype=torch.uint8)
        scale = (std / 4.61) * (1.0 + self.normal((n, k // g), 0.1)).clamp_min(0.5)
        mins = -7.5 * scale * (1.0 + self.normal((n, k // g), 0.02))
        return Int4Weight(q, scale.half(), mins.half(), g)


def _random_layer(s: _Sampler, c: ModelConfig) -> LayerWeights:
    return LayerWeights(
        attn_norm=s.norm(c.hidden), wq=s.linear(c.q_dim, c.hidden), wk=s.linear(c.kv_dim, c.hidden),
        wv=s.linear(c.kv_dim, c.hidden), wo=s.linear(c.hidden, c.q_dim), ffn_norm=s.norm(c.hidden),
        w_gate=s.linear(c.ffn, c.hidden), w_up=s.linear(c.ffn, c.hidden), w_down=s.linear(c.hidden, c.ffn))


def random_weights(config: ModelConfig, seed: int = 0, weight_dtype: str = "int4", group_size: int = 32,
                   device="cpu") -> ModelWeights:
    """Seeded random weights for `config`: linears with std ~1/sqrt(fan_in), norms ~1.

    `weight_dtype` "int4" draws INT4 codes/scales/mins directly; "bf16"/"fp32" draw dense matrices.
    The embedding is dense (std 1/sqrt(hidden), so tied logits are O(1)).
    """
    check_weight_args(weight_dtype, group_size)
    for k in (config.hidden, config.ffn, config.q_dim):
        if weight_dtype == "int4" and k % group_size:
            raise ValueError(f"group_size {group_size} must divide every in-feature size, not {k}")
    s = _Sampler(seed, device, weight_dtype, group_size)
    embedding = s.normal((config.vocab, config.hidden), config.hidden ** -0.5,
                         dense_dtype_for(weight_dtype, device))
    layers = tuple(_random_layer(s, config) for _ in range(config.n_layers))
    final_norm = s.norm(config.hidden)
    output = embedding if config.tie_embeddings else s.linear(config.vocab, config.hidden)
    return ModelWeights(embedding, layers, final_norm, output, weight_dtype)
