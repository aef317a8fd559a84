"""When and how often a fault strikes: at a step, at the next event of a kind, or with probability p.

The injector is an engine observer. Faults strike at the engine's ``after_schedule`` point (pages of
the step allocated and mapped, validation not yet run). An event trigger (``alloc``, ``free``,
``evict``) arms the fault when that event happens; it strikes at the next ``after_schedule``. Every
random choice comes from one ``random.Random(seed)``: a run is reproducible from its seed.

A fault may also strike where a request finishes (``on_finish(engine, rng, request, pages)``: right after
the engine released the request, before anything else is allocated), for bugs in the release path;
``pages`` are the request's pages by logical page, as granted (the row is gone by then).
"""
import random
from dataclasses import dataclass

from ..engine.choices import check_choice
from ..chaos.limits import LIMITS, check_number
from .catalog import Context, get_fault

TRIGGERS = ("step", "event", "prob")
EVENTS = ("alloc", "free", "evict")


@dataclass(frozen=True)
class Trigger:
    """``mode="step"``: first opportunity at or after ``step``; ``"event"``: after the next ``event``;
    ``"prob"``: with probability ``p`` at each step."""

    mode: str = "step"
    step: int = 3
    event: str = "alloc"
    p: float = 0.1

    def __post_init__(self):
        """The rules a scenario's [faults] trigger, step, event and p follow (LIMITS); ValueError."""
        check_choice("trigger mode", self.mode, TRIGGERS)
        if self.mode == "event":
            check_choice("trigger event", self.event, EVENTS)
        check_number("trigger step", self.step, *LIMITS[("faults", "step")])
        check_number("trigger p", self.p, *LIMITS[("faults", "p")])


class Injector:
    """Applies ``count`` strikes of one fault to an engine, as the trigger says."""

    def __init__(self, fault_name: str, trigger: Trigger = Trigger(), count: int = 1, seed: int = 0):
        self.fault = get_fault(fault_name)
        self.trigger = trigger
        self.remaining = count
        self.rng = random.Random(seed)
        self.injected: list[dict] = []
        self._grants: list = []
        self._armed = False
        self._write_armed = False
        self._evictions_seen = 0
        self._last_prob_step = -1
        self._engine = None
        self._pages: dict[str, dict[int, int]] = {}  # rid -> logical page -> page, as granted

    # -- observations ------------------------------------------------------------------------------
    def on_engine(self, engine, **_):
        self._engine = engine

    def on_finish(self, request, step, **_):
        """The release-path strike point (faults with an ``on_finish``)."""
        pages = self._pages.pop(request.rid, {})
        hook = getattr(self.fault, "on_finish", None)
        if hook is None or self.remaining <= 0 or self._engine is None or not self._due(self._engine, step):
            return
        record = hook(self._engine, self.rng, request, [pages[j] for j in sorted(pages)])
        if record is not None:
            self._strike(step, "finish", record)

    def on_abort(self, request, **_):
        self._pages.pop(request.rid, None)

    def on_grant(self, request, first, pages, previous, step, **_):
        self._grants.append((request, first, pages, previous))
        held = self._pages.setdefault(request.rid, {})
        held.update({first + k: p for k, p in enumerate(pages)})

    def on_alloc(self, pages):
        self._armed |= self.trigger.mode == "event" and self.trigger.event == "alloc"

    def on_free(self, pages):
        self._armed |= self.trigger.mode == "event" and self.trigger.event == "free"

    # -- strike points -----------------------------------------------------------------------------
    def after_schedule(self, engine, step, kind, requests):
        grants, self._grants = self._grants, []
        if self.remaining <= 0 or not self._due(engine, step):
            return
        record = self.fault.apply(engine, self.rng, Context(kind, list(requests), grants))
        if record is None:
            return  # no opportunity now: try again at the next point
        if record.get("armed"):
            self._write_armed = True
            return
        self._strike(step, kind, record)

    def mutate_write_slots(self, engine, requests, positions, slots):
        """For ``stray_write``: redirect one new K/V write into another live request's page."""
        if not self._write_armed or len(requests) < 2 or len(positions) != len(requests):
            return slots
        b = self.rng.randrange(len(requests))
        others = [r for r in engine.running if r is not requests[b] and r.row is not None and r.kv_len > 0]
        if not others:
            return slots
        victim = self.rng.choice(others)
        pos = self.rng.randrange(victim.kv_len)
        page = int(engine.table[victim.row, pos // engine.page_size])
        slots = slots.clone()
        slots[b] = page * engine.page_size + pos % engine.page_size
        self._write_armed = False
        self._strike(engine.step_id, "write", {"writer": requests[b].rid, "victim": victim.rid,
                                               "position": pos, "page": page})
        return slots

    def _strike(self, step, kind, record):
        self.remaining -= 1
        self._armed = False
        self.injected.append({"fault": self.fault.name, "step": step, "phase": kind, **record})

    def _due(self, engine, step) -> bool:
        t = self.trigger
        if t.mode == "step":
            return step >= t.step
        if t.mode == "event":
            if t.event == "evict":
                evictions = engine.cache.evictions
                self._armed |= evictions > self._evictions_seen
                self._evictions_seen = evictions
            return self._armed
        if step == self._last_prob_step:
            return False
        self._last_prob_step = step
        return self.rng.random() < t.p
