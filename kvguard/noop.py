"""The tracker protocol and its default: ``Check`` (a launched validation) and ``NoopTracker``.

An engine drives a tracker through five calls (see docs/structures.md): ``on_alloc`` / ``on_free`` as its
allocator hands pages out and takes them back, ``record`` / ``drop`` as a request slot gains and releases
pages, ``validate`` right before a forward reads the KV cache (one launch, no sync), and ``resolve`` after
the engine has copied the verdict to the host together with the sampled token ids. ``NoopTracker`` (the
default) answers every call at once and costs nothing; ``kvguard.tracker.TagTracker`` checks.
"""
from dataclasses import dataclass

import torch

from .violations import KVGuardViolation


@dataclass
class Check:
    """A launched validation: the device verdict plus what is needed to explain a failure."""

    verdict: torch.Tensor  # int32 [B, n_chunks] on the device; read it with the sampled ids
    rows: torch.Tensor  # [B] request slot (row of `expected`) of each batch entry
    source: torch.Tensor  # the engine's own table (never quarantined), for diagnostics
    source_rows: torch.Tensor  # [B] row of `source` for each batch entry
    entry_step: int
    page_div: int
    per_token: bool = False  # every token entry of a token table was checked (page and in-page offset)


class NoopTracker:
    """The default tracker: every call returns at once; no device work, no allocation."""

    enabled = False

    def attach(self, *, num_pages: int, num_rows: int, max_entries: int, device, page_size: int = 1) -> None:
        """Size the tracker for a pool of ``num_pages`` pages (scratch page 0 included)."""

    def on_alloc(self, pages: torch.Tensor) -> torch.Tensor | None:
        """Pages handed out by the allocator; returns the tag each slot of the allocation got (or None)."""

    def on_free(self, pages: torch.Tensor) -> None:
        """Pages returned to the allocator."""

    def record(self, row: int, first: int, pages: torch.Tensor, tags: torch.Tensor | None = None) -> None:
        """Request slot ``row`` now maps logical pages ``first..first+len(pages)`` to ``pages``.

        ``tags``: the tags the allocation gave these pages (slices of what ``on_alloc`` returned);
        None reads the pages' current tags (pages shared from a prefix cache).
        """

    def record_many(self, rows: torch.Tensor, cols: torch.Tensor, pages: torch.Tensor,
                    where: torch.Tensor | None = None, tags: torch.Tensor | None = None) -> None:
        """Vectorized :meth:`record`: ``expected[rows[i], cols[i]] = tags[i]`` (default: ``tag(pages[i])``).

        ``where`` (a bool mask, on the device: no sync) limits the update; other entries keep theirs.
        """

    def record_decode(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, *,
                      fresh: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
        """One decode step's growth: each request whose position starts a page maps its new page there."""

    def drop(self, row: int) -> None:
        """Request slot ``row`` released its pages."""

    def held_pages(self, row: int, first: int, end: int) -> torch.Tensor:
        """Pages recorded for ``row`` at logical ``first..end`` that it still holds (tags unchanged)."""
        raise NotImplementedError("the no-op tracker records nothing")

    def validate(self, table, rows, n_entries, *, max_entries, table_rows=None, source=None,
                 source_rows=None, entry_step=1, page_div=1, per_token=False, entries_hint=None,
                 guard=None) -> Check | None:
        """Launch the batched check (the no-op tracker launches nothing and returns None)."""
        return None

    def resolve(self, check: Check | None, verdict_host: torch.Tensor | None,
                request_ids: list[str], ignore: list[bool] | None = None) -> list[KVGuardViolation]:
        """Turn a host verdict into one violation per flagged request not in ``ignore`` (none for the no-op)."""
        return []

    # -- KV transfers (phase split; see kvguard/transfer.py) ----------------------------------------
    def transfer_issue(self, pages: torch.Tensor, *, row: int = -1, first: int = 0):
        """A transfer into ``pages`` was issued: the ticket to land it with (None: unguarded)."""
        return None

    def transfer_land(self, tickets) -> torch.Tensor | None:
        """Transfers are landing: bool [n] device verdict, True = commit (None: all land, unguarded)."""
        return None
