"""Packaging boundaries: the kernels ship only as ``kvguard.kernels`` (no top-level ``kernels``); kvguard never pulls in faultlab.

Imports are checked in fresh subprocesses run from the repository root (so the root is on ``sys.path``
the way it is for anyone running ``python`` there); source-level rules are checked with ``ast``.
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KERNELS = REPO / "kvguard" / "kernels"
FORBIDDEN_IN_KVGUARD = ("faultlab", "sglang")


def run_python(code: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter, cwd = repository root."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"TRITON_INTERPRET": "1", **(extra_env or {})})
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def inside_repo(path: str) -> bool:
    return Path(path).resolve().is_relative_to(REPO)


# -- the bare name `kernels` ---------------------------------------------------------------------------
def test_bare_import_kernels_fails_from_repo_root():
    """Exactly what a user types at the repository root: ``python -c "import kernels"``."""
    proc = run_python("import kernels")
    if proc.returncode != 0:
        assert "ModuleNotFoundError" in proc.stderr, proc.stderr
        assert "No module named 'kernels'" in proc.stderr
    else:  # some other `kernels` package is installed: it must be that one
        located = run_python("import kernels; print(kernels.__file__)")
        assert not inside_repo(located.stdout.strip())


PROBE = """
try:
    import kernels
except ModuleNotFoundError as err:
    print("MISSING", err.name)
else:
    print("FOUND", kernels.__file__)
"""


@pytest.mark.parametrize("pythonpath", [None, "repo"], ids=["cwd-on-path", "PYTHONPATH=repo"])
def test_bare_kernels_never_resolves_into_repo(pythonpath):
    env = None if pythonpath is None else {"PYTHONPATH": str(REPO)}
    out = run_python(PROBE, env)
    assert out.returncode == 0, out.stderr
    verdict, _, where = out.stdout.strip().partition(" ")
    assert verdict in ("MISSING", "FOUND"), out.stdout
    if verdict == "MISSING":
        assert where == "kernels"
    else:
        assert not inside_repo(where), where


def test_bare_kernels_defers_to_another_installed_package(tmp_path):
    """With a real (PyPI-like) ``kernels`` later on the path, the bare name resolves to it, not to us."""
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("MARKER = 'pypi-kernels'\n")
    code = "import kernels, sys\nprint(kernels.MARKER, kernels.__file__, sys.modules['kernels'] is kernels)"
    out = run_python(code, {"PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])})
    assert out.returncode == 0, out.stderr
    marker, theirs, registered = out.stdout.split()
    assert marker == "pypi-kernels" and registered == "True"
    assert Path(theirs).resolve() == (fake / "__init__.py").resolve()


# -- kvguard and kvguard.kernels ------------------------------------------------------------------------
IMPORT_ALL = """
import importlib, json, pkgutil, sys
import torch
import kvguard
import kvguard.kernels
import kvguard.kernels.tag_check as tc
names = [f"kvguard.kernels.{m.name}" for m in pkgutil.iter_modules(kvguard.kernels.__path__)]
names += [f"kvguard.{m.name}" for m in pkgutil.iter_modules(kvguard.__path__) if m.name != "sglang"]
for name in names:
    importlib.import_module(name)
# a check imports the kernel lazily: run one too
tracker = kvguard.make_tracker(kvguard.TrackerConfig(mode="check", backend="triton"))
tracker.attach(num_pages=4, num_rows=1, max_entries=2, device="cpu")
pages = torch.tensor([1, 2])
tracker.on_alloc(pages)
tracker.record(0, 0, pages)
check = tracker.validate(torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([0]),
                         torch.tensor([2]), max_entries=2)
print(json.dumps({"tag_check": tc.__file__, "has": [hasattr(tc, "tag_check"), hasattr(tc, "tag_check_ref")],
                  "verdict": check.verdict.sum().item(), "imported": names, "modules": sorted(sys.modules)}))
"""


@pytest.fixture(scope="module")
def imported():
    """Everything kvguard ships, imported (and one check run) in a fresh interpreter."""
    out = run_python(IMPORT_ALL)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def pyproject(which: str = "kvguard") -> dict:
    """The project table of a distribution's pyproject: kvguard (the repository root) or faultlab."""
    import tomllib

    path = REPO / "pyproject.toml" if which == "kvguard" else REPO / "packaging" / "faultlab" / "pyproject.toml"
    return tomllib.loads(path.read_text())


