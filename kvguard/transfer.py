"""The transfer guard: a KV transfer whose target pages changed hands while it was in flight is discarded.

Phase-split serving prefills on one KV pool and decodes on another: each finished prefill's KV is copied
into pages the decode side allocated for it. The copy is asynchronous, so between *issue* and *landing*
the decode side can free those pages (an abort, a retraction, a bookkeeping bug) and hand them to another
request; landing then writes one request's KV into another request's pages.

The guard rides on the tag table: tags change on every free and every allocation.

- ``issue(tags, pages)`` snapshots the target pages' tags (a device gather, no host sync);
- ``land(tags, tickets)`` compares every ticket's snapshot with the current tags in one batched pass and
  returns one verdict per transfer (``ok``: bool, on the device, no host sync);
- ``stamp(tags, ticket)`` is the writer's side of a transfer tag (PD decode in SGLang): after its KV
  landed, the writer stamps its ticket; a late stale write thus leaves fresh tags the pages' new owners do
  not expect;
- ``guard_slots(slots, owner, ok, page_size)`` turns the flat destination slots of a batch of landing
  transfers into the slots the commit may write: a failed transfer's tokens go to the scratch page.

NOTE (stage then commit, not "order the write after the check"): the transfer lands in a staging buffer
(the engine's), and only the commit -- one store per layer, *after* the check, through ``guard_slots`` --
writes the decode pages. Ordering the copy itself after the check would serialize the transfer behind
the landing point and lose the overlap that makes it asynchronous; staging keeps the long copy (the
prefill pool read, across a link in a real disaggregated deployment) off the critical path, and the
commit is a local, pool-sized-per-token copy. The commit needs no host sync either: a failed transfer's
writes are redirected to scratch page 0 (never handed out; its content is garbage by definition), the
same trick the batched check uses to quarantine reads. The host learns the verdict when it next syncs
and aborts the request.

Nothing here imports faultlab; the engine owns the staging buffers and the pages.
"""
from dataclasses import dataclass
from typing import Sequence

import torch

from .tags import TagTable


@dataclass(frozen=True, eq=False)
class TransferTicket:
    """A transfer in flight: its target pages and their tags when it was issued."""

    pages: torch.Tensor  # int64 [n] target pages, on the tag device
    tags: torch.Tensor  # int64 [n] their tags at issue
    row: int = -1  # request slot (for the explanation only)
    first: int = 0  # first logical page of the targets (for the explanation only)


def issue(table: TagTable, pages: torch.Tensor, *, row: int = -1, first: int = 0) -> TransferTicket:
    """Snapshot the tags of ``pages`` (device gather, no sync)."""
    pages = pages.to(device=table.tags.device, dtype=torch.int64)
    return TransferTicket(pages, table.gather(pages), row, first)


def land(table: TagTable, tickets: Sequence[TransferTicket]) -> torch.Tensor:
    """One batched compare: bool [len(tickets)] on the device, True where every target kept its tag."""
    device = table.tags.device
    if not tickets:
        return torch.ones(0, dtype=torch.bool, device=device)
    pages = torch.cat([t.pages for t in tickets])
    want = torch.cat([t.tags for t in tickets])
    # NOTE: the counts are tensor shapes, known on the host: building `owner` needs no device sync.
    counts = torch.tensor([t.pages.numel() for t in tickets])
    owner = torch.repeat_interleave(torch.arange(len(tickets)), counts).to(device, non_blocking=True)
    bad = (table.tags[pages] != want).to(torch.int32)
    bad_per_ticket = torch.zeros(len(tickets), dtype=torch.int32, device=device).index_add_(0, owner, bad)
    return bad_per_ticket == 0


def stamp(table: TagTable, ticket: TransferTicket) -> None:
    """The writer's stamp after its KV landed in ``ticket.pages``.

    A transfer whose targets kept their tags changes nothing. A late one (its targets freed and handed
    out since) gives each target whose tag changed a fresh tag nobody expects, so every holder's next check
    fails (device, no sync).

    NOTE: not the ticket's own (old) tag, as a writer in the write-up's design stamps into a separate
    table: here the stamp lands in the one tag table, and an old tag written back could match an
    expectation still held for it (a tree page adopted with that tag), so every tag stays issued once.
    """
    count = ticket.pages.numel()
    if count == 0:
        return
    assert table.next_tag + count < 2**63 - 1, f"tag counter would wrap at {table.next_tag}"
    fresh = torch.arange(table.next_tag, table.next_tag + count, device=table.tags.device)
    table.next_tag += count
    now = table.tags[ticket.pages]
    table.tags.index_copy_(0, ticket.pages, torch.where(now == ticket.tags, now, fresh))


def guard_slots(slots: torch.Tensor, owner: torch.Tensor, ok: torch.Tensor, page_size: int,
                scratch_page: int = 0) -> torch.Tensor:
    """Flat destination slots [T] of a landing batch, with a failed transfer's tokens sent to scratch.

    ``owner[t]`` is the transfer (index into ``ok``) token ``t`` belongs to.
    """
    keep = ok.to(slots.device)[owner.to(slots.device)]
    return torch.where(keep, slots, scratch_page * page_size + slots % page_size)


def first_bad(table: TagTable, ticket: TransferTicket) -> tuple[int, int, int, int, int] | None:
    """Slow path (host), for the error message: (index, page, tag at issue, tag now, targets changed)
    of the first target whose tag changed, or None."""
    now = table.gather(ticket.pages).cpu()
    want = ticket.tags.cpu()
    changed = (now != want).nonzero().flatten()
    if changed.numel() == 0:
        return None
    i = int(changed[0])
    return i, int(ticket.pages[i]), int(want[i]), int(now[i]), changed.numel()
