"""Phase split in one process: prefill on its own KV pool (BF16), decode on the engine's pool (FP8).

``make_engine(EngineConfig(phase_split=True, ...))`` builds a ``PhaseSplitEngine``. Each admitted request:

1. gets its decode row and pages as in the single-pool engine (``Engine._place``: prefix match, fresh
   pages, tracker record), and the tracker snapshots the fresh pages' tags (``transfer_issue``: a ticket);
2. is prefilled on the prefill side: its own allocator, its own pool (``prefill_kv_dtype``) and, when
   ``prefill_weight_dtype`` differs, its own weights; its first token is sampled and streamed there;
3. has its KV (positions past the shared prefix) *staged*: read from the prefill pages into a buffer (on
   a side stream on CUDA). The transfer is now in flight; it lands ``transfer_lag`` steps later;
4. at landing, before the decode side first reads the pages, one batched check compares every landing
   ticket with the pages' current tags; the commit stores the staged K/V into the decode pages
   (``PagedKVCache.store``: ``store_kv``, quantizing to the decode dtype), a failed transfer's slots
   sent to the scratch page, and the failed transfer's request is aborted. Decode starts that step.

A step: admit + prefill + issue; the ``after_schedule(kind="transfer")`` fault point (transfers in
flight); land what is due; decode every landed request. With ``transfer_lag=1`` a request decodes in the
step after its prefill, as in the single-pool engine.

Observers get ``on_transfer_issue`` and ``on_transfer_land`` (before the check), then ``on_write`` for
the landing's writes (where they really went).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvguard.transfer import guard_slots

from .context import StepContext
from .engine import Engine
from .kvcache import PagedKVCache
from .memory import PageAllocator
from .model import load_model
from .requests import Event, Request
from .runner import ModelRunner


@dataclass(eq=False)
class Transfer:
    """One prefill -> decode KV transfer in flight."""

    request: Request
    first: int  # first logical page of the targets (pages past the shared prefix)
    pages: torch.Tensor  # int64 [n] decode pages the transfer writes (CPU)
    src: torch.Tensor  # int64 [m] prefill pages holding the whole prompt (CPU)
    ticket: object  # the tracker's ticket (None: unguarded)
    land_step: int
    staged: list  # per layer (k, v) [T, Hkv, D]: positions first * page_size .. len(prompt)
    ready: object = None  # CUDA event recorded after the staging copy (None on CPU)


class PhaseSplitEngine(Engine):
    """The engine with a prefill side of its own and a guarded, asynchronous KV transfer to decode."""

    def __init__(self, config, tracker=None, observers=()):
        self.in_flight: dict[str, Transfer] = {}  # rid -> transfer, in issue order
        super().__init__(config, tracker, observers)
        self._build_prefill_side()

    def _build_prefill_side(self) -> None:
        c = self.config
        self.prefill_model, _ = load_model(c.model, c.prefill_weight_dtype or c.weight_dtype, c.backend,
                                           c.device, c.seed)
        mc = self.prefill_model.config
        # NOTE: as many pages as the decode pool (twice its bytes for BF16 over FP8). Prefill pages are
        # held from prefill to landing only; admission also checks this pool (`_admissible`).
        self.prefill_kv = PagedKVCache(mc.n_layers, self.num_pages, c.page_size, mc.n_kv_heads, mc.head_dim,
                                       dtype=c.prefill_kv_dtype, device=c.device, backend=c.backend)
        self.prefill_runner = ModelRunner(self.prefill_model, self.prefill_kv, batch_invariant=c.batch_invariant)
        self.prefill_allocator = PageAllocator(self.num_pages)  # no listeners: the tracker guards decode
        device = torch.device(c.device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit + prefill + issue, the transfer fault point, land what is due, decode the landed."""
        self.step_id += 1
        events: list[Event] = []
        self.emit("on_step_begin", engine=self, step=self.step_id)
        decoding = [r for r in self.running if r.rid not in self.in_flight]
        for request in self._admit():
            self._prefill(request, events)
        if self.in_flight:
            self.emit("after_schedule", engine=self, step=self.step_id, kind="transfer",
                       requests=[t.request for t in self.in_flight.values()])
        decoding += self._land(self._due(), events)
        decoding = [r for r in decoding if r.status == "running"]
        if decoding:
            self._decode(decoding, events)
        self.emit("on_step_end", engine=self, step=self.step_id)
        return events

    def abort(self, request: Request, message: str, *, by_tracker: bool = False) -> Event:
        """Abort a request; a transfer still in flight for it is cancelled (it never lands)."""
        transfer = self.in_flight.pop(request.rid, None)
        if transfer is not None:
            self.prefill_allocator.free(transfer.src)
        return super().abort(request, message, by_tracker=by_tracker)

    def accounting(self) -> dict:
        acct = super().accounting()
        held = sum(t.src.numel() for t in self.in_flight.values())
        acct["prefill_balanced"] = self.prefill_allocator.available() + held == self.prefill_allocator.num_pages
        return acct

    # -- admission and prefill ---------------------------------------------------------------------
    def _prompt_pages(self, request: Request) -> int:
        return -(-len(request.prompt) // self.page_size)

    def _admissible(self, request: Request, admitted: list[Request]) -> bool:
        need = sum(self._prompt_pages(r) for r in admitted) + self._prompt_pages(request)
        return need <= self.prefill_allocator.available()

    def _prefill(self, request: Request, events: list[Event]) -> None:
        n_total, new = self._place(request)  # decode side: row, prefix, fresh pages, tracker record
        # NOTE: the ticket is taken where the decode side hands out the target pages, so the guarded
        # window covers the prefill compute too, not only the copy.
        ticket = self.tracker.transfer_issue(new, row=request.row, first=request.n_shared)
        self.emit("after_schedule", engine=self, step=self.step_id, kind="prefill", requests=[request])
        src = self.prefill_allocator.alloc(n_total)
        logits = self._prefill_side(request, src)
        self._issue(request, request.n_shared, new, src, ticket)
        self._finish_step([request], logits, None, events)  # the prefill side reads no decode page

    def _prefill_side(self, request: Request, src: torch.Tensor) -> torch.Tensor:
        """The whole prompt on the prefill side (its own pool, no prefix cache): last-token logits."""
        ps, device = self.page_size, self.prefill_kv.device
        positions = torch.arange(len(request.prompt), device=device)
        src = src.to(device)
        slots = src[positions // ps] * ps + positions % ps
        tokens = torch.tensor(request.prompt, device=device)
        ctx = StepContext.for_prefill(0, slots, src.to(torch.int32), positions=positions)
        return self.prefill_runner.prefill(tokens, ctx)

    # -- the transfer ------------------------------------------------------------------------------
    def _issue(self, request: Request, first: int, pages: torch.Tensor, src: torch.Tensor, ticket) -> None:
        """Stage the prompt's KV past the shared prefix; the transfer lands ``transfer_lag`` steps on."""
        start, end = first * self.page_size, len(request.prompt)
        ready = None
        if self._stream is None:
            staged = self._stage(src, start, end)
        else:
            # NOTE: on CUDA the staging copy runs on a side stream after the prefill that wrote the pages,
            # overlapping the following forwards; the landing waits for its event.
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                staged = self._stage(src, start, end)
                ready = torch.cuda.Event()
                ready.record()
        land_step = self.step_id + self.config.transfer_lag
        self.in_flight[request.rid] = Transfer(request, first, pages, src, ticket, land_step, staged, ready)
        self.emit("on_transfer_issue", request=request, first=first, pages=pages.tolist(), land_step=land_step,
                   step=self.step_id)

    def _stage(self, src: torch.Tensor, start: int, end: int) -> list:
        """K/V of positions ``start..end`` read from the prefill pages, one (k, v) per layer."""
        kv = self.prefill_kv
        row = src.to(kv.device)
        # NOTE: `gather` dequantizes to float32; BF16/FP32 values round-trip exactly, so the staging
        # buffer holds the prefill pool's bytes (what a wire would carry).
        keep = torch.float32 if kv.dtype == "fp8" else kv.torch_dtype
        staged = []
        for layer in range(kv.n_layers):
            k, v = kv.gather(layer, row, end)
            staged.append((k[start:].to(keep), v[start:].to(keep)))
        return staged

    def _due(self) -> list[Transfer]:
        due = [t for t in self.in_flight.values() if t.land_step <= self.step_id]
        for t in due:
            del self.in_flight[t.request.rid]
        return due

    def _land(self, due: list[Transfer], events: list[Event]) -> list[Request]:
        """Check and commit the transfers that land now; abort those whose targets changed hands.

        Returns the requests whose KV landed (they decode from now on).
        """
        if not due:
            return []
        for t in due:
            self.emit("on_transfer_land", engine=self, request=t.request, first=t.first,
                       pages=t.pages.tolist(), step=self.step_id)
        self._wait_staged(due)
        ok = self.tracker.transfer_land([t.ticket for t in due])  # device bool [n]; None = unguarded
        positions, slots, owner = self._target_slots(due)
        if ok is not None:
            slots = guard_slots(slots, owner, ok, self.page_size)
        self._commit(due, slots)
        writers = [t.request for t in due for _ in range(t.staged[0][0].shape[0])]
        self.emit("on_write", requests=writers, positions=positions.tolist(), slots=slots.tolist(),
                   step=self.step_id)
        verdict = [True] * len(due) if ok is None else ok.cpu().tolist()
        landed = []
        for t, good in zip(due, verdict):
            self.prefill_allocator.free(t.src)
            if good:
                landed.append(t.request)
            else:
                events.append(self._discard(t))
        return landed

    def _wait_staged(self, due: list[Transfer]) -> None:
        if self._stream is None:
            return
        current = torch.cuda.current_stream()
        for t in due:
            current.wait_event(t.ready)
            for k, v in t.staged:  # allocated on the side stream, used and freed on this one
                k.record_stream(current)
                v.record_stream(current)

    def _target_slots(self, due: list[Transfer]):
        """(positions, flat decode slots, transfer index) of every token the landing batch writes."""
        ps, device = self.page_size, self.kv.device
        positions, slots, owner = [], [], []
        for i, t in enumerate(due):
            pos = torch.arange(t.first * ps, len(t.request.prompt))
            positions.append(pos)
            slots.append(t.pages[pos // ps - t.first] * ps + pos % ps)
            owner.append(torch.full_like(pos, i))
        return torch.cat(positions), torch.cat(slots).to(device), torch.cat(owner).to(device)

    def _commit(self, due: list[Transfer], slots: torch.Tensor) -> None:
        """One store per layer of the whole landing batch (quantizing to the decode pool's dtype)."""
        for layer in range(self.kv.n_layers):
            k = torch.cat([t.staged[layer][0] for t in due])
            v = torch.cat([t.staged[layer][1] for t in due])
            self.kv.store(layer, k, v, slots)

    def _discard(self, transfer: Transfer) -> Event:
        """The guard discarded ``transfer`` (its targets changed hands in flight): abort its request."""
        err = self.tracker.transfer_violation(transfer.ticket, transfer.request.rid)
        request = transfer.request
        if request.status != "running":
            # NOTE: its request is gone already (an abort that freed the pages and left the transfer in
            # flight, sglang #24527): nothing to release; the guard's catch is the discarded late write.
            self.emit("on_abort", request=request, step=self.step_id, by_tracker=True)
            return Event(request.rid, "abort", self.step_id, message=str(err))
        self.tracker.note_aborted(1)
        return self.abort(request, str(err), by_tracker=True)

    def _complete(self, request: Request) -> Event:
        transfer = self.in_flight.pop(request.rid, None)
        if transfer is not None:
            # NOTE: finished at its first token: its KV lands now, before the pages are published to the
            # prefix cache (the guard still checks it).
            events: list[Event] = []
            if not self._land([transfer], events):
                return events[0]
        return super()._complete(request)
