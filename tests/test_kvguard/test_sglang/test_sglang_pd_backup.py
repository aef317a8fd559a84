"""PD decode with SGLang's retraction backup (issue 46): kvguard checks the row a retracted request's KV is copied out
through and the row it is restored through (:mod:`kvguard.sglang.pd_backup`).

Every test drives SGLang 0.5.23's real PD decode scheduling on the rig's real pools (page 16, FP8 MHA pool) and the
decode tree SGLang's own factory builds for them (``registry.default_radix_cache_factory``: a ``UnifiedRadixCache``
with its radix cache off, a decode server's default; with ``host_pool``, HiCache attached by its ``init_hicache``),
kvguard's hooks applied by SGLang's own HookRegistry: ``DecodePreallocQueue._pre_alloc`` (a transferred request's
row and pages), ``Scheduler.get_next_disagg_decode_batch_to_run`` (the prebuilt batch, its result, the merge,
``update_running_batch`` with its retraction: ``ScheduleBatch.retract_decode`` -> ``release_req`` ->
``backup_kv_cache`` -> ``release_kv_cache``, then ``prepare_for_decode``), ``Scheduler._add_request_to_queue`` and
``DecodePreallocQueue.resume_retracted_reqs`` (``_pre_alloc`` + ``restore_kv_cache``). Both backends are SGLang's
own: ``cpu_tensor`` is ``Req.offload_kv_cache`` / ``load_kv_cache``; ``host_pool`` (SGLang's default on a decode
server for an MHA pool: ``kv_cache_builder.resolve_decode_retraction_backup``) is ``UnifiedRadixCache``'s
``backup_kv_cache`` / ``restore_kv_cache`` through its ``HybridCacheController`` (``allocate_host_transfers``,
``L2TransferEngine``) into its ``MHATokenToKVPoolHost``. Stand-ins (:class:`PDDecode`) only for what kvguard does
not touch: the transfer's bytes (a payload written into the destination slots), the model (one payload token per
decode step), the output streamer and metrics. SGLang's own retraction switch (``SGLANG_TEST_RETRACT``: the module
constant, set per step) picks the steps that retract; SGLang's retraction order picks the request.

The host pool runs on this CPU with the two shims of the HiCache test (tests/host_pool_shims.py: pinning its buffer
with ``cudaHostRegister`` a no-op, it changes no byte and no index; the ``direct`` IO backend's ``transfer_kv_direct``
the torch copy it stands for), ``hicache_io_backend="direct"``, ``hicache_mem_layout="layer_first"`` and
``hicache_ratio=1`` (an explicit ``--hicache-ratio``: the host pool as large as the device pool, so a retraction never
finds it full). Every restored request's KV is compared, position by position, with what it had before its
retraction, so the copies out and back are real.
"""
from __future__ import annotations

import random
from types import SimpleNamespace as NS

import host_pool_shims
import pytest
import torch

pytestmark = pytest.mark.sglang
both_backends = pytest.mark.usefixtures("kvguard_backend")  # the torch references and the Triton kernels
PS = 16
BACKENDS = ["cpu_tensor", "host_pool"]  # the retraction backups that copy KV (``none`` copies nothing)
retraction_backups = pytest.mark.parametrize("pd", BACKENDS, indirect=True)  # each test on both


def _hooked(target: str, fn) -> bool:
    """SGLang's function at ``target`` is a HookRegistry wrapper chain that calls kvguard's ``fn``."""
    import pkgutil

    wrapper = pkgutil.resolve_name(target)
    while wrapper is not None:
        for cell in getattr(wrapper, "__closure__", None) or ():
            try:
                if cell.cell_contents is fn:
                    return True
            except ValueError:  # an empty cell
                pass
        wrapper = getattr(wrapper, "__wrapped__", None)
    return False


