"""HiCache (issue 43 item 2): SGLang 0.5.23's real hierarchical cache, driven step by step on the CPU with kvguard.

The rig holds SGLang's real ``UnifiedRadixCache`` with HiCache attached by its own ``init_hicache`` (a
``HybridCacheController`` over an ``MHATokenToKVPoolHost``, host memory only, ``io_backend="direct"``,
``layer_first``), over real device pools, kvguard installed on them and its hooks applied by SGLang's plugin loader.
Requests are admitted through SGLang's own ``Scheduler._get_new_batch_prefill_raw`` (``PrefillAdder.add_one_req`` ->
``tree.init_load_back``, ``ready_to_load_host_cache``, ``prepare_for_extend``) on a scheduler shell holding the rig's
pools (as in test_sglang_stale_release.py); the tree writes through / back, evicts and loads back by itself.

Two shims stand in for CUDA-only calls outside the logic under test (SGLang makes neither on the CPU, where its
host pool does not start; tests/host_pool_shims.py, shared with test_sglang_pd_backup.py's host-pool retraction
backup): ``pool_host.common._cuda_host_register`` (pinning the host buffer with ``cudaHostRegister``: it changes no
byte and no index) is a no-op, and ``pool_host.mha.transfer_kv_direct`` (the ``sgl_kernel`` op the ``direct`` IO
backend calls with the ``layer_first`` layout, imported by SGLang only on CUDA/ROCm/XPU) is its torch reference: per
layer, ``dst[dst_indices] = src[src_indices]``. The bytes a load-back brings back are compared with what was written
before eviction, so the copies are real.
"""
from __future__ import annotations

import time
from types import SimpleNamespace as NS

import pytest
import torch
import host_pool_shims
from sglang_scheduler import scheduler_shell

pytestmark = pytest.mark.sglang
both_backends = pytest.mark.usefixtures("kvguard_backend")  # the torch references and the Triton kernels
PS = 16


