"""Typed settings, read in one place: ``TrackerConfig`` and the ``KVGUARD_*`` environment registry.

One normalisation for every string setting (:func:`_normalise`: surrounding blanks dropped, lower case),
applied by the dataclass itself, so ``TrackerConfig(mode="CHECK")`` and ``KVGUARD_MODE=CHECK`` agree.
Booleans: the dataclass takes only ``True``/``False``; the environment spells them 1/0, true/false,
yes/no or on/off (:data:`FLAG_WORDS`). An empty value is never accepted.
"""
import os
from dataclasses import dataclass, fields
from typing import Mapping

ENV_PREFIX = "KVGUARD_"
MODES = ("off", "check")
BACKENDS = ("auto", "triton", "torch")
CHOICES = {"mode": MODES, "backend": BACKENDS}  # the string fields of TrackerConfig and their choices
FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
              "off": False}
_FLAG_HELP = "use 1/0, true/false, yes/no or on/off"
HISTORY_MAX = 64  # events kept per page by the optional history ring (KVGUARD_HISTORY)


class SettingsError(ValueError):
    """A setting (config field or KVGUARD_* variable) has a value we do not accept."""


def _normalise(value: str) -> str:
    """The one normalisation of a string setting (config field or environment value)."""
    return value.strip().lower()


def _choice(name: str, value, choices: tuple[str, ...]) -> str:
    """``value`` normalised, if it is one of ``choices``; else SettingsError naming name, value, choices."""
    if not isinstance(value, str):
        raise SettingsError(f"{name}={value!r} is not a string; choose one of {', '.join(choices)}")
    normal = _normalise(value)
    if normal not in choices:
        what = "is empty" if not normal else "is not valid"
        raise SettingsError(f"{name}={value!r} {what}; choose one of {', '.join(choices)}")
    return normal


def _flag(name: str, value: str) -> bool:
    """An environment boolean (one of FLAG_WORDS, any case, blanks ignored)."""
    normal = _normalise(value)
    if normal not in FLAG_WORDS:
        what = "is empty, not a boolean" if not normal else "is not a boolean"
        raise SettingsError(f"{name}={value!r} {what}; {_FLAG_HELP}")
    return FLAG_WORDS[normal]


def _int(name: str, value: str, low: int, high: int) -> int:
    if not value.strip():
        raise SettingsError(f"{name}={value!r} is empty; give an integer in {low}..{high}")
    try:
        number = int(value.strip())
    except ValueError:
        number = None
    if number is None or not low <= number <= high:
        raise SettingsError(f"{name}={value!r} is not valid; give an integer in {low}..{high}")
    return number


def _is_bool_field(f) -> bool:
    return f.type in (bool, "bool")


@dataclass(frozen=True)
class TrackerConfig:
    """How a deployment runs kvguard. ``mode="off"`` (the default) is the no-op tracker.

    Attributes:
        mode: ``off`` (NoopTracker, no device or host work) or ``check`` (TagTracker); any case.
        backend: ``triton`` (the kernel), ``torch`` (the reference) or ``auto`` (triton on CUDA); any case.
        quarantine: redirect failing entries to the scratch page before attention reads them (a bool).
        log_violations: emit one structlog event per violation (a bool).
        incident_dir: a folder for incident records (one JSON line per flagged request, in
            ``incidents-<pid>.jsonl``); empty (the default): none are written.
        history: tag events kept per page for the incident records (0..HISTORY_MAX; 0, the default:
            no ring, nothing recorded on the hot path).
        graph: capture the decode check into SGLang's decode CUDA graphs, so a replay runs it without a launch
            from the host (a bool; ``False``: launched before each decode forward instead).

    Raises SettingsError for an unknown or empty choice, or a non-bool boolean (``"false"`` is a
    string, and a truthy one: it is rejected rather than read as True).
    """

    mode: str = "off"
    backend: str = "auto"
    quarantine: bool = True
    log_violations: bool = True
    incident_dir: str = ""
    history: int = 0
    graph: bool = True

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "incident_dir":
                if not isinstance(value, str):
                    raise SettingsError(f"incident_dir={value!r} is not a string; give a folder path or ''")
                object.__setattr__(self, f.name, value.strip())
            elif f.name == "history":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= HISTORY_MAX:
                    raise SettingsError(f"history={value!r} is not valid; give an int in 0..{HISTORY_MAX} "
                                        f"(events kept per page; 0: off)")
            elif f.name in CHOICES:
                object.__setattr__(self, f.name, _choice(f.name, value, CHOICES[f.name]))
            elif _is_bool_field(f) and not isinstance(value, bool):
                raise SettingsError(f"{f.name}={value!r} is not a bool; use True or False "
                                    f"(the {ENV_PREFIX}{f.name.upper()} variable: {_FLAG_HELP})")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "TrackerConfig":
        """Build from ``KVGUARD_MODE``, ``KVGUARD_BACKEND``, ``KVGUARD_QUARANTINE``, ``KVGUARD_LOG_VIOLATIONS``,
        ``KVGUARD_INCIDENT_DIR``, ``KVGUARD_HISTORY``, ``KVGUARD_GRAPH``.

        ``overrides`` (config values) win over the environment. Any bad variable raises SettingsError
        naming the variable, its value and what is allowed.
        """
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key not in env:  # a bad variable is an error even where an override wins
                continue
            if _is_bool_field(f):
                values[f.name] = _flag(key, env[key])
            elif f.name == "incident_dir":
                if not env[key].strip():
                    raise SettingsError(f"{key}={env[key]!r} is empty; give a folder for incident records, or "
                                        f"leave it unset")
                values[f.name] = env[key]
            elif f.name == "history":
                values[f.name] = _int(key, env[key], 0, HISTORY_MAX)
            else:  # checked here so that the message names the variable, not the field
                values[f.name] = _choice(key, env[key], CHOICES[f.name])
        values.update(overrides)
        return cls(**values)