def dep_names(deps: list[str]) -> set[str]:
    return {d.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip().lower() for d in deps}


def test_runtime_install_pulls_nothing_of_faultlab():
    """`pip install kvguard` brings what KVGUARD_MODE=check runs, and registers no pytest plugin; faultlab's
    dependencies (pytest, hypothesis, ...) come with the faultlab distribution, which depends on kvguard."""
    kvguard, faultlab = pyproject("kvguard")["project"], pyproject("faultlab")["project"]
    assert dep_names(kvguard["dependencies"]) == {"torch", "triton", "numpy", "structlog", "prometheus-client"}
    assert "optional-dependencies" not in kvguard  # `kvguard[faultlab]` is replaced by the faultlab distribution
    assert {"kvguard", "pytest", "hypothesis"} <= dep_names(faultlab["dependencies"])
    assert "kvguard==" + kvguard["version"] in faultlab["dependencies"]
    for project in (kvguard, faultlab):
        assert "pytest11" not in project.get("entry-points", {})


def test_each_distribution_declares_only_its_own_entry_points():
    kvguard, faultlab = pyproject("kvguard")["project"], pyproject("faultlab")["project"]
    assert kvguard["entry-points"] == {"sglang.srt.plugins": {"kvguard": "kvguard.sglang:register"}}
    assert kvguard["scripts"] == {"kvguard": "kvguard.sglang.dryrun:cli"}
    assert faultlab["entry-points"] == {"sglang.srt.plugins": {"faultlab_inject": "faultlab.sglang_live.inject:register"}}
    assert faultlab["scripts"] == {"faultlab": "faultlab.chaos.cli:main"}


def test_dev_env_has_both_distributions_each_with_its_entry_point():
    """`make setup` installs both (editable): SGLang sees kvguard's plugin from kvguard and the injector from
    faultlab, and each command from its own distribution."""
    from importlib.metadata import entry_points

    plugins = {e.name: e.dist.name for e in entry_points(group="sglang.srt.plugins")}
    assert plugins.get("kvguard") == "kvguard" and plugins.get("faultlab_inject") == "faultlab", plugins
    scripts = {e.name: e.dist.name for e in entry_points(group="console_scripts") if e.name in ("kvguard", "faultlab")}
    assert scripts == {"kvguard": "kvguard", "faultlab": "faultlab"}


def test_kvguard_ships_only_its_own_kernels():
    """kvguard/ is the production tracker: its kernels are the check (eager, and as a CUDA-graph node) with its
    write guard, the decode recorder (with the tag bump), their direct launcher, the sliding-window map check and
    the recurrent state-slot check; the engine owns the others (attention, KV store, INT4 GEMM)."""
    assert sorted(p.name for p in KERNELS.glob("*.py")) == ["__init__.py", "graph_check.py", "launch.py", "record.py",
                                                            "state_check.py", "tag_check.py", "window_check.py",
                                                            "write_guard.py"]


def test_kvguard_sources_never_import_pytest_or_hypothesis():
    for path in sorted((REPO / "kvguard").rglob("*.py")):
        bad = [m for level, m in imports_of(path) if level == 0 and top(m) in ("pytest", "hypothesis")]
        assert bad == [], f"{path.relative_to(REPO)} imports {bad}"


def test_kvguard_kernels_tag_check_imports(imported):
    assert Path(imported["tag_check"]).resolve() == (KERNELS / "tag_check.py").resolve()
    assert imported["has"] == [True, True] and imported["verdict"] == 0
    assert "kvguard.kernels.tag_check" in imported["imported"]


@pytest.mark.parametrize("package", FORBIDDEN_IN_KVGUARD)
def test_kvguard_never_imports(imported, package):
    leaked = [m for m in imported["modules"] if m == package or m.startswith(package + ".")]
    assert leaked == [], f"importing kvguard pulled in {leaked}"


def test_bare_kernels_not_in_modules_after_kvguard_import(imported):
    assert "kernels" not in imported["modules"]


