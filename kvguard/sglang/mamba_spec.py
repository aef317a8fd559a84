"""Speculative decoding on a hybrid linear-attention / mamba model (SGLang 0.5.23, chain drafting): the state check.

What SGLang does with a request's recurrent-state slot in one spec step (``EAGLEWorkerV2.forward_batch_generation``
-> ``run_eagle_verify``, kvguard/sglang/spec.py for the KV side): the draft model (an MTP layer: full attention only,
no state of its own) drafts; the target-verify forward reads each request's state at the slot its row's state index
names (``HybridLinearAttnBackend.init_forward_metadata``, inside the verify forward: ``get_mamba_indices`` of the
rows, into ``forward_metadata.mamba_cache_indices``), rewrites the slot's conv state in place and writes each draft
step's state into the speculative buffers (indexed by batch position); then the commit
(``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify``, from ``commit_mamba_states_after_verify``) scatters
the accepted step's state into ``forward_metadata.mamba_cache_indices[:n]``: the same slots the verify read.

=========================================================================  ======  ==================================
target                                                                     type    what kvguard does there
=========================================================================  ======  ==================================
(kvguard/sglang/spec.py ``fire``, before the step's first forward)          call    :func:`launch`: the state check on
                                                                                   the step's rows, beside its KV
                                                                                   check (folded into the agreed
                                                                                   verdict under attention TP)
``layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend.``    AROUND  the commit's destinations must be
``update_mamba_state_after_mtp_verify``                                            each request's own slot: one not
                                                                                   is pointed at the dummy slot and
                                                                                   its request flagged
=========================================================================  ======  ==================================

**The check.** :func:`launch` runs :class:`kvguard.sglang.mamba.StateFollower`'s check (one launch) on the rows the
step reads, right after its KV check and before any of its forwards: an index that is not the request's own slot at
its own generation is pointed at SGLang's dummy slot 0 in the table, before the verify forward computes its metadata
from the table (``_forward_metadata``, run by ``forward_extend`` after ``eagle_prepare_for_verify``; with CUDA graphs
by the replay's ``init_forward_metadata_replay_cuda_graph``, also inside the step), so the verify reads and rewrites
the dummy slot for it and the commit scatters into the dummy slot. Its verdict is read with the KV verdict at the
step's result (the follower's ``resolve``): the request is aborted alone.

**The commit.** A backstop on what the commit writes: each destination ``forward_metadata.mamba_cache_indices[i]``
is compared on the device with request ``i``'s recorded slot (``req.kvguard_state``); a mismatch (the dummy slot of a
request the check flagged, or a destination changed after the check) is pointed at the dummy slot before SGLang's
scatter, and ORed into the step's state flags (one rank: re-copied to the host behind a re-recorded event, no sync;
attention TP: MAX all-reduced over the step's agreement on the device first, so every rank flags the same requests).

Refused (the registry, kvguard/sglang/paths.py; here again at the first step or at the commit, fail closed):
ReplaySSM pools (``--enable-linear-replayssm[-spec]``: the commit folds a ring of its own, or the KDA fused-accept
pool, ``accept_lens_pool``), the PP stable-rows commit (``SGLANG_ENABLE_PP_SPEC``: pipeline_parallel), extra-buffer
tracking slots (``mamba_track_indices``: hybrid_linear_radix_cache), tree drafting, other algorithms (spec.py).
Only functions of this module import SGLang, and only when they run.
"""
from __future__ import annotations

import logging

import torch

from .mamba import SCRATCH_STATE

log = logging.getLogger("kvguard.sglang")

_SRT = "sglang.srt"
REFUSED_REPLAY = "hybrid_linear_spec_own_state"  # kvguard.sglang.paths: a state pool whose commit is not followed
AGREED = "agreed"  # a StateFollower.open entry's fourth field: its flags (check's and commit's) agreed by every rank
# (its fifth: this rank's own flags, int32 [n] on the device)


def launch(pending, rows: torch.Tensor, agreement=None) -> torch.Tensor | None:
    """kvguard.sglang.spec's ``fire``, right after the step's KV check: the step's state check on ``rows`` (its
    ``table_rows``) when the guard follows a hybrid pool. ``agreement``: attention TP's (the flags returned, int32
    [n] on the device, for the agreed verdict to fold in), or None (one rank: None returned)."""
    follower = getattr(pending.guard, "mamba", None)
    if follower is None:
        return None
    _refuse_unfollowed(follower.pool)
    follower.spec_step = (pending, agreement)  # the step whose commit is checked next (one spec step in flight)
    if agreement is None:
        follower.launch(pending, rows)
        return None
    return follower.fold(pending, rows)


