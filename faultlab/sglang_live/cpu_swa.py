"""SGLang 0.5.23's CUDA branch of the SWA free, on a CPU device (test environment only).

``SWATokenToKVPoolAllocator._free_swa_pages`` (``sglang/srt/mem_cache/allocator/swa.py``) branches on the device of
the slots it frees. On CUDA, ``_free_swa_pages_cuda`` runs SGLang's Triton kernel ``get_and_clear_swa_pages``: it
reads each full page's SWA peer and zeroes the page's map entries *inside the kernel*. Elsewhere,
``_free_swa_pages_none_cuda`` reads the peers in torch and clears through ``clear_full_to_swa_mapping``. A GPU
deployment runs the first; the CPU engines of CI ran only the second, so a follower of
``clear_full_to_swa_mapping`` alone (kvguard's, before the fix) passed on the CPU and over-freed SWA pages on an H100
(SGLang's ``free_group_end`` asserted at the first finished request of a GPT-OSS-shaped engine, page 16).

:func:`install` makes the CPU take SGLang's CUDA branch, its own code and kernel (under ``TRITON_INTERPRET=1``).
Called by faultlab's SGLang plugin (:func:`faultlab.sglang_live.inject.register`) when
``FAULTLAB_SGLANG_SWA_CUDA_FREE=1`` is set. Nothing of SGLang's free logic is reimplemented.
"""
from __future__ import annotations

ENV_VAR = "FAULTLAB_SGLANG_SWA_CUDA_FREE"


def install() -> None:
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    cls = SWATokenToKVPoolAllocator
    if getattr(cls._free_swa_pages_none_cuda, "_faultlab_cuda_branch", False):
        return
    cuda = cls._free_swa_pages_cuda

    def _free_swa_pages_none_cuda(self, full_page_representatives):
        return cuda(self, full_page_representatives)

    _free_swa_pages_none_cuda._faultlab_cuda_branch = True
    cls._free_swa_pages_none_cuda = _free_swa_pages_none_cuda
