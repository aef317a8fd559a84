"""Real bookkeeping faults injected into SGLang 0.5.23's own classes on the CPU, caught by kvguard.

Every fault is made with SGLang's API (allocator.free, req_to_token writes, release_kv_cache) on a real
PagedTokenToKVPoolAllocator over an FP8 MHATokenToKVPool, a real ReqToTokenPool and RadixCache, and
requests driven through SGLang's own prepare_for_extend / prepare_for_decode. The check is the one the
hooks launch from prepare_for_decode; the abort is SGLang's per-request path.
"""
import pytest
import torch


pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("kvguard_backend")]


def test_double_free_is_caught_for_the_earlier_owner(rig_ps):
    rig, ps = rig_ps, rig_ps.page_size
    gone = rig.prefill(ps)  # one full page
    page = rig.pages_of(gone.reqs[0])[0]
    rig.release(gone.reqs[0])  # the legitimate free
    rig.allocator.free(rig.page_slots(page))  # the bug: a second, separate free of the same page
    free = rig.allocator.free_pages.tolist()
    assert free.count(page) == 2  # really twice in SGLang's free list
    earlier = rig.prefill(ps)  # takes the first copy
    later = rig.prefill(ps)  # takes the second copy: two live requests share one page
    assert rig.pages_of(earlier.reqs[0]) == rig.pages_of(later.reqs[0]) == [page]
    batch = rig.to_decode(earlier, later)
    rig.decode(batch)
    verdict = rig.verdict(batch)
    assert verdict[earlier.reqs[0].rid] >= 1 and verdict[later.reqs[0].rid] == 0


def test_premature_free_is_caught_before_the_page_is_reused(rig_ps):
    rig, ps = rig_ps, rig_ps.page_size
    batch = rig.running(2 * ps + 1, ps + 3)
    victim, other = batch.reqs
    page = rig.pages_of(victim)[0]
    rig.allocator.free(rig.page_slots(page))  # freed while the request still maps it
    rig.decode(batch)
    assert rig.verdict(batch) == {victim.rid: 1, other.rid: 0}
    err = rig.guard.tracker.resolve(rig.guard.check_of(batch._kvguard), rig.guard.check_of(batch._kvguard).verdict.cpu(), [victim.rid, other.rid])
    assert [e.request_id for e in err] == [victim.rid]
    assert err[0].reason == "tag_mismatch" and err[0].page == page and err[0].logical_position == 0


def test_swapped_req_to_token_entries_flag_both_requests(rig_ps):
    rig, ps = rig_ps, rig_ps.page_size
    batch = rig.running(3 * ps, 3 * ps, ps)
    a, b, c = batch.reqs
    table = rig.req_to_token_pool.req_to_token
    ra, rb = a.kv.req_pool_idx, b.kv.req_pool_idx
    span = slice(ps, 2 * ps)  # the second page of each row
    saved = table[ra, span].clone()
    table[ra, span] = table[rb, span]
    table[rb, span] = saved
    rig.decode(batch)
    assert rig.verdict(batch) == {a.rid: 1, b.rid: 1, c.rid: 0}


def test_out_of_range_entry_is_flagged(rig_ps):
    rig, ps = rig_ps, rig_ps.page_size
    batch = rig.running(2 * ps + 2, ps)
    a, b = batch.reqs
    beyond = (rig.allocator.num_pages + 7) * ps  # a slot past the pool: attention would read off the end
    rig.req_to_token_pool.req_to_token[a.kv.req_pool_idx, 0] = beyond
    rig.decode(batch)
    assert rig.verdict(batch) == {a.rid: 1, b.rid: 0}
    err = rig.guard.tracker.resolve(rig.guard.check_of(batch._kvguard), rig.guard.check_of(batch._kvguard).verdict.cpu(), [a.rid, b.rid])
    assert err[0].reason == "out_of_range" and err[0].found_tag is None