def _refuse_unfollowed(pool) -> None:
    """A state pool whose spec commit does not go through the destinations checked here: stop (fail closed)."""
    mamba_pool = pool.mamba_pool
    if getattr(mamba_pool, "replayssm_is_kda", False) or getattr(mamba_pool, "replayssm_spec_fold", False) \
            or getattr(mamba_pool, "replayssm_cache_base", None) is not None:
        from .runtime import unchecked

        raise unchecked(REFUSED_REPLAY)


def around_commit(original, backend, last_correct_step_indices, *args, **kwargs):
    linear = backend.linear_attn_backend
    follower = linear.req_to_token_pool.__dict__.get("_kvguard_mamba")
    if follower is None:
        return original(backend, last_correct_step_indices, *args, **kwargs)
    _refuse_commit(linear, follower, *args, **kwargs)
    n = last_correct_step_indices.shape[0]
    step = follower.__dict__.get("spec_step")
    entry = follower.open.get(id(step[0])) if step is not None else None
    if entry is None or entry[2] != n:
        raise RuntimeError(f"kvguard: a speculative commit of {n} requests' recurrent state without the state check "
                           f"of its step (open checks: {[e[2] for e in follower.open.values()]}): stopping")
    commit_guard(follower, step[0], entry, linear.forward_metadata.mamba_cache_indices[:n], step[1])
    return original(backend, last_correct_step_indices, *args, **kwargs)


def _refuse_commit(linear, follower, mamba_track_indices=None, mamba_steps_to_track=None, model=None,
                   req_pool_indices=None) -> None:
    from sglang.srt.layers.attention.linear.utils import pp_spec_stable_rows_enabled

    from .runtime import unchecked

    if pp_spec_stable_rows_enabled() and req_pool_indices is not None:  # destinations read from the rows instead
        raise unchecked("pipeline_parallel")
    if mamba_track_indices is not None:  # extra-buffer tracking slots (not recorded)
        raise unchecked("hybrid_linear_radix_cache")
    if getattr(linear, "accept_lens_pool", None) is not None:  # KDA fused-accept: the next verify seeds from it
        raise unchecked(REFUSED_REPLAY)
    _refuse_unfollowed(follower.pool)


def commit_guard(follower, pending, entry: tuple, dst: torch.Tensor, agreement=None) -> torch.Tensor:
    """Each commit destination ``dst[i]`` (int32 [n], SGLang's own tensor, rewritten in place) that is not request
    ``i``'s recorded slot is pointed at the dummy slot and flagged in the step's state flags. Device only, no sync.
    Returns this commit's own flags (int32 [n]; agreed across the ranks under attention TP)."""
    k, n, folded = entry[1], entry[2], entry[3]
    slots, _ = follower.expected(pending.reqs)  # [n] int64, the per-composition expectation (cached)
    wrong = (dst.to(torch.int64) != slots).to(torch.int32)  # [n]
    own = None
    if agreement is not None:  # every rank must flag the same requests: MAX over the ranks, on the stream
        # (this rank's own flags, its check's and its commit's, kept apart: the verdict explains those here and names
        # the rest a peer's, StateFollower.flagged; the agreed flags below carry every rank's)
        own = torch.maximum(follower.bad[k][:n], wrong)
        agreement.max_(wrong)
    dst.masked_fill_(wrong.bool(), SCRATCH_STATE)
    bad = follower.bad[k][:n]
    torch.maximum(bad, wrong, out=bad)
    follower.publish(k, n)  # the host copy the verdict reads, again behind this commit
    if agreement is not None and folded:
        follower.open[id(pending)] = (pending, k, n, AGREED, own)
    return wrong


HOOKS = {  # name: (SGLang target, kvguard's hook, HookRegistry type); composed into kvguard.sglang.plugin's table
    "mamba_spec_commit": (f"{_SRT}.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend."
                          "update_mamba_state_after_mtp_verify", around_commit, "AROUND"),
}
