"""kvguard inside SGLang never makes things worse: safe aborts, guarded writes, every entry, fail closed.

Each test drives SGLang 0.5.23's real pools, allocator, radix tree and ScheduleBatch (prepare_for_extend /
prepare_for_decode, release_kv_cache) with kvguard's hooks applied by SGLang's own plugin loader, and
breaks a mapping with SGLang's own API or a plain req_to_token write, as a bug would. Each one fails on
the plugin as it was before issue 13 (page-granular decode-only checks, release from the broken row).
"""
import os
import random
import subprocess
import sys

import pytest
import torch


pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("kvguard_backend")]


def _free_pages(rig) -> list[int]:
    """Every page on SGLang's free lists (staged / release lists included; slots for the token allocator)."""
    return sorted(rig.allocator.get_all_free_pages().tolist())


def _abort_flagged(rig, batch):
    pending = batch.__dict__.pop("_kvguard")
    flagged = rig.guard.resolve(pending, group=None)
    return rig.guard.abort(flagged, tree_cache=rig.tree, stream=None)


def _all_pages(rig) -> list[int]:
    return list(range(1, rig.allocator.num_pages + 1)) if rig.page_size > 1 or hasattr(
        rig.allocator, "num_pages") else list(range(1, rig.allocator.size + 1))


# -- 1. the abort releases only what the request legitimately holds --------------------------------------
@pytest.mark.parametrize("page_size,need_sort", [(1, False), (16, False), (1, True), (16, True)])
def test_abort_never_frees_another_requests_page(make_rig, page_size, need_sort):
    rig, ps = make_rig(page_size, need_sort=need_sort), page_size
    rig.install(registry=rig.registry)
    batch = rig.running(2 * ps + 3, 2 * ps + 3, 2 * ps + 3)
    a, b, c = batch.reqs
    c_page, a_page1 = rig.pages_of(c)[0], rig.pages_of(a)[1]
    rig.row(a)[ps:2 * ps] = rig.page_slots(c_page).to(torch.int32)  # A's 2nd page now names C's 1st
    rig.decode(batch)
    assert rig.verdict(batch) == {a.rid: 1, b.rid: 0, c.rid: 0}
    assert [r.rid for r in _abort_flagged(rig, batch)] == [a.rid]
    free = _free_pages(rig)
    assert c_page not in free  # SGLang's release alone would free C's page here (the row names it)
    assert a_page1 in free  # A's own page, which its broken row no longer names, is not leaked
    assert len(free) == len(set(free))
    rig.sample(batch)
    batch.filter_batch()
    rig.decode(batch)  # C is not flagged one step later (no chain of innocent aborts)
    assert rig.verdict(batch) == {b.rid: 0, c.rid: 0}
    for req in (b, c):
        rig.release(req)
    assert _free_pages(rig) == _all_pages(rig)  # accounting exactly as after clean finishes


def test_abort_leaves_a_shared_tree_page_with_its_holders(make_rig):
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    ps, prefix = 16, [11 + i for i in range(32)]
    rig.publish(prefix + [901])  # the tree keeps its two full pages
    holders = rig.prefill(reqs=[rig.make_req(0, tokens=prefix + [902 + i]) for i in range(2)])
    other = rig.prefill(2 * ps + 3)
    batch = rig.to_decode(holders, other)
    h1, h2, victim = batch.reqs
    tree_page = rig.pages_of(h1)[0]
    assert rig.pages_of(h2)[0] == tree_page and h1.kv.cache_protected_len == 32
    rig.decode(batch)
    rig.sample(batch)
    rig.row(victim)[ps:2 * ps] = rig.page_slots(tree_page).to(torch.int32)  # names the shared page
    rig.decode(batch)
    assert rig.verdict(batch) == {h1.rid: 0, h2.rid: 0, victim.rid: 1}
    _abort_flagged(rig, batch)
    assert tree_page not in _free_pages(rig)
    rig.sample(batch)
    batch.filter_batch()
    rig.decode(batch)
    assert rig.verdict(batch) == {h1.rid: 0, h2.rid: 0}
    # a newcomer matching the prefix gets the tree page once, and is clean
    late = rig.prefill(reqs=[rig.make_req(0, tokens=prefix + [999, 998])])
    pages = rig.pages_of(late.reqs[0])
    assert pages[0] == tree_page and len(pages) == len(set(pages))
    assert rig.verdict(late) == {late.reqs[0].rid: 0}


