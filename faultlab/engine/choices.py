"""The engine's one choice validator: a value must be one of a setting's valid choices.

Every choice check of ``faultlab.engine`` (EngineConfig's fields, KV dtypes and backends, weight dtypes and
INT4 group sizes, model presets) goes through :func:`check_choice`, so each message names the setting, the
value and what is allowed, the same way. (The kernels' launchers validate their own arguments: they import
nothing from faultlab.)
"""
from __future__ import annotations

from typing import Iterable


def check_choice(where: str, value, valid: Iterable, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming ``where``, ``value`` and ``valid`` unless ``value`` is one of ``valid``."""
    valid = list(valid)
    if value not in valid:
        raise error(f"{where} = {value!r} is not valid; choose one of {valid}")
