"""The radix tree never publishes pages whose verdict is unread or flagged (issue 47, items 2 and 3).

Each test drives SGLang 0.5.23's real pools, allocator, radix tree and ScheduleBatch with kvguard's hooks applied
by SGLang's own plugin loader, in the order SGLang's overlap scheduler (``Scheduler.event_loop_overlap``) runs
them: the next batch is prepared (and the chunked request stashed into the tree: ``stash_chunked_request`` ->
``checkpoint_kv_cache``) before the last batch's result is processed. The model forward is the one thing left
out; a chunk's writes are read from its write slots (the write guard sends a flagged request's to the padding
slot 0).
"""
from array import array
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("kvguard_backend")]

PS = 16


def _tokens(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


def _chunk(rig, reqs, chunked, end: int):
    """SGLang's batch for one prefill step whose ``chunked`` request runs its tokens up to ``end`` (as
    get_new_batch_prefill builds it: ``chunked_req`` set unless this is its last chunk), prepared
    (alloc_for_extend, kvguard's check)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if chunked.prefix_len:
        chunked.init_next_round_input()  # what get_new_batch_prefill does for a continuing chunked request
    chunked.extend_end = end
    batch = ScheduleBatch.init_new(list(reqs), rig.req_to_token_pool, rig.allocator, rig.tree, rig.model_config,
                                   True, SpeculativeAlgorithm.NONE,
                                   chunked_req=chunked if end < len(chunked.full_untruncated_fill_ids) else None)
    batch.prepare_for_extend()
    return batch


def _stash(rig, req) -> None:
    """Scheduler.stash_chunked_request (no PD): publish what the chunked request computed so far."""
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    checkpoint_kv_cache(req, rig.tree)


def _prefill_result(batch) -> list:
    """kvguard's hook on process_batch_result_prefill (SGLang's own processing left out): the discarded requests."""
    from kvguard.sglang.batches import _around_process_batch_result_prefill

    before = {id(r) for r in batch.reqs if r.__dict__.get("kvguard_aborted")}
    _around_process_batch_result_prefill(lambda *a, **k: None, None, batch, None)
    return [r for r in batch.reqs if r.__dict__.get("kvguard_aborted") and id(r) not in before]


def _decode_result(rig, batch) -> None:
    """kvguard's hook on process_batch_result_decode (SGLang's own processing left out)."""
    from kvguard.sglang.batches import _around_process_batch_result_decode

    processor = SimpleNamespace(tree_cache=rig.tree, output_streamer=SimpleNamespace(
        stream_output=lambda reqs, *a, **k: None))
    _around_process_batch_result_decode(lambda *a, **k: None, processor, batch, None)


def _violations(guard) -> float:
    return sum(child._value.get() for child in guard.tracker.metrics.violations._metrics.values())


def _balanced(rig) -> bool:
    """Every page is free or the tree's (no request runs): SGLang's idle accounting."""
    free = len(rig.allocator.get_all_free_pages().tolist())
    return free + rig.tree.total_size() // rig.page_size == rig.allocator.num_pages


# -- item 2: a chunk enters the tree only after its verdict is read clean ------------------------------------
def test_a_flagged_chunk_stashed_before_its_verdict_is_never_published(make_rig):
    rig = make_rig(PS)
    guard = rig.install(registry=rig.registry)
    prompt = _tokens(1000, 70)
    req = rig.make_req(0, tokens=prompt)
    first = _chunk(rig, [req], req, 2 * PS)
    assert rig.verdict(first) == {req.rid: 0}
    _stash(rig, req)  # (overlap: chunk 1's verdict unread, and clean)
    assert _prefill_result(first) == []
    assert req.kv.cache_protected_len == 2 * PS  # the clean chunk is published
    other = rig.prefill(20)
    rig.row(req)[3] = rig.pages_of(other.reqs[0])[0] * PS + 3  # the bug: the row is broken between chunks
    second = _chunk(rig, [req], req, 4 * PS)
    assert rig.verdict(second) == {req.rid: 1}
    assert second.out_cache_loc.tolist() == [0] * 2 * PS  # the chunk's writes go to the padding slot
    _stash(rig, req)  # the overlap scheduler stashes it before it reads the chunk's verdict
    assert req.kv.cache_protected_len == 2 * PS, "a chunk whose check flagged it was published to the radix tree"
    assert rig.tree.total_size() == 2 * PS
    assert _prefill_result(second) == [req]  # then its verdict: discarded
    assert _violations(guard) == 1
    # A later request with the same prompt maps only the verified chunk from the tree and computes the rest.
    late = rig.prefill(reqs=[rig.make_req(0, tokens=prompt[:4 * PS] + [5, 6])])
    assert late.reqs[0].prefix_len == 2 * PS
    assert rig.verdict(late) == {late.reqs[0].rid: 0}
    for r in (req, other.reqs[0], late.reqs[0]):
        rig.release(r)
    assert _balanced(rig)


def test_a_clean_chunk_is_published_before_its_verdict_is_read(make_rig):
    """No false positive: the gate publishes a clean chunk at SGLang's own stash, and a request matching it is clean;
    a chunked request in a batch where another request was flagged is published as usual."""
    rig = make_rig(PS)
    guard = rig.install(registry=rig.registry)
    shared = _tokens(3000, 2 * PS)
    tree_pages = rig.publish(shared + [1])[:2]
    rig.allocator.free(rig.page_slots(tree_pages[0]))  # the bug: a tree page freed while the tree maps it
    hit = rig.make_req(0, tokens=shared + [2, 3])  # matches the freed page: its check flags it
    prompt = _tokens(5000, 4 * PS + 5)
    req = rig.make_req(0, tokens=prompt)
    first = _chunk(rig, [hit, req], req, 2 * PS)
    assert rig.verdict(first) == {hit.rid: 1, req.rid: 0}
    _stash(rig, req)
    assert req.kv.cache_protected_len == 2 * PS
    assert _prefill_result(first) == [hit]
    second = _chunk(rig, [req], req, 4 * PS)
    assert rig.verdict(second) == {req.rid: 0}
    _stash(rig, req)
    assert req.kv.cache_protected_len == 4 * PS
    assert _prefill_result(second) == []
    late = rig.prefill(reqs=[rig.make_req(0, tokens=prompt[:4 * PS] + [7])])
    assert late.reqs[0].prefix_len == 4 * PS and rig.verdict(late) == {late.reqs[0].rid: 0}
    assert _violations(guard) == 1  # the freed tree page's one


# -- item 3: a finishing request is published from a row checked a step earlier ------------------------------
def _finish_with_a_late_flag(rig, prompt, break_row):
    """A request R (prompt ``prompt``, two new tokens) and another request O decode; after R's last check the
    row of R is broken (``break_row(R, O)``); the overlap scheduler prepares (and checks) the next step, then
    processes R's last result: R finishes and is released into the tree; then that next step's result."""
    r = rig.make_req(0, tokens=prompt, max_new_tokens=2)
    batch = rig.to_decode(rig.prefill(reqs=[r]), rig.prefill(2 * PS + 8))
    o = batch.reqs[1]
    rig.decode(batch)
    _decode_result(rig, batch)
    rig.sample(batch)
    rig.decode(batch)  # R's last step (its check clean)
    assert set(rig.verdict(batch).values()) == {0}
    _decode_result(rig, batch)
    break_row(r, o)
    rig.decode(batch)  # the next step, prepared before R's last result is processed (overlap)
    flagged = rig.verdict(batch)
    rig.sample(batch)  # R's last result: it finishes and goes into the tree
    r.update_finish_state()
    assert r.finished()
    rig.release(r, checkpoint=True)
    _decode_result(rig, batch)  # the next step's result
    return r, o, batch, flagged


def test_a_finished_requests_late_flag_is_counted_and_its_prefix_never_served(make_rig):
    rig = make_rig(PS)
    guard = rig.install(registry=rig.registry)
    prompt = _tokens(2000, 2 * PS + 8)

    def break_row(r, o):  # R's 2nd page now names O's first page: a page the tree never adopted
        rig.row(r)[PS:2 * PS] = rig.page_slots(rig.pages_of(o)[0]).to(torch.int32)

    r, o, batch, flagged = _finish_with_a_late_flag(rig, prompt, break_row)
    assert flagged == {r.rid: 1, o.rid: 0}
    assert _violations(guard) == 1, "a flag on a request that finished before its verdict was read went uncounted"
    assert not o.finished()  # the other request runs on
    late = rig.prefill(reqs=[rig.make_req(0, tokens=prompt + [7, 9])])
    assert late.reqs[0].prefix_len == 2 * PS and rig.pages_of(late.reqs[0])[1] == rig.pages_of(o)[0]
    assert rig.verdict(late) == {late.reqs[0].rid: 1}, "a prefix match read another request's page, clean"


def test_a_tree_page_never_adopted_fails_every_prefix_match(make_rig):
    """``_prefix_tags``: a page the tree holds and kvguard never adopted (inserted outside the checkpoint kvguard
    follows) is expected with a tag no page carries, never with its current tag."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    rig = make_rig(PS)
    rig.install(registry=rig.registry)
    prompt = _tokens(4000, 2 * PS)
    slots = rig.allocator.alloc(2 * PS).long()
    rig.tree.insert(InsertParams(key=RadixKey(array("q", prompt)), value=slots))
    hit = rig.prefill(reqs=[rig.make_req(0, tokens=prompt + [1, 2])])
    assert hit.reqs[0].prefix_len == 2 * PS
    assert rig.verdict(hit) == {hit.reqs[0].rid: 1}


