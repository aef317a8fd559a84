"""Typed settings, read in one place: ``TrackerConfig`` and the ``KVGUARD_*`` environment registry."""
import os
from dataclasses import dataclass, fields
from typing import Mapping

ENV_PREFIX = "KVGUARD_"
MODES = ("off", "check")
BACKENDS = ("auto", "triton", "torch")


class SettingsError(ValueError):
    """A setting (config field or KVGUARD_* variable) has a value we do not accept."""


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SettingsError(f"{name}={value!r} is not valid; choose one of {', '.join(choices)}")
    return value


def _flag(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={value!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


@dataclass(frozen=True)
class TrackerConfig:
    """How a deployment runs kvguard. ``mode="off"`` (the default) is the no-op tracker.

    Attributes:
        mode: ``off`` (NoopTracker, no device or host work) or ``check`` (TagTracker).
        backend: ``triton`` (the kernel), ``torch`` (the reference) or ``auto`` (triton on CUDA).
        quarantine: redirect failing entries to the scratch page before attention reads them.
        log_violations: emit one structlog event per violation.
    """

    mode: str = "off"
    backend: str = "auto"
    quarantine: bool = True
    log_violations: bool = True

    def __post_init__(self):
        _choice("mode", self.mode, MODES)
        _choice("backend", self.backend, BACKENDS)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "TrackerConfig":
        """Build from ``KVGUARD_MODE``, ``KVGUARD_BACKEND``, ``KVGUARD_QUARANTINE``, ``KVGUARD_LOG_VIOLATIONS``."""
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key in env:
                values[f.name] = _flag(key, env[key]) if f.type in (bool, "bool") else env[key].strip().lower()
        values.update(overrides)
        try:
            return cls(**values)
        except SettingsError as err:
            raise SettingsError(f"{err} (from the {ENV_PREFIX}* environment or config)") from None
