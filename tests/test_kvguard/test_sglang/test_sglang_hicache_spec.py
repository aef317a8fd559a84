"""HiCache with speculative decoding: the draft model's KV written back and loaded back beside the target's, on
SGLang 0.5.23's real classes (CPU rig, no engine).

The rig is test_sglang_hicache.py's (SGLang's ``UnifiedRadixCache`` with its own ``init_hicache``, a
``HybridCacheController`` over an ``MHATokenToKVPoolHost``, write-back, admission through its scheduler) plus an
EAGLE draft model's KV pool (one layer, as an EAGLE chain draft has) and the HiCache draft plan SGLang's own
``BaseSpecWorker._build_hicache_draft_plan`` makes for it (``SIDECAR``: the draft is not an MTP/NextN layer),
registered by SGLang's own ``kv_cache_builder.maybe_register_hicache_draft`` (a draft host pool whose transfers take
their indices from the target's: ``indices_from_pool=KV``). Spec decode steps reserve through SGLang's real
``alloc_for_spec_decode`` (chain 3/1/4) and launch their check as kvguard's spec forward hook does
(test_sglang_spec_rig.py's ``_spec_step``).

Both pools' bytes are written before write-back, scribbled over after eviction, and compared after load-back: the
draft's copies are real (host_pool_shims' torch reference of the ``direct`` IO backend).
"""
from __future__ import annotations

import time
from types import SimpleNamespace as NS

import host_pool_shims
import pytest
import torch
from test_sglang_hicache import PS, HiRig, _bytes_of, _flags, _prefix
from test_sglang_spec_rig import _Spec, _spec_step

pytestmark = pytest.mark.sglang
both_backends = pytest.mark.usefixtures("kvguard_backend")  # the torch references and the Triton kernels
DRAFT_LAYERS = 1


@pytest.fixture
def spec_on(monkeypatch):
    """This process's spec configuration: EAGLE chain 3/1/4, checked (as test_sglang_spec_rig.py's fixture)."""
    import sglang.srt.mem_cache.common as common

    from kvguard.sglang import spec

    monkeypatch.setattr(spec, "_REFUSAL", [None])
    get_spec = common.get_spec  # (read when called: the rig publishes its server arguments after this fixture)
    monkeypatch.setattr(common, "get_spec", lambda: _Spec(get_spec()))


class HiSpecRig(HiRig):
    """:class:`HiRig` with an EAGLE draft model's KV pool, backed up and loaded back by SGLang's draft plan."""

    def __init__(self, registry, **kw):
        from sglang.srt.mem_cache.kv_cache_builder import maybe_register_hicache_draft
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.speculative.base_spec_worker import BaseSpecWorker, HiCacheDraftMode
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        super().__init__("write_back", registry, **kw)
        self.draft = MHATokenToKVPool(size=self.allocator.size, page_size=PS, dtype=torch.float32, head_num=1,
                                      head_dim=4, layer_num=DRAFT_LAYERS, device="cpu", enable_memory_saver=False)
        # SGLang's own plan for an EAGLE draft worker (Scheduler.init_memory_pools -> init_hicache_draft_plan)
        worker = BaseSpecWorker.__new__(BaseSpecWorker)
        runner = NS(spec_algorithm=SpeculativeAlgorithm.EAGLE, req_to_token_pool=self.req_to_token_pool)
        draft_runner = NS(token_to_kv_pool=self.draft, model_config=NS(num_nextn_predict_layers=None))
        worker._target_worker, worker._draft_worker = NS(model_runner=runner), NS(draft_runners=[draft_runner])
        self.plan = BaseSpecWorker._build_hicache_draft_plan(worker)
        assert self.plan.mode == HiCacheDraftMode.SIDECAR and self.plan.device_pools == (self.draft,), self.plan
        with host_pool_shims.host_budget():
            maybe_register_hicache_draft(tree_cache=self.tree, draft_plan=self.plan)

    def write_kv(self, req) -> None:
        super().write_kv(req)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(req.full_untruncated_fill_ids)].long()
        for layer in range(DRAFT_LAYERS):
            self.draft.k_buffer[layer][row] = _draft_bytes(req, layer)
            self.draft.v_buffer[layer][row] = -_draft_bytes(req, layer)

    def draft_kv_of(self, req, n: int, layer: int = 0) -> torch.Tensor:
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
        return self.draft.k_buffer[layer][row]

    def scribble(self) -> None:
        """Every device byte of both pools overwritten (after an eviction): what a load-back restores is copied."""
        for buffers in (self.kv.k_buffer, self.kv.v_buffer, self.draft.k_buffer, self.draft.v_buffer):
            for layer in buffers:
                layer.fill_(-7.0)


def _draft_bytes(req, layer: int) -> torch.Tensor:
    return _bytes_of(req, layer) + 0.5  # distinct from the target's


