"""faultlab's engine: a paged, continuously batching LLM engine with kvguard wired in.

Model side: ``shapes`` (ModelConfig), ``config`` (presets), ``weights``, ``gguf_loader``, ``model``
(+ ``load_model``), ``tp`` (sharding). Serving side: ``options`` (EngineConfig), ``choices`` (the one
choice validator), ``context`` (StepContext, a forward's per-step state), ``engine`` (the scheduler),
``runner`` (runs the forwards), ``kvcache`` (+ ``residual``, ``kv_torch``), ``memory`` (allocator, request
rows), ``radix`` (prefix cache), ``requests``, ``cuda_graphs``, ``phase_split``, ``sglang_memory``
(``memory="sglang"``). Kernels: ``kernels``. Build engines with :func:`make_engine`.
"""
from .factory import make_engine

__all__ = ["make_engine"]
