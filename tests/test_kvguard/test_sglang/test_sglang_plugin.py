"""kvguard's SGLang plugin: loaded by SGLang's own loader, off = untouched, install on the real pools.

SGLang's own ``load_plugins()`` runs in this process, first with KVGUARD_MODE=off, then with =check
(fixture ``sglang_loader``); the entry point is kvguard's installed metadata (pyproject's
``sglang.srt.plugins`` group). Every other sglang test then
runs with the hooks that loader applied.
"""
import pytest


pytestmark = pytest.mark.sglang


@pytest.fixture
def loader_run(sglang_loader):
    return sglang_loader


def test_entry_point_is_found_by_sglang(loader_run):
    assert "kvguard=kvguard.sglang:register" in loader_run["entry_points"]


def test_off_mode_patches_nothing(loader_run):
    assert loader_run["off_hooks"] == []
    assert loader_run["off_untouched"] is True


def test_check_mode_hooks_applied_by_sglang_loader(loader_run):
    from kvguard.sglang.plugin import TARGETS

    assert sorted(TARGETS.values()) == [t for t in loader_run["check_hooks"] if t in TARGETS.values()]
    assert all(loader_run["check_wrapped"].values()), loader_run["check_wrapped"]
    assert loader_run["schedule_batch_rebound"] is True


def test_build_kv_cache_hook_installs_on_that_instance_only(check_hooks, make_rig):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_cache_builder import KVCacheBuildResult

    from kvguard.sglang.plugin import _after_build_kv_cache

    rig, other = make_rig(16), make_rig(16)
    result = KVCacheBuildResult(is_hybrid_swa=False, is_hybrid_ssm=False, sliding_window_size=None,
                                full_tokens_per_layer=None, swa_tokens_per_layer=None,
                                req_to_token_pool=rig.req_to_token_pool,
                                token_to_kv_pool_allocator=rig.allocator, disable_radix_cache=False,
                                tree_cache=rig.tree)
    assert _after_build_kv_cache(result) is None  # SGLang's result is kept
    guard = rig.allocator._kvguard
    assert guard.tracker.enabled and guard.page_size == 16 and guard.num_pages == rig.allocator.num_pages
    assert "alloc_extend" in vars(rig.allocator) and "_release_page_ids" in vars(rig.allocator)
    # the class and every other allocator instance stay as shipped
    assert getattr(other.allocator, "_kvguard", None) is None and "alloc_extend" not in vars(other.allocator)
    assert not hasattr(PagedTokenToKVPoolAllocator.alloc_extend, "__wrapped__")


def test_clean_traffic_passes_and_costs_one_check_per_step(rig_ps):
    rig = rig_ps
    batch = rig.to_decode(rig.prefill(20, 33), rig.prefill(rig.page_size * 2))
    rig.guard.tracker.flush_metrics()
    checks0 = rig.guard.tracker.metrics.checks._value.get()
    for _ in range(3 * max(rig.page_size, 4)):  # crosses page boundaries for every request
        rig.decode(batch)
        assert set(rig.verdict(batch).values()) == {0}
        rig.sample(batch)
    rig.guard.tracker.flush_metrics()  # (counted in batches: TagTracker.count_check)
    assert rig.guard.tracker.metrics.checks._value.get() - checks0 == 3 * max(rig.page_size, 4)
    # a finished request returns everything; a new one reusing its row and pages is clean too
    done = batch.reqs[0]
    rig.release(done)
    batch.filter_batch(keep_indices=[1, 2])
    fresh = rig.prefill(5)
    batch = rig.to_decode(batch, fresh)
    for _ in range(rig.page_size + 2):
        rig.decode(batch)
        assert set(rig.verdict(batch).values()) == {0}
        rig.sample(batch)


def test_radix_prefix_share_and_checkpoint_are_not_false_positives(check_hooks, make_rig):
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    prompt = list(range(1000, 1040))  # 40 tokens: two full pages go to the tree
    first = rig.prefill(reqs=[rig.make_req(0, tokens=prompt)])
    rig.tree.checkpoint(first.reqs[0], up_to=40)  # the tree takes the full pages and repoints the row
    second = rig.prefill(reqs=[rig.make_req(0, tokens=prompt + [5, 6, 7])])
    assert second.reqs[0].prefix_len == 32  # really shared through the real RadixCache
    batch = rig.to_decode(first, second)
    for _ in range(20):
        rig.decode(batch)
        assert set(rig.verdict(batch).values()) == {0}
        rig.sample(batch)


def test_check_counters_are_exact_once_the_requests_are_released(rig_ps):
    rig = rig_ps
    tracker = rig.guard.tracker
    tracker.flush_metrics()
    checks0, launched0 = tracker.metrics.checks._value.get(), tracker.checks_launched
    batch = rig.running(9, 12)
    for _ in range(5):
        rig.decode(batch)
        rig.sample(batch)
    assert tracker.checks_launched - launched0 >= 6
    for req in batch.reqs:
        rig.release(req)  # SGLang's release_kv_cache (hooked): the counters catch up
    assert tracker.metrics.checks._value.get() - checks0 == tracker.checks_launched - launched0