def _publish(rig, prefixes):
    """Requests of these prompts prefilled (checked), both models' KV written, finished into the tree."""
    from sglang.srt.mem_cache.common import release_kv_cache

    reqs = [rig.make_req(p + [5, 6, 7]) for p in prefixes]
    assert _flags(rig.admit(reqs)) == [0] * len(reqs)
    for req in reqs:
        rig.write_kv(req)
        release_kv_cache(req, rig.tree, checkpoint=True)
    rig.events()


def _loaded(rig, prefixes, tail: int = 40, new: int = 64):
    """Prefixes evicted to host (write-back), scribbled on the device, and matchers admitted through SGLang's
    load-back: checked clean, both models' bytes the published ones."""
    rig.evict_device()
    assert rig.allocator.available_size() == rig.free0
    rig.scribble()
    reqs = [rig.make_req(p + [tail, tail + 1, tail + 2], new=new) for p in prefixes]
    batch = rig.admit(reqs)
    assert [r.host_loaded_length for r in reqs] == [len(p) for p in prefixes], "no load-back happened"
    assert _flags(batch) == [0] * len(reqs), "a healthy loaded-back request was flagged at prefill"
    rig.events()
    for req, p in zip(reqs, prefixes):
        want = rig.make_req(p + [5, 6, 7])
        assert torch.equal(rig.kv_of(req, len(p)), _bytes_of(want, 0)[:len(p)]), "target bytes differ"
        assert torch.equal(rig.draft_kv_of(req, len(p)), _draft_bytes(want, 0)[:len(p)]), "draft bytes differ"
    return reqs, batch


def _accept(batch, n: int) -> None:
    """Stand-in for verify: ``n`` tokens of each request accepted (what SGLang's result processing commits)."""
    for req in batch.reqs:
        req.kv.kv_committed_len += n
        req.output_ids.extend([7] * n)
    batch.seq_lens = batch.seq_lens + n
    batch.seq_lens_cpu = batch.seq_lens_cpu + n


def test_write_back_evict_load_back_spec_steps_raise_no_false_flag(check_hooks, hicache_shims, spec_on):
    """Clean: publish (both models' KV), write back, evict, load back through admission, then spec decode steps over
    the loaded-back prefix: no flag anywhere, both pools' bytes restored, pools balanced."""
    from prometheus_client import CollectorRegistry

    from sglang.srt.mem_cache.common import release_kv_cache

    rig = HiSpecRig(CollectorRegistry())
    cycles, per, steps = 250, 4, 4
    loads = checks = 0
    t0 = time.time()
    for cycle in range(cycles):
        prefixes = [_prefix(cycle % 5, i) for i in range(per)]
        _publish(rig, prefixes)
        reqs, batch = _loaded(rig, prefixes, tail=40 + cycle % 50)
        loads += per
        for accepted in (1, 4, 2, 3)[:steps]:
            assert set(_spec_step(rig._rig, batch).values()) == {0}, f"cycle {cycle}: a clean spec step was flagged"
            _accept(batch, accepted)
            checks += per
        for req in reqs:
            release_kv_cache(req, rig.tree, checkpoint=True)
        rig.events()
    rig.balanced()
    print(f"{loads} load-backs (target + draft), {checks} request spec checks clean in {time.time() - t0:.1f}s")


@both_backends
def test_a_draft_read_before_the_load_is_submitted_is_caught(check_hooks, hicache_shims, spec_on):
    """A batch prepared after the load-back (target and draft, one CacheOperation) was queued but before
    ``ready_to_load_host_cache`` submitted it: the draft's pages still hold other bytes, and its request is flagged;
    the same prefix read after the submission is clean, through its spec steps."""
    from prometheus_client import CollectorRegistry

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    rig = HiSpecRig(CollectorRegistry())
    prefix = _prefix(70, 0)
    _publish(rig, [prefix])
    rig.evict_device()
    rig.scribble()
    early = rig.make_req(prefix + [80, 81])
    early.init_next_round_input(rig.tree)
    assert early.host_hit_length == 3 * PS
    loaded, early.last_node = rig.tree.init_load_back(InitLoadBackParams(
        best_match_node=early.best_match_node, host_hit_length=early.host_hit_length, req=early))
    early.prefix_len += loaded
    early.kv.cache_protected_len = early.prefix_len
    (op,) = rig.tree.cache_controller.load_queue  # one queued operation carries both models' copies
    (draft_xfer,) = op.pool_transfers
    assert draft_xfer.device_indices is op.device_indices, "the draft's load is not on the target's device slots"
    batch = ScheduleBatch.init_new([early], rig.req_to_token_pool, rig.allocator, rig.tree, rig.model_config,
                                   False, SpeculativeAlgorithm.EAGLE)
    batch.prepare_for_extend()
    want = _draft_bytes(rig.make_req(prefix + [5, 6, 7]), 0)[:len(prefix)]
    assert not torch.equal(rig.draft_kv_of(early, len(prefix)), want)  # what its draft extend would read now
    assert _flags(batch) == [3 * PS], "a draft read of pages whose copy was never submitted passed"
    aborted = rig.guard.abort(rig.guard.resolve(batch.__dict__.pop("_kvguard"), group=None), tree_cache=rig.tree,
                              stream=None)
    assert aborted == [early]
    assert rig.tree.ready_to_load_host_cache() >= 0  # submitted now (late)
    rig.events()
    (late,), lbatch = _loaded_after_submission(rig, prefix)
    assert torch.equal(rig.draft_kv_of(late, len(prefix)), want)
    for accepted in (2, 4, 1):
        assert set(_spec_step(rig._rig, lbatch).values()) == {0}
        _accept(lbatch, accepted)
    release_kv_cache(late, rig.tree, checkpoint=True)
    rig.balanced()


