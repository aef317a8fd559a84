"""kvguard under tensor parallelism: every rank checks its own KV shard, all ranks abort the same requests.

Under TP each rank holds a slice of the KV heads in its own pool, with its own page table copy, tag
table and expected tags. A bookkeeping bug can strike one rank only, so the ranks' verdicts can
differ; a rank that aborted a request alone would then run a different batch from its peers and the
next collective would pair the wrong tensors (or hang). ``combine_verdict`` makes the per-request
verdict the elementwise MAX over ranks with one small all-reduce, so every rank aborts exactly the
same requests. ``RankTracker`` is a ``TagTracker`` that does this inside ``validate`` (no host sync:
the all-reduce is one more launch in the step, CUDA-graph capturable on NCCL); ``make_rank_tracker``
builds one the way ``kvguard.make_tracker`` builds the single-process tracker.

Piggyback (``RankTracker(piggyback=True)``): instead of its own all-reduce, the verdict rides on one
the step already does. ``validate`` then returns a check whose ``verdict`` is not combined yet and
whose ``ride`` (a ``VerdictRide``) holds this rank's per-request flags (0/1). The model, at its last
row-parallel all-reduce (SUM) of the forward, calls ``wide = ride.board(y)`` (y [n, H] -> [n, H + k]:
the flags as k = ceil(B / n) extra columns, row-major, zero-padded), all-reduces ``wide`` as it would
have ``y``, and continues with ``y = ride.land(wide)``, which writes the combined verdict (the number
of ranks that flagged each request, > 0 = bad) into ``check.verdict`` and returns the hidden-state
columns. The other columns' sums are untouched, so the hidden state is the same as without the ride
(bit-identical at 2 ranks; at more ranks a backend may chunk a wider buffer differently, which can
move the reduction order of an element: a last-bit difference). SUM instead of MAX is exact: the
column holds small integers (<= world), exact in bf16 up to 256 ranks. Everything stays on the
device, so the verdict is still read on the step's one host sync, and the ride is CUDA-graph
capturable. A caller with no all-reduce to ride calls ``ride.combine()`` (the separate MAX
all-reduce) instead. ``resolve`` refuses a check whose ride never landed (its verdict would be
rank-local, and the ranks could diverge).

Collectives here use the verdict's own device: NCCL needs CUDA tensors; gloo all-reduces CPU tensors
and CUDA tensors (over TCP, its usual transport, it stages CUDA tensors through the host, any reduce
op; its GPUDirect path reduces with SUM only, which the piggyback uses), so a CUDA engine on gloo
works unchanged.

kvguard never imports faultlab; this module needs only ``torch.distributed``.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .tracker import Check, TagTracker, make_tracker
from .violations import PEER_RANK, KVGuardViolation, Violation



def combine_verdict(verdict_rows: torch.Tensor, group=None) -> torch.Tensor:
    """Per-request verdicts (int32 [B], > 0 = bad) -> their MAX over the ranks of ``group``, in place.

    One all-reduce of B int32 values; every rank must call it with the same B (same batch). The tensor
    must live where the group's backend works: the rank's GPU for NCCL; CPU or CUDA for gloo (gloo
    all-reduces CUDA tensors through the host).
    """
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(verdict_rows, op=dist.ReduceOp.MAX, group=group)
    return verdict_rows


def verdict_rows(verdict: torch.Tensor) -> torch.Tensor:
    """A check's verdict int32 [B, n_chunks] -> bad entries per request, int32 [B] (no sync)."""
    return verdict.sum(1, dtype=torch.int32)


