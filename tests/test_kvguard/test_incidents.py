"""Incident records (kvguard.incidents): one JSON line per flagged request, with the page's tag history.

Driven like test_tracker.py's engine (on_alloc -> record -> validate -> resolve) on a real TagTracker.
"""
import json

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvguard import SettingsError, TagTracker, TrackerConfig
from kvguard.incidents import prepare_dir
from kvguard.settings import HISTORY_MAX


def _tracker(tmp_path, history=4):
    config = TrackerConfig(mode="check", backend="torch", incident_dir=str(tmp_path), history=history)
    tracker = TagTracker(config, CollectorRegistry())
    tracker.attach(num_pages=16, num_rows=4, max_entries=4, device="cpu")
    return tracker


def _premature_free(tracker):
    """Request r0 on row 1 maps pages 3, 4; page 4 is freed under it and handed to r1; a check finds r0."""
    pages = torch.tensor([3, 4])
    tracker.on_alloc(pages)
    tracker.record(1, 0, pages)
    tracker.on_free(torch.tensor([4]))
    tracker.on_alloc(torch.tensor([4]))
    tracker.record(2, 0, torch.tensor([4]))
    table = torch.tensor([[3, 4], [4, 0]], dtype=torch.int32)
    check = tracker.validate(table, torch.tensor([1, 2]), torch.tensor([2, 1]), max_entries=4)
    return tracker.resolve(check, check.verdict.cpu(), ["r0", "r1"])


def test_one_record_per_flagged_request_with_the_pages_history(tmp_path):
    tracker = _tracker(tmp_path)
    found = _premature_free(tracker)
    assert [e.request_id for e in found] == ["r0"]
    files = list(tmp_path.glob("incidents-*.jsonl"))
    assert len(files) == 1
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert len(records) == 1
    rec = records[0]
    v = found[0].violation
    assert (rec["request_id"], rec["page"], rec["logical_position"]) == ("r0", 4, 1)
    assert (rec["expected_tag"], rec["found_tag"], rec["reason"]) == (v.expected_tag, v.found_tag, "tag_mismatch")
    assert rec["rank"] == 0 and rec["step"] == 1
    events = rec["page_history"]
    assert [e["event"] for e in events] == ["alloc", "free", "alloc"]
    assert events[0]["tag"] == rec["expected_tag"] and events[-1]["tag"] == rec["found_tag"]


def test_history_ring_keeps_the_last_events_oldest_first(tmp_path):
    tracker = _tracker(tmp_path, history=2)
    page = torch.tensor([5])
    tags = [int(tracker.on_alloc(page)[0])]
    for _ in range(3):
        tracker.on_free(page)
        tags.append(int(tracker.tags.tags[5]))
        tags.append(int(tracker.on_alloc(page)[0]))
    assert tracker.history.of(5) == [{"event": "free", "tag": tags[-2]}, {"event": "alloc", "tag": tags[-1]}]


def test_no_ring_and_no_file_by_default(tmp_path):
    tracker = TagTracker(TrackerConfig(mode="check", backend="torch"), CollectorRegistry())
    tracker.attach(num_pages=16, num_rows=4, max_entries=4, device="cpu")
    assert tracker.history is None and tracker.incident_log is None
    assert len(_premature_free(tracker)) == 1


@pytest.mark.parametrize("value", ["-1", str(HISTORY_MAX + 1), "x", "", " "])
def test_bad_history_setting_is_refused(value):
    with pytest.raises(SettingsError, match="KVGUARD_HISTORY"):
        TrackerConfig.from_env({"KVGUARD_HISTORY": value})


def test_incident_dir_must_be_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in ("/proc/nope", str(blocker / "sub")):
        with pytest.raises(SettingsError, match="KVGUARD_INCIDENT_DIR"):
            prepare_dir(bad)
    with pytest.raises(SettingsError, match="KVGUARD_INCIDENT_DIR=.* is empty"):
        TrackerConfig.from_env({"KVGUARD_INCIDENT_DIR": " "})
    assert prepare_dir(str(tmp_path / "new")) and (tmp_path / "new").is_dir()
    assert list((tmp_path / "new").iterdir()) == []


def test_register_refuses_an_unwritable_incident_dir():
    from kvguard.sglang.plugin import KVGuardStartupError, register

    with pytest.raises(KVGuardStartupError, match="KVGUARD_INCIDENT_DIR"):
        register({"KVGUARD_MODE": "check", "KVGUARD_INCIDENT_DIR": "/proc/nope"})
