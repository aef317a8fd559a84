"""Model shapes: the frozen `ModelConfig` of a Llama-style decoder (no presets, no file reading).

It sits alone so that everything that builds or reads a model (weights, the GGUF reader, the model) can
import it without importing the preset registry (`config.py`), which itself reads the GGUF header for
`smollm2`: no import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass


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