# -- 2. the current step never writes through a broken entry -----------------------------------------------
def test_write_slot_of_a_flagged_request_is_redirected_before_the_forward(make_rig):
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    ps = 16
    batch = rig.running(ps + 3, ps + 3)
    a, c = batch.reqs
    c_page0 = rig.pages_of(c)[0]
    seq = int(a.kv.kv_allocated_len)  # the next write goes to position seq, slot = row[seq - 1] + 1
    span = torch.arange(ps, seq)
    rig.row(a)[ps:seq] = (c_page0 * ps + span % ps).to(torch.int32)  # A's current page -> C's first page
    rig.decode(batch)
    out = batch.out_cache_loc.tolist()
    # SGLang chose last_loc + 1 inside C's page for A: kvguard moved it to the padding slot
    assert out[0] == 0 and out[1] // ps == rig.pages_of(c)[1]
    assert rig.verdict(batch) == {a.rid: 1, c.rid: 0}


def test_extend_write_slots_of_a_flagged_request_are_redirected(make_rig):
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    prefix = [21 + i for i in range(32)]
    rig.publish(prefix + [5])
    tree_page = rig.pages_of(rig.prefill(reqs=[rig.make_req(0, tokens=prefix + [6])]).reqs[0])[1]
    rig.allocator.free(rig.page_slots(tree_page))  # the bug: a tree page freed while the tree maps it
    batch = rig.prefill(reqs=[rig.make_req(0, tokens=prefix + [7, 8, 9]), rig.make_req(20)])
    hit, clean = batch.reqs
    assert rig.verdict(batch) == {hit.rid: 1, clean.rid: 0}
    lens = batch.extend_lens
    out = batch.out_cache_loc.tolist()
    assert out[:lens[0]] == [0] * lens[0] and 0 not in out[lens[0]:]


# -- 3. every entry is checked, inside pages too ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["other_page", "same_page_wrong_offset"])
def test_entry_inside_a_page_is_checked(make_rig, kind):
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    ps = 16
    batch = rig.running(2 * ps + 1, 2 * ps + 1)
    a, b = batch.reqs
    own = rig.pages_of(a)[0]
    if kind == "other_page":
        rig.row(a)[5] = rig.pages_of(b)[0] * ps + 5
    else:
        rig.row(a)[5] = own * ps + 6  # token 5 reads token 6's KV
    rig.decode(batch)
    assert rig.verdict(batch) == {a.rid: 1, b.rid: 0}
    err = rig.guard.tracker.resolve(rig.guard.check_of(batch._kvguard), rig.guard.check_of(batch._kvguard).verdict.cpu(), [a.rid, b.rid])
    assert err[0].logical_position == 5
    assert err[0].reason == ("tag_mismatch" if kind == "other_page" else "misplaced_in_page")


# -- 4. extend / prefill batches are checked before their forward ---------------------------------------
def test_prefill_matching_a_freed_tree_page_is_flagged_and_discarded(rig_ps):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rig, ps = rig_ps, rig_ps.page_size
    prefix = [31 + i for i in range(2 * ps)]
    tree_pages = rig.publish(prefix + [5])[:2]
    rig.allocator.free(rig.page_slots(tree_pages[0]))  # freed while the tree still references it
    thief = rig.prefill(ps)  # LIFO reuse: another request now owns and writes that page
    assert rig.pages_of(thief.reqs[0])[0] == tree_pages[0]
    batch = rig.prefill(reqs=[rig.make_req(0, tokens=prefix + [6, 7])])
    hit = batch.reqs[0]
    assert rig.pages_of(hit)[0] == tree_pages[0]  # the tree handed out the stolen page
    assert rig.verdict(batch) == {hit.rid: 1}
    pending = batch.__dict__.pop("_kvguard")
    flagged = rig.guard.resolve(pending)
    assert rig.guard.discard(flagged) == [hit]
    assert isinstance(hit.discard_output_reason, FINISH_ABORT) and hit.skip_radix_cache_insert
    rig.release(hit)  # what SGLang's prefill path does with a discarded request
    assert tree_pages[0] not in _free_pages(rig)  # still the thief's
    rig.decode(thief)
    assert rig.verdict(thief) == {thief.reqs[0].rid: 0}


