"""SGLang 0.5.23's speculative-decoding tree ops on a plain CPU device (test environment only).

SGLang's EAGLE path builds each step's draft tree and verifies it greedily through two dispatchers in
``sglang/kernels/ops/speculative/spec_tree.py``: ``build_tree_kernel_efficient_func`` and
``verify_tree_greedy_func``. Each picks its implementation by the module's platform flags (``_is_cuda``,
``_is_hip``, ``_is_musa``, ``_is_npu``, ``_is_xpu``, ``_is_cpu``; the last one means SGLang's sgl-kernel
CPU build, ``SGLANG_USE_CPU_ENGINE=1``). With ``device="cpu"`` on a plain host every flag is False: the tree
build then calls the CUDA op ``sgl_build_tree_kernel_efficient``, which is not imported (``NameError``), and
the greedy verify silently returns its outputs unfilled.

SGLang ships Triton implementations of both, which it uses on XPU (``sgl_build_tree_kernel_triton``,
``verify_tree_greedy_triton``). :func:`install` turns that module's ``_is_xpu`` flag on, so both dispatchers
take SGLang's own XPU branch: SGLang's own Triton kernels, run by Triton's interpreter
(``TRITON_INTERPRET=1``). Nothing of SGLang's logic is reimplemented here. The flag is set in that one module
only: every other module keeps its own, computed at its import (``is_xpu()`` is not patched).

Why it lives here and how it reaches the scheduler process: as :mod:`.cpu_rotary`. It is called by faultlab's
SGLang plugin (:func:`faultlab.sglang_live.inject.register`) when ``FAULTLAB_SGLANG_CPU_SPEC=1`` is set;
SGLang's loader runs that plugin in every SGLang process, the scheduler included, before the spec worker is
built. It does nothing on a CUDA host, or where SGLang's module already has a native implementation.
"""
from __future__ import annotations

ENV_VAR = "FAULTLAB_SGLANG_CPU_SPEC"
MODULE = "sglang.kernels.ops.speculative.spec_tree"


def install() -> bool:
    """Point SGLang's spec tree build and greedy verify at its own Triton (XPU) implementations.

    Returns False (and changes nothing) when CUDA is available or the module has a native branch on this
    host (CUDA, HIP, MUSA, NPU, sgl-kernel CPU); True once the XPU branch is selected.
    """
    import importlib

    import torch

    if torch.cuda.is_available():
        return False
    spec_tree = importlib.import_module(MODULE)
    native = ("_is_cuda", "_is_hip", "_is_musa", "_is_npu", "_is_cpu")
    if any(getattr(spec_tree, flag, False) for flag in native):
        return False
    # Both functions SGLang's XPU branch calls exist in this SGLang (checked, not assumed).
    assert callable(spec_tree.sgl_build_tree_kernel_triton) and callable(spec_tree.verify_tree_greedy_triton)
    spec_tree._is_xpu = True
    # NOTE: SGLang's DeepSeek models (the NEXTN / MTP draft) call torch.cuda.synchronize() unconditionally when the
    # spec worker shares the target's embedding and head with the draft (DeepseekV2ForCausalLM.set_embed_and_head);
    # on a host without CUDA there is no stream to wait for, and the call would only fail CUDA's lazy init.
    torch.cuda.synchronize = _no_device_to_wait_for
    return True


def _no_device_to_wait_for(device=None) -> None:
    """``torch.cuda.synchronize`` on a host without CUDA (installed by :func:`install` only there)."""
