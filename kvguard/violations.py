"""What a failed check produces: an exception per affected request and one structured log event."""
from dataclasses import asdict, dataclass

import structlog

log = structlog.get_logger("kvguard")


# Every reason a violation can carry (the ``reason`` label of kvguard_violations_total, set up in advance so
# that an alert's series exists before the first violation).
PEER_RANK = "peer_rank"  # a violation found by another tensor-parallel rank only
REASONS = ("tag_mismatch", "out_of_range", "unrecorded", "misplaced_in_page", "bad_row", "unchecked",
           "stale_row", "unknown_row", "transfer_target_changed",
           "state_slot", PEER_RANK)


@dataclass(frozen=True)
class Violation:
    """One request whose KV mapping does not match what it expects (first bad entry reported)."""

    request_id: str
    row: int
    logical_position: int  # first token position of the first bad page
    page: int  # the page id the table holds there (may be out of range)
    expected_tag: int
    found_tag: int | None  # None when the page id is out of range
    reason: str  # one of REASONS
    bad_entries: int


class KVGuardViolation(RuntimeError):
    """Raised (or returned) for a request whose KV pages do not match its expected mapping."""

    def __init__(self, violation: Violation):
        self.violation = violation
        v = violation
        found = "out of range" if v.found_tag is None else f"found tag {v.found_tag}"
        super().__init__(
            f"kvguard: request {v.request_id} aborted: KV page mapping broken at position "
            f"{v.logical_position} (page {v.page}: expected tag {v.expected_tag}, {found}; "
            f"{v.bad_entries} bad entr{'y' if v.bad_entries == 1 else 'ies'}, {v.reason})"
        )

    def __getattr__(self, name):
        # request_id, logical_position, page, expected_tag, found_tag ... straight from the record
        if name == "violation":
            raise AttributeError(name)
        return getattr(self.violation, name)


def log_violation(violation: Violation) -> None:
    """One structlog event per violation."""
    log.warning("kvguard.violation", **asdict(violation))
