"""Model presets by name (`get_preset`); the shape type itself is `faultlab.engine.shapes.ModelConfig`."""
from __future__ import annotations

from typing import Callable

from faultlab.engine.choices import check_choice
from faultlab.engine.shapes import ModelConfig

__all__ = ["ModelConfig", "PRESETS", "get_preset"]


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
    check_choice("model preset", name, sorted(PRESETS))
    return PRESETS[name]()