def test_a_page_the_tree_took_against_kvguards_record_is_poisoned(make_rig):
    """The finishing row names another tree node's page: the tree now holds that page under two keys (evicting
    either frees it under the other), so it fails every later match, of both prefixes."""
    rig = make_rig(PS)
    guard = rig.install(registry=rig.registry)
    other_prompt = _tokens(6000, 2 * PS)
    other_page = rig.publish(other_prompt + [1])[1]
    prompt = _tokens(2000, 2 * PS + 8)

    def break_row(r, o):
        rig.row(r)[PS:2 * PS] = rig.page_slots(other_page).to(torch.int32)

    r, o, batch, flagged = _finish_with_a_late_flag(rig, prompt, break_row)
    assert flagged == {r.rid: 1, o.rid: 0} and _violations(guard) == 1
    late = rig.prefill(reqs=[rig.make_req(0, tokens=prompt + [7, 9])])
    assert rig.pages_of(late.reqs[0])[1] == other_page
    assert rig.verdict(late) == {late.reqs[0].rid: 1}
    twin = rig.prefill(reqs=[rig.make_req(0, tokens=other_prompt + [3])])
    assert rig.verdict(twin) == {twin.reqs[0].rid: 1}


def test_the_pages_a_late_flagged_request_published_are_poisoned_and_no_others(make_rig):
    """The row broke past the part the tree takes: its published pages are poisoned all the same; the prefix it
    matched from the tree (another request's pages) is not, and a request matching only that runs clean."""
    rig = make_rig(PS)
    guard = rig.install(registry=rig.registry)
    shared = _tokens(8000, PS)
    rig.publish(shared + [1])
    prompt = shared + _tokens(9000, PS + 8)  # the shared page, one page of its own, 8 tokens of a third

    def break_row(r, o):  # a token of its unpublished last page reads O's page
        rig.row(r)[2 * PS + 2] = rig.pages_of(o)[0] * PS + 2

    r, o, batch, flagged = _finish_with_a_late_flag(rig, prompt, break_row)
    assert flagged == {r.rid: 1, o.rid: 0} and _violations(guard) == 1
    late = rig.prefill(reqs=[rig.make_req(0, tokens=prompt[:2 * PS] + [4])])
    assert late.reqs[0].prefix_len == 2 * PS
    assert rig.verdict(late) == {late.reqs[0].rid: 1}  # R's own page, published by R: poisoned
    shared_only = rig.prefill(reqs=[rig.make_req(0, tokens=shared + [5, 6])])
    assert shared_only.reqs[0].prefix_len == PS
    assert rig.verdict(shared_only) == {shared_only.reqs[0].rid: 0}


