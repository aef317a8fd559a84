"""Scenarios: TOML files -> frozen, validated dataclasses.

A malformed file or an unknown name raises ``ScenarioError`` naming the field and the valid choices;
the CLI turns it into exit code 2 before anything is written. Defaults live in the dataclasses below
(and in ``EngineConfig``), written once.
"""
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from .engine.engine import ConfigError, EngineConfig
from .faults.catalog import FAULTS
from .faults.injector import EVENTS, TRIGGERS, Trigger


class ScenarioError(ValueError):
    """The scenario file is malformed; the message names the field at fault and how to mend it."""


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 10
    prompt_len: tuple[int, int] = (8, 40)
    output_len: tuple[int, int] = (6, 20)
    concurrency: int = 6
    shared_prefix_fraction: float = 0.5
    shared_prefix_len: int = 32
    arrival: str = "burst"  # burst | staggered
    arrivals_per_step: int = 2
    temperature: float = 0.0


@dataclass(frozen=True)
class FaultSpec:
    classes: tuple[str, ...] = ()
    seeds: int = 20
    first_seed: int = 0
    count: int = 1
    trigger: str = "step"
    step: tuple[int, int] = (2, 8)
    event: str = "alloc"
    p: float = 0.1

    def trigger_for(self, rng) -> Trigger:
        return Trigger(mode=self.trigger, step=rng.randint(*self.step), event=self.event, p=self.p)


@dataclass(frozen=True)
class Expectations:
    all_detectable_caught: bool = True
    max_false_positives: int = 0
    max_corrupted_tokens_with_tracker: int = 0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str = ""
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    engine: EngineConfig = field(default_factory=EngineConfig)
    faults: FaultSpec = field(default_factory=FaultSpec)
    expect: Expectations = field(default_factory=Expectations)
    path: str = ""


SECTIONS = {"workload": WorkloadSpec, "engine": EngineConfig, "faults": FaultSpec, "expect": Expectations}
_CHOICES = {("workload", "arrival"): ("burst", "staggered"), ("faults", "trigger"): TRIGGERS,
            ("faults", "event"): EVENTS}


def _coerce(section: str, f, value):
    where = f"[{section}].{f.name}"
    default = f.default if f.default is not MISSING else f.default_factory()
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ScenarioError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, list) or not all(isinstance(v, (int, str)) for v in value):
            raise ScenarioError(f"{where} must be a list, got {value!r}")
        if default and isinstance(default[0], int) and (len(value) != 2 or value[0] > value[1]):
            raise ScenarioError(f"{where} must be a [low, high] range with low <= high, got {value!r}")
        return tuple(value)
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScenarioError(f"{where} must be a number, got {value!r}")
        if isinstance(default, int) and not isinstance(value, int):
            raise ScenarioError(f"{where} must be an integer, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ScenarioError(f"{where} must be a string, got {value!r}")
    valid = _CHOICES.get((section, f.name))
    if valid and value not in valid:
        raise ScenarioError(f"{where} = {value!r} is not valid; choose one of {list(valid)}")
    return value


def _section(name: str, cls, table) -> object:
    if not isinstance(table, dict):
        raise ScenarioError(f"[{name}] must be a table")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ScenarioError(f"[{name}] has unknown key(s) {unknown}; valid keys: {sorted(known)}")
    values = {k: _coerce(name, known[k], v) for k, v in table.items()}
    try:
        return cls(**values)
    except (ConfigError, ValueError) as err:
        raise ScenarioError(f"[{name}]: {err}") from None


def _check_faults(spec: FaultSpec) -> None:
    classes = list(spec.classes)
    if classes == ["all"]:
        return
    bad = [c for c in classes if c not in FAULTS]
    if bad:
        raise ScenarioError(f"[faults].classes has unknown fault(s) {bad}; valid: ['all', "
                            f"{', '.join(repr(n) for n in sorted(FAULTS))}]")
    if spec.seeds < 1 or spec.count < 1:
        raise ScenarioError("[faults].seeds and [faults].count must be >= 1")


def _check_requires(spec: FaultSpec, engine: EngineConfig) -> None:
    """A fault class that needs an engine feature (``requires``) the scenario's engine lacks."""
    missing = [c for c in spec.classes if c in FAULTS and not fault_available(FAULTS[c], engine)]
    if missing:
        need = sorted({FAULTS[c].requires for c in missing})
        raise ScenarioError(f"[faults].classes {missing} need [engine] {', '.join(f'{n} = true' for n in need)}")


def _check_workload(w: WorkloadSpec) -> None:
    if w.requests < 1 or w.concurrency < 1 or w.prompt_len[0] < 1 or w.output_len[0] < 1:
        raise ScenarioError("[workload]: requests, concurrency, prompt_len and output_len must be >= 1")
    if not 0.0 <= w.shared_prefix_fraction <= 1.0:
        raise ScenarioError(f"[workload].shared_prefix_fraction must be in [0, 1], got {w.shared_prefix_fraction}")


def parse(data: dict, path: str = "<memory>") -> Scenario:
    top = {"name", "description", *SECTIONS}
    unknown = sorted(set(data) - top)
    if unknown:
        raise ScenarioError(f"{path}: unknown top-level key(s) {unknown}; valid: {sorted(top)}")
    if not isinstance(data.get("name", ""), str) or not data.get("name"):
        raise ScenarioError(f"{path}: 'name' (a non-empty string) is required")
    parts = {k: _section(k, cls, data.get(k, {})) for k, cls in SECTIONS.items()}
    _check_faults(parts["faults"])
    _check_requires(parts["faults"], parts["engine"])
    _check_workload(parts["workload"])
    return Scenario(name=data["name"], description=str(data.get("description", "")), path=path, **parts)


def load(path: str | Path) -> Scenario:
    """Read and validate a scenario file."""
    path = Path(path)
    if not path.is_file():
        raise ScenarioError(f"scenario file {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ScenarioError(f"{path}: not valid TOML: {err}") from None
    return parse(data, str(path))


def fault_available(cls, engine: EngineConfig) -> bool:
    """Can ``engine`` host the fault class? ``requires`` names an EngineConfig flag (e.g. phase_split)."""
    return cls.requires is None or bool(getattr(engine, cls.requires, False))


def available_faults(engine: EngineConfig) -> list[str]:
    """Every registered fault the engine can host, in catalog order."""
    return [n for n, cls in FAULTS.items() if fault_available(cls, engine)]


def fault_classes(scenario: Scenario) -> list[str]:
    """The fault names a scenario asks for (``["all"]`` = every available one)."""
    if list(scenario.faults.classes) == ["all"]:
        return available_faults(scenario.engine)
    return list(scenario.faults.classes)