# -- 0 false aborts over many clean steps, accounting balanced ------------------------------------------
@pytest.mark.parametrize("page_size,need_sort", [(1, False), (16, False), (16, True)])
def test_no_false_aborts_over_clean_steps_with_prefix_sharing(make_rig, kvguard_backend, page_size, need_sort):
    rig = make_rig(page_size, num_tokens=4096, rows=24, context=256, need_sort=need_sort)
    rig.install(registry=rig.registry)
    rng = random.Random(page_size * 7 + need_sort)
    prefixes = [[100 + 50 * p + i for i in range(rng.choice([16, 32, 40]))] for p in range(4)]
    # The torch references soak 400 steps; the Triton kernels (interpreted: ~0.1 s a step) run the same
    # workload for its first 120 (longer soaks: the live engines' and the CLI's sweeps).
    budget = 400 if kvguard_backend == "torch" else 120
    running, steps, finished = None, 0, 0
    while steps < budget:
        if running is None or (len(running.reqs) < 12 and rng.random() < 0.3):
            reqs = [rig.make_req(0, max_new_tokens=64,
                                 tokens=rng.choice(prefixes) + [rng.randrange(1000, 9000) for _ in range(rng.randrange(1, 20))])
                    for _ in range(rng.randrange(1, 4))]
            new = rig.prefill(reqs=reqs)
            assert set(rig.verdict(new).values()) == {0}
            running = new if running is None else rig.to_decode(running, new)
        rig.decode(running)
        assert set(rig.verdict(running).values()) == {0}, steps
        rig.sample(running)
        steps += 1
        keep = []
        for i, req in enumerate(running.reqs):
            if len(req.output_ids) > rng.randrange(8, 60):
                rig.release(req, checkpoint=True)
                finished += 1
            else:
                keep.append(i)
        if not keep:
            running = None
            continue
        running.filter_batch(keep_indices=keep)
    assert finished > budget // 20, finished
    counts = {labels: child._value.get() for labels, child in rig.guard.tracker.metrics.violations._metrics.items()}
    assert set(counts.values()) == {0}, counts  # no violation of any reason (every series exists, at 0)


# -- 5. fail closed -------------------------------------------------------------------------------------
@pytest.mark.parametrize("env,name", [
    ({"KVGUARD_MODE": "chekc"}, "KVGUARD_MODE"),
    ({"KVGUARD_MODE": ""}, "KVGUARD_MODE"),
    ({"KVGUARD_MODE": "on"}, "KVGUARD_MODE"),
    ({"KVGUARD_MODE": "check", "KVGUARD_BACKEND": "cuda"}, "KVGUARD_BACKEND"),
    ({"KVGUARD_MODE": "check", "KVGUARD_LOG_VIOLATIONS": "maybe"}, "KVGUARD_LOG_VIOLATIONS"),
])
def test_register_refuses_bad_settings(env, name):
    from kvguard.sglang.plugin import KVGuardStartupError, register

    with pytest.raises(KVGuardStartupError) as info:
        register(env=env)
    assert isinstance(info.value, SystemExit) and not isinstance(info.value, Exception)
    assert name in str(info.value.code)


def _run(code: str, **env):
    full = {**os.environ, "SGLANG_PLUGINS": "kvguard", **env}
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


def test_bad_setting_stops_the_process_through_sglangs_own_loader():
    # SGLang's load_plugins() catches Exception from plugins; kvguard's refusal must get through it
    r = _run("import sglang.srt.plugins as p; p.load_plugins(); print('SERVING')", KVGUARD_MODE="chekc")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "SERVING" not in r.stdout
    assert "KVGUARD_MODE" in r.stderr and "check" in r.stderr


def test_launcher_exits_2_before_sglang_starts():
    r = _run("from kvguard.sglang.launch import main; main(['--help'])", KVGUARD_MODE="bogus")
    assert r.returncode == 2 and "KVGUARD_MODE" in r.stderr
    r = _run("from kvguard.sglang.launch import main; main(['--help'])", SGLANG_PLUGINS="other")
    assert r.returncode == 2 and "SGLANG_PLUGINS" in r.stderr


