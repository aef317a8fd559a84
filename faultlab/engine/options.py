"""EngineConfig: every engine setting, its default and its valid choices, written once and checked here.

The choice tuples come from their owners (KV dtypes and backends: kvcache.py; weight dtypes: weights.py);
the CLI, scenarios and the pytest plugin read them from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from .choices import check_choice
from .kvcache import BACKENDS, KV_DTYPES, RESIDUAL_SINK, RESIDUAL_WINDOW
from .weights import WEIGHT_DTYPES

PAGE_SIZES = (1, 16, 64)
MEMORY_BACKENDS = ("native", "sglang")


class ConfigError(ValueError):
    """An engine setting is not valid; the message names the field and the valid choices."""


def _choice(field: str, value, valid) -> None:
    check_choice(f"engine.{field}", value, valid, ConfigError)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes a run. Each default is written here once (CLI and scenarios read it)."""

    model: str = "tiny"
    kv_dtype: str = "fp8"
    kv_rotate_k: bool = False  # Hadamard-rotated K in the decode cache (PagedKVCache.rotate_k)
    kv_residual: bool = False  # FP8 K/V at ~BF16 precision for each request's first/last tokens
    kv_residual_sink: int = RESIDUAL_SINK  # tokens at the start of each request that keep their KV residual
    kv_residual_window: int = RESIDUAL_WINDOW  # most recent tokens of each request that keep their KV residual
    weight_dtype: str = "int4"
    page_size: int = 16
    kv_budget_mb: float = 4.0  # KV memory; pages = budget / page bytes (FP8 fits ~2x BF16)
    num_pages: int = 0  # 0 = from kv_budget_mb
    max_running: int = 16
    max_context: int = 1024
    backend: str = "torch"  # torch (references) | triton (kernels; CPU needs TRITON_INTERPRET=1)
    memory: str = "native"  # native | sglang (SGLang 0.5.23's own bookkeeping classes)
    prefix_cache: bool = True
    batch_invariant: bool = True  # decode row by row, so outputs never depend on batch composition
    device: str = "cpu"
    cuda_graphs: bool = False  # decode steps replayed as CUDA graphs (device cuda, backend triton)
    seed: int = 0
    # -- phase split (faultlab/engine/phase_split.py): prefill on its own pool, KV transferred to decode
    phase_split: bool = False
    prefill_kv_dtype: str = "bf16"  # the prefill pool; the decode pool is kv_dtype
    prefill_weight_dtype: str = ""  # "" = weight_dtype
    transfer_lag: int = 1  # a transfer issued at step s lands at step s + transfer_lag

    def __post_init__(self):
        _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _choice("weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        _choice("page_size", self.page_size, PAGE_SIZES)
        _choice("memory", self.memory, MEMORY_BACKENDS)
        _choice("backend", self.backend, BACKENDS)
        if self.max_running < 1 or self.max_context < 2:
            raise ConfigError("engine.max_running must be >= 1 and engine.max_context >= 2")
        if self.num_pages < 0 or self.kv_budget_mb <= 0:
            raise ConfigError("engine.num_pages must be >= 0 and engine.kv_budget_mb > 0")
        _choice("prefill_kv_dtype", self.prefill_kv_dtype, KV_DTYPES)
        _choice("prefill_weight_dtype", self.prefill_weight_dtype, ("", *WEIGHT_DTYPES))
        if self.cuda_graphs and (not self.device.startswith("cuda") or self.backend != "triton"):
            raise ConfigError(f"engine.cuda_graphs needs device 'cuda' and backend 'triton', got device "
                              f"{self.device!r}, backend {self.backend!r}")
        if self.kv_residual and (self.kv_dtype != "fp8" or self.phase_split):
            raise ConfigError(f"engine.kv_residual needs kv_dtype 'fp8' and no phase_split, got kv_dtype "
                              f"{self.kv_dtype!r}, phase_split {self.phase_split}")
        if self.kv_residual_sink < 0 or self.kv_residual_window < 1:
            raise ConfigError(f"engine.kv_residual_sink must be >= 0 and engine.kv_residual_window >= 1, got "
                              f"{self.kv_residual_sink}, {self.kv_residual_window}")
        if self.transfer_lag < 1:
            raise ConfigError(f"engine.transfer_lag must be >= 1 (steps in flight), got {self.transfer_lag}")