# -- 0 false positives: chunked prefill under the overlap order, prefix sharing, finishes into the tree ----------
def test_no_false_flags_over_chunked_prefills_and_finishes_in_overlap_order(make_rig, kvguard_backend):
    import random

    rig = make_rig(PS, num_tokens=4096, rows=24, context=256)
    guard = rig.install(registry=rig.registry)
    rng = random.Random(47)
    prefixes = [_tokens(100 + 500 * p, rng.choice([16, 40, 70])) for p in range(3)]
    running, chunked, last_chunk, steps, finished = None, None, None, 0, 0
    budget = 60 if kvguard_backend == "torch" else 20
    while steps < budget:
        steps += 1
        # get_next_batch_to_run: stash the chunked request (its last chunk's verdict unread), then the next batch
        if chunked is not None:
            _stash(rig, chunked)
            assert chunked.kv.cache_protected_len == chunked.extend_end // PS * PS  # every clean chunk published
        if chunked is None and rng.random() < 0.5:
            chunked = rig.make_req(0, max_new_tokens=12, tokens=rng.choice(prefixes) + _tokens(
                rng.randrange(1000, 9000), rng.randrange(10, 60)))
        if chunked is not None:
            total = len(chunked.origin_input_ids)
            end = min(total, chunked.prefix_len // PS * PS + 2 * PS)
            batch = _chunk(rig, [chunked], chunked, end)
            assert set(rig.verdict(batch).values()) == {0}, steps
            done = end == total
            if last_chunk is not None:
                assert _prefill_result(last_chunk) == []  # the previous chunk's result (overlap)
            last_chunk = batch
            if done:  # its result: SGLang publishes the prompt (checkpoint_kv_cache) and it decodes
                assert _prefill_result(batch) == []
                _stash(rig, chunked)
                running = batch if running is None else rig.to_decode(running, batch)
                last_chunk, chunked = None, None
        if running is None:
            continue
        rig.decode(running)
        assert set(rig.verdict(running).values()) == {0}, steps
        rig.sample(running)
        keep = []
        for i, req in enumerate(running.reqs):
            req.update_finish_state()
            if req.finished():
                rig.release(req, checkpoint=True)
                finished += 1
            else:
                keep.append(i)
        _decode_result(rig, running)  # the step's verdict, read after its finishes were released (overlap)
        running = running if keep else None
        if keep:
            running.filter_batch(keep_indices=keep)
    assert finished >= 2, finished
    assert _violations(guard) == 0
