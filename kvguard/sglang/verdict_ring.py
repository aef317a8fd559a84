"""The per-step check's buffers on one SGLang 0.5.23 pool set: :class:`VerdictRing`.

Where a check launched before each forward writes its verdict: a flag cell in pinned host memory per slot (read by
:meth:`kvguard.sglang.verdicts.VerdictSide.resolve` with the sampled ids), a device verdict buffer read only when
that cell says so, an event, and attention TP's agreed copy. Owned by one
:class:`~kvguard.sglang.guard.SGLangGuard` (``guard._ring``).
"""
from __future__ import annotations

import logging

import torch

from ..kernels.launch import cuda_index
from ..kernels.tag_check import n_chunks_for

log = logging.getLogger("kvguard.sglang")

VERDICT_RING = 8  # checks in flight at most (see VerdictRing)
STAMP_LIMIT = 2**30  # flag stamps run 1..STAMP_LIMIT (an i32 kernel argument: one compiled variant)


class VerdictRing:
    """The per-step check's buffers, reused round robin: no allocation, no new event per step.

    Slot ``i`` has a flag cell in pinned host memory (the check writes its stamp there when anything is
    bad), a device verdict buffer (grown when a batch needs more cells) and a CUDA event. NOTE: at most two
    checks are in flight (the overlap scheduler's batch N, resolved after N+1 was launched, plus a
    prefill's); a ring of VERDICT_RING slots is never reused before its verdict was read.
    """

    def __init__(self, launch, device: torch.device):
        self.launch, self.device = launch, device
        cuda = device.type == "cuda"
        self.host_flags = torch.zeros(VERDICT_RING, dtype=torch.int64, pin_memory=cuda)
        self.host_cells = [self.host_flags[i:i + 1] for i in range(VERDICT_RING)]
        self._host_np = memoryview(self.host_flags.numpy())  # reads Python ints (no numpy scalar per step)
        self.device_flags = None  # set by self_test when the device cannot write pinned memory directly
        self.flag_cells = self.host_cells
        self._verdicts = [torch.empty(0, dtype=torch.int32, device=device) for _ in range(VERDICT_RING)]
        self.generation = object()  # replaced whenever a buffer or flag cell is (bound launches hold pointers)
        self.events = [torch.cuda.Event() for _ in range(VERDICT_RING)] if cuda else None
        self._streams: dict[int, torch.cuda.Stream] = {}  # raw handle -> stream object (see record)
        self._index = cuda_index(device) if cuda else None
        self.use_events = False  # set by SGLangGuard.resolve when a result carries no copy_done to wait on
        self._agreed = [torch.empty(0, dtype=torch.int32, pin_memory=cuda) for _ in range(VERDICT_RING)]
        self._agree_dev = [torch.empty(0, dtype=torch.int32, device=device) for _ in range(VERDICT_RING)]
        self._agreed_np = [a.numpy() for a in self._agreed]  # the same host buffers, read without a torch op
        self._one = torch.ones(1, dtype=torch.int32, device=device)  # copied after an agreed verdict (agree)
        self.turn, self.stamp = 0, 0
        self.bindings = 0  # bound launches built (once per batch composition; a benchmark reads it)

    def next(self) -> tuple[int, int]:
        """The next check's (slot, stamp): slots round robin, stamps 1..STAMP_LIMIT."""
        self.turn = (self.turn + 1) % VERDICT_RING
        self.stamp = self.stamp % STAMP_LIMIT + 1
        return self.turn, self.stamp

    def agreed_host(self, slot: int, need: int) -> torch.Tensor:
        """Attention TP: the host buffer (pinned) the agreed verdict of ``slot`` is copied into."""
        buf = self._agreed[slot]
        if buf.numel() < need:
            buf = self._agreed[slot] = torch.zeros(1 << (need - 1).bit_length(), dtype=torch.int32,
                                                   pin_memory=self.device.type == "cuda")
            self._agreed_np[slot] = buf.numpy()
        return buf[:need]

    def agree(self, slot: int, cells: int, n: int, stale: list | None, group,
              side: torch.Tensor | None = None) -> torch.Tensor:
        """Attention TP: the first ``cells`` of slot's verdict (``n`` requests' rows; ``stale``: per request, its row
        went to a newer owner here, or None when none did; ``side``: a side check's per-request flags, int32 [n] on
        the device, e.g. the recurrent-state check of kvguard.sglang.mamba, or None) MAX all-reduced across the ranks
        on the stream (``group``: the ranks' :class:`kvguard.sglang.agree.VerdictAgreement`) into a buffer of the
        slot's own, and copied to the slot's pinned host buffer (returned: its first ``cells``); then a one into the
        host cell after them, which the host cleared first, copied last: once the host sees it, the cells before it
        are in (:meth:`agreed_clean` reads them before any wait). One collective and two copies per step (a side
        check: two small launches more, folding it in), no host sync, no allocation in the steady state."""
        dev = self._agree_dev[slot]
        if dev.numel() < cells:
            dev = self._agree_dev[slot] = torch.empty(1 << (cells - 1).bit_length(), dtype=torch.int32,
                                                      device=self.device)
        verdict = self._verdicts[slot][:cells]
        if stale is None and side is None:
            mine = group.max_(verdict, dev[:cells])
        else:  # a stale row here (rare), or a side check's flags: in the request's first cell, which every rank sees
            mine = dev[:cells]
            mine.copy_(verdict)
            first = mine.view(n, -1)[:, 0]  # [n], strided
            if stale is not None:
                first += torch.tensor(stale, dtype=torch.int32).to(self.device, non_blocking=True)
            if side is not None:
                torch.maximum(first, side, out=first)
            group.max_(mine)
        host = self.agreed_host(slot, cells + 1)
        self._agreed_np[slot][cells] = 0  # (before the copies are enqueued: the second one writes the one)
        agreed = host[:cells]
        agreed.copy_(mine, non_blocking=True)
        host[cells:].copy_(self._one, non_blocking=True)  # after the cells, on the same stream
        return agreed

    def agreed_clean(self, slot: int, cells: int) -> bool:
        """Attention TP: slot's agreed verdict is in (the one after it) and no rank flagged anything in it. Read
        before any wait: False when not in yet (the caller then waits and reads it in full)."""
        view = self._agreed_np[slot]
        return view[cells] == 1 and not view[:cells].any()

    def verdict(self, slot: int, batch: int, max_entries: int) -> torch.Tensor:
        need = batch * n_chunks_for(max_entries)
        buf = self._verdicts[slot]
        if buf.numel() < need:  # rare: a bigger batch or longer rows than before (grown in powers of two)
            buf = self._verdicts[slot] = torch.empty(1 << (need - 1).bit_length(), dtype=torch.int32,
                                                     device=self.device)
            self.generation = object()
        return buf

    def reserve(self, batch: int, width: int) -> None:
        """Every slot's buffer holds a check of ``batch`` requests of up to ``width`` entries (a bound launch's
        whole life: no buffer moves under it)."""
        for slot in range(VERDICT_RING):
            self.verdict(slot, batch, width)

    def buffers(self) -> list:
        return self._verdicts

    def copy_flag(self, slot: int) -> None:
        """The fallback (a device that cannot write pinned memory): slot's device flag copied to its host cell."""
        if self.device_flags is not None:
            self.host_cells[slot].copy_(self.device_flags[slot:slot + 1], non_blocking=True)

    def record(self, slot: int) -> torch.cuda.Event:
        """Record slot's event on the current stream, now (after the check, before the forward)."""
        return self.record_event(self.events[slot])

    def record_event(self, event: torch.cuda.Event) -> torch.cuda.Event:
        """Record ``event`` on the current stream, now.

        NOTE: ``Event.record()`` looks the current stream up through ``torch.cuda.current_stream()``, tens of
        microseconds of Python per call on the scheduler's thread; the raw handle is one C call, and the
        stream object for it is made once."""
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        stream = self._streams.get(raw)
        if stream is None:
            if len(self._streams) > 64:  # a scheduler that makes streams as it goes: keep the map small
                self._streams.clear()
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        torch._C._CudaEventBase.record(event, stream)
        return event

    def flagged(self, slot: int, stamp: int) -> bool:
        return self._host_np[slot] == stamp

    def self_test(self, tracker, row: int) -> None:
        """At install: a check of one entry nothing was recorded for (the padding row) must flag, in the host
        cell and in the verdict, through both the first (JIT) and the direct launch; an empty one must not.
        Falls back to a device flag copied to the host if the device cannot write the pinned cell; raises
        if the verdict itself is wrong (kvguard must not serve a check it cannot trust)."""
        for fallback in (False, True):
            if fallback:
                if self.device.type != "cuda":
                    break
                log.warning("kvguard: this device does not write pinned host memory from a kernel; the "
                            "check's flag is copied to the host instead")
                self.device_flags = torch.zeros(VERDICT_RING, dtype=torch.int64, device=self.device)
                self.flag_cells = [self.device_flags[i:i + 1] for i in range(VERDICT_RING)]
                self.generation = object()
            if all(self._probe(tracker, row, n) for n in (1, 0, 1, 0, 1)):
                return
        raise RuntimeError(f"kvguard: the check's self-test failed on {self.device}: its flag cell does not "
                           f"show the verdict; refusing to serve")

    def _probe(self, tracker, row: int, n: int) -> bool:
        """One self-test launch of ``n`` unrecorded entries: True if the flag cell agrees with the verdict."""
        dev = self.device
        rows = torch.full((1,), row, dtype=torch.int64, device=dev)
        n_entries = torch.full((1,), n, dtype=torch.int64, device=dev)
        slot, stamp = self.next()
        verdict = self.verdict(slot, 1, 1)
        with tracker.lock:
            self.launch(rows, rows, n_entries, max_entries=1, verdict=verdict, flag=self.flag_cells[slot],
                        stamp=stamp)
        if self.device_flags is not None:
            self.host_cells[slot].copy_(self.device_flags[slot:slot + 1])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if (int(verdict[0]) > 0) != (n > 0):
            raise RuntimeError(f"kvguard: the check's self-test failed on {dev}: an entry with nothing recorded "
                               f"was {'not ' if n else ''}flagged; refusing to serve")
        return self.flagged(slot, stamp) == (n > 0)
