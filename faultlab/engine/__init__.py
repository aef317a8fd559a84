"""faultlab's engine: a paged, continuously batching LLM engine with kvguard wired in.

Model side: ``shapes`` (ModelConfig), ``config`` (presets), ``weights``, ``gguf_loader``, ``model``,
``tp`` (sharding). Serving side: ``options`` (EngineConfig), ``engine`` (the scheduler), ``kvcache``, ``memory``
(allocator, request rows), ``radix`` (prefix cache), ``requests``, ``cuda_graphs``, ``phase_split``,
``sglang_memory`` (``memory="sglang"``). Kernels: ``kernels``. Build engines with :func:`make_engine`.
"""
from .factory import make_engine

__all__ = ["make_engine"]
