"""Scenarios: TOML files -> frozen, validated dataclasses.

A malformed file or an unknown name raises ``ScenarioError`` naming the field, the value and what is
allowed; the CLI turns it into exit code 2 before anything is written. Defaults live in the dataclasses
below (and in ``EngineConfig``), written once; so do the bounds of every number (``limits.LIMITS``), checked
by the one ``check_number`` (limits.py) / ``check_choice`` (engine/choices.py) the CLI and the plugin use too.
``parse``/``load`` check the file itself; ``check_runnable`` (faultlab/chaos/validate.py) checks what depends
on this machine (the device, the model package, memory) and runs before a case does.
"""
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from faultlab.engine.choices import check_choice
from faultlab.engine.options import ConfigError, EngineConfig
from faultlab.faults.catalog import FAULTS, SUITES
from faultlab.faults.injector import EVENTS, TRIGGERS, Trigger
from faultlab.chaos.limits import LIMITS, SEED_MAX, check_number


class ScenarioError(ValueError):
    """The scenario file is malformed; the message names the field at fault and how to mend it."""


ARRIVALS = ("burst", "staggered")  # all requests at step 0 | arrivals_per_step per step


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 10
    prompt_len: tuple[int, int] = (8, 40)
    output_len: tuple[int, int] = (6, 20)
    concurrency: int = 6
    shared_prefix_fraction: float = 0.5
    shared_prefix_len: int = 32
    arrival: str = "burst"  # ARRIVALS
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
    suite: str = "catalog"  # the registry part `all` and `faultlab matrix` draw from (catalog.SUITES)

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
_CHOICES = {("workload", "arrival"): ARRIVALS, ("faults", "trigger"): TRIGGERS,
            ("faults", "event"): EVENTS, ("faults", "suite"): SUITES}


def _coerce(section: str, f, value):
    where = f"[{section}].{f.name}"
    default = f.default if f.default is not MISSING else f.default_factory()
    limits = LIMITS.get((section, f.name))
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ScenarioError(f"{where} = {value!r} is not valid; it must be true or false")
        return value
    if isinstance(default, tuple):
        if limits is None:  # a list of names ([faults].classes)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ScenarioError(f"{where} = {value!r} is not valid; it must be a list of strings")
            return tuple(value)
        if not isinstance(value, list) or len(value) != 2:
            raise ScenarioError(f"{where} = {value!r} is not valid; it must be a [low, high] range of "
                                f"integers in {limits[0]}..{limits[1]}")
        low, high = (check_number(f"{where}[{i}]", v, *limits, ScenarioError) for i, v in enumerate(value))
        if low > high:
            raise ScenarioError(f"{where} = {value!r} is not valid; it must be a [low, high] range with low <= high")
        return (low, high)
    if isinstance(default, (int, float)):
        if limits is None:  # a number from a fixed set (engine.page_size): its dataclass checks the set
            return check_number(where, value, -2**63, 2**63 - 1, ScenarioError)
        low, high = limits if isinstance(default, int) else map(float, limits)
        return check_number(where, value, low, high, ScenarioError)
    if not isinstance(value, str):
        raise ScenarioError(f"{where} = {value!r} is not valid; it must be a string")
    valid = _CHOICES.get((section, f.name))
    if valid:
        check_choice(where, value, valid, ScenarioError)
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


RUNNERS = {"tp": "python -m faultlab.chaos.tp_run"}  # fault requirements met outside scenarios, and where


def check_classes(names, engine: EngineConfig, where: str = "[faults].classes",
                  suite: str = "catalog") -> list[str]:
    """``names`` (a scenario's or ``--faults``'s) as fault classes ``engine`` can host; ``all`` alone = every
    one of ``suite`` it can host. Unknown, repeated or unhostable names raise ScenarioError naming ``where``."""
    names = list(names)
    if names == ["all"]:
        return available_faults(engine, suite)
    valid = f"valid: ['all' (alone), {', '.join(repr(n) for n in sorted(FAULTS))}]"
    bad = [c for c in names if c not in FAULTS]
    if bad:
        raise ScenarioError(f"{where} has unknown fault(s) {bad}; {valid}")
    repeated = sorted({c for c in names if names.count(c) > 1})
    if repeated:
        raise ScenarioError(f"{where} lists {repeated} more than once; name each class once")
    missing = [c for c in names if not fault_available(FAULTS[c], engine)]
    if missing:
        need = sorted({FAULTS[c].requires for c in missing})
        fields_ = {f.name for f in fields(EngineConfig)}
        how = [f"[engine] {n} = true" if n in fields_ else f"{n!r}, which no scenario engine provides"
               + (f" (run it with {RUNNERS[n]})" if n in RUNNERS else "") for n in need]
        raise ScenarioError(f"{where} {missing} cannot strike in this engine: they need {', '.join(how)}")
    return names


