"""Incident records: what an operator reads when kvguard flags a request ("which page, who had it, since when").

One JSON object per flagged request, appended as one line to ``<KVGUARD_INCIDENT_DIR>/incidents-<pid>.jsonl``
and emitted as a structlog ``kvguard.incident`` event: request id, rank, step (the check it was found
by), page, logical position, expected and found tag, reason, bad entries, time, and, with
``KVGUARD_HISTORY=N``, the page's last N tag events (alloc / free / stamp) from a bounded ring.

Cost: the records are written only on a violation (the slow path). The ring is off by default; on, it
adds two small device writes per allocation and per free (no host sync). It is read only for a record.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict

import structlog
import torch

from .settings import SettingsError

log = structlog.get_logger("kvguard")

KINDS = ("alloc", "free", "stamp")
ALLOC, FREE, STAMP = range(len(KINDS))


def prepare_dir(folder: str) -> str:
    """Create the incident folder (if it is set) and prove a file can be made there; SettingsError if not."""
    if not folder:
        return folder
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kvguard-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise SettingsError(f"KVGUARD_INCIDENT_DIR={folder!r} is not valid: no file can be made there "
                            f"({err.strerror or err}); give a writable folder, or leave it unset") from None
    return folder


class PageHistory:
    """The last ``depth`` tag events of every page, on the tags' device (written without a host sync)."""

    def __init__(self, num_pages: int, depth: int, device):
        self.depth = depth
        self.events = torch.full((num_pages, depth), -1, dtype=torch.int64, device=device)  # tag * 4 + kind
        self.cursor = torch.zeros(num_pages, dtype=torch.int64, device=device)

    def note(self, pages: torch.Tensor, tags: torch.Tensor, kind: int) -> None:
        if pages.numel() == 0:
            return
        pages = pages.to(self.events.device, torch.int64)
        slot = self.cursor[pages] % self.depth
        self.events[pages, slot] = tags.to(self.events.device, torch.int64) * 4 + kind
        self.cursor.index_add_(0, pages, torch.ones_like(pages))

    def of(self, page: int) -> list[dict]:
        """Slow path: the page's events, oldest first."""
        if not 0 <= page < self.events.shape[0]:
            return []
        row, n = self.events[page].cpu().tolist(), int(self.cursor[page])
        order = [row[(n + i) % self.depth] for i in range(self.depth)]
        return [{"event": KINDS[e % 4], "tag": e // 4} for e in order if e >= 0]


class IncidentLog:
    """Appends incident records to ``<folder>/incidents-<pid>.jsonl`` (one line each, flushed)."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, f"incidents-{os.getpid()}.jsonl")

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def record_of(violation, *, rank: int, step: int, history: PageHistory | None) -> dict:
    """The incident record of one violation."""
    record = {"time": time.time(), "rank": rank, "step": step, **asdict(violation)}
    if history is not None:
        record["page_history"] = history.of(violation.page)
    return record


def emit(record: dict, incident_log: IncidentLog | None) -> None:
    log.warning("kvguard.incident", **record)
    if incident_log is not None:
        incident_log.write(record)


def rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0
