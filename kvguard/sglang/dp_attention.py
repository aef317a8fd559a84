"""Attention data parallelism (SGLang 0.5.23, ``--attn-dp-size N`` / ``--dp-size N --enable-dp-attention``): each
attention-DP rank's decode check launched on its own rows, before SGLang pads its batch to its peers'.

Under DP attention every attention-DP rank is a scheduler process of its own: its own requests, row pool, allocator,
radix tree and batches, each checked by its own guard as on one server. The ranks meet only in the model's
collectives (the MLP's tensor parallelism over all of them), so before each forward SGLang's MLP sync tells every
rank the others' token counts (``Scheduler.prepare_mlp_sync_batch``), and a rank with nothing to run runs an idle
batch (``ForwardMode.IDLE``: ``ScheduleBatch.prepare_for_idle``, no requests, no pages, no decode allocation; its
result goes to ``process_batch_result_idle``, which kvguard does not hook: nothing to check).

=================================================================  ======  ==========================================
target (``sglang.srt.``)                                           type    what kvguard does there
=================================================================  ======  ==========================================
``model_executor.forward_batch_info.ForwardBatch.``                AROUND  an eager decode forward of a DP-attention
``prepare_mlp_sync_batch``                                                 rank: launch the armed decode check on the
                                                                           batch's own rows, before SGLang pads them
=================================================================  ======  ==========================================

NOTE (why the launch moves here). In an eager forward SGLang pads each rank's decode batch to the largest batch of
the DP group (``DpPaddingMode.MAX_LEN``: ``_pad_inputs_to_size`` appends rows of request-pool index 0, sequence
length 1) in ``ModelRunner._prepare_eager_forward_batch``, before the runner's ``execute``. kvguard's eager launch
(:mod:`kvguard.sglang.graphs`: ``SGLangGuard.fire_armed``) then sees a batch larger than the one it armed and
launches nothing, and the step's verdict stops the scheduler ("a decode batch ... ran without its check"): seen on
the CPU with tp_size=2, attn_dp_size=2, one request on one rank and two on the other. Launched here, the check reads
the rows as kvguard armed them; its write guard rewrites the step's write slots in place, before the padding copies
them. The padded rows are SGLang's own dummies (the padding row), never a request's. A decode graph replay is not
affected: the graph runner pads into its own buffers (``_prepare_eager_forward_batch`` is skipped there) and the
captured check reads the owner rows (:meth:`SGLangGuard.graph_step`).

NOTE (agreement). A rank's verdict is its own: the ranks run different batches anyway, and SGLang's MLP sync
re-counts every rank's tokens each step, so a request one rank aborts changes no other rank's batch. The ranks that
share one batch are the attention-TP group (tp_size / attn_dp_size ranks); kvguard's agreement is already over
SGLang's attention-TP group (:func:`kvguard.sglang.runtime._attn_tp`), which is one rank when tp_size equals
attn_dp_size (no agreement).

Only this subpackage imports SGLang, and only inside functions.
"""
from __future__ import annotations

_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"


def _around_prepare_mlp_sync_batch(original, forward_batch, model_runner, *args, **kwargs):
    allocator = getattr(model_runner, "token_to_kv_pool_allocator", None)
    guard = getattr(allocator, "_kvguard", None)
    if guard is not None and guard.armed is not None and forward_batch.forward_mode == guard.decode_mode:
        guard.fire_armed(forward_batch)  # unpadded: its batch_size is the armed batch's
    return original(forward_batch, model_runner, *args, **kwargs)


# name -> (SGLang target, hook, HookRegistry type); composed into kvguard.sglang.plugin's TARGETS and hooks()
HOOKS = {
    "dp_mlp_sync": (f"{_FORWARD_BATCH}.prepare_mlp_sync_batch", _around_prepare_mlp_sync_batch, "AROUND"),
}
