"""SGLang 0.5.23's speculative mamba-state commit on a plain CPU device (test environment only).

After a verify step, ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`` calls
``scatter_mamba_states_after_mtp_verify`` (``sglang/kernels/ops/mamba/mamba_state_scatter_triton.py``), which copies
each request's accepted step's SSM state and conv window into its slot through ``fused_mamba_state_scatter_with_mask``
and ``fused_conv_window_scatter_with_mask`` (``fused_conv_window_scatter_multi`` for bf16 pools). Both raise
``ValueError: ... only supports CUDA/XPU tensors`` on a CPU device, so a CPU engine with speculative decoding on a
hybrid model stops at its first commit.

:func:`install` binds those two names of that module to SGLang's own portable scatter,
``HybridLinearAttnBackend._scatter_speculative_state_with_mask`` (its non-CUDA branch: the same masked gather-scatter,
``dst[:, dst_indices[i]] = src[:, src_indices[i], steps[i]]`` for every ``steps[i] >= 0``; SGLang's commit of the PLE
side states runs it on every device). Nothing of SGLang's logic is reimplemented. Called by faultlab's SGLang plugin
(:func:`faultlab.sglang_live.inject.register`) when ``FAULTLAB_SGLANG_CPU_MAMBA_SPEC=1`` is set. Does nothing on a
CUDA host.
"""
from __future__ import annotations

ENV_VAR = "FAULTLAB_SGLANG_CPU_MAMBA_SPEC"
MODULE = "sglang.kernels.ops.mamba.mamba_state_scatter_triton"
NAMES = ("fused_mamba_state_scatter_with_mask", "fused_conv_window_scatter_with_mask")


def install() -> bool:
    """Bind the commit's two CUDA-only scatters to SGLang's portable one. False (nothing changed) on a CUDA host."""
    import importlib

    import torch

    if torch.cuda.is_available():
        return False
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    scatter = importlib.import_module(MODULE)
    portable = HybridLinearAttnBackend._scatter_speculative_state_with_mask
    for name in NAMES:
        setattr(scatter, name, portable)
    return True