@pytest.fixture(scope="module")
def backup_hooks(check_hooks):
    """kvguard.sglang.pd_backup's hooks, registered with SGLang's HookRegistry and applied by it, as SGLang's plugin
    loader applies kvguard's (once kvguard's plugin composes pd_backup's table, the loader has applied them
    already and nothing is registered here)."""
    import sglang.srt.disaggregation.decode  # noqa: F401  (holds a `from ...common import restore_kv_cache` copy)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvguard.sglang import pd_backup

    for target, fn, kind in pd_backup.HOOKS.values():
        if not _hooked(target, fn):
            HookRegistry.register(target, fn, getattr(HookType, kind))
            if target in HookRegistry._patched:  # (another hook on it was applied before: apply_hooks skips it)
                HookRegistry._apply_target(target, [(getattr(HookType, kind), fn, None)])
    HookRegistry.apply_hooks()
    for target, fn, _ in pd_backup.HOOKS.values():
        assert _hooked(target, fn), target
    # the callers' own `from ... import` copies were rebound too (HookRegistry._propagate_patch)
    assert _hooked("sglang.srt.managers.schedule_batch.backup_kv_cache", pd_backup.around_backup_kv_cache)
    assert _hooked("sglang.srt.disaggregation.decode.restore_kv_cache", pd_backup.around_restore_kv_cache)
    return pd_backup


