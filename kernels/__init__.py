"""Triton kernels of kvguard, each beside its torch reference.

This folder ships as ``kvguard.kernels``. Imported as a bare top-level ``kernels`` (the repository
root on ``sys.path``), it steps aside: SGLang imports the PyPI package ``kernels`` and ours must never
shadow it. See :func:`_defer_bare_import`.
"""
import sys as _sys


def _defer_bare_import() -> None:
    """Replace this module in ``sys.modules`` with the real PyPI ``kernels``, or fail like a missing one."""
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent
    others = [p for p in _sys.path if Path(p or ".").resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec("kernels", others)
    del _sys.modules["kernels"]
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels' (kvguard's kernels are kvguard.kernels)",
                                  name="kernels")
    module = importlib.util.module_from_spec(spec)
    _sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _defer_bare_import()
