"""The paged, continuously batching engine: admission, prefill, decode, kvguard wired in.

One step = admit and prefill what fits, then one batched decode over every running request. Before any
forward reads the KV cache the tracker validates the rows it will read (one launch, no sync); the
verdict comes back to the host with the sampled token ids, and flagged requests are aborted before any
of their tokens from that step is streamed.

Each forward gets one ``StepContext`` (context.py), built here once the step's check has run and its write
slots are final; the ``ModelRunner`` (runner.py) executes it. Observers (the oracle, the injector, a client)
receive events by method name; see ``emit`` call sites.
"""
from __future__ import annotations

import torch

from kvguard import KVGuardViolation, NoopTracker

from .context import StepContext
from .kvcache import PagedKVCache, ResidualLayout
from .memory import PageAllocator, ReqToPagePool
from .model import load_model
from .options import MEMORY_BACKENDS, PAGE_SIZES, ConfigError, EngineConfig  # noqa: F401  (re-exported)
from .radix import RadixCache
from .requests import Event, Request
from .runner import ModelRunner


class Engine:
    """Continuous batching over a paged KV cache, with a kvguard tracker (no-op by default)."""

    def __init__(self, config: EngineConfig = EngineConfig(), tracker=None, observers=()):
        if config.phase_split and type(self) is Engine:
            raise ConfigError("engine.phase_split = true needs the phase-split engine: build engines with "
                              "faultlab.engine.factory.make_engine(config, ...)")
        self.config = config
        self.device = torch.device(config.device)
        self.model, self.tokenizer = self._load_model()
        mc = self.model.config
        self.page_size = config.page_size
        self.max_pages = -(-min(config.max_context, mc.max_context) // config.page_size)
        self.residual = None
        if config.kv_residual:
            self.residual = ResidualLayout.of(config.max_running, config.page_size, config.kv_residual_sink,
                                              config.kv_residual_window)
        # NOTE: the KV residual's pages come out of the same budget, so FP8 + residual is compared
        # with BF16 at equal memory.
        residual = PagedKVCache.residual_bytes(self.residual, mc.n_layers, mc.n_kv_heads, mc.head_dim)
        num_pages = config.num_pages or PagedKVCache.pages_for_budget(
            int(config.kv_budget_mb * 2**20) - residual, mc.n_layers, config.page_size, mc.n_kv_heads,
            mc.head_dim, config.kv_dtype)
        self.kv = self._build_kv(num_pages)
        graphs = None
        if config.cuda_graphs:
            from .cuda_graphs import GraphedDecode

            graphs = GraphedDecode(self.model, self.kv, config.max_running, self.max_pages)
        self.runner = ModelRunner(self.model, self.kv, batch_invariant=config.batch_invariant, graphs=graphs)
        self.tracker = tracker if tracker is not None else NoopTracker()
        self.observers = list(observers)
        self.allocator, self.req_pool = self._build_memory(num_pages)
        self.cache = RadixCache(self.allocator, config.page_size, enabled=config.prefix_cache)
        # NOTE: the hit guard (radix.py): cached pages carry their tag from insert to every hit, so a
        # prefix whose page changed hands while the tree still referenced it fails its sharers' checks.
        self.cache.tagger = self.tracker.transfer_issue
        self.tracker.attach(num_pages=num_pages + 1, num_rows=config.max_running,
                            max_entries=self.max_pages, device=config.device, page_size=config.page_size)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.done: list[Request] = []
        self.step_id = 0
        self.emit("on_engine", engine=self)

    def _load_model(self):
        """(model, tokenizer) of this engine; a subclass may build another model (a TP shard: engine/tp.py)."""
        c = self.config
        return load_model(c.model, c.weight_dtype, c.backend, c.device, c.seed)

    def _build_kv(self, num_pages: int) -> PagedKVCache:
        """The decode KV cache; memory="sglang" backs it with an MHATokenToKVPool's buffers."""
        mc, config = self.model.config, self.config
        if config.memory == "sglang":
            from .sglang_memory import build_sglang_kv

            return build_sglang_kv(self, num_pages)
        return PagedKVCache(mc.n_layers, num_pages, config.page_size, mc.n_kv_heads, mc.head_dim,
                            dtype=config.kv_dtype, device=config.device, backend=config.backend,
                            rotate_k=config.kv_rotate_k, residual=self.residual)

    def _build_memory(self, num_pages: int):
        """(allocator, request pool); the tracker tags every allocation (``alloc_tagged`` returns the tags)."""
        listeners = [o for o in self.observers if hasattr(o, "on_alloc")]
        if self.config.memory == "sglang":
            from .sglang_memory import build_sglang_memory

            return build_sglang_memory(self, num_pages, listeners, tagger=self.tracker)
        return (PageAllocator(num_pages, listeners, tagger=self.tracker),
                ReqToPagePool(self.config.max_running, self.max_pages, self.config.device))

    # -- public API ---------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def graphs(self):
        """The decode's CUDA graphs (``GraphedDecode``) or None; owned by the runner."""
        return self.runner.graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self.runner.graphs = graphs

    @property
    def table(self) -> torch.Tensor:
        """The engine's page table (int32 [rows, max_pages]); owned by the request pool."""
        return self.req_pool.table

    def add_request(self, request: Request) -> None:
        if len(request.prompt) < 1 or request.max_new_tokens < 1:
            raise ValueError(f"request {request.rid}: needs a non-empty prompt and max_new_tokens >= 1")
        if request.pages_needed(self.page_size) > min(self.max_pages, self.num_pages):
            raise ValueError(f"request {request.rid}: {len(request.prompt)} + {request.max_new_tokens} "
                             f"tokens exceed the context ({self.max_pages * self.page_size} tokens)")
        if request.temperature > 0:
            request.generator = torch.Generator().manual_seed(request.seed)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Event]:
        """Admit + prefill, then one decode over the running batch; returns the client events."""
        self.step_id += 1
        events: list[Event] = []
        self.emit("on_step_begin", engine=self, step=self.step_id)
        decoding = list(self.running)
        for request in self._admit():
            self._prefill(request, events)
        if decoding:
            self._decode([r for r in decoding if r.status == "running"], events)
        self.emit("on_step_end", engine=self, step=self.step_id)
        return events

    def run(self, max_steps: int = 1_000_000) -> list[Event]:
        events = []
        while self.has_work() and self.step_id < max_steps:
            events.extend(self.step())
        return events

    def abort(self, request: Request, message: str, *, by_tracker: bool = False) -> Event:
        """Abort one request and release exactly its pages."""
        request.status, request.error = "aborted", message
        self._release(request, publish=False, by_tracker=by_tracker)
        self.emit("on_abort", request=request, step=self.step_id, by_tracker=by_tracker)
        return Event(request.rid, "abort", self.step_id, message=message)

    # -- accounting --------------------------------------------------------------------------------
    def accounting(self) -> dict:
        """free + owned by running requests + cached == total (SGLang's idle check, our terms)."""
        owned = sum(r.n_pages - r.n_shared for r in self.running)
        free = self.allocator.available()
        cached = self.cache.num_pages
        return {"total": self.num_pages, "free": free, "owned": owned, "cached": cached,
                "balanced": free + owned + cached == self.num_pages}

    # -- admission ---------------------------------------------------------------------------------
    def _reserved(self) -> int:
        return sum(r.pages_needed(self.page_size) - r.n_pages for r in self.running)

    def _admit(self) -> list[Request]:
        admitted = []
        while self.waiting and len(self.running) < self.config.max_running and self.req_pool.can_alloc():
            request = self.waiting[0]
            spare = self.allocator.available() + self.cache.evictable_pages() - self._reserved()
            if request.pages_needed(self.page_size) > spare or not self._admissible(request, admitted):
                break
            self.waiting.pop(0)
            request.status = "running"
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _admissible(self, request: Request, admitted: list[Request]) -> bool:
        """Hook: may ``request`` be admitted after ``admitted`` (this step's)? Decode pages are checked."""
        return True

    def _alloc(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``n`` pages (evicting cached prefixes if needed) and the tags the tracker gave them."""
        if not self.allocator.can_alloc(n):
            self.cache.evict(n - self.allocator.available())
        return self.allocator.alloc_tagged(n)

    def _grant(self, request: Request, first: int, pages: torch.Tensor, tags=None, shared: int = 0) -> None:
        """Map logical pages first.. of the request's row to ``pages`` and tell the tracker.

        A prefix-cache hit (``shared``) records the tags its nodes were inserted with (the hit guard).
        """
        if shared and tags is None:
            tags = self.cache.hit_tags(request.nodes[first:first + pages.numel()])
        previous = self.table[request.row, first:first + pages.numel()].tolist()  # stale entries
        self.req_pool.write(request.row, first, pages)
        self.tracker.record(request.row, first, pages, tags)
        request.n_pages = first + pages.numel()
        self.emit("on_grant", request=request, first=first, pages=pages.tolist(), previous=previous,
                   shared=shared, step=self.step_id)

    # -- prefill -----------------------------------------------------------------------------------
    def _place(self, request: Request) -> tuple[int, torch.Tensor]:
        """A row, the cached prefix and fresh pages for the prompt: (pages in all, the fresh pages)."""
        ps = self.page_size
        request.row = self.req_pool.alloc_row()
        shareable = (len(request.prompt) - 1) // ps  # prompt pages the prefix cache could hand out
        # NOTE: only pages past those get a KV residual from the recent window (and the sink is
        # refreshed on a hit, `ModelRunner.refresh_sink`), so a request's numerics never depend on cache hits.
        self.kv.reset_residual(request.row, window_start=shareable)
        request.nodes = self.cache.match(request.prompt, max_pages=shareable)
        self.cache.lock(request.nodes)
        request.n_shared = len(request.nodes)
        shared = torch.tensor([n.page for n in request.nodes], dtype=torch.int64)
        n_total = -(-len(request.prompt) // ps)
        new, fresh = self._alloc(n_total - request.n_shared)
        if request.n_shared:
            self._grant(request, 0, shared, shared=request.n_shared)  # the tags the nodes were inserted with
        self._grant(request, request.n_shared, new, fresh)
        return n_total, new

    def _prefill(self, request: Request, events: list[Event]) -> None:
        ps = self.page_size
        n_total, _ = self._place(request)
        self.emit("after_schedule", engine=self, step=self.step_id, kind="prefill", requests=[request])
        start = request.n_shared * ps
        positions = torch.arange(start, len(request.prompt), device=self.device)
        rows = torch.tensor([request.row], dtype=torch.int32, device=self.device)
        block = self.table[request.row:request.row + 1, :n_total].clone()  # kernel-visible row
        check = self._validate(block, rows, [n_total], [request], positions_read=[len(request.prompt)])
        slots = self._write_slots(block, torch.zeros_like(positions), positions)
        slots = self._emit_writes([request] * len(positions), positions, slots)
        ctx = StepContext(positions, slots, block, rows, ride=self._step_ride(check, graphed=False), start=start)
        self.runner.refresh_sink(request.prompt, request.n_shared, ctx)
        logits = self.runner.prefill(torch.tensor(request.prompt[start:], device=self.device), ctx)
        self._finish_step([request], logits, check, events)

    # -- decode ------------------------------------------------------------------------------------
    def _decode(self, batch: list[Request], events: list[Event]) -> None:
        if not batch:
            return
        self._grow(batch)
        self.emit("after_schedule", engine=self, step=self.step_id, kind="decode", requests=batch)
        batch = [r for r in batch if r.status == "running"]
        if not batch:
            return
        positions = torch.tensor([r.kv_len for r in batch], device=self.device)  # position of the token fed now
        n_entries = [r.n_pages for r in batch]
        width = max(n_entries)
        rows = torch.tensor([r.row for r in batch], dtype=torch.int32, device=self.device)
        block = self.table[rows.long(), :width]  # gather: the kernel-visible table
        check = self._validate(block, rows, n_entries, batch, positions_read=(positions + 1).tolist())
        slots = self._write_slots(block, torch.arange(len(batch), device=self.device), positions)
        slots = self._emit_writes(batch, positions, slots)
        tokens = torch.tensor([r.tokens[-1] for r in batch], device=self.device)
        ctx = StepContext.for_decode(positions, slots, block, rows, self._step_ride(check, self.runner.graphed))
        logits = self.runner.decode(tokens, ctx)
        self._finish_step(batch, logits, check, events)

    def _grow(self, batch: list[Request]) -> None:
        """Give each request whose next token starts a new page one more page."""
        growing = [r for r in batch if r.kv_len // self.page_size >= r.n_pages]
        if not growing:
            return
        pages, fresh = self._alloc(len(growing))
        for i, (request, page) in enumerate(zip(growing, pages)):
            self._grant(request, request.n_pages, page.view(1), None if fresh is None else fresh[i:i + 1])

    def _step_ride(self, check, graphed: bool):
        """What of ``check`` rides in its forward's context to the last all-reduce (None here; a TP
        rank's verdict ride, engine/tp.py). ``graphed``: the forward replays CUDA graphs, which take none."""
        return None

    # -- shared step pieces ------------------------------------------------------------------------
    def _validate(self, block, rows, n_entries, batch, positions_read):
        self.emit("before_read", engine=self, step=self.step_id, requests=batch, lengths=positions_read)
        return self.tracker.validate(block, rows, torch.tensor(n_entries, dtype=torch.int32, device=self.device),
                                     max_entries=block.shape[1], source=self.table, source_rows=rows,
                                     entries_hint=sum(n_entries))

    def _write_slots(self, block, batch_index, positions) -> torch.Tensor:
        ps = self.page_size
        return block[batch_index, positions // ps].long() * ps + positions % ps

    def _emit_writes(self, requests, positions, slots) -> torch.Tensor:
        for obs in self.observers:
            mutate = getattr(obs, "mutate_write_slots", None)
            if mutate is not None:
                slots = mutate(engine=self, requests=requests, positions=positions, slots=slots)
        self.emit("on_write", requests=requests, positions=positions.tolist(), slots=slots.tolist(),
                   step=self.step_id)
        return slots

    def _sample(self, request: Request, logits: torch.Tensor) -> int:
        if request.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / request.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=request.generator))

    def _finish_step(self, batch, logits, check, events) -> None:
        # The one host sync of the step: sampled ids and the verdict come back together.
        verdict = None if check is None else check.verdict.cpu()
        violations = self.tracker.resolve(check, verdict, [r.rid for r in batch])
        flagged = {v.request_id: v for v in violations}
        for b, request in enumerate(batch):
            if request.rid in flagged:
                events.append(self._abort_flagged(request, flagged[request.rid]))
                continue
            token = self._sample(request, logits[b])
            request.output.append(token)
            events.append(Event(request.rid, "token", self.step_id, token=token))
            self.emit("on_token", request=request, token=token, step=self.step_id)
            if self._is_finished(request, token):
                events.append(self._complete(request))

    def _abort_flagged(self, request: Request, violation: KVGuardViolation) -> Event:
        self.tracker.note_aborted(1)
        return self.abort(request, str(violation), by_tracker=True)

    def _is_finished(self, request: Request, token: int) -> bool:
        if token in request.stop_ids:
            request.finish_reason = "stop"
        elif len(request.output) >= request.max_new_tokens:
            request.finish_reason = "length"
        elif len(request.tokens) >= self.max_pages * self.page_size:
            request.finish_reason = "context"
        return request.finish_reason is not None

    def _complete(self, request: Request) -> Event:
        request.status = "finished"
        self._release(request, publish=True)
        self.emit("on_finish", request=request, step=self.step_id)
        return Event(request.rid, "finish", self.step_id, message=request.finish_reason)

    # -- release -----------------------------------------------------------------------------------
    def _release(self, request: Request, *, publish: bool, by_tracker: bool = False) -> None:
        """Publish (on finish) or drop the request's pages, unlock its prefix, free its row."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.done.append(request)
        if request.row is None:
            return
        owned = self.table[request.row, request.n_shared:request.n_pages].long()
        if by_tracker:
            # NOTE: the row failed its check, so it may name pages that belong to someone else now;
            # free only the pages the tracker confirms this request still holds (a leak beats a
            # second corruption).
            owned = self.tracker.held_pages(request.row, request.n_shared, request.n_pages)
        if publish:  # the cache takes the full pages it does not hold yet; the rest is freed
            pages = self.table[request.row, :request.n_pages].tolist()
            rejected = self.cache.insert(request.tokens[:request.kv_len], pages)
            owned = torch.tensor(rejected, dtype=torch.int64)
        self.cache.unlock(request.nodes)
        self.allocator.free(owned)
        self.tracker.drop(request.row)
        self.req_pool.free_row(request.row)
        request.row = None

    def emit(self, name: str, **payload) -> None:
        for obs in self.observers:
            handler = getattr(obs, name, None)
            if handler is not None:
                handler(**payload)
