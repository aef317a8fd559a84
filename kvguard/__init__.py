"""kvguard: a KV-cache integrity tracker for paged-KV LLM serving.

``NoopTracker`` is the default and costs nothing; ``TagTracker`` checks every request's page mapping
before the KV cache is read and names the requests to abort. ``make_tracker()`` picks one from
``TrackerConfig`` or the ``KVGUARD_MODE=off|check`` environment variable.
"""
from .settings import SettingsError, TrackerConfig
from .tags import TagTable
from .tracker import Check, NoopTracker, TagTracker, make_tracker
from .violations import KVGuardViolation, Violation

__all__ = ["Check", "KVGuardViolation", "NoopTracker", "SettingsError", "TagTable", "TagTracker",
           "TrackerConfig", "Violation", "make_tracker"]