def test_stale_row_after_release_and_reuse_is_flagged(make_rig):
    # a request keeps decoding from a row SGLang already gave to somebody else (stale req_pool_idx)
    rig = make_rig(16)
    rig.install(registry=rig.registry)
    batch = rig.running(20, 20)
    a, b = batch.reqs
    stale_row = a.kv.req_pool_idx
    rig.release(a)
    newcomer = rig.prefill(40)
    assert newcomer.reqs[0].kv.req_pool_idx == stale_row  # SGLang reuses the row (LIFO free_slots)
    a.kv.req_pool_idx = stale_row  # the bug: the released request is still scheduled on its old row
    a.kv.kv_allocated_len = a.kv.kv_committed_len = 21
    rig.decode(rig.to_decode(batch, newcomer))
    verdict = rig.verdict(batch)
    # the row's pages all carry the newcomer's tags, so only SGLang's row generation tells them apart
    assert verdict == {a.rid: 1, b.rid: 0, newcomer.reqs[0].rid: 0}
    flagged = rig.guard.resolve(batch._kvguard)
    assert [item[0].rid for item in flagged] == [a.rid] and "stale row" in flagged[0][1]


def test_token_allocator_page_size_one(make_rig):
    # SGLang's page_size=1 deployments use TokenToKVPoolAllocator (kv_cache_configurator)
    rig = make_rig(1, allocator="token")
    rig.install(registry=rig.registry)
    batch = rig.running(9, 4)
    a, b = batch.reqs
    rig.allocator.free(rig.row(a)[3:4].long())
    rig.decode(batch)
    assert rig.verdict(batch) == {a.rid: 1, b.rid: 0}


def test_abort_marks_exactly_the_flagged_requests(rig_ps):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rig, ps = rig_ps, rig_ps.page_size
    batch = rig.running(ps + 1, 2 * ps, ps + 5)
    a, b, c = batch.reqs
    rig.allocator.free(rig.page_slots(rig.pages_of(b)[0]))
    rig.decode(batch)
    pending = batch.__dict__.pop("_kvguard")
    flagged = rig.guard.resolve(pending, group=None)
    assert [item[0].rid for item in flagged] == [b.rid]
    streamed = []
    free_rows_before = len(rig.req_to_token_pool.free_slots)
    aborted = rig.guard.abort(flagged, tree_cache=rig.tree,
                              stream=lambda reqs, logprob: streamed.append([r.rid for r in reqs]))
    assert aborted == [b] and streamed == [[b.rid]]
    assert isinstance(b.finished_reason, FINISH_ABORT) and b.finished_reason.status_code == 500
    assert "kvguard" in b.finished_reason.message and b.skip_radix_cache_insert
    assert not b.kv.holds_kv and len(rig.req_to_token_pool.free_slots) == free_rows_before + 1
    for req in (a, c):
        assert not req.finished() and req.kv.holds_kv and not getattr(req, "kvguard_aborted", False)
    # (SGLang's finish handler then skips it for that one result; the real normal loop is exercised by the
    # live engine at page 1, whose pools balance: no second release)
    # the running batch drops it like any finished request (update_running_batch's filter_batch)
    batch.filter_batch()
    assert [r.rid for r in batch.reqs] == [a.rid, c.rid]
    assert rig.guard.tracker.metrics.aborted._value.get() == 1
    # NOTE: the injected premature free plus SGLang's release of the aborted request free that page twice;
    # kvguard keeps tracking it (a later owner sharing it would be flagged like any double free).


def test_verdict_travels_with_the_overlap_copy(rig_ps):
    rig = rig_ps
    batch = rig.running(5, 7)
    rig.decode(batch)
    copy = batch.copy()  # what the overlap scheduler queues for process_batch_result
    assert copy._kvguard is batch._kvguard and copy._kvguard.reqs == batch.reqs


def test_no_host_sync_ops_in_the_clean_step_beyond_the_verdict(rig_ps):
    # the check reads every token entry the batch maps (the slot this step writes included)
    rig, ps = rig_ps, rig_ps.page_size
    batch = rig.running(3 * ps + 1, ps)
    rig.guard.tracker.flush_metrics()
    before = rig.guard.tracker.metrics.entries._value.get()
    rig.decode(batch)
    tokens = sum(int(n) for n in batch.seq_lens_cpu.tolist())
    rig.guard.tracker.flush_metrics()  # (counted in batches: TagTracker.count_check)
    assert rig.guard.tracker.metrics.entries._value.get() - before == tokens
    ring = rig.guard._ring  # the clean step's answer is one host cell, not a device read
    assert ring.host_flags.device.type == "cpu" and not ring.flagged(batch._kvguard.slot, batch._kvguard.stamp)
    assert torch.equal(rig.guard.check_of(batch._kvguard).source, rig.req_to_token_pool.req_to_token)