# -- source rules -----------------------------------------------------------------------------------------
def imports_of(path: Path) -> list[tuple[int, str]]:
    """(relative level, absolute-or-relative module name) for every import in a file, dynamic ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", ""))
              in ("import_module", "__import__")):
            found.append((0, node.args[0].value))
    return found


def top(name: str) -> str:
    return name.split(".")[0]


ENGINE_KERNELS = REPO / "faultlab" / "engine" / "kernels"


@pytest.mark.parametrize("path", sorted([*KERNELS.glob("*.py"), *ENGINE_KERNELS.glob("*.py")]),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_kernel_sources_import_neither_kvguard_nor_faultlab(path):
    for level, module in imports_of(path):
        assert level <= 1, f"{path.name}: relative import escapes its kernels package ({'.' * level}{module})"
        if level == 0:
            assert top(module) not in ("kvguard", "faultlab", "kernels"), f"{path.name} imports {module}"


@pytest.mark.parametrize("path", sorted((REPO / "kvguard").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_kvguard_sources_never_import_faultlab(path):
    bad = [m for level, m in imports_of(path) if level == 0 and top(m) == "faultlab"]
    assert bad == [], f"{path.relative_to(REPO)} imports {bad}"


def test_source_checker_sees_imports(tmp_path):
    """The ast scan itself: plain, from, relative and dynamic imports are all seen."""
    probe = tmp_path / "probe.py"
    probe.write_text("import faultlab.x\nfrom kvguard import y\nfrom . import z\nfrom .. import w\n"
                     "def f():\n    import importlib\n    importlib.import_module('faultlab')\n"
                     "    __import__('kvguard.tags')\n")
    assert sorted(imports_of(probe)) == sorted([(0, "faultlab.x"), (0, "kvguard"), (1, ""), (2, ""),
                                                (0, "importlib"), (0, "faultlab"), (0, "kvguard.tags")])


# -- no import cycles ---------------------------------------------------------------------------------------
def _module_graph() -> dict[str, set[str]]:
    """Project module -> project modules it imports (at module level or inside functions)."""
    files = {}
    for pkg in ("kvguard", "faultlab"):
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in files:
                return ".".join(parts[:k])
        return None

    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` depends on pkg.sub when that is a module, else on pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            deps |= {t for t in map(known, targets) if t and t != mod}
        graph[mod] = deps
    return graph


def test_no_import_cycles():
    graph, cycles = _module_graph(), []
    index, low, stack, on_stack, counter = {}, {}, [], set(), [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"
    assert "faultlab.engine.engine" in graph and graph["faultlab.engine.engine"]  # the scan sees imports


@pytest.mark.parametrize("which", ["kvguard", "faultlab"])
def test_every_package_folder_is_listed_in_pyproject(which):
    """A non-editable install ships only the listed packages: a folder left out would be missing. kvguard's
    pyproject lists kvguard's folders, faultlab's lists faultlab's (from the repository's faultlab/)."""
    listed = set(pyproject(which)["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / which).rglob("__init__.py")}
    assert found == listed
    if which == "faultlab":
        assert pyproject(which)["tool"]["setuptools"]["package-dir"] == {"faultlab": "../../faultlab"}


def test_faultlab_top_level_is_grouped_by_role():
    """A reader finds each part from the folder names: the oracle at the top, everything else in its role's
    folder (chaos runner and commands, pytest side, GPU harnesses, engine, fault catalog, SGLang parts)."""
    modules = sorted(p.name for p in (REPO / "faultlab").glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in (REPO / "faultlab").iterdir() if (p / "__init__.py").exists())
    assert modules == ["oracle.py"], modules
    assert folders == ["chaos", "engine", "faults", "gpu", "sglang_gpu", "sglang_live", "testing"], folders


# -- the two wheels: what a serving machine installs, and what it does not ------------------------------------------
@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """Both wheels, built offline (no build isolation: the environment's pinned setuptools) from a copy of the
    sources, so that the build leaves nothing in the repository."""
    import shutil

    tmp = tmp_path_factory.mktemp("wheels")
    src, out = tmp / "src", tmp / "out"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("kvguard", "faultlab", "packaging"):
        shutil.copytree(REPO / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(src), str(src / "packaging" / "faultlab")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {p.name.split("-")[0]: p for p in out.glob("*.whl")}
    assert set(found) == {"kvguard", "faultlab"}, sorted(out.iterdir())
    return found


def wheel_files(wheel: Path) -> dict[str, str]:
    """name -> text of the small metadata files; every other member with ''."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        return {n: zf.read(n).decode() if ".dist-info/" in n and not n.endswith("RECORD") else "" for n in zf.namelist()}


def entry_point_groups(files: dict[str, str]) -> dict[str, dict[str, str]]:
    import configparser

    text = next(v for n, v in files.items() if n.endswith(".dist-info/entry_points.txt"))
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read_string(text)
    return {group: dict(parser[group]) for group in parser.sections()}


def test_production_wheel_holds_kvguard_alone(wheels):
    files = wheel_files(wheels["kvguard"])
    tops = {n.split("/")[0] for n in files if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvguard"}, tops
    assert not [n for n in files if "faultlab" in n.lower()]
    modules = {n for n in files if n.endswith(".py")}
    assert {"kvguard/sglang/__init__.py", "kvguard/sglang/plugin.py", "kvguard/sglang/dryrun.py",
            "kvguard/kernels/tag_check.py", "kvguard/tracker.py"} <= modules
    assert entry_point_groups(files) == {"sglang.srt.plugins": {"kvguard": "kvguard.sglang:register"},
                                         "console_scripts": {"kvguard": "kvguard.sglang.dryrun:cli"}}
    metadata = next(v for n, v in files.items() if n.endswith(".dist-info/METADATA"))
    requires = dep_names([ln.split(":", 1)[1] for ln in metadata.splitlines() if ln.startswith("Requires-Dist:")])
    assert requires == {"torch", "triton", "numpy", "structlog", "prometheus-client"}
    assert "Provides-Extra" not in metadata


def test_faultlab_wheel_holds_faultlab_and_its_injector(wheels):
    files = wheel_files(wheels["faultlab"])
    tops = {n.split("/")[0] for n in files if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"faultlab"}, tops
    assert "faultlab/sglang_live/inject.py" in files and "faultlab/chaos/cli.py" in files
    assert entry_point_groups(files) == {
        "sglang.srt.plugins": {"faultlab_inject": "faultlab.sglang_live.inject:register"},
        "console_scripts": {"faultlab": "faultlab.chaos.cli:main"}}
    metadata = next(v for n, v in files.items() if n.endswith(".dist-info/METADATA"))
    assert "Requires-Dist: kvguard==0.1.0" in metadata


SGLANG_WITH_THE_WHEEL = r"""
import json, site, sys
wheel_dir, site_view = sys.argv[1], sys.argv[2]
sys.path.insert(0, wheel_dir)
site.addsitedir(site_view)
import sglang.srt.plugins as plugins
from importlib.metadata import entry_points
plugins.load_plugins()
try:
    import faultlab
    faultlab_found = faultlab.__file__
except ModuleNotFoundError:
    faultlab_found = None
print(json.dumps({
    "plugins": sorted([e.name, e.value, e.dist.name] for e in entry_points(group="sglang.srt.plugins")),
    "kvguard": sys.modules["kvguard.sglang"].__file__ if "kvguard.sglang" in sys.modules else None,
    "faultlab_modules": sorted(m for m in sys.modules if m.split(".")[0] == "faultlab"),
    "faultlab": faultlab_found,
}))
"""


@pytest.mark.sglang
@pytest.mark.timeout(180)
def test_sglang_with_only_the_production_wheel_loads_kvguard_and_nothing_of_faultlab(wheels, tmp_path):
    """A serving machine's environment: SGLang and its dependencies, and kvguard's wheel installed (unpacked),
    neither this repository nor faultlab's install on the path. SGLang's own ``load_plugins`` finds kvguard's
    entry point alone and loads it from the wheel; ``import faultlab`` fails there."""
    import sysconfig
    import zipfile

    wheel_dir, site_view = tmp_path / "wheel", tmp_path / "site"
    with zipfile.ZipFile(wheels["kvguard"]) as zf:
        zf.extractall(wheel_dir)
    site_view.mkdir()
    ours = ("kvguard", "faultlab", "__editable__.kvguard", "__editable__.faultlab", "__editable___kvguard",
            "__editable___faultlab")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(ours):
            (site_view / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("KVGUARD_", "SGLANG_"))}
    env["KVGUARD_MODE"] = "off"
    proc = subprocess.run([sys.executable, "-S", "-c", SGLANG_WITH_THE_WHEEL, str(wheel_dir), str(site_view)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["plugins"] == [["kvguard", "kvguard.sglang:register", "kvguard"]], seen
    assert seen["kvguard"] is not None and Path(seen["kvguard"]).is_relative_to(wheel_dir), seen
    assert seen["faultlab_modules"] == [] and seen["faultlab"] is None, seen
