"""kvguard: a KV-cache integrity tracker for paged-KV LLM serving.

``NoopTracker`` is the default and costs nothing; ``TagTracker`` checks every request's page mapping
before the KV cache is read and names the requests to abort. ``make_tracker()`` picks one from
``TrackerConfig`` or the ``KVGUARD_MODE=off|check`` environment variable.

NOTE: the names below are imported on first use (PEP 562), not with the package: SGLang's plugin loader
imports ``kvguard`` in every SGLang process to reach ``kvguard.sglang:register``, and it swallows an
ImportError raised there. Importing the package therefore imports nothing that could fail; the entry point
decides, with the standard library alone, whether a failure must stop the process (``KVGUARD_MODE=check``).
"""
from importlib import import_module

_WHERE = {"SettingsError": "settings", "TrackerConfig": "settings", "TagTable": "tags", "Check": "tracker",
          "NoopTracker": "tracker", "TagTracker": "tracker", "make_tracker": "tracker",
          "KVGuardViolation": "violations", "Violation": "violations"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvguard' has no attribute {name!r}")