class PDDecode:
    """A PD decode server's scheduling on the rig: SGLang's own DecodePreallocQueue and Scheduler methods on shells
    holding the rig's pools (``__init__`` skipped: it builds the transfer backend and the model)."""

    def __init__(self, rig, monkeypatch, backend: str):
        import sglang.srt.managers.scheduler as scheduler_mod
        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.overlap_utils import FutureMap
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
        from sglang.srt.runtime_context import get_disagg
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.rig, self.guard, self.backend = rig, rig.guard, backend
        assert get_disagg().disaggregation_decode_retraction_backup == backend
        monkeypatch.setattr(scheduler_mod, "TEST_RETRACT", True)  # SGLang's own switch, per step (forward_ct)
        self.streamed, self.aborted = [], []
        s = Scheduler.__new__(Scheduler)
        q = DecodePreallocQueue.__new__(DecodePreallocQueue)
        out = NS(stream_output=lambda reqs, *a, **k: self.streamed.extend(reqs))
        processor = SchedulerBatchResultProcessor(
            is_generation=True, disaggregation_mode=DisaggregationMode.DECODE, enable_overlap=False,
            enable_overlap_mlx=False, model_config=rig.model_config, token_to_kv_pool_allocator=rig.allocator,
            tree_cache=rig.tree, hisparse_coordinator=None, req_to_token_pool=rig.req_to_token_pool,
            decode_offload_manager=None, metrics_collector=None, metrics_reporter=None, draft_worker=None,
            model_worker=None, logprob_result_processor=None, output_streamer=out, beam_coordinator=None,
            abort_request=None)
        for name, value in dict(
                grammar_manager=NS(has_waiting_grammars=lambda: False), waiting_queue=[], chunked_req=None,
                enable_priority_scheduling=False, abort_on_priority_when_disabled=False,
                req_to_token_pool=rig.req_to_token_pool, token_to_kv_pool_allocator=rig.allocator, tree_cache=rig.tree,
                max_running_requests=64, model_config=rig.model_config, enable_overlap=False,
                spec_algorithm=SpeculativeAlgorithm.NONE, kv_checksum_computer=None,
                ngram_embedding_manager=NS(prepare_for_forward=lambda *a, **k: None),
                future_map=FutureMap(torch.device("cpu"), SpeculativeAlgorithm.NONE, rig.req_to_token_pool,
                                     needs_cpu_seq_lens=False),
                batch_result_processor=processor, enable_hisparse=False, hisparse_coordinator=None,
                dp_attn_adapter=NS(maybe_prepare_mlp_sync_batch=lambda b: b), enable_skip_finishing_decode=False,
                result_queue=[], forward_ct=1, decode_offload_manager=None,
                new_token_ratio_tracker=NS(current=0.0, decay_step=lambda: None),
                metrics_reporter=NS(num_retracted_reqs=0, enable_metrics=False), output_streamer=out,
                beam_coordinator=NS(retire_group=lambda req: None), disaggregation_mode=DisaggregationMode.DECODE,
                disagg_decode_prealloc_queue=q, last_batch=None, scheduler_stage_metrics=None,
                running_batch=ScheduleBatch(reqs=[]),
        ).items():
            setattr(s, name, value)
        s.send_abort_output = lambda abort_req, req: self.aborted.append((req, abort_req))
        for name, value in dict(
                req_to_token_pool=rig.req_to_token_pool, token_to_kv_pool_allocator=rig.allocator,
                token_to_kv_pool=rig.kv, tree_cache=rig.tree, scheduler=s, transfer_queue=NS(queue=[]), queue=[],
                retracted_queue=[], num_reserved_decode_tokens=PS, max_total_num_tokens=rig.allocator.size,
                host_pool=None,
        ).items():
            setattr(q, name, value)
        self.s, self.q = s, q

    def aborts(self) -> list:
        """The requests streamed to their client as aborted (rid, message), each once."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        seen = {}
        for req in self.streamed + [req for req, _ in self.aborted]:
            reason = req.finished_reason or req.to_finish
            if isinstance(reason, FINISH_ABORT):
                seen[req.rid] = reason.message
        return sorted(seen.items())

    def host_free(self) -> int | None:
        """The free slots of the tree's host KV pool (``host_pool``; None for ``cpu_tensor``: no host pool)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName

        group = getattr(self.rig.tree, "host_pool_group", None)
        return None if group is None else group.get_pool(PoolName.KV).available_size()

    # -- the stand-ins: the transfer's and the model's bytes ------------------------------------------------------
    def _write(self, req, pos: int, slot: int) -> None:
        n = int(req.rid[3:])
        kv = self.rig.kv
        k, v = kv.k_buffer[0].view(torch.uint8), kv.v_buffer[0].view(torch.uint8)
        word = torch.tensor([n % 251, pos % 251, pos // 251 % 251, 7], dtype=torch.uint8)
        k[slot].view(-1)[:4] = word
        v[slot].view(-1)[:4] = word + 1

    def kv_intact(self, req) -> bool:
        """The KV the request's row names, position by position, is the request's own (its transfer's and steps')."""
        n, seq = int(req.rid[3:]), int(req.seqlen) - 1
        slots = self.rig.row(req)[:seq].long()
        k = self.rig.kv.k_buffer[0].view(torch.uint8)[slots].reshape(seq, -1)[:, :4].long()
        pos = torch.arange(seq)
        return bool(((k[:, 0] == n % 251) & (k[:, 1] == pos % 251) & (k[:, 2] == pos // 251 % 251)).all())

    # -- SGLang's PD decode paths ---------------------------------------------------------------------------------
    def arrive(self, prompt_len: int, max_new_tokens: int = 64):
        """A transferred request: its row and destination from SGLang's _pre_alloc (kvguard's PD hook records them),
        the transfer's bytes written there, then the waiting queue (as DecodeTransferQueue.pop_transferred does)."""
        req = self.rig.make_req(prompt_len, max_new_tokens=max_new_tokens)
        req.output_ids.append(11)  # the prefill's first token
        kv_loc = self.q._pre_alloc(req)
        for pos, slot in enumerate(kv_loc.tolist()):
            self._write(req, pos, slot)
        self.s.waiting_queue.append(req)
        return req

    def step(self, retract: bool = False) -> list:
        """One decode scheduling step (SGLang's get_next_disagg_decode_batch_to_run; ``retract``: SGLang's test
        retraction this step), the check's verdict (flagged requests aborted as the result processing does), one
        token each. Returns the flagged (req, message, stale)."""
        s = self.s
        s.forward_ct = 0 if retract else 1  # TEST_RETRACT fires when forward_ct % SGLANG_TEST_RETRACT_INTERVAL == 0
        plan = s.get_next_disagg_decode_batch_to_run(s.running_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if batch is None:
            return []
        pending = batch.__dict__.pop("_kvguard", None)
        assert pending is not None, "a decode step ran without kvguard's check"
        flagged = self.guard.resolve(pending)
        if flagged:
            self.guard.abort(flagged, tree_cache=self.rig.tree, stream=s.output_streamer.stream_output)
        for i, req in enumerate(batch.reqs):
            if not req.finished():
                self._write(req, int(req.seqlen) - 1, int(batch.out_cache_loc[i]))
        self.rig.sample(batch)
        self._finish(batch)
        return flagged

    def _finish(self, batch) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        for req in batch.reqs:
            if not req.finished() and len(req.output_ids) >= req.sampling_params.max_new_tokens:
                req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
                self.rig.release(req, checkpoint=True)

    def resume(self) -> list:
        """SGLang's resume of retracted requests (process_decode_queue): _pre_alloc + restore, then waiting."""
        resumed = self.q.resume_retracted_reqs()
        self.s.waiting_queue.extend(resumed)
        return resumed

    def drain(self) -> None:
        """Everything back: retracted requests resumed, every request finished and released."""
        while self.q.retracted_queue or self.s.waiting_queue:
            self.resume()
            self.step()
        for req in list(self.s.running_batch.reqs):
            req.sampling_params.max_new_tokens = len(req.output_ids)
        self._finish(self.s.running_batch)
        self.s.running_batch.filter_batch()


def decode_server(rig, backend: str):
    """A PD decode server's tree for the rig's pools, as SGLang builds it (``build_kv_cache`` ->
    ``registry.default_radix_cache_factory`` with the radix cache off -> ``create_unified_radix_cache``, then
    ``validate_retraction_host_capacity`` for ``host_pool``), under the config a decode server publishes. Returns
    the entered disagg override (its ``__exit__`` undoes it); the tree is the rig's (installed by the caller)."""
    from sglang.srt.runtime_context import get_disagg
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path="dummy", page_size=PS, device="cpu", hicache_io_backend="direct",
                      hicache_mem_layout="layer_first", hicache_ratio=1.0)
    set_global_server_args_for_scheduler(args)
    bag = get_disagg().override(disaggregation_mode="decode", disaggregation_decode_retraction_backup=backend)
    bag.__enter__()
    try:
        rig.tree = _decode_tree(rig, args, backend)
    except BaseException:
        bag.__exit__(None, None, None)
        raise
    return bag


def _decode_tree(rig, args, backend: str):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, default_radix_cache_factory
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(disable=True, req_to_token_pool=rig.req_to_token_pool,
                             token_to_kv_pool_allocator=rig.allocator, page_size=PS)
    counters = []  # the host-to-device layer counter SGLang hands the model runner (the stand-in model waits on none)
    ctx = TreeCacheBuildContext(
        server_args=args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False,
        disable_radix_cache=True, tp_worker=NS(register_hicache_layer_transfer_counter=counters.append),
        model_config=rig.model_config, tp_size=1, tp_rank=0, tp_group=None)
    with host_pool_shims.host_budget():
        tree = default_radix_cache_factory(ctx)
    assert isinstance(tree, UnifiedRadixCache) and tree.disable
    if backend == "host_pool":
        assert tree.cache_controller is not None and len(counters) == 1 and tree.supports_retraction_backup()
        tree.validate_retraction_host_capacity()
        assert tree.host_pool_group.get_pool(PoolName.KV).size >= rig.allocator.size
    else:
        assert tree.cache_controller is None
    return tree


@pytest.fixture
def pd(request, make_rig, backup_hooks, monkeypatch):
    if "kvguard_backend" in request.fixturenames:
        request.getfixturevalue("kvguard_backend")  # (set before the guard is installed)
    backend = getattr(request, "param", "cpu_tensor")
    if backend == "host_pool":
        host_pool_shims.apply(monkeypatch)
    rig = make_rig(PS, num_tokens=4096, rows=24, context=1024, radix=False)
    bag = decode_server(rig, backend)
    try:
        rig.install(registry=rig.registry)
        pd = PDDecode(rig, monkeypatch, backend)
        calls = pd.verdicts = []  # every row verdict kvguard's backup / restore hooks took (kvguard's, counted)
        verdict = backup_hooks.row_verdict
        monkeypatch.setattr(backup_hooks, "row_verdict", lambda *a: calls.append(a[1].rid) or verdict(*a))
        pd.start = (rig.allocator.available_size(), rig.req_to_token_pool.available_size(), pd.host_free())
        yield pd
    finally:
        bag.__exit__(None, None, None)


def _balanced(pd) -> None:
    rig = pd.rig
    free = rig.allocator.get_all_free_pages().tolist()
    assert len(free) == len(set(free)), "a page is on the free list twice"
    assert (rig.allocator.available_size(), rig.req_to_token_pool.available_size(), pd.host_free()) == pd.start


def _others_unharmed(pd, *others) -> None:
    """After a fault's step: the others decode three clean steps with their KV intact, and everything drains back."""
    for _ in range(3):
        assert pd.step() == []
    assert all(pd.kv_intact(r) for r in others)
    pd.drain()
    _balanced(pd)


def _violations(pd) -> dict:
    return {k[0]: int(c._value.get()) for k, c in pd.guard.tracker.metrics.violations._metrics.items()
            if c._value.get()}


def _running(pd, n: int = 4, *, steps: int = 3):
    """``n`` transferred requests decoding; the last to arrive has the fewest tokens: SGLang's retraction order
    (ScheduleBatch._get_decode_retraction_order) takes it first. (the requests, in arrival order)"""
    reqs = [pd.arrive(40 + 13 * i, max_new_tokens=200) for i in range(n - 1)]
    for _ in range(steps):
        assert pd.step() == []
    reqs.append(pd.arrive(35, max_new_tokens=200))
    assert pd.step() == []
    return reqs


def _point_at(pd, req, first: int, other, page: int = 0) -> None:
    """The fault: ``req``'s row entries of its logical page ``first`` name ``other``'s page ``page`` (its slots)."""
    rig = pd.rig
    target = rig.row(other)[page * PS:(page + 1) * PS].clone()
    rig.row(req)[first * PS:(first + 1) * PS] = target


def _host_expected(pd) -> int | None:
    """The host pool's free slots with the backups of the retracted requests held (``host_pool``; each: the row's
    ``[0, seqlen - 1)`` padded to its last page), None for ``cpu_tensor``."""
    if pd.backend != "host_pool":
        return None
    held = [req.kv.retraction_backup for req in pd.q.retracted_queue]
    assert all(backup is not None and backup.host_indices is not None for backup in held)
    return pd.start[2] - sum(len(backup.host_indices) for backup in held)


# -- (a) clean backup + restore: no false abort, KV intact, nothing stale -------------------------------------------
@both_backends
@retraction_backups
def test_clean_retract_and_restore_cycles(pd):
    """200 randomized retract / restore cycles (SGLang picks the request), other requests arriving, decoding and
    finishing in between: no check flags anything, every restored request decodes on KV that is its own, no restored
    request is seen as stale, and the pools end balanced."""
    rng = random.Random(46)
    for _ in range(6):
        pd.arrive(rng.randint(20, 90), max_new_tokens=rng.randint(20, 80))
    pd.step()
    cycles = restored = 0
    while cycles < 200:
        if rng.random() < 0.3 and len(pd.s.running_batch.reqs) + len(pd.s.waiting_queue) < 12:
            pd.arrive(rng.randint(10, 120), max_new_tokens=rng.randint(10, 80))
        before = len(pd.q.retracted_queue)
        flagged = pd.step(retract=len(pd.s.running_batch.reqs) > 1)
        assert flagged == [], [m for _, m, _ in flagged]
        cycles += len(pd.q.retracted_queue) > before
        assert pd.host_free() == _host_expected(pd)  # (host_pool) the host pool holds exactly the saved KV
        if pd.q.retracted_queue and rng.random() < 0.6:
            back = pd.resume()
            restored += len(back)
            assert all(pd.kv_intact(r) for r in back)  # the saved KV came back, under the new row
            assert pd.host_free() == _host_expected(pd)  # (host_pool) a restore gives its host slots back
        running = pd.s.running_batch
        for req, stale in zip(running.reqs, pd.guard.stale_flags(running)[0] if running.reqs else []):
            if not req.finished():  # (a finished request stays in the batch, released, until SGLang's next filter)
                assert pd.kv_intact(req) and not stale, req.rid
    assert restored > 100 and pd.aborted == [] and pd.aborts() == []
    assert len(pd.verdicts) >= cycles + restored  # kvguard checked every backup and every restore
    assert _violations(pd) == {}
    pd.drain()
    _balanced(pd)


# -- (b) a row broken before the backup: that request only, nothing copied ------------------------------------------
@both_backends
@retraction_backups
def test_a_row_broken_before_backup_is_aborted_and_never_copied(pd):
    a, b, c, victim = _running(pd)
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    running = pd.s.running_batch
    assert running.reqs[ScheduleBatch._get_decode_retraction_order(running.reqs)[-1]] is victim
    own = pd.rig.pages_of(victim)[1]
    _point_at(pd, victim, 1, c)  # its second page's entries name C's first page (broken since its last check)
    c_kv = pd.rig.kv.k_buffer[0][pd.rig.page_slots(pd.rig.pages_of(c)[0])].clone()
    flagged = pd.step(retract=True)  # SGLang retracts the victim: retract_decode -> release_req -> backup_kv_cache
    assert flagged == []  # the step's check of the requests still running: clean
    assert victim.kv.retraction_backup is None and victim not in pd.q.retracted_queue  # nothing copied
    assert pd.host_free() == pd.start[2]  # (host_pool) no host slot taken: SGLang's tree backup never ran
    assert [r.rid for r, _ in pd.aborted] == [victim.rid]
    (rid, message), = pd.aborts()
    assert rid == victim.rid and message.startswith("kvguard") and "tag_mismatch" in message
    sent = pd.aborted[0][1].finished_reason  # what SGLang sends the client (send_abort_output)
    assert sent["message"] == message and sent["status_code"] == 500
    assert _violations(pd) == {"tag_mismatch": 1}
    assert own in pd.rig.allocator.get_all_free_pages().tolist()  # its own page came back (safe release)
    assert torch.equal(pd.rig.kv.k_buffer[0][pd.rig.page_slots(pd.rig.pages_of(c)[0])], c_kv)  # C's page: C's
    _others_unharmed(pd, a, b, c)


# -- (c) a row broken after the restore: the next check flags only it ----------------------------------------------
@both_backends
@retraction_backups
def test_a_row_broken_after_restore_is_flagged_by_the_next_check(pd):
    a, b, c, victim = _running(pd)
    assert pd.step(retract=True) == [] and pd.q.retracted_queue == [victim]
    assert victim.kv.retraction_backup is not None  # SGLang's backup (kvguard found the row intact)
    if pd.backend == "host_pool":  # in the tree's host pool: the row's [0, seqlen - 1), padded to its last page
        assert pd.host_free() == pd.start[2] - -(-(int(victim.seqlen) - 1) // PS) * PS
    assert pd.resume() == [victim] and pd.kv_intact(victim)  # restored into new pages, under a new row
    assert victim.kv.retraction_backup is None and pd.host_free() == pd.start[2]
    assert not pd.guard.stale_flags(NS(reqs=[victim], req_pool_indices_cpu=None))[0][0]  # its own row
    _point_at(pd, victim, 1, a)  # the fault, after the restore
    flagged = pd.step()  # the prebuilt batch joins the running batch; the decode check
    assert [(r.rid, "tag_mismatch" in m) for r, m, _ in flagged] == [(victim.rid, True)]
    assert [rid for rid, _ in pd.aborts()] == [victim.rid] and _violations(pd) == {"tag_mismatch": 1}
    _others_unharmed(pd, a, b, c)


@both_backends
@retraction_backups
def test_a_row_broken_before_the_restore_writes_is_never_written_through(pd, monkeypatch):
    """The new row broken between SGLang's _pre_alloc and its restore_kv_cache (resume_retracted_reqs): the saved KV
    is not written through it (it would land in another request's page); the request finishes at its prebuilt step
    with kvguard's message, released safely."""
    a, b, c, victim = _running(pd)
    assert pd.step(retract=True) == [] and pd.q.retracted_queue == [victim]
    pre_alloc = pd.q._pre_alloc

    def broken_after_pre_alloc(req, *args, **kwargs):
        out = pre_alloc(req, *args, **kwargs)  # SGLang's (kvguard's PD hook records the new row)
        _point_at(pd, req, 1, a)
        return out

    monkeypatch.setattr(pd.q, "_pre_alloc", broken_after_pre_alloc)
    a_kv = pd.rig.kv.k_buffer[0][pd.rig.page_slots(pd.rig.pages_of(a)[0])].clone()
    assert pd.resume() == [victim]
    assert torch.equal(pd.rig.kv.k_buffer[0][pd.rig.page_slots(pd.rig.pages_of(a)[0])], a_kv)  # not written
    assert victim.kv.retraction_backup is None and pd.host_free() == pd.start[2]  # discarded (host slots back)
    monkeypatch.undo()
    assert pd.step() == []  # the prebuilt result finishes it (SGLang's to_finish), the others decode
    assert victim.finished() and [rid for rid, _ in pd.aborts()] == [victim.rid]
    assert "tag_mismatch" in dict(pd.aborts())[victim.rid] and _violations(pd) == {"tag_mismatch": 1}
    assert victim not in pd.s.running_batch.reqs
    _others_unharmed(pd, a, b, c)


@pytest.mark.parametrize("mode,backend,threshold,resolved", [
    ("decode", None, 1.0, "host_pool"),  # SGLang's default for an MHA pool
    ("decode", "cpu_tensor", 1.0, "cpu_tensor"),
    ("decode", "host_pool", 1.0, "host_pool"),
    ("null", None, 1.0, "cpu_tensor"),
    ("decode", None, 0.5, None),  # decode host KV buffering (SGLang resolves host_pool): stops
])
def test_either_backend_resolved_at_start_serves_and_host_receive_stops(make_rig, backup_hooks, mode, backend,
                                                                       threshold, resolved):
    """SGLang's own resolution of the backend once the pools exist
    (``kv_cache_builder.resolve_decode_retraction_backup``, kvguard's hook after it) on the rig's MHA pool: either
    backend serves (both are checked, whatever the registry inferred from the launch line); a PD decode server with
    decode host KV buffering (not shown) stops there, before anything serves."""
    from transformers import LlamaConfig

    from sglang.srt.mem_cache import kv_cache_builder
    from sglang.srt.runtime_context import get_disagg
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from faultlab.sglang_live.rig import publish_server_args

    target = "sglang.srt.mem_cache.kv_cache_builder.resolve_decode_retraction_backup"
    assert _hooked(target, backup_hooks.after_resolve_backup)
    rig = make_rig(PS)  # (publishes SGLang's config namespaces, as a scheduler does)
    model_config = NS(hf_config=LlamaConfig(architectures=["LlamaForCausalLM"]), is_draft_model=False,
                      linear_attn_registry_result=None)
    tp_worker = NS(get_memory_pool=lambda: (rig.req_to_token_pool, rig.allocator), is_hybrid_swa=False,
                   model_runner=NS(mtp_draft_device_pools=(), spec_algorithm=SpeculativeAlgorithm.NONE,
                                   model_config=model_config))
    bag = get_disagg().override(disaggregation_mode=mode, disaggregation_decode_retraction_backup=backend,
                                disaggregation_decode_host_receive_threshold=threshold)
    try:
        with bag:
            if resolved is None:
                with pytest.raises(RuntimeError, match="pd_decode_host_receive"):
                    kv_cache_builder.resolve_decode_retraction_backup(tp_worker=tp_worker)
            else:
                assert kv_cache_builder.resolve_decode_retraction_backup(tp_worker=tp_worker) == resolved
    finally:
        publish_server_args(PS)  # (drops the resolution's overrides of SGLang's config bags)