def _loaded_after_submission(rig, prefix):
    req = rig.make_req(prefix + [90, 91], new=64)
    batch = rig.admit([req])
    assert _flags(batch) == [0]
    rig.events()
    return (req,), batch


@both_backends
def test_an_evicted_page_still_mapped_is_caught_at_the_next_spec_step(check_hooks, hicache_shims, spec_on):
    """A loaded-back prefix whose tree lock is dropped while a decoding request maps it (a lock not honoured):
    HiCache's eviction frees its device pages (written back to host: evictable) through the allocator's release
    kvguard wraps; the next spec step flags that request only, and its safe release frees nothing twice."""
    from prometheus_client import CollectorRegistry

    from sglang.srt.mem_cache.common import release_kv_cache

    rig = HiSpecRig(CollectorRegistry())
    prefixes = [_prefix(90, 0), _prefix(90, 1)]
    _publish(rig, prefixes)
    (victim, bystander), batch = _loaded(rig, prefixes)
    assert set(_spec_step(rig._rig, batch).values()) == {0}
    _accept(batch, 3)
    rig.tree.unlock(victim.lock)  # the fault: the victim's lock dropped while it still maps the node's pages
    victim.lock = None
    before = rig.allocator.available_size()
    rig.evict_device()
    assert rig.allocator.available_size() == before + 3 * PS  # the victim's loaded-back prefix left the device
    verdict = _spec_step(rig._rig, batch)
    assert verdict == {victim.rid: 1, bystander.rid: 0}, verdict
    pending = batch.__dict__.pop("_kvguard")
    aborted = rig.guard.abort(rig.guard.resolve(pending, group=None), tree_cache=rig.tree, stream=None)
    assert aborted == [victim] and victim.kvguard_aborted
    release_kv_cache(bystander, rig.tree, checkpoint=True)
    rig.balanced()


def test_packed_draft_layers_are_refused_at_install_and_a_sidecar_is_not(check_hooks, hicache_shims):
    """The structural backstop (``model_facts.pool_refusal``, at install): SGLang's packed MTP/NextN draft layers
    (``CacheInitParams.mtp_draft_device_pools``, what ``HiCacheDraftMode.PACKED`` sets) on the target's host pool
    are refused; the sidecar stack the tests above check is not."""
    from prometheus_client import CollectorRegistry

    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs

    from kvguard.sglang.model_facts import pool_refusal

    rig = HiSpecRig(CollectorRegistry())  # (publishes the rig's server arguments)
    assert pool_refusal(rig.req_to_token_pool, rig.allocator, None, rig.tree) is None
    args = ServerArgs(model_path="dummy", page_size=PS, device="cpu", enable_hierarchical_cache=True,
                      hicache_io_backend="direct", hicache_mem_layout="layer_first", hicache_ratio=2.0)
    pools = [MHATokenToKVPool(size=256, page_size=PS, dtype=torch.float32, head_num=1, head_dim=4, layer_num=n,
                              device="cpu", enable_memory_saver=False) for n in (2, DRAFT_LAYERS)]
    allocator = PagedTokenToKVPoolAllocator(256, page_size=PS, dtype=torch.float32, device="cpu", kvcache=pools[0],
                                            need_sort=False)
    rows = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=allocator,
                             page_size=PS, tree_components=(ComponentType.FULL,), mtp_draft_device_pools=pools[1:])
    tree = UnifiedRadixCache(params)
    with host_pool_shims.host_budget():
        tree.init_hicache(args, params)
    assert list(tree.cache_controller.mem_pool_host.anchor_entry.packed_draft_device_pools) == pools[1:]
    assert pool_refusal(rows, allocator, None, tree) == "hierarchical_cache_spec_packed"
