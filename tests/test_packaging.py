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


def test_runtime_install_pulls_nothing_of_faultlab():
    """`pip install kvguard` (no extra) brings what KVGUARD_MODE=check runs, and registers no pytest plugin."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {dep.split(">")[0].split("=")[0].split("[")[0].strip().lower() for dep in project["dependencies"]}
    assert runtime == {"torch", "triton", "numpy", "structlog", "prometheus-client"}
    assert {"pytest", "hypothesis"} <= {d.split(">")[0].split("=")[0] for d in project["optional-dependencies"]["faultlab"]}
    assert "pytest11" not in project.get("entry-points", {})


def test_kvguard_ships_only_its_own_kernels():
    """kvguard/ is the production tracker: its kernels are the check (eager, and as a CUDA-graph node) and the
    decode recorder (with the tag bump), and their direct launcher; the engine owns the others (attention, KV
    store, INT4 GEMM)."""
    assert sorted(p.name for p in KERNELS.glob("*.py")) == ["__init__.py", "graph_check.py", "launch.py", "record.py",
                                                            "tag_check.py"]


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


def test_every_package_folder_is_listed_in_pyproject():
    """A non-editable `pip install .` ships only the listed packages: a folder left out would be missing."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for top in ("kvguard", "faultlab")
             for p in (REPO / top).rglob("__init__.py")}
    assert found == listed


def test_faultlab_top_level_is_grouped_by_role():
    """A reader finds each part from the folder names: the oracle at the top, everything else in its role's
    folder (chaos runner and commands, pytest side, GPU harnesses, engine, fault catalog, SGLang parts)."""
    modules = sorted(p.name for p in (REPO / "faultlab").glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in (REPO / "faultlab").iterdir() if (p / "__init__.py").exists())
    assert modules == ["oracle.py"], modules
    assert folders == ["chaos", "engine", "faults", "gpu", "sglang_gpu", "sglang_live", "testing"], folders
