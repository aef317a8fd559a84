"""The model runners (SGLang 0.5.23): the decode check launched by the forward that runs the batch.

============================================================  ======  ========================================
target (``sglang.srt.model_executor.runner.``)                type    what kvguard does there
============================================================  ======  ========================================
``decode_cuda_graph_runner.DecodeCudaGraphRunner.execute``    AROUND  a replay runs the armed decode check
                                                                      (its epoch)
``eager_runner.EagerRunner.execute``                          AROUND  an eager decode forward: launch the
                                                                      armed decode check first
============================================================  ======  ========================================

A decode step's check is armed when SGLang allocates the step's write slots (kvguard's ``alloc_for_decode``
hook, inside ``prepare_for_decode``: :mod:`kvguard.sglang.batches`) and launched by the forward that runs it:

- **a decode graph replay** (``DecodeCudaGraphRunner.execute``): the check was captured into every decode
  graph, first node before the forward (SGLang's ``ModelRunner.capture_head_hooks``), on the graph's own
  static buffers. The replay runs it: no launch on the host. kvguard counts the replays (the check's epoch,
  :mod:`kvguard.kernels.graph_check`) and writes the batch's expectation rows into the graph's owner buffer
  when the batch's composition changes;
- **an eager decode forward** (``EagerRunner.execute``: no graph, or a batch larger than the graphs): the
  check is launched right before it, on the tensors it reads;
- **a mixed chunked-prefill batch** (``ScheduleBatch.mix_with_running``, :mod:`kvguard.sglang.batches`):
  launched before the decode part is merged.

For that, kvguard installs on the scheduler's pools before SGLang captures its graphs
(``Scheduler.init_all_cuda_graphs``: :mod:`kvguard.sglang.plugin`, which runs the same checks as at
``build_kv_cache``). Checks wait for the forward only when every decode forward of the scheduler goes through a
runner hooked here (the model runner's decode runner is none, the eager runner, or one whose graphs all carry the
check); otherwise they are launched as the batch is prepared, as before. An armed check that no forward launched
is refused at its verdict (the scheduler stops), and so is a decode batch whose result arrives without having
passed alloc_for_decode (``kvguard.sglang.batches._unarmed``): kvguard never serves a decode step it did not check.

Only this subpackage imports SGLang, and only inside functions.
"""
from __future__ import annotations

_RUNNER = "sglang.srt.model_executor.runner"


def _guard_of_runner(runner):
    """The guard of a model runner's pools (kept on the runner once found: a per-step lookup)."""
    guard = runner.__dict__.get("_kvguard")
    if guard is None:
        model_runner = getattr(runner, "model_runner", None)
        guard = getattr(getattr(model_runner, "token_to_kv_pool_allocator", None), "_kvguard", None)
        if guard is not None:
            runner._kvguard = guard
    return guard


def _around_graph_execute(original, runner, forward_batch, *args, **kwargs):
    guard = _guard_of_runner(runner)
    if guard is None or guard.graph is None or forward_batch.forward_mode != guard.decode_mode:
        return original(runner, forward_batch, *args, **kwargs)
    guard.graph_step(runner, forward_batch)
    return original(runner, forward_batch, *args, **kwargs)


def _around_eager_execute(original, runner, forward_batch, *args, **kwargs):
    guard = _guard_of_runner(runner)
    if guard is not None and guard.armed is not None and forward_batch.forward_mode == guard.decode_mode:
        guard.fire_armed(forward_batch)
    return original(runner, forward_batch, *args, **kwargs)


# name -> (SGLang target, hook, HookRegistry type); composed into kvguard.sglang.plugin's TARGETS and hooks()
HOOKS = {
    "graph_execute": (f"{_RUNNER}.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute", _around_graph_execute,
                      "AROUND"),
    "eager_execute": (f"{_RUNNER}.eager_runner.EagerRunner.execute", _around_eager_execute, "AROUND"),
}
