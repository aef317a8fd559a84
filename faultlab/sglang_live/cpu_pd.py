"""SGLang 0.5.23's PD prefill send path on a plain CPU device (test environment only).

``PrefillBootstrapQueue``'s ``_send_kv_chunk`` (``sglang/srt/disaggregation/prefill.py``) hands a sender that
declares ``supports_host_tensor_indices`` (Mooncake's ``MooncakeKVSender``) its page indices in a *pinned*
host tensor copied from the device with a CUDA event, so that the transfer worker, not the scheduler, waits
for the device-to-host copy. On a host without CUDA ``torch.empty(..., pin_memory=True)`` raises
("Found no NVIDIA driver on your system") and the prefill scheduler dies at its first send.

:func:`install` turns that class flag off on a host without CUDA: ``_send_kv_chunk`` then takes SGLang's own
other branch (``kv_to_page_indices``: the same page indices as a host array, no event), the one every other
backend takes. Nothing of SGLang's transfer logic is reimplemented: the Mooncake sender, its transfer worker
and the decode side are SGLang's own. Called by faultlab's SGLang plugin
(:func:`faultlab.sglang_live.inject.register`) when ``FAULTLAB_SGLANG_CPU_PD=1`` is set, in every SGLang
process (the prefill scheduler included). It does nothing on a CUDA host.
"""
from __future__ import annotations

ENV_VAR = "FAULTLAB_SGLANG_CPU_PD"
MODULE = "sglang.srt.disaggregation.mooncake.conn"


def install() -> bool:
    """Send Mooncake's page indices as a plain host array on a host without CUDA. True when changed."""
    import importlib

    import torch

    if torch.cuda.is_available():
        return False
    conn = importlib.import_module(MODULE)
    conn.MooncakeKVSender.supports_host_tensor_indices = False
    return True
