"""Ground truth, kept outside the engine's bookkeeping and never reading the tracker.

The oracle shadows three things, each from the engine's observable actions:
- *content*: which KV content sits in every physical slot. A slot written for request r at position
  i holds "the KV of tokens[:i+1]" (a prefix hash), so shared prefix pages compare equal, as they must;
- *grants*: which physical page each request was legitimately given for each logical page, and the
  allocator's move count of that page at that moment (every alloc and free moves a page);
- *reads*: the page-table rows a forward is about to read (the engine's own table, pre-check).

A request becomes a **victim** at the first forward that would read, for any live position, a page
other than the one it was granted (``mapping``), a page the allocator has moved since the grant or that
sits in the free pool now (``revoked``: freed or handed out again; a prefix-cache hit on a page a buggy
release freed under the tree is granted while free), or a slot whose content is not its own
(``foreign_data``). After ``on_kv_scales_lost`` (the FP8 scales of the KV pool were lost, e.g. a
sleep/wake cycle that re-allocates the pool without its scales) every read is a victim (``kv_scale``):
no mapping is wrong, every byte is read with the wrong scale.
In phase-split mode a request is also a victim when its prefill->decode transfer lands while a target
page is no longer its own (``transfer_revoked``); the landing's writes are ``on_write`` events like any.
"""
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class OracleReport:
    victims: dict[str, int] = field(default_factory=dict)  # rid -> first victim step
    reasons: dict[str, str] = field(default_factory=dict)
    aborted_by_tracker: dict[str, int] = field(default_factory=dict)  # rid -> abort step
    corrupted_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def false_positives(self) -> list[str]:
        return sorted(set(self.aborted_by_tracker) - set(self.victims))

    @property
    def victims_aborted(self) -> list[str]:
        return sorted(set(self.aborted_by_tracker) & set(self.victims))

    def detection_latencies(self) -> list[int]:
        return [self.aborted_by_tracker[r] - self.victims[r] for r in self.victims_aborted]


class Oracle:
    """Observer of an Engine: allocator listener + engine events. See the module docstring."""

    def __init__(self):
        self.report = OracleReport()
        self.moves: dict[int, int] = defaultdict(int)  # page -> allocator moves seen
        self.granted: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)  # rid -> j -> (page, moves)
        self.keys: dict[str, list[int]] = {}
        self.holder: dict[int, str] = {}  # page -> request it was last handed to exclusively
        self.content: np.ndarray | None = None
        self.page_size = 1
        self._pending: list = []
        self.free_now: set[int] = set()  # pages whose last allocator move was a free
        self.scales_lost_at: int | None = None

    # -- allocator listener ------------------------------------------------------------------------
    def on_alloc(self, pages) -> None:
        for p in pages.tolist():
            self.moves[p] += 1
            self.free_now.discard(p)

    def on_free(self, pages) -> None:
        for p in pages.tolist():
            self.moves[p] += 1
            self.holder.pop(p, None)
            self.free_now.add(p)

    def on_kv_scales_lost(self, step: int, **_) -> None:
        """The KV pool's FP8 scales were lost: every read from now on dequantizes with the wrong scale."""
        if self.scales_lost_at is None:
            self.scales_lost_at = step

    # -- engine events -----------------------------------------------------------------------------
    def on_engine(self, engine) -> None:
        self.page_size = engine.page_size
        slots = (engine.num_pages + 1 + engine.kv.guard_pages) * engine.page_size
        self.content = np.full(slots, -1, dtype=np.int64)

    def on_grant(self, request, first: int, pages: list[int], step: int, shared: int = 0, **_) -> None:
        for j, page in enumerate(pages):
            if j >= shared:  # an exclusive hand-out: it supersedes any other holder of the page
                if self.holder.get(page, request.rid) != request.rid:
                    self.moves[page] += 1
                self.holder[page] = request.rid
            self.granted[request.rid][first + j] = (page, self.moves[page])

    def before_read(self, engine, step: int, requests, lengths) -> None:
        """Snapshot the rows the forward will read; judged once this forward's writes are known."""
        ps = self.page_size
        self._pending = [(r, engine.table[r.row, :-(-n // ps)].tolist(), n) for r, n in zip(requests, lengths)]

    def on_write(self, requests, positions: list[int], slots: list[int], step: int) -> None:
        for request, pos, slot in zip(requests, positions, slots):
            if 0 <= slot < self.content.size:
                self.content[slot] = self._key(request, pos)
        for request, row, n in self._pending:
            self._judge(request, row, n, step)
        self._pending = []

    def on_transfer_land(self, request, first: int, pages: list[int], step: int, **_) -> None:
        """A prefill->decode transfer is landing (its writes follow as ``on_write``).

        Its request is a victim if a target is no longer the page it was granted, unmoved since: its KV
        cannot land where it belongs, whether the transfer then writes someone else's page or is dropped.
        """
        if request.rid in self.report.victims:
            return
        grants = self.granted[request.rid]
        for j, page in enumerate(pages):
            grant = grants.get(first + j)
            if grant is None or grant[0] != page or self.moves[page] != grant[1]:
                self.report.victims[request.rid] = step
                self.report.reasons[request.rid] = "transfer_revoked"
                return

    def on_token(self, request, token: int, step: int) -> None:
        if request.rid in self.report.victims:
            self.report.corrupted_tokens[request.rid] += 1

    def on_abort(self, request, step: int, by_tracker: bool) -> None:
        if by_tracker:
            self.report.aborted_by_tracker[request.rid] = step

    # -- truth -------------------------------------------------------------------------------------
    def _key(self, request, pos: int) -> int:
        """Content id of request's KV at ``pos``: a hash of its tokens[:pos + 1]."""
        keys = self.keys.setdefault(request.rid, [])
        tokens = request.tokens
        while len(keys) <= pos:
            keys.append(hash((keys[-1] if keys else 0x9E37, tokens[len(keys)])))
        return keys[pos]

    def _judge(self, request, row: list[int], n_tokens: int, step: int) -> None:
        if request.rid in self.report.victims:
            return
        reason = self._mapping_fault(request.rid, row) or self._content_fault(request, row, n_tokens)
        if reason is None and self.scales_lost_at is not None:
            reason = "kv_scale"
        if reason:
            self.report.victims[request.rid] = step
            self.report.reasons[request.rid] = reason

    def _mapping_fault(self, rid: str, row: list[int]) -> str | None:
        grants = self.granted[rid]
        for j, page in enumerate(row):
            if j not in grants or grants[j][0] != page:
                return "mapping"
            if self.moves[page] != grants[j][1] or page in self.free_now:
                return "revoked"
        return None

    def _content_fault(self, request, row: list[int], n_tokens: int) -> str | None:
        ps = self.page_size
        pos = np.arange(n_tokens)
        slots = np.asarray(row, dtype=np.int64)[pos // ps] * ps + pos % ps
        inside = (slots >= 0) & (slots < self.content.size)
        if not inside.all():
            return "foreign_data"
        want = np.array([self._key(request, int(i)) for i in pos], dtype=np.int64)
        return None if np.array_equal(self.content[slots], want) else "foreign_data"
