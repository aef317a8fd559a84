"""``TagTracker``'s transfer-tag methods (PD: a KV transfer's ticket issued, landed, stamped, explained).

A mixin of :class:`kvguard.tracker.TagTracker`, which owns every structure these methods read or write (the tag
table, ``overwritten``, the page history, the lock); the tensor work is ``kvguard.transfer``'s.
"""
import torch

from . import incidents, transfer
from .violations import KVGuardViolation, Violation


class TransferTagMethods:
    """transfer_issue, transfer_land, transfer_stamp, transfer_violation (state: :class:`TagTracker`'s)."""

    def transfer_issue(self, pages: torch.Tensor, *, row: int = -1, first: int = 0):
        self._require_attached()
        with self.lock:
            return transfer.issue(self.tags, pages, row=row, first=first)

    def transfer_land(self, tickets) -> torch.Tensor:
        self._require_attached()
        self.metrics.checks.inc()
        with self.lock:
            return transfer.land(self.tags, tickets)

    def transfer_stamp(self, ticket) -> None:
        """The writer of a transfer stamps its ticket's tags after its KV landed (``transfer.stamp``)."""
        self._require_attached()
        with self.lock:
            self.overwritten[ticket.pages] = self.tags.tags[ticket.pages]
            transfer.stamp(self.tags, ticket)
            if self.history is not None:
                self.history.note(ticket.pages, self.tags.tags[ticket.pages], incidents.STAMP)

    def transfer_violation(self, ticket, request_id: str) -> KVGuardViolation:
        """Slow path, only for a discarded transfer: the violation that aborts its request."""
        i, page, want, now, bad = transfer.first_bad(self.tags, ticket) or (0, -1, -1, -1, 0)
        err = KVGuardViolation(Violation(
            request_id=request_id, row=ticket.row, logical_position=(ticket.first + i) * self.page_size,
            page=page, expected_tag=want, found_tag=now, reason="transfer_target_changed", bad_entries=bad))
        self.report(err.violation)
        return err
