"""The transfer writer's stamp (kvguard.transfer.stamp, TagTracker.transfer_stamp): PD decode's transfer tags."""
import torch
from prometheus_client import CollectorRegistry

from kvguard import TagTracker, TrackerConfig


def _tracker():
    tracker = TagTracker(TrackerConfig(mode="check", backend="torch"), CollectorRegistry())
    tracker.attach(num_pages=16, num_rows=4, max_entries=4, device="cpu")
    return tracker


def _check(tracker, row, pages):
    table = torch.tensor([pages], dtype=torch.int32)
    check = tracker.validate(table, torch.tensor([row]), torch.tensor([len(pages)]), max_entries=4)
    return tracker.resolve(check, check.verdict.cpu(), ["r"])


def test_a_current_transfer_stamps_nothing_new():
    tracker = _tracker()
    pages = torch.tensor([3, 4])
    tracker.on_alloc(pages)
    tracker.record(1, 0, pages)
    ticket = tracker.transfer_issue(pages, row=1)
    before = tracker.tags.tags.clone()
    tracker.transfer_stamp(ticket)
    assert torch.equal(tracker.tags.tags, before) and _check(tracker, 1, [3, 4]) == []


def test_a_late_transfer_leaves_a_fresh_tag_its_pages_new_owner_does_not_expect():
    tracker = _tracker()
    a_pages = torch.tensor([3, 4])
    tracker.on_alloc(a_pages)
    tracker.record(1, 0, a_pages)
    ticket = tracker.transfer_issue(a_pages, row=1)  # A's transfer, still in flight
    tracker.on_free(a_pages)  # A finished (or was aborted): its pages go back ...
    tracker.drop(1)
    tracker.on_alloc(torch.tensor([4]))  # ... and page 4 is handed to B
    tracker.record(2, 0, torch.tensor([4]))
    b_tag, issued = int(tracker.tags.tags[4]), tracker.tags.next_tag
    tracker.transfer_stamp(ticket)  # A's transfer lands late
    now = int(tracker.tags.tags[4])
    assert now not in (b_tag, int(ticket.tags[1])) and now >= issued  # fresh: no old tag comes back
    [err] = _check(tracker, 2, [4])
    assert (err.page, err.expected_tag, err.found_tag) == (4, b_tag, now)
    assert tracker.held_pages(2, 0, 1).tolist() == [4]  # still B's to give back when B is aborted
