"""``make_engine``: the one place that picks the engine class for a configuration.

- ``EngineConfig(phase_split=True)``: :class:`~faultlab.engine.phase_split.PhaseSplitEngine` (prefill on
  its own pool, KV transferred to the decode pool);
- ``tp=True`` (inside an initialised ``torch.distributed``): :class:`~faultlab.engine.tp.TPEngine`, this
  process's tensor-parallel rank (its keyword arguments, ``group`` and ``verify_schedule``, pass through);
- otherwise the plain :class:`~faultlab.engine.engine.Engine`.
"""
from __future__ import annotations

from .engine import ConfigError, Engine, EngineConfig


def make_engine(config: EngineConfig = EngineConfig(), tracker=None, observers=(), *, tp: bool = False,
                **tp_options):
    """Build the engine ``config`` asks for (see the module docstring)."""
    if tp:
        if config.phase_split:
            raise ConfigError("engine.phase_split is not supported with tensor parallelism")
        from .tp import TPEngine

        return TPEngine(config, tracker=tracker, observers=observers, **tp_options)
    if tp_options:
        raise ConfigError(f"tensor-parallel options {sorted(tp_options)} need tp=True")
    if config.phase_split:
        from .phase_split import PhaseSplitEngine

        return PhaseSplitEngine(config, tracker=tracker, observers=observers)
    return Engine(config, tracker=tracker, observers=observers)