# -- 6. the API a user reaches for ----------------------------------------------------------------------
def test_guard_of_reaches_the_installed_guard(rig_ps):
    from kvguard.sglang.plugin import guard_of, guards

    rig = rig_ps
    batch = rig.prefill(5)
    assert guard_of(rig.allocator) is rig.guard
    assert guard_of(rig.tree) is rig.guard
    assert guard_of(batch) is rig.guard
    assert rig.guard in guards()
    assert guard_of(object()) is None


def test_allocator_subclass_is_covered_and_others_refused(make_rig):
    from prometheus_client import CollectorRegistry
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    from kvguard.metrics import metrics_for
    from kvguard.sglang.plugin import KVGuardStartupError, install

    class MyAllocator(PagedTokenToKVPoolAllocator):
        pass

    rig = make_rig(16)
    sub = MyAllocator(1024, page_size=16, dtype=torch.float8_e4m3fn, device="cpu", kvcache=rig.kv,
                      need_sort=False)
    guard = install(rig.req_to_token_pool, sub, None, registry=rig.registry)  # no tree: fine
    assert guard is not None and guard.allocator is sub

    class Other:
        page_size = 16

    registry = CollectorRegistry()
    with pytest.raises(KVGuardStartupError, match="Other.*not covered"):
        install(rig.req_to_token_pool, Other(), None, registry=registry)
    assert metrics_for(registry).uncovered._value.get() == 1

    # A paged subclass whose pages are not handed out from free_pages (one free list per shard class): refused
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    interleaved = PageInterleavePoolAllocator(512, physical_page_size=16, shard_size=2, dtype=torch.float8_e4m3fn,
                                              device="cpu", kvcache=rig.kv, need_sort=False)
    with pytest.raises(KVGuardStartupError, match="PageInterleavePoolAllocator.*not covered"):
        install(rig.req_to_token_pool, interleaved, None, registry=CollectorRegistry())


@pytest.mark.parametrize("deferred", [False, True], ids=["launched-at-prepare", "armed-then-launched-at-mix"])
def test_mixed_chunk_batch_carries_the_decode_parts_verdict(make_rig, deferred):
    from kvguard.sglang.runtime import _flagged

    rig = make_rig(16)
    guard = rig.install(registry=rig.registry)
    running = rig.running(20, 20)
    guard.defer = deferred  # as a scheduler whose every decode forward kvguard hooks (CUDA graphs, eager runner)
    a, b = running.reqs
    rig.row(a)[3] = rig.pages_of(b)[0] * 16 + 3  # broken before the mixed step's prepare_for_decode
    rig.decode(running)
    new = rig.prefill(9)
    new.mix_with_running(running)
    flagged = _flagged(new, None)[1]
    assert [item[0].rid for item in flagged] == [a.rid]


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_handed_out_twice_in_one_allocation_flags_the_earlier_holder(make_rig, page_size):
    rig = make_rig(page_size)
    rig.install(registry=rig.registry)
    ps = page_size
    gone = rig.prefill(ps)
    page = rig.pages_of(gone.reqs[0])[0]
    rig.release(gone.reqs[0])
    rig.allocator.free(rig.page_slots(page))  # the bug: a second free; the free list holds it twice
    batch = rig.prefill(ps, ps)  # ONE allocation hands the page to both requests
    first, second = batch.reqs
    assert rig.pages_of(first)[0] == rig.pages_of(second)[0] == page
    assert rig.verdict(batch) == {first.rid: 1, second.rid: 0}


