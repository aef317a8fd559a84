"""Reading a step's verdict on one SGLang 0.5.23 pool set, with the wait SGLang makes anyway.

:class:`VerdictSide` is the part of :class:`kvguard.sglang.guard.SGLangGuard` that reads what a launched check
(:class:`kvguard.sglang.guard.Pending`) wrote: its flag cell before any wait in the steady state, else after
SGLang's own wait for the forward's sampled ids, then which requests were flagged, agreed across TP ranks.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..tracker import Check
from ..violations import KVGuardViolation
from .aborts import ABORT_MESSAGE, _all_reduce_max

log = logging.getLogger("kvguard.sglang")


class VerdictSide:
    """:class:`kvguard.sglang.guard.SGLangGuard`'s verdicts: a launched check read, flagged requests named.

    (``pending``: a :class:`kvguard.sglang.guard.Pending`; not imported here, the guard's module imports this one.)
    """

    def check_of(self, pending) -> Check:
        """The launched check of ``pending`` as a :class:`kvguard.tracker.Check` (made here for a bound launch:
        only a flagged step needs it)."""
        if pending.check is None:
            verdict = self.graph.verdict(pending.epoch, len(pending.reqs)) if pending.epoch is not None else \
                self._ring.buffers()[pending.slot][:pending.cells].view(len(pending.reqs), -1)
            pending.check = Check(verdict, pending.rows, self.req_to_token_pool.req_to_token, pending.table_rows,
                                  1, self.page_size, True)
        return pending.check

    def resolve(self, pending, group=None, done=None, result=None) -> list[tuple[Any, str, bool]]:
        """Read the verdict (with the sampled ids); agree across TP ranks; (req, message, stale).

        ``done``, ``result``: SGLang's wait for this batch's forward (its result's ``copy_done``) and the result
        (:meth:`wait_forward`). The ranks' agreement is the
        verdict all-reduced at launch (``pending.agreed``), or else, with a CPU ``group``, one small
        all-reduce here.
        """
        # NOTE (the steady state of a captured check on one rank): its result word is read before any wait. The check
        # is the first node of the forward's graph, so its result is in long before the sampled ids are; clean, the
        # step goes on to SGLang's own wait for them, and kvguard waits for nothing (after a wait the host's caches
        # are cold). Not in yet, or anything else: the wait, then the full read below.
        if pending.epoch is not None and not pending.any_stale and group is None and pending.agreed is None \
                and self.graph.clean(pending.epoch):
            return []
        # (attention TP's: every rank's verdict, all-reduced and marked, is in and clean)
        if pending.agreed is not None and not pending.any_stale \
                and self._ring.agreed_clean(pending.slot, pending.agreed.numel()):
            return []
        self.wait_forward(pending, done, result)
        if pending.epoch is not None:
            flagged = self.graph.flagged(pending.epoch)  # raises if this epoch's result is not in its slot
        elif pending.slot < 0:
            message = (f"kvguard: a decode batch of {len(pending.reqs)} requests ran without its check (no forward "
                       f"kvguard hooks launched it); kvguard does not serve a step it did not check")
            log.critical(message)
            raise RuntimeError(message)
        else:
            flagged = self._ring.flagged(pending.slot, pending.stamp)
        if not flagged and not pending.any_stale and (pending.agreed is None and group is None or
                                                       pending.agreed is not None and not pending.agreed.any()):
            return []  # the steady state: nothing flagged here or on any rank
        agreed = None if pending.agreed is None else (pending.agreed.reshape(len(pending.reqs), -1) > 0).any(1)
        check = self.check_of(pending)
        verdict_host = check.verdict.cpu() if flagged else None  # rare: which requests
        rids = [str(req.rid) for req in pending.reqs]
        # NOTE: a request already finished is never aborted again (every rank skips the same requests: finishing
        # is agreed across ranks), and one kvguard aborted on an earlier verdict is not counted again: one
        # violation per flagged request. One that finished since this check was launched (the overlap scheduler's
        # in-flight batch still holds it) is counted, and what it published to the radix tree, a step after its
        # last clean check, is poisoned (kvguard.sglang.radix).
        aborted = [bool(req.__dict__.get("kvguard_aborted")) for req in pending.reqs]
        found = {err.request_id: err for err in
                 self.tracker.resolve(check, verdict_host, rids, ignore=aborted)}
        finished = [a or bool(req.finished()) for a, req in zip(aborted, pending.reqs)]
        late = [req for req, rid, a, d in zip(pending.reqs, rids, aborted, finished) if d and not a and rid in found]
        if late:
            self.radix.late_flags(late)
        flags = [0 if d else 1 if rid in found or stale else 0 for rid, stale, d in zip(rids, pending.stale, finished)]
        if agreed is not None:
            flags = [0 if d else int(f or a) for f, a, d in zip(flags, agreed.tolist(), finished)]
        else:
            flags = _all_reduce_max(flags, group)
        out = []
        for req, rid, flag, stale in zip(pending.reqs, rids, flags, pending.stale):
            if not flag:
                continue
            err: KVGuardViolation | None = found.get(rid)
            if err is not None:
                message = str(err)
            elif stale:
                message = self.stale_message(req)
            else:
                message = f"{ABORT_MESSAGE} on a peer tensor-parallel rank (request {rid})"
            out.append((req, message, bool(stale)))
        return out

    def wait_forward(self, pending, done=None, result=None) -> None:
        """Wait until the check of ``pending`` ran, with the wait SGLang makes next anyway for the forward's
        sampled ids:

        - ``done``: the result's ``copy_done`` (the overlap scheduler's copy of the sampled ids);
        - else the result's sampled ids still on the device (no overlap): copied to the host here, which waits
          for the stream the forward, and the check before it, ran on. SGLang's result processing takes the
          host tensor as it would have the device one (its ``tolist()``), so the copy and the wait are SGLang's
          own, made a moment earlier, and kvguard records no event;
        - else the event recorded after the check; the first time there is none, the stream, and events from
          then on.
        """
        if not self.on_cuda:
            return
        if done is not None:
            done.synchronize()
            return
        ids = getattr(result, "next_token_ids", None)
        if isinstance(ids, torch.Tensor) and ids.is_cuda:
            result.next_token_ids = ids.cpu()
        elif pending.ready is not None:
            pending.ready.synchronize()
        else:
            (self._ring or self._make_ring()).use_events = True
            torch.cuda.current_stream(self.device).synchronize()
