"""SGLang 0.5.23's attention data parallelism (``tp_size=2, attn_dp_size=2``) on a plain CPU device (test environment
only).

On ``device="cpu"`` without ``SGLANG_USE_CPU_ENGINE=1`` (that path needs an sgl-kernel CPU build, not installed here)
SGLang's ``is_cpu()`` is False, and a DP-attention engine takes CUDA branches on the host. Each was met in turn on
this machine (2026-12-06, a tiny Qwen2 config, torch_native attention), and :func:`install` points it at SGLang's own
CPU branch or at torch:

* ``parallel_state.GroupCoordinator`` builds a ``PyNcclCommunicator`` for every group of more than one rank
  (``init_model_parallel_group``: ``use_pynccl`` unless NPU/XPU; ``pynccl.py:116`` ``torch.cuda.device(cpu)``:
  "Expected a cuda device, but got: cpu"): off, and the custom / MSCCL++ / symmetric-memory all-reduces with it
  (the groups then reduce through torch.distributed over gloo, SGLang's fallback);
* ``GroupCoordinator.all_gather_into_tensor`` calls the ``sglang::reg_all_gather_into_tensor`` custom op, which has
  no CPU kernel (NotImplementedError): ``parallel_state._is_cpu`` on, SGLang's CPU branch (torch.distributed);
* ``ForwardBatch.prepare_mlp_sync_batch`` pins host memory (``use_pin_memory = not _is_cpu``; "Found no NVIDIA
  driver"): ``forward_batch_info._is_cpu`` on. It then reads the attention backend's
  ``get_cpu_graph_seq_len_fill_value`` (the padded rows' sequence length), which ``TorchNativeAttnBackend`` lacks
  (NotImplementedError): 1, as the Triton and Intel AMX backends return;
* ``dp_attention.memcpy`` launches a Triton kernel ("0 active drivers"): SGLang's ``memcpy_cpu``;
* an idle DP rank's forward (no tokens) fails in ``RotaryEmbedding.forward_native`` (``query.view(0, -1, head)``:
  "cannot reshape tensor of 0 elements"): no tokens, nothing to rotate.

Also needed, outside this module: ``SGLANG_CPU_OMP_THREADS_BIND`` (one core set per rank, e.g. ``0|1``: SGLang
asserts ranks <= NUMA nodes otherwise, ``numa_utils.py:463``), and a model whose vocabulary embedding follows the
attention-TP group under DP attention (Qwen2: ``use_attn_tp_group=is_dp_attention_enabled()``; Llama's all-reduces
over the full TP group with each DP rank's own token count, and the ranks' gloo collectives desynchronise).

Called by faultlab's SGLang plugin (:func:`faultlab.sglang_live.inject.register`) when ``FAULTLAB_SGLANG_CPU_DP=1``
is set, in every SGLang process, before the scheduler builds its groups or its model. It does nothing on a CUDA
host. Nothing of SGLang's scheduling, MLP sync or idle batches is reimplemented.
"""
from __future__ import annotations

ENV_VAR = "FAULTLAB_SGLANG_CPU_DP"


def install() -> bool:
    """On a host without CUDA: SGLang's DP-attention collectives and padding through its CPU branches."""
    import torch

    if torch.cuda.is_available():
        return False
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.model_executor import forward_batch_info

    parallel_state.init_model_parallel_group = _without_device_communicators(parallel_state.init_model_parallel_group)
    parallel_state._is_cpu = True
    forward_batch_info._is_cpu = True
    TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1
    TorchNativeAttnBackend.get_cuda_graph_seq_len_fill_value = lambda self: 1
    dp_attention.memcpy_func = dp_attention.memcpy_cpu
    RotaryEmbedding.forward_native = _no_tokens_no_rotation(RotaryEmbedding.forward_native)
    return True


def _without_device_communicators(init_group):
    def init_model_parallel_group(*args, **kwargs):
        kwargs.update(use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                      use_torch_symm_mem_allreduce=False)
        return init_group(*args, **kwargs)

    return init_model_parallel_group


def _no_tokens_no_rotation(forward_native):
    def forward(self, positions, query, key, *args, **kwargs):
        if positions.numel() == 0:  # an idle DP-attention rank's forward
            return query, key
        return forward_native(self, positions, query, key, *args, **kwargs)

    return forward
