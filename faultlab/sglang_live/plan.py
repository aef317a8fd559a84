"""The fault plan of faultlab's SGLang plugin (faultlab/sglang_live/inject.py, whose docstring says what each
variable, entry key and fault class means): the environment variables, the fault classes, and the entries
parsed from ``FAULTLAB_SGLANG_FAULTS``. Stdlib only.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

ENV_FAULTS = "FAULTLAB_SGLANG_FAULTS"
ENV_SEED = "FAULTLAB_SGLANG_SEED"
ENV_LOG = "FAULTLAB_SGLANG_LOG"
ENV_ROTARY = "FAULTLAB_SGLANG_CPU_ROTARY"
ENV_CPU_SPEC = "FAULTLAB_SGLANG_CPU_SPEC"
ENV_CPU_MAMBA = "FAULTLAB_SGLANG_CPU_MAMBA"
ENV_DUMMY = "FAULTLAB_SGLANG_DUMMY_INIT"
ENV_ACCOUNTING = "FAULTLAB_SGLANG_ACCOUNTING"
ENV_KV_WATCH = "FAULTLAB_SGLANG_KV_WATCH"
ENV_KV_WATCH_RIDS = "FAULTLAB_SGLANG_KV_WATCH_RIDS"
ENV_PD_WRITER = "FAULTLAB_SGLANG_PD_WRITER"

DECODE_FAULTS = ("swapped_entries", "index_shift", "in_page_entry", "out_of_range_entry")
CONTROL = "none"  # arms and logs like a fault, corrupts nothing (the fault-free episode of a driver)
REUSER_FAULTS = ("premature_free", "double_free", "stale_row")
# A control with a victim: at a reuser's prefill it picks the request stale_row would (same seed, same
# draws) and has SGLang abort it at its next decode step (the scheduler's own abort path), corrupting
# nothing: the run a stale_row episode's other requests are compared with.
ABORT_CONTROL = "sglang_abort"
TWIN = {ABORT_CONTROL: "stale_row"}  # a control draws its choices as its twin fault does
# Armed like a decode fault; strikes after SGLang prepared the step (ScheduleBatch.prepare_for_decode,
# AFTER) and is undone before the next step is prepared.
ROW_FAULTS = ("stale_batch_row",)
# PD decode only (disaggregation_mode="decode", fake transfer backend, faultlab's prefill writer on):
# strikes between two decode steps of the reusers, once every reuser decodes.
PD_FAULTS = ("late_transfer_write",)
# Speculative decoding only (a spec engine: kvguard/sglang/spec.py): strike at arming, between two spec steps, in the
# region alloc_for_spec_decode reserved past the committed length (faultlab/sglang_live/path_strikes.py: _strike_spec).
SPEC_FAULTS = ("spec_region_entry", "rejected_page_freed", "draft_slot_reused")
# Hybrid linear-attention / mamba models only (a HybridReqToTokenPool): mamba_index_swap strikes when armed, like a
# decode fault; mamba_slot_reuse at a reuser's prefill, like a reuser fault (faultlab/sglang_live/path_strikes.py).
MAMBA_FAULTS = ("mamba_index_swap", "mamba_slot_reuse")
# Their twins on a hybrid model with speculative decoding (a spec engine: kvguard/sglang/mamba_spec.py), struck at the
# same points, between two spec steps; skipped (logged) on an engine without speculative decoding.
SPEC_MAMBA_FAULTS = ("spec_mamba_index_swap", "spec_mamba_slot_reuse")
# Sliding-window hybrids only (SWATokenToKVPoolAllocator): strike when armed, like a decode fault, at a position inside
# the victim's window (faultlab/sglang_live/path_strikes.py: _strike_swa).
SWA_FAULTS = ("swa_cleared_entry", "swa_foreign_entry", "swa_freed_slot")
FAULTS = DECODE_FAULTS + REUSER_FAULTS + ROW_FAULTS + PD_FAULTS + SPEC_FAULTS + MAMBA_FAULTS + SPEC_MAMBA_FAULTS \
    + SWA_FAULTS + (CONTROL, ABORT_CONTROL)
# what a sweep or a GPU fault run covers by default: the classes of the plain serving path (the aggregated
# engine), in this order, and the twin control. ROW_FAULTS and PD_FAULTS are run by
# tests/test_faultlab/test_sglang_live/test_sglang_paths.py.
EPISODE_CLASSES = DECODE_FAULTS + REUSER_FAULTS + (ABORT_CONTROL,)


class PlanError(ValueError):
    """A malformed fault plan (raised at registration: the scheduler does not start)."""


@dataclass
class Entry:
    fault: str
    seed: int
    rid_prefix: str = ""
    reuser_prefix: str | None = None
    step: int | None = None
    min_candidates: int = 2
    min_reusers: int = 1  # late_transfer_write: reusers that must decode before it strikes
    label: str = ""
    tp_rank: int | None = None  # arms only in the scheduler process of this SGLang TP rank (None: in every one)
    # runtime state
    decoding: bool = False  # a candidate reached a decode batch (logged once: a driver's cue)
    armed: bool = False
    done: bool = False
    candidates: list = field(default_factory=list)
    rng: random.Random | None = None
    watch: dict | None = None  # double_free: page -> copies left to hand out, receivers
    abort: object = None  # sglang_abort: the request to abort at its next decode step
    pending: bool = False  # stale_batch_row: armed at this step's BEFORE hook, strikes at its AFTER hook
    clobbered: bool = False  # stale_batch_row: struck; the true rows are rebuilt at the next step
    reuser_step: int = 0  # late_transfer_write: the reusers' output tokens when it strikes (1 or 2)

    def __post_init__(self):
        if self.fault not in FAULTS:
            raise PlanError(f"{ENV_FAULTS}: fault {self.fault!r} is not one of {', '.join(FAULTS)}")
        self.rng = random.Random(f"{TWIN.get(self.fault, self.fault)}:{self.seed}")
        if self.step is None:
            self.step = self.rng.randint(2, 6)
        if self.fault == "late_transfer_write":
            # NOTE: at a reuser's first or second decode step: the handoff token (and at most one decode
            # token) came from the KV the transfer wrote; every later token would read the late write.
            self.reuser_step = self.rng.randint(1, 2)

    def is_candidate(self, req) -> bool:
        return str(req.rid).startswith(self.rid_prefix)

    def is_reuser(self, req) -> bool:
        if self.reuser_prefix is not None:
            return str(req.rid).startswith(self.reuser_prefix)
        return not any(req is c for c in self.candidates)


def parse_plan(text: str, seed: int | str = 0) -> list[Entry]:
    """The entries of a plan (see the module docstring); PlanError names what is wrong."""
    try:
        seed = int(seed)
    except ValueError:
        raise PlanError(f"{ENV_SEED}: {seed!r} is not an integer") from None
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{ENV_FAULTS}: not valid JSON ({exc})") from None
        keys = {"fault", "seed", "rid_prefix", "reuser_prefix", "step", "min_candidates", "min_reusers", "label",
                "tp_rank"}
        if not isinstance(raw, list):
            raise PlanError(f"{ENV_FAULTS}: a JSON list of entries is expected, got {type(raw).__name__}")
        entries = []
        for item in raw:
            if not isinstance(item, dict) or set(item) - keys or "fault" not in item:
                raise PlanError(f"{ENV_FAULTS}: entry {item!r}: needs 'fault'; allowed keys are {sorted(keys)}")
            for key in ("seed", "step", "min_candidates", "min_reusers", "tp_rank"):
                if item.get(key) is not None and (not isinstance(item[key], int) or isinstance(item[key], bool)
                                                  or item[key] < 0):
                    raise PlanError(f"{ENV_FAULTS}: entry {item!r}: {key} must be an integer >= 0")
            entries.append(Entry(**{"seed": seed, **item}))
        return entries
    return [Entry(fault=name.strip(), seed=seed) for name in text.split(",") if name.strip()]