@pytest.mark.parametrize("page_size", [1, 16])
def test_stale_request_never_feeds_its_token_to_the_rows_new_owner(make_rig, page_size):
    # Found on the H200: SGLang relays each request's sampled token to its next step through the overlap
    # FutureMap (output_tokens_buf[req_pool_idx], written with the batch's device row indices). A stale
    # request still decoding on its old row made the new owner's next input whichever of the two tokens
    # the duplicate-index write kept. kvguard aborts it before the step is prepared (kvguard.sglang.stale, in
    # Scheduler._reqs_finishing_inflight, the first call of update_running_batch). (The whole scheduler runs in
    # test_sglang_engine.py; here its two calls that matter,
    # filter_batch and prepare_for_decode, with the real pools and FutureMap.) On the CPU the later
    # duplicate write wins, so the stale request comes after the owner.
    from types import SimpleNamespace

    from sglang.srt.managers.overlap_utils import FutureMap, RelayPayload, resolve_forward_inputs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from kvguard.sglang.stale import around_reqs_finishing_inflight

    rig = make_rig(page_size)
    rig.install(registry=rig.registry)
    batch = rig.running(20, 2 * page_size + 3)
    victim, other = batch.reqs
    rig.req_to_token_pool.free_rows([victim.kv.req_pool_idx])  # the bug: its row is released under it
    newcomer = rig.prefill(24)
    owner = newcomer.reqs[0]
    assert owner.kv.req_pool_idx == victim.kv.req_pool_idx
    newcomer.prefill_input_ids_cpu = None  # consumed by its prefill forward
    batch = rig.to_decode(newcomer, batch)  # owner first, the stale request after it
    streamed = []
    scheduler = SimpleNamespace(tree_cache=rig.tree, output_streamer=SimpleNamespace(
        stream_output=lambda reqs, *a, **k: streamed.extend(reqs)))

    def update_running_batch(scheduler, batch):  # SGLang's: drop finished requests, prepare the step
        batch.filter_batch()
        batch.prepare_for_decode()
        return batch

    owner_row = rig.row(owner).clone()
    batch = around_reqs_finishing_inflight(update_running_batch, scheduler, batch)
    assert streamed == [victim] and victim.finished() and "stale row" in victim.finished_reason.message
    assert batch.reqs == [owner, other]
    assert rig.verdict(batch) == {owner.rid: 0, other.rid: 0}
    assert batch.req_pool_indices.tolist().count(owner.kv.req_pool_idx) == 1  # one request per row
    changed = (rig.row(owner) != owner_row).nonzero().flatten().tolist()
    assert changed == [len(owner.origin_input_ids)]  # only the owner's own new slot was written
    future_map = FutureMap(torch.device("cpu"), SpeculativeAlgorithm.NONE, rig.req_to_token_pool,
                           needs_cpu_seq_lens=False)
    sampled = torch.randperm(1000)[:len(batch.reqs)] + 3  # this step's tokens, one per request
    future_map.stash(batch.req_pool_indices, RelayPayload(bonus_tokens=sampled))  # the scheduler, after the forward
    batch.input_ids = None
    resolve_forward_inputs(batch, future_map)  # the next step's inputs, as SGLang gathers them
    assert batch.input_ids.tolist() == sampled.tolist()
    rig.sample(batch)
    for req in batch.reqs:
        rig.release(req)
    assert len(_free_pages(rig)) == rig.allocator.num_pages  # the victim's pages came back too


def test_stale_row_abort_gives_back_its_pages_and_tree_lock(make_rig):
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    prefix = [41 + i for i in range(32)]
    rig.publish(prefix + [1])
    matcher = rig.make_req(0, tokens=prefix + [2, 3, 4])
    matcher.lock = rig.tree.lock(matcher.last_node)  # what SGLang's PrefillAdder does for a prefix hit
    batch = rig.to_decode(rig.prefill(reqs=[matcher]), rig.prefill(40))
    rig.decode(batch)
    rig.sample(batch)
    victim, other = batch.reqs
    assert victim.kv.cache_protected_len == 32 and rig.tree.protected_size() == 32
    rig.req_to_token_pool.free_rows([victim.kv.req_pool_idx])  # the bug: its row is released under it
    newcomer = rig.prefill(24)
    assert newcomer.reqs[0].kv.req_pool_idx == victim.kv.req_pool_idx
    batch = rig.to_decode(batch, newcomer)
    owner_row, owner_len = rig.row(newcomer.reqs[0]).clone(), len(newcomer.reqs[0].origin_input_ids)
    rig.decode(batch)
    assert rig.verdict(batch) == {victim.rid: 1, other.rid: 0, newcomer.reqs[0].rid: 0}
    # SGLang wrote only the owner's own new slot into the row: the stale request's write went elsewhere
    # (the owner's forward, in flight under the overlap scheduler, reads this row)
    changed = (rig.row(newcomer.reqs[0]) != owner_row).nonzero().flatten().tolist()
    assert changed == [owner_len]
    newcomer_row = rig.row(newcomer.reqs[0]).clone()
    _abort_flagged(rig, batch)
    assert torch.equal(rig.row(newcomer.reqs[0]), newcomer_row)  # the newcomer's row is untouched
    assert newcomer.reqs[0].kv.req_pool_idx not in rig.req_to_token_pool.free_slots
    rig.sample(batch)
    batch.filter_batch()
    rig.decode(batch)
    assert rig.verdict(batch) == {other.rid: 0, newcomer.reqs[0].rid: 0}
    for req in batch.reqs:
        rig.release(req)
    # everything is back: free pages + the tree's evictable pages == the pool, and no lock is held
    tree_pages = rig.tree.evictable_size() // 16
    assert len(_free_pages(rig)) + tree_pages == rig.allocator.num_pages
    assert rig.tree.protected_size() == 0


