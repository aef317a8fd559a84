"""Attention tensor parallelism: the ranks' agreement on a step's verdict, one MAX all-reduce on the device.

Every rank checks its own page tables; a rank-local fault must still make every rank drop the same requests
(ranks that ran different batches would hang in their next collective). So each decode step's verdict is
MAX-reduced across the attention-TP ranks on the stream, after the check and before the forward, and read with
the step's sampled ids (kvguard.sglang.guard: ``VerdictRing.agree``).

The all-reduce goes over kvguard's own NCCL communicator for those ranks, made once over SGLang's CPU group of
the attention-TP group, through SGLang's NCCL bindings (``pynccl_wrapper``): one ctypes call per step onto the
current stream, with no ProcessGroup work object, event or watchdog entry (torch.distributed's NCCL all-reduce
costs a few hundred microseconds of host time per call inside SGLang's scheduler). Its own communicator, not
SGLang's: SGLang uses its communicators from other streams (graph replays, the overlap scheduler's forward
stream), and two streams enqueueing onto one communicator can order its collectives differently on different
ranks, which hangs them. Off CUDA (SGLang's CPU build) the agreement is torch.distributed's all-reduce over the
CPU group.
"""
from __future__ import annotations

import ctypes

import torch


class VerdictAgreement:
    """One MAX all-reduce per call of a small int32 tensor across the ranks of ``cpu_group``, on ``device``."""

    def __init__(self, cpu_group, device: torch.device):
        self.cpu_group, self.device = cpu_group, device
        self.ranks = torch.distributed.get_world_size(cpu_group)
        self._comm = None
        if device.type != "cuda":
            return
        from sglang.srt.distributed.device_communicators.pynccl_wrapper import (
            NCCLLibrary,
            ncclDataTypeEnum,
            ncclRedOpTypeEnum,
            ncclUniqueId,
        )

        # NOTE: a collective over the CPU group: every rank makes its agreement at the same point (kvguard's
        # lookup of the attention-TP groups, before SGLang captures its graphs). A failure stops the scheduler.
        lib = NCCLLibrary()
        rank = torch.distributed.get_rank(cpu_group)
        unique_id = lib.ncclGetUniqueId() if rank == 0 else ncclUniqueId()
        shared = torch.ByteTensor(list(unique_id.internal))
        torch.distributed.broadcast(shared, src=torch.distributed.get_process_group_ranks(cpu_group)[0],
                                    group=cpu_group)
        for i, byte in enumerate(shared.tolist()):
            unique_id.internal[i] = byte
        with torch.cuda.device(device):
            self._comm = lib.ncclCommInitRank(self.ranks, unique_id, rank)
        self._lib, self._index = lib, device.index if device.index is not None else torch.cuda.current_device()
        self._int32, self._max = ncclDataTypeEnum.from_torch(torch.int32), ncclRedOpTypeEnum.from_torch(
            torch.distributed.ReduceOp.MAX)

    def max_(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor`` (int32, contiguous) MAX-reduced across the ranks into ``out`` (default: in place), on the current
        stream; no host sync. Every rank must call it for the same step, in the same order. Returns the result."""
        out = tensor if out is None else out
        if self._comm is None:
            if out is not tensor:
                out.copy_(tensor)
            torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=self.cpu_group)
            return out
        stream = torch._C._cuda_getCurrentRawStream(self._index)
        self._lib.ncclAllReduce(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_void_p(out.data_ptr()), tensor.numel(),
                                self._int32, self._max, self._comm, ctypes.c_void_p(stream))
        return out
