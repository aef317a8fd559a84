"""Model shapes: a frozen `ModelConfig` and a registry of presets by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of a Llama-style decoder."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    max_context: int
    bos_id: int
    eos_id: int

    def __post_init__(self) -> None:
        for field in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab", "max_context"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_dim(self) -> int:
        """Width of the query projection (n_heads * head_dim)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection (n_kv_heads * head_dim)."""
        return self.n_kv_heads * self.head_dim


def _tiny() -> ModelConfig:
    # NOTE: untied output on purpose, so the fast CPU tests cover the separate LM-head path
    # (smollm2 covers the tied one).
    return ModelConfig(name="tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
                       ffn=128, vocab=256, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=False,
                       max_context=1024, bos_id=1, eos_id=2)


def _llama3_8b() -> ModelConfig:
    return ModelConfig(name="llama3-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
                       head_dim=128, ffn=14336, vocab=128256, rope_theta=500000.0, rms_eps=1e-5,
                       tie_embeddings=False, max_context=16384, bos_id=128000, eos_id=128001)


def _smollm2() -> ModelConfig:
    from faultlab.engine.gguf_loader import smollm2_config  # lazy: reads the GGUF header

    return smollm2_config()


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": _tiny,
    "llama3-8b": _llama3_8b,
    "smollm2": _smollm2,
}


def get_preset(name: str) -> ModelConfig:
    """The `ModelConfig` registered as `name` (one of `PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}")
    return PRESETS[name]()
