"""The fault registry: first-principles faults (catalog.py) and replayed published bugs (real_bugs.py,
real_bugs_release.py; imported here in that order, which is the suite's catalog order)."""
from . import real_bugs, real_bugs_release  # noqa: F401  (registers the replays)