def test_an_extend_batch_whose_writes_cannot_be_mapped_is_never_run_unguarded(make_rig):
    """Fail closed: write slots that do not match the requests' new tokens stop the step (no warn-and-serve)."""
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    batch = rig.prefill(20, 9)
    guard = rig.guard
    assert guard.write_guard(batch) is not None  # SGLang's own batch: mapped
    batch.extend_lens = [batch.extend_lens[0] + 1] + batch.extend_lens[1:]  # one slot more than written
    with pytest.raises(RuntimeError, match="cannot guard"):
        guard.write_guard(batch)


def test_an_armed_decode_check_that_no_forward_launched_stops_the_scheduler(make_rig):
    """Deferred decode checks (launched by the forward that runs the batch): a step whose check was armed and
    never launched is never served; its verdict read stops the scheduler instead of passing it."""
    from kvguard.sglang.runtime import _flagged

    rig = make_rig(16)
    guard = rig.install(registry=rig.registry)
    running = rig.running(20, 20)
    guard.defer = True
    pending = rig.decode(running)
    assert guard.armed is pending and pending.slot < 0 and pending.batch is running  # armed, not launched
    with pytest.raises(RuntimeError, match="ran without its check"):
        _flagged(running, None)


def test_an_armed_decode_check_launched_on_the_forwards_tensors_flags_exactly_the_broken_request(make_rig):
    from kvguard.sglang.runtime import _flagged

    rig = make_rig(16)
    guard = rig.install(registry=rig.registry)
    running = rig.running(20, 20, 33)
    guard.defer = True
    a, b, c = running.reqs
    rig.row(c)[5] = rig.pages_of(a)[0] * 16 + 5  # c reads a's page
    pending = rig.decode(running)
    slots = running.out_cache_loc.clone()
    guard.fire(pending, running.req_pool_indices, running.seq_lens, running.out_cache_loc)  # what the eager runner's hook does
    assert guard.armed is None and pending.batch is None and pending.slot >= 0
    assert running.out_cache_loc.tolist() == slots.tolist()[:2] + [0]  # c's write went to the padding slot
    assert [item[0].rid for item in _flagged(running, None)[1]] == [c.rid]


def test_a_decode_batch_that_never_passed_alloc_for_decode_is_not_served(make_rig):
    """Fail closed: the decode check is armed in kvguard's alloc_for_decode hook; a decode batch whose result
    arrives without having passed it (a path that prepares decode its own way) stops the scheduler, while one
    kvguard armed, or marked as holding nothing to check, is served."""
    from kvguard.sglang.batches import _around_process_batch_result_decode as process

    rig = make_rig(16)
    rig.install(registry=rig.registry)
    running = rig.running(20, 20)
    served = []

    def original(processor, batch, result):
        served.append(batch)
        return "served"

    assert rig.decode(running) is not None  # armed inside prepare_for_decode (its alloc_for_decode)
    assert process(original, None, running, None) == "served" and "_kvguard" not in running.__dict__
    running._kvguard = None  # nothing to check (kvguard follows none of its rows)
    assert process(original, None, running, None) == "served"
    with pytest.raises(RuntimeError, match="without passing alloc_for_decode"):
        process(original, None, running, None)  # carries neither: never passed kvguard's hook
    assert len(served) == 2