def check_trigger(spec: FaultSpec) -> None:
    """Every trigger the seeds can draw is valid (the runner builds them case by case)."""
    for step in spec.step:
        try:
            Trigger(mode=spec.trigger, step=step, event=spec.event, p=spec.p)
        except ValueError as err:
            raise ScenarioError(f"[faults]: {err}") from None


def check_seed_range(first_seed: int, seeds: int, where: str = "[faults].first_seed + seeds") -> None:
    if first_seed + seeds - 1 > SEED_MAX:
        raise ScenarioError(f"{where} = {first_seed} + {seeds} runs past the last seed {SEED_MAX}; "
                            f"seeds are 0..{SEED_MAX}")


def parse(data: dict, path: str = "<memory>") -> Scenario:
    top = {"name", "description", *SECTIONS}
    unknown = sorted(set(data) - top)
    if unknown:
        raise ScenarioError(f"{path}: unknown top-level key(s) {unknown}; valid: {sorted(top)}")
    if not isinstance(data.get("name"), str) or not data["name"].strip():
        raise ScenarioError(f"{path}: 'name' = {data.get('name')!r} is not valid; a non-empty string is required")
    if not isinstance(data.get("description", ""), str):
        raise ScenarioError(f"{path}: 'description' = {data['description']!r} is not valid; it must be a string")
    parts = {k: _section(k, cls, data.get(k, {})) for k, cls in SECTIONS.items()}
    faults = parts["faults"]
    check_classes(faults.classes, parts["engine"], suite=faults.suite)
    check_trigger(faults)
    check_seed_range(faults.first_seed, faults.seeds)
    return Scenario(name=data["name"], description=data.get("description", ""), path=path, **parts)


def load(path: str | Path) -> Scenario:
    """Read and validate a scenario file (UTF-8 TOML).

    A scenario may start from another: ``base = "smoke.toml"`` (a path relative to this file) takes every
    key of that scenario, and this file's keys override it, section by section and key by key.
    """
    path = Path(path)
    return parse(_read_with_base(path, ()), str(path))


def _read_with_base(path: Path, chain: tuple[Path, ...]) -> dict:
    data = _read(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base.strip():
        raise ScenarioError(f"{path}: 'base' = {base!r} is not valid; give the path of another scenario file")
    base_path = (path.parent / base).resolve()
    if base_path in chain or base_path == path.resolve():
        raise ScenarioError(f"{path}: 'base' = {base!r} makes a cycle ({' -> '.join(str(p) for p in chain)})")
    merged = _read_with_base(base_path, (*chain, path.resolve()))
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _read(path: Path) -> dict:
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ScenarioError(f"scenario file {str(path)!r} {what}; give a .toml file (see scenarios/)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ScenarioError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); a scenario is a "
                            f"UTF-8 TOML file") from None
    except OSError as err:
        raise ScenarioError(f"scenario file {str(path)!r} cannot be read: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ScenarioError(f"{path}: not valid TOML: {err}") from None
    return data


def fault_available(cls, engine: EngineConfig) -> bool:
    """Can ``engine`` host the fault class? ``requires`` names an EngineConfig flag (e.g. phase_split)."""
    return cls.requires is None or bool(getattr(engine, cls.requires, False))


def available_faults(engine: EngineConfig, suite: str = "catalog") -> list[str]:
    """Every registered fault of ``suite`` the engine can host, in catalog order."""
    return [n for n, cls in FAULTS.items() if cls.suite == suite and fault_available(cls, engine)]


def fault_classes(scenario: Scenario) -> list[str]:
    """The fault names a scenario asks for (``["all"]`` = every available one)."""
    return check_classes(scenario.faults.classes, scenario.engine, suite=scenario.faults.suite)
