"""The chaos runner: one scenario case = workload x fault x seed x tracker on/off, judged by the oracle.

Every case is compared with the fault-free run of the same seed: outputs of requests the oracle did not
mark as victims must be identical, token for token.
"""
import random
from dataclasses import asdict, dataclass, field

from kvguard import TrackerConfig, make_tracker
from prometheus_client import CollectorRegistry

from faultlab.engine.engine import Engine
from faultlab.engine.factory import make_engine
from faultlab.engine.requests import Request
from faultlab.faults.injector import Injector
from faultlab.oracle import Oracle
from faultlab.chaos.scenario import Scenario


@dataclass
class CaseResult:
    fault: str | None
    seed: int
    tracker: str  # "on" | "off"
    injected: int = 0
    victims: int = 0
    victims_aborted: int = 0
    false_positives: int = 0
    corrupted_tokens_returned: int = 0
    detection_latencies: list[int] = field(default_factory=list)
    nonvictim_mismatches: int = 0
    sglang_checks: dict = field(default_factory=dict)  # check name -> first step it fired (or None)
    steps: int = 0
    injections: list[dict] = field(default_factory=list)
    outputs: dict = field(default_factory=dict)  # rid -> {"status", "tokens", "error"}

    def to_json(self) -> dict:
        return asdict(self)


class SGLangStyleChecks:
    """What SGLang's own checks would see, on our bookkeeping: duplicate free pages (double free),
    owners' pages found in the free list (use after free), and accounting totals at idle."""

    def __init__(self):
        self.fired: dict[str, int | None] = {"duplicate_free_pages": None, "owner_page_in_free_list": None,
                                             "accounting_at_idle": None, "lock_ref_underflow": None}

    def on_step_end(self, engine, step):
        free = set(engine.allocator.free_pages.tolist())
        if engine.allocator.duplicate_free_pages() > 0:
            self._fire("duplicate_free_pages", step)
        for r in engine.running:
            if r.row is not None and free & set(engine.table[r.row, :r.n_pages].tolist()):
                self._fire("owner_page_in_free_list", step)
        if engine.cache.lock_underflows:
            self._fire("lock_ref_underflow", step)
        if not engine.running and not engine.waiting and not engine.accounting()["balanced"]:
            self._fire("accounting_at_idle", step)

    def _fire(self, name, step):
        if self.fired[name] is None:
            self.fired[name] = step


def make_workload(scenario: Scenario, seed: int, vocab: int) -> list[tuple[int, Request]]:
    """(arrival step, request) pairs drawn from the scenario's workload with ``seed``."""
    w, rng = scenario.workload, random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(w.shared_prefix_len)]
    arrivals = []
    for i in range(w.requests):
        n = rng.randint(*w.prompt_len)
        tokens = [rng.randrange(3, vocab) for _ in range(n)]
        if rng.random() < w.shared_prefix_fraction:
            tokens = prefix + tokens
        request = Request(f"r{i}", tokens, rng.randint(*w.output_len), temperature=w.temperature,
                          seed=seed * 1000 + i)
        step = 0 if w.arrival == "burst" else i // max(1, w.arrivals_per_step)
        arrivals.append((step, request))
    return arrivals


def checking_tracker(log: bool = False, *, on: bool = True, backend: str = "auto"):
    """faultlab's one way to build a tracker (``kvguard.make_tracker``): a checking TagTracker, or with
    ``on=False`` the NoopTracker; ``log`` logs each violation. A checking tracker gets its own Prometheus
    registry: runs, benchmarks and tests never share counters."""
    config = TrackerConfig(mode="check" if on else "off", backend=backend, log_violations=log)
    return make_tracker(config, CollectorRegistry())


def run_case(scenario: Scenario, fault: str | None, seed: int, tracker_on: bool,
             baseline: "CaseResult | None" = None, trigger=None, count: int | None = None) -> CaseResult:
    """Run one case; with ``baseline`` (the fault-free run of this seed) compare non-victims' outputs."""
    cfg = scenario.engine
    engine_cfg = type(cfg)(**{**asdict(cfg), "max_running": scenario.workload.concurrency})
    oracle, checks = Oracle(), SGLangStyleChecks()
    observers = [oracle, checks]
    injector = None
    if fault is not None:
        rng = random.Random(seed ^ 0x5EED)
        injector = Injector(fault, trigger or scenario.faults.trigger_for(rng),
                            count or scenario.faults.count, seed)
        observers.insert(0, injector)
    engine = make_engine(engine_cfg, tracker=checking_tracker(on=tracker_on), observers=observers)
    arrivals = make_workload(scenario, seed, engine.model.config.vocab)
    requests = [r for _, r in arrivals]
    drive(engine, arrivals)
    return judge(fault, seed, tracker_on, engine, requests, oracle, checks, injector, baseline)


def drive(engine: Engine, arrivals, max_steps: int | None = None) -> None:
    """Add each request at its arrival step and step the engine until every request has ended.

    ``max_steps`` (default: the last arrival plus, per request, its prompt and output tokens and two
    steps: a bound no healthy run reaches, even one request at a time) stops a run that hangs.
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    if max_steps is None:
        max_steps = max((a[0] for a in pending), default=0) + sum(
            len(r.prompt) + r.max_new_tokens + 2 for _, r in pending) + 100
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        engine.step()
        step += 1
        if step > max_steps:
            raise RuntimeError(f"chaos run did not finish in {max_steps} steps")


def judge(fault, seed, tracker_on, engine, requests, oracle, checks, injector, baseline) -> CaseResult:
    rep = oracle.report
    result = CaseResult(
        fault=fault, seed=seed, tracker="on" if tracker_on else "off",
        injected=len(injector.injected) if injector else 0,
        victims=len(rep.victims), victims_aborted=len(rep.victims_aborted),
        false_positives=len(rep.false_positives),
        corrupted_tokens_returned=sum(rep.corrupted_tokens.values()),
        detection_latencies=rep.detection_latencies(), sglang_checks=dict(checks.fired),
        steps=engine.step_id, injections=injector.injected if injector else [],
        outputs={r.rid: {"status": r.status, "tokens": list(r.output), "error": r.error} for r in requests},
    )
    if baseline is not None:
        for r in requests:
            if r.rid not in rep.victims and r.status == "finished":
                result.nonvictim_mismatches += r.output != baseline.outputs[r.rid]["tokens"]
    return result
