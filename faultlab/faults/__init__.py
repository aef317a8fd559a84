"""The fault registry: first-principles faults (catalog.py) and replayed published bugs (real_bugs.py)."""
from . import real_bugs  # noqa: F401  (registers the replays)
