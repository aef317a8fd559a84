"""SGLang 0.5.23's PD send path on a plain CPU device, Mooncake and NIXL (test environment only).

Mooncake: ``PrefillBootstrapQueue``'s ``_send_kv_chunk`` (``sglang/srt/disaggregation/prefill.py``) hands a sender
that declares ``supports_host_tensor_indices`` (Mooncake's ``MooncakeKVSender``) its page indices in a *pinned*
host tensor copied from the device with a CUDA event, so that the transfer worker, not the scheduler, waits
for the device-to-host copy. On a host without CUDA ``torch.empty(..., pin_memory=True)`` raises
("Found no NVIDIA driver on your system") and the prefill scheduler dies at its first send. :func:`install` turns
that class flag off on a host without CUDA: ``_send_kv_chunk`` then takes SGLang's own other branch
(``kv_to_page_indices``: the same page indices as a host array, no event), the one every other backend takes.

NIXL: SGLang labels every KV buffer it registers with NIXL ``VRAM`` (``decode.py`` sets ``kv_data_mem_kinds`` to
``VRAM`` unless HiSparse; the prefill side defaults to it in ``nixl/conn.py`` ``_normalize_kv_mem_kinds``). On a
CPU device those buffers are host memory, and NIXL's UCX backend refuses them at ``register_buffer_to_engine``
(``nixl/conn.py:1992``: ``nixlBackendError: NIXL_ERR_BACKEND``; NIXL logs "VRAM memory is detected as host by
UCX"). :func:`install` labels them ``DRAM`` before ``NixlKVManager.__init__`` reads the labels, on a host without
CUDA: SGLang then registers and transfers them through its own DRAM branch (the one HiSparse's host KV takes);
the peer learns the label from the decode's registration message, as SGLang sends it.

Nothing of SGLang's transfer logic is reimplemented: the senders, their transfer workers and the decode side are
SGLang's own. Called by faultlab's SGLang plugin (:func:`faultlab.sglang_live.inject.register`) when
``FAULTLAB_SGLANG_CPU_PD=1`` is set, in every SGLang process (the prefill scheduler included). It does nothing on a
CUDA host.
"""
from __future__ import annotations

ENV_VAR = "FAULTLAB_SGLANG_CPU_PD"
MODULE = "sglang.srt.disaggregation.mooncake.conn"
NIXL_INIT = "sglang.srt.disaggregation.nixl.conn.NixlKVManager.__init__"


def install() -> bool:
    """On a host without CUDA: Mooncake's page indices as a plain host array, NIXL's KV labelled DRAM."""
    import importlib

    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if torch.cuda.is_available():
        return False
    conn = importlib.import_module(MODULE)
    conn.MooncakeKVSender.supports_host_tensor_indices = False
    HookRegistry.register(NIXL_INIT, _around_nixl_init, HookType.AROUND)
    return True


def _around_nixl_init(original, manager, args, *rest, **kwargs):
    args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)  # host memory, whatever SGLang set
    return original(manager, args, *rest, **kwargs)
