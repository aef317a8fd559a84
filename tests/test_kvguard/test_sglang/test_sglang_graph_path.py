"""The decode check on SGLang's captured-graph path, on the CPU: real SGLang pools and batches, kvguard's hooks as
SGLang's HookRegistry applied them, the guard's graph buffers, and the captured check run on the forward's buffers
as a decode graph replay runs it (the kernel under the Triton interpreter; there is no CUDA graph here).

The verdict of a captured check is read before any wait (GraphCheck's result word): a step whose check has not run
must never read as clean, a clean step goes straight to SGLang, a broken mapping aborts exactly its request.
"""
import types

import pytest
import torch

pytestmark = pytest.mark.sglang


@pytest.fixture(params=[False, True], ids=["ranks-not-looked-up", "one-rank"])
def ranks(request, monkeypatch):
    """The process's attention-TP group: not looked up yet (the hooks look it up each step), or looked up and one
    rank, as in every SGLang scheduler of a TP-1 server (the verdict's hook then compares the result word inline)."""
    from kvguard.sglang import plugin, runtime  # noqa: F401

    monkeypatch.setattr(runtime, "_GROUP", [(None, None)] if request.param else [])
    monkeypatch.setattr(runtime, "_ONE_RANK", request.param)
    return request.param


class Runner:
    """SGLang's decode graph runner as kvguard's replay hook reads it (its model runner's allocator)."""

    def __init__(self, allocator):
        self.model_runner = types.SimpleNamespace(token_to_kv_pool_allocator=allocator)


def on_graph(rig) -> Runner:
    """From now on the rig's decode forwards are replays of graphs that all carry the check (a server whose decode
    graphs were captured with it): the guard's graph buffers on, decode checks deferred to the forward."""
    guard = rig.guard
    assert guard.enable_graph(8) is not None  # its self-test passed: the result words are written as read
    runner = Runner(rig.allocator)
    guard.graph_runners = {runner: True}
    guard.defer = True
    return runner


class Processor:
    """What kvguard's result hook reads of SGLang's SchedulerBatchResultProcessor: its tree and its streamer; the
    processing itself (SGLang's, not kvguard's) is the ``original`` each step hands the hook."""

    def __init__(self, tree):
        self.tree_cache, self.streamed = tree, []
        self.output_streamer = types.SimpleNamespace(stream_output=lambda reqs, *a: self.streamed.extend(reqs))

    def _handle_finish_state_updated_req(self, req, *args, **kwargs):  # SGLang's per-request finish (kvguard shadows it)
        return None


def step(rig, runner, batch, *, replay=True, before_replay=None):
    """One decode step on the graph path: SGLang's prepare_for_decode (kvguard's alloc_for_decode hook arms the
    check), the replay hook (the check's epoch), the captured check on the forward's buffers (``replay``), then
    kvguard's result hook around SGLang's processing. Returns (whether SGLang's processing ran, the processor)."""
    from kvguard.sglang import batches, graphs, runtime  # noqa: F401
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch.prepare_for_decode()
    assert batch.forward_mode == ForwardMode.DECODE and batch.__dict__["_kvguard"].batch is batch  # armed only
    fb = types.SimpleNamespace(forward_mode=batch.forward_mode, batch_size=len(batch.reqs))
    graphs._around_graph_execute(lambda *a, **k: None, runner, fb)
    pending = batch.__dict__["_kvguard"]
    assert pending.epoch is not None and pending.batch is None  # the replay took it
    words, cell, word = pending.clean  # what the verdict's hook compares: this epoch's cell, its clean word
    assert words is rig.guard.graph.words and word == 2 * (pending.epoch + 1) and words[cell] != word  # not in yet
    if before_replay is not None:
        before_replay()
    if replay:
        rig.guard.graph.launch(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, len(batch.reqs))
    processor, ran = Processor(rig.tree), []
    result = types.SimpleNamespace(copy_done=None, next_token_ids=torch.zeros(len(batch.reqs), dtype=torch.int64))
    batches._around_process_batch_result_decode(lambda *a, **k: ran.append(True), processor, batch, result)
    rig.sample(batch)
    return bool(ran), processor


def test_clean_steps_go_straight_to_sglang(rig_ps, ranks):
    rig, ps = rig_ps, rig_ps.page_size
    batch = rig.running(2 * ps + 3, ps + 2, 3)
    runner = on_graph(rig)
    epochs = rig.guard.graph.host_epoch
    for _ in range(ps + 4):  # every request crosses into a new page on the way (the step's record launch)
        ran, processor = step(rig, runner, batch)
        assert ran and processor.streamed == [] and not any(req.finished() for req in batch.reqs)
    assert rig.guard.graph.host_epoch == epochs + ps + 4 == int(rig.guard.graph.epoch)


def test_a_step_whose_check_did_not_run_never_reads_as_clean(rig_ps, ranks):
    rig = rig_ps
    batch = rig.running(5, 9)
    runner = on_graph(rig)
    with pytest.raises(RuntimeError, match="cannot be trusted"):
        step(rig, runner, batch, replay=False)  # the replay never ran the check: its result word is not in


def test_a_broken_mapping_aborts_exactly_its_request(rig_ps, ranks):
    rig, ps = rig_ps, rig_ps.page_size
    batch = rig.running(3 * ps, 3 * ps, ps)
    runner = on_graph(rig)
    a, b, c = batch.reqs
    table = rig.req_to_token_pool.req_to_token
    ra, rb = int(a.kv.req_pool_idx), int(b.kv.req_pool_idx)

    def swap():  # a's second page entries now name b's page (and b's name a's): both read another's KV
        span = slice(ps, 2 * ps)
        saved = table[ra, span].clone()
        table[ra, span] = table[rb, span]
        table[rb, span] = saved

    ran, processor = step(rig, runner, batch, before_replay=swap)
    assert a.finished() and b.finished() and not c.finished()
    assert {id(r) for r in processor.streamed} == {id(a), id(b)}  # their errors streamed, c's tokens untouched
    assert "KV page mapping broken" in str(a.finished_reason.message)
    assert ran  # SGLang's processing still ran for the rest of the batch