class VerdictRide:
    """This rank's per-request flags, riding as extra columns on a hidden-state all-reduce (SUM).

    ``flags``: int32 [B] bad entries per request on this rank (only ``> 0`` is sent). ``out``: int32
    [B, 1], the check's verdict, written by ``land`` (or ``combine``). See the module docstring.
    """

    def __init__(self, flags: torch.Tensor, out: torch.Tensor, group=None):
        self.flags, self.out, self.group = flags, out, group
        self.landed = False  # host-side bookkeeping only (no sync); set at capture time under a graph

    def columns(self, n_rows: int) -> int:
        """Extra columns on a hidden state of ``n_rows`` rows: ceil(B / n_rows)."""
        return -(-self.flags.numel() // n_rows)

    def board(self, y: torch.Tensor) -> torch.Tensor:
        """y [n, H] (this rank's partial sums) -> [n, H + k]: y, then the flags (0/1, y's dtype)."""
        if y.dim() != 2:
            raise ValueError(f"VerdictRide.board: expected a 2-D hidden state [n, H], got {tuple(y.shape)}")
        n, b = y.shape[0], self.flags.numel()
        k = self.columns(n)
        col = (self.flags > 0).to(y.dtype)
        if n * k != b:
            col = torch.nn.functional.pad(col, (0, n * k - b))
        return torch.cat([y, col.view(n, k)], dim=1)

    def land(self, wide: torch.Tensor) -> torch.Tensor:
        """The all-reduced [n, H + k] -> the hidden state [n, H]; the combined verdict goes to ``out``."""
        k, b = self.columns(wide.shape[0]), self.flags.numel()
        summed = wide[:, -k:].reshape(-1)[:b]  # ranks that flagged each request (small exact integers)
        self.out.copy_(summed.to(torch.int32).view_as(self.out))
        self.landed = True
        return wide[:, :-k]

    def combine(self) -> None:
        """No all-reduce to ride on: the separate one (MAX of the bad-entry counts), into ``out``."""
        self.out.copy_(combine_verdict(self.flags.clone(), self.group).view_as(self.out))
        self.landed = True


@dataclass
class RankCheck(Check):
    """A check combined over ranks: ``verdict`` [B, 1] is the MAX over ranks, ``local`` [B] this rank's.

    With a piggyback tracker ``ride`` is set and ``verdict`` holds the combined verdict (ranks that
    flagged) only once the ride has landed.
    """

    local: torch.Tensor | None = None
    ride: VerdictRide | None = None


class RankTracker(TagTracker):
    """The tag tracker of one TP rank: validates its own shard, then combines the verdict across ranks.

    ``combine=False`` keeps the verdict rank-local (for showing what goes wrong without the combine).
    ``piggyback=True`` issues no all-reduce: the check's ``ride`` must be carried by the model's last
    all-reduce of the forward (or ``ride.combine()``d) before the verdict is read; see the module doc.
    """

    def __init__(self, config=None, registry=None, *, group=None, combine: bool = True, piggyback: bool = False):
        super().__init__(config, registry)
        self.group, self.combine, self.piggyback = group, combine, piggyback

    def validate(self, table, rows, n_entries, *, max_entries, **kwargs) -> RankCheck:
        """``TagTracker.validate`` on this rank's table, then one all-reduce (MAX) of the per-request verdict.

        Piggyback: no all-reduce here; the returned check carries a ``VerdictRide`` instead.
        """
        check = super().validate(table, rows, n_entries, max_entries=max_entries, **kwargs)
        local = verdict_rows(check.verdict)
        ride = None
        if self.combine and self.piggyback:
            combined = torch.zeros(local.shape[0], 1, dtype=torch.int32, device=local.device)
            ride = VerdictRide(local, combined, self.group)
        else:
            combined = (combine_verdict(local.clone(), self.group) if self.combine else local)[:, None]
        return RankCheck(combined, check.rows, check.source, check.source_rows, check.entry_step,
                         check.page_div, local=local, ride=ride)

    def resolve(self, check, verdict_host, request_ids, ignore=None) -> list[KVGuardViolation]:
        """One violation per request flagged on any rank; explained locally where this rank saw it."""
        if not isinstance(check, RankCheck) or verdict_host is None:
            return super().resolve(check, verdict_host, request_ids, ignore)
        if check.ride is not None and not check.ride.landed:
            raise RuntimeError("RankTracker(piggyback=True): the check's verdict never rode an all-reduce "
                               "(pass check.ride to the model's forward, or call check.ride.combine())")
        combined = verdict_host.reshape(len(request_ids), -1).amax(1)
        flagged = [b for b in combined.nonzero().flatten().tolist() if ignore is None or not ignore[b]]
        if not flagged:
            return []
        local = check.local.cpu()  # slow path only: some request is flagged
        found = [KVGuardViolation(self._explain(check, b, request_ids[b], int(local[b])) if local[b] > 0
                                  else self._peer(check, b, request_ids[b], int(combined[b])))
                 for b in flagged]
        for err in found:
            self.report(err.violation)
        return found

    @staticmethod
    def _peer(check: Check, b: int, request_id: str, bad: int) -> Violation:
        """A request this rank's shard found clean but another rank flagged.

        ``bad``: the combined verdict, i.e. the largest bad-entry count of a rank (separate all-reduce)
        or the number of ranks that flagged the request (piggyback).
        """
        return Violation(request_id=request_id, row=int(check.rows[b]), logical_position=-1, page=-1,
                         expected_tag=-1, found_tag=None, reason=PEER_RANK, bad_entries=bad)


def make_rank_tracker(config=None, registry=None, *, group=None, combine: bool = True, piggyback: bool = False):
    """``kvguard.make_tracker`` for one TP rank: the ``NoopTracker`` in mode off (on every rank, as every rank
    reads the same settings), else a ``RankTracker`` combining its verdict over ``group`` (None: the default
    process group)."""
    return make_tracker(config, registry, checking=RankTracker, group=group, combine=combine, piggyback=piggyback)