class HiRig:
    """Real SGLang device pools and a ``UnifiedRadixCache`` with HiCache (its own ``init_hicache``), kvguard on it."""

    def __init__(self, policy: str, registry, num_tokens: int = 1024, rows: int = 16):
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        from faultlab.sglang_live.rig import Rig
        from kvguard.sglang.plugin import install

        args = ServerArgs(model_path="dummy", page_size=PS, device="cpu", enable_hierarchical_cache=True,
                          hicache_io_backend="direct", hicache_mem_layout="layer_first", hicache_ratio=2.0,
                          hicache_write_policy=policy)
        set_global_server_args_for_scheduler(args)
        self.page_size = PS
        self.kv = MHATokenToKVPool(size=num_tokens, page_size=PS, dtype=torch.float32, head_num=1, head_dim=4,
                                   layer_num=2, device="cpu", enable_memory_saver=False)
        self.allocator = PagedTokenToKVPoolAllocator(num_tokens, page_size=PS, dtype=torch.float32, device="cpu",
                                                     kvcache=self.kv, need_sort=False)
        self.req_to_token_pool = ReqToTokenPool(size=rows, max_context_len=512, device="cpu",
                                                enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.req_to_token_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=PS,
                                 tree_components=(ComponentType.FULL,))
        self.tree = UnifiedRadixCache(params)
        with host_pool_shims.host_budget():
            self.tree.init_hicache(args, params)
        self.host = self.tree.cache_controller.mem_pool_host
        self.model_config = NS(is_encoder_decoder=False, vocab_size=32000)
        self.guard = install(self.req_to_token_pool, self.allocator, self.tree, registry=registry)
        self.free0, self.host0 = self.allocator.available_size(), self.host.available_size()
        self._rig = Rig.__new__(Rig)  # the plain rig's request helpers, on this rig's pools and tree
        self._rig.__dict__.update(self.__dict__)

    def make_req(self, tokens, new: int = 8):
        return self._rig.make_req(0, max_new_tokens=new, tokens=tokens)

    def admit(self, reqs, running=None):
        """SGLang's own prefill admission and batch preparation (load-back included), on a scheduler shell."""
        s = scheduler_shell(self, overlap=False, hierarchical=True, running=running)
        s.waiting_queue = list(reqs)
        batch, _ = s._get_new_batch_prefill_raw(None, s.running_batch)
        assert batch is not None and batch.reqs == list(reqs), "a request was not admitted"
        return batch

    def write_kv(self, req) -> None:
        """Stand-in for the forward: this request's KV bytes (distinct per slot), in every layer."""
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(req.full_untruncated_fill_ids)].long()
        for layer in range(self.kv.layer_num):
            self.kv.k_buffer[layer][row] = _bytes_of(req, layer)
            self.kv.v_buffer[layer][row] = -_bytes_of(req, layer)

    def kv_of(self, req, n: int, layer: int = 0) -> torch.Tensor:
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
        return self.kv.k_buffer[layer][row]

    def events(self) -> None:
        self.tree.check_hicache_events()  # what the scheduler polls every step (acks of writes and loads)

    def evict_device(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.tree.evict(EvictParams(num_tokens=self.allocator.size))
        self.events()

    def balanced(self, extra: int = 0) -> None:
        """Everything evicted from device and host: both pools hold every page again (``extra`` slots more: an
        injected free the tree's own free repeats), no lock left."""
        self.events()
        self.evict_device()
        self.tree.evict_host(self.host.size)
        self.events()
        assert self.tree.protected_size() == 0
        assert self.allocator.available_size() == self.free0 + extra, (self.allocator.available_size(), self.free0)
        assert self.host.available_size() == self.host0, (self.host.available_size(), self.host0)
        assert sorted(self.req_to_token_pool.free_slots) == list(range(1, self.req_to_token_pool.size + 1))


def _bytes_of(req, layer: int) -> torch.Tensor:
    ids = torch.tensor(list(req.full_untruncated_fill_ids), dtype=torch.float32)
    return (ids * 10 + layer).reshape(-1, 1, 1).expand(-1, 1, 4)


def _flags(batch) -> list[int]:
    """Bad entries per request of this batch's check (0: clean)."""
    pending = batch.__dict__.get("_kvguard")
    assert pending is not None, "the batch was not checked"
    return pending.guard.check_of(pending).verdict.cpu().reshape(len(pending.reqs), -1).sum(1).tolist()


def _prefix(cycle: int, i: int) -> list[int]:
    return [1000 + (cycle * 7 + i) * 131 + t for t in range(3 * PS)]  # three pages, one node per request


def _publish(rig, prefixes) -> torch.Tensor:
    """Requests of these prompts prefilled (checked), their KV written, finished into the tree; its pages of them."""
    from sglang.srt.mem_cache.common import release_kv_cache

    reqs = [rig.make_req(p + [5, 6, 7]) for p in prefixes]
    batch = rig.admit(reqs)
    assert _flags(batch) == [0] * len(reqs)
    table = rig.req_to_token_pool.req_to_token
    pages = torch.cat([table[r.kv.req_pool_idx, :len(p):PS].long() // PS for r, p in zip(reqs, prefixes)])
    for req in reqs:
        rig.write_kv(req)
        release_kv_cache(req, rig.tree, checkpoint=True)
    rig.events()
    return pages


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_write_evict_load_back_cycles_raise_no_false_flag(check_hooks, hicache_shims, policy):
    """(a) publish, write to host, evict from device, match: load back, check; >= 1,000 load-backs with
    SGLang's policy, 0 false flags, the loaded bytes the published ones, pools balanced (d)."""
    from prometheus_client import CollectorRegistry

    from sglang.srt.mem_cache.common import release_kv_cache

    rig = HiRig(policy, CollectorRegistry())
    cycles, per = 250, 4
    loads, t0 = 0, time.time()
    for cycle in range(cycles):
        prefixes = [_prefix(cycle % 5, i) for i in range(per)]
        pages = _publish(rig, prefixes)
        adopted = rig.guard.radix.tags[pages].clone()
        rig.evict_device()
        assert rig.allocator.available_size() == rig.free0  # every device page of the tree went back
        # HiCache's eviction freed them through the allocator's release kvguard wraps: a reader would be flagged
        assert bool((rig.guard.tracker.current_tags(pages) != adopted).all()), "an evicted page kept its tag"
        matchers = [rig.make_req(p + [40 + cycle % 50, 41, 42]) for p in prefixes]
        batch = rig.admit(matchers)
        assert [r.host_loaded_length for r in matchers] == [3 * PS] * per, "no load-back happened"
        assert batch.hicache_consumer_index >= 0
        assert _flags(batch) == [0] * per, f"cycle {cycle}: a healthy loaded-back request was flagged"
        rig.events()  # the load acks (the copies ran in start_loading on the CPU)
        for req, p in zip(matchers, prefixes):
            want = rig.make_req(p + [5, 6, 7])
            assert torch.equal(rig.kv_of(req, len(p)), _bytes_of(want, 0)[:len(p)]), "load-back bytes differ"
            release_kv_cache(req, rig.tree, checkpoint=True)
        rig.events()
        loads += per
    assert loads >= 1000
    rig.balanced()
    print(f"{policy}: {loads} load-backs checked clean in {time.time() - t0:.1f}s")


def _loaded_request(rig, tag: int):
    """One prefix published, evicted to host, and a matcher admitted through SGLang's load-back (clean)."""
    prefix = _prefix(50 + tag, 0)
    _publish(rig, [prefix])
    rig.evict_device()
    req = rig.make_req(prefix + [60, 61, 62], new=32)
    batch = rig.admit([req])
    assert req.host_loaded_length == 3 * PS and _flags(batch) == [0]
    rig.events()
    return req, batch


@both_backends
def test_a_loaded_back_page_freed_and_reallocated_flags_only_its_reader(check_hooks, hicache_shims):
    """(b) a page the load-back gave the tree, freed while a request maps it (a lock not honoured) and handed to
    another request: the reader is flagged at its next check, the new holder and a bystander are not."""
    from prometheus_client import CollectorRegistry

    from faultlab.sglang_live.rig import Rig
    from sglang.srt.mem_cache.common import release_kv_cache

    rig = HiRig("write_through", CollectorRegistry())
    victim, vbatch = _loaded_request(rig, 0)
    bystander = rig.make_req(list(range(3000, 3000 + 2 * PS + 3)), new=32)
    batch = rig.admit([bystander])
    assert _flags(batch) == [0]
    page = int(rig.req_to_token_pool.req_to_token[victim.kv.req_pool_idx, PS]) // PS  # its second loaded page
    rig.allocator.free(torch.arange(page * PS, page * PS + PS))  # the fault: freed under the reader
    at = rig.allocator.free_pages.tolist().index(page)
    holder = rig.make_req(list(range(5000, 5000 + (at + 1) * PS - 1)), new=32)  # takes the free list up to it
    hbatch = rig.admit([holder])
    assert page in (rig.req_to_token_pool.req_to_token[holder.kv.req_pool_idx, :(at + 1) * PS:PS] // PS).tolist()
    assert _flags(hbatch) == [0]
    running = vbatch
    running.merge_batch(batch)
    running.merge_batch(hbatch)
    Rig.sample(None, running)
    running.prepare_for_decode()
    flags = dict(zip([r.rid for r in running.reqs], _flags(running)))
    assert flags[victim.rid] > 0 and flags[bystander.rid] == 0 and flags[holder.rid] == 0, flags
    pending = running.__dict__.pop("_kvguard")
    aborted = rig.guard.abort(rig.guard.resolve(pending, group=None), tree_cache=rig.tree, stream=None)
    assert aborted == [victim] and victim.kvguard_aborted  # released safely: the page its holder has stays
    for req in (bystander, holder):
        release_kv_cache(req, rig.tree, checkpoint=False)
    # (d) balanced, but for the fault itself: the injected free and the tree's own eviction of the node free that
    # page twice (the tree's structure is broken; kvguard flags its readers, it does not repair the tree)
    rig.balanced(extra=PS)


@both_backends
def test_a_read_before_the_load_is_submitted_is_caught(check_hooks, hicache_shims):
    """(c) a batch prepared after the load-back was queued but before ``ready_to_load_host_cache`` submitted it
    (no layer event orders its forward after the copy): its request is flagged; the same prefix read by the next
    batch, prepared after the submission, is clean."""
    from prometheus_client import CollectorRegistry

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    rig = HiRig("write_through", CollectorRegistry())
    prefix = _prefix(70, 0)
    _publish(rig, [prefix])
    rig.evict_device()
    early = rig.make_req(prefix + [80, 81])
    early.init_next_round_input(rig.tree)
    assert early.host_hit_length == 3 * PS
    # what PrefillAdder.add_one_req does, then the faulty path: the batch prepared before any submission
    loaded, early.last_node = rig.tree.init_load_back(InitLoadBackParams(
        best_match_node=early.best_match_node, host_hit_length=early.host_hit_length, req=early))
    early.prefix_len += loaded
    early.kv.cache_protected_len = early.prefix_len
    batch = ScheduleBatch.init_new([early], rig.req_to_token_pool, rig.allocator, rig.tree, rig.model_config,
                                   False, SpeculativeAlgorithm.NONE)
    batch.prepare_for_extend()
    assert _flags(batch) == [3 * PS], "a read of pages whose copy was never submitted passed"
    aborted = rig.guard.abort(rig.guard.resolve(batch.__dict__.pop("_kvguard"), group=None), tree_cache=rig.tree,
                              stream=None)
    assert aborted == [early]
    assert rig.tree.ready_to_load_host_cache() >= 0  # submitted now (late)
    rig.events()
    late = rig.make_req(prefix + [90, 91])
    assert _flags(rig.admit([late])) == [0]
    release_kv_cache(late, rig.tree, checkpoint=True)
    rig.balanced()
