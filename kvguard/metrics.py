"""Prometheus counters, one set per registry (tests and multi-tracker processes stay separate)."""
import weakref
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, REGISTRY

from .violations import REASONS

# A server's per-step checks are counted into kvguard_checks / kvguard_entries_checked in batches of this many
# (kvguard.tracker.TagTracker.count_check), and the rest at each request's release.
METRICS_EVERY = 64


@dataclass(frozen=True)
class Metrics:
    checks: Counter
    entries: Counter
    violations: Counter
    aborted: Counter
    uncovered: Counter
    paths: Gauge


# Keyed by the registry itself (weakly): an id() key is reused once a registry is freed, which
# handed a new registry the counters of a dead one.
_BY_REGISTRY: "weakref.WeakKeyDictionary[CollectorRegistry, Metrics]" = weakref.WeakKeyDictionary()


def metrics_for(registry: CollectorRegistry | None = None) -> Metrics:
    """The kvguard counters registered in ``registry`` (the default process registry if None)."""
    registry = REGISTRY if registry is None else registry
    if registry not in _BY_REGISTRY:
        _BY_REGISTRY[registry] = Metrics(
            checks=Counter("kvguard_checks", "Batched validation passes launched", registry=registry),
            entries=Counter("kvguard_entries_checked", "Page-table entries validated", registry=registry),
            violations=Counter("kvguard_violations", "Requests found with a broken KV mapping",
                               ["reason"], registry=registry),
            aborted=Counter("kvguard_requests_aborted", "Requests aborted by kvguard", registry=registry),
            uncovered=Counter("kvguard_pools_uncovered", "KV pools kvguard was asked to check and could not "
                              "cover (the process refuses to start)", registry=registry),
            paths=Gauge("kvguard_path_active", "SGLang serving paths this server runs (1), by kvguard's "
                        "verdict on each (kvguard.sglang.paths)", ["path", "status"], registry=registry,
                        multiprocess_mode="max"),
        )
        for reason in REASONS:
            _BY_REGISTRY[registry].violations.labels(reason=reason)  # each series exists from the start (0)
    return _BY_REGISTRY[registry]
