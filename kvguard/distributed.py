"""kvguard under tensor parallelism: every rank checks its own KV shard, all ranks abort the same requests.

Under TP each rank holds a slice of the KV heads in its own pool, with its own page table copy, tag
table and expected tags. A bookkeeping bug can strike one rank only, so the ranks' verdicts can
differ; a rank that aborted a request alone would then run a different batch from its peers and the
next collective would pair the wrong tensors (or hang). ``combine_verdict`` makes the per-request
verdict the elementwise MAX over ranks with one small all-reduce, so every rank aborts exactly the
same requests. ``RankTracker`` is a ``TagTracker`` that does this inside ``validate`` (no host sync:
the all-reduce is one more launch in the step, CUDA-graph capturable on NCCL).

kvguard never imports faultlab; this module needs only ``torch.distributed``.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .tracker import Check, TagTracker
from .violations import KVGuardViolation, Violation, log_violation

PEER_RANK = "peer_rank"  # reason of a violation found by another rank only


def combine_verdict(verdict_rows: torch.Tensor, group=None) -> torch.Tensor:
    """Per-request verdicts (int32 [B], > 0 = bad) -> their MAX over the ranks of ``group``, in place.

    One all-reduce of B int32 values; every rank must call it with the same B (same batch). The tensor
    must live where the group's backend works (CPU for gloo, the rank's GPU for NCCL).
    """
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(verdict_rows, op=dist.ReduceOp.MAX, group=group)
    return verdict_rows


def verdict_rows(verdict: torch.Tensor) -> torch.Tensor:
    """A check's verdict int32 [B, n_chunks] -> bad entries per request, int32 [B] (no sync)."""
    return verdict.sum(1, dtype=torch.int32)


@dataclass
class RankCheck(Check):
    """A check combined over ranks: ``verdict`` [B, 1] is the MAX over ranks, ``local`` [B] this rank's."""

    local: torch.Tensor | None = None


class RankTracker(TagTracker):
    """The tag tracker of one TP rank: validates its own shard, then combines the verdict across ranks.

    ``combine=False`` keeps the verdict rank-local (for showing what goes wrong without the combine).
    """

    def __init__(self, config=None, registry=None, *, group=None, combine: bool = True):
        super().__init__(config, registry)
        self.group, self.combine = group, combine

    def validate(self, table, rows, n_entries, *, max_entries, **kwargs) -> RankCheck:
        """``TagTracker.validate`` on this rank's table, then one all-reduce (MAX) of the per-request verdict."""
        check = super().validate(table, rows, n_entries, max_entries=max_entries, **kwargs)
        local = verdict_rows(check.verdict)
        combined = combine_verdict(local.clone(), self.group) if self.combine else local
        return RankCheck(combined[:, None], check.rows, check.source, check.source_rows, check.entry_step,
                         check.page_div, local=local)

    def resolve(self, check, verdict_host, request_ids) -> list[KVGuardViolation]:
        """One violation per request flagged on any rank; explained locally where this rank saw it."""
        if not isinstance(check, RankCheck) or verdict_host is None:
            return super().resolve(check, verdict_host, request_ids)
        combined = verdict_host.reshape(len(request_ids), -1).amax(1)
        flagged = combined.nonzero().flatten().tolist()
        if not flagged:
            return []
        local = check.local.cpu()  # slow path only: some request is flagged
        found = [KVGuardViolation(self._explain(check, b, request_ids[b], int(local[b])) if local[b] > 0
                                  else self._peer(check, b, request_ids[b], int(combined[b])))
                 for b in flagged]
        for err in found:
            self.metrics.violations.labels(reason=err.violation.reason).inc()
            if self.config.log_violations:
                log_violation(err.violation)
        return found

    @staticmethod
    def _peer(check: Check, b: int, request_id: str, bad: int) -> Violation:
        """A request this rank's shard found clean but another rank flagged."""
        return Violation(request_id=request_id, row=int(check.rows[b]), logical_position=-1, page=-1,
                         expected_tag=-1, found_tag=None, reason=PEER_RANK, bad_entries=bad)
