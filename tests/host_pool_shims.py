"""The two shims that let SGLang 0.5.23's ``MHATokenToKVPoolHost`` and its ``direct`` IO backend run on the CPU.

SGLang's host KV pool (HiCache's, and the PD decode server's ``host_pool`` retraction backup, which builds the same
``UnifiedRadixCache.init_hicache`` stack: a ``HybridCacheController`` over an ``MHATokenToKVPoolHost``) makes two
CUDA-only calls outside the logic kvguard's tests are about; SGLang makes neither on the CPU, where its host pool
does not start:

* ``pool_host.common._cuda_host_register``: pins the host buffer with ``cudaHostRegister`` ("Found no NVIDIA
  driver" here). Pinning changes no byte and no index: a no-op.
* ``pool_host.mha.transfer_kv_direct``: the ``sgl_kernel`` op the ``direct`` IO backend calls with the
  ``layer_first`` layout (imported by SGLang only on CUDA/ROCm/XPU): its torch reference, per layer,
  ``dst[dst_indices] = src[src_indices]``.

Everything else runs as shipped: the host pool's allocator, the controller's index moves and transfer plans,
``L2TransferEngine`` (on ``torch.cpu``'s stream and event stand-ins). The rigs run with ``hicache_io_backend=
"direct"`` and ``hicache_mem_layout="layer_first"`` (SGLang's default IO backend, ``kernel``, calls
``sgl_kernel``'s other ops, which have no reference here). The tests compare the bytes a copy brings back with
what was there before, so the copies are real.

The rigs also build their host pools inside SGLang's own budget scope (:func:`host_budget`): SGLang sizes a host
pool against the machine's free memory less a 10 GiB reserve, which a loaded 24 GiB test machine does not always
have (measured in CI: "Not enough host memory available. Requesting 0.00 GB but only have -0.02 GB free"); a rig's
pool is a few MB.

Used by tests/test_kvguard/test_sglang/test_sglang_hicache.py and test_sglang_pd_backup.py.
"""
from __future__ import annotations


HOST_BUDGET = 1 << 30  # bytes a rig's host pools may claim (SGLang's host_memory_budget_scope)


def host_budget():
    """SGLang's own budget scope (``pool_host.base.host_memory_budget_scope``) to build a rig's host pools in."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    return host_memory_budget_scope(HOST_BUDGET)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """The torch reference of ``sgl_kernel.kvcacheio.transfer_kv_direct``: per layer, copy the indexed rows."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device).long()] = src[src_indices.to(src.device).long()]


def apply(monkeypatch) -> None:
    """Both shims, for one test (``monkeypatch`` undoes them)."""
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha

    monkeypatch.setattr(common, "_cuda_host_register", lambda buffer, granularity=None: None)
    monkeypatch.setattr(mha, "transfer_kv_direct", transfer_kv_direct, raising=False)
