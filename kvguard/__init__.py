"""kvguard: a KV-cache integrity tracker for paged-KV LLM serving.

``NoopTracker`` is the default and costs nothing; ``TagTracker`` checks every request's page mapping
before the KV cache is read and names the requests to abort. ``make_tracker()`` picks one from
``TrackerConfig`` or the ``KVGUARD_MODE=off|check`` environment variable.
"""
def _map_kernels_from_checkout() -> None:
    """Run from a source checkout without installation: map ``<repo>/kernels`` to ``kvguard.kernels``.

    An installed kvguard (wheel or editable) already maps it through pyproject's package-dir.
    """
    import importlib.util
    import sys
    from pathlib import Path

    if importlib.util.find_spec(__name__ + ".kernels") is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    spec = importlib.util.spec_from_file_location(__name__ + ".kernels", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_map_kernels_from_checkout()

from .settings import SettingsError, TrackerConfig  # noqa: E402
from .tags import TagTable  # noqa: E402
from .tracker import Check, NoopTracker, TagTracker, make_tracker  # noqa: E402
from .violations import KVGuardViolation, Violation  # noqa: E402

__all__ = ["Check", "KVGuardViolation", "NoopTracker", "SettingsError", "TagTable", "TagTracker",
           "TrackerConfig", "Violation", "make_tracker"]
