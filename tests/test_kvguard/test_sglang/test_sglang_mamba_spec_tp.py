"""Attention TP (2 gloo ranks) on a hybrid linear-attention model with speculative decoding: the ranks agree on whom
a spec step's state check and its commit guard abort (kvguard/sglang/mamba_spec.py).

Each rank is a process with SGLang 0.5.23's real pools (test_sglang_mamba_tp.py's rig: a tiny NemotronH's mamba2 state
and a tiny Qwen3-Next's GDN state, here with the ``HybridReqToTokenPool``'s speculative buffers, chain 3/1/4) and
kvguard loaded through SGLang's plugin loader, its agreement over the two ranks set where its hooks read it. Each spec
step runs in SGLang's order: SGLang's ``alloc_for_spec_decode`` (kvguard's hook arms the step's check with the
agreement), the check fired where the spec worker's forward hook fires it (``spec.fire``: KV check, state check,
agreed on the device), the verify's state indices computed from the table (test_sglang_mamba_spec_commit.py), SGLang's
real commit ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`` (hooked; backend objects built with
``__new__``, its CPU scatter from faultlab/sglang_live/cpu_mamba_spec.py), then the verdict resolved and the flagged
requests aborted as the result hook does.

The bug happens on rank 1 only, at step 1 of three:

- ``commit``: the victim's commit destination names another request's slot, changed AFTER the check (only the commit
  guard can see it): its flags are MAX all-reduced on the device, so rank 0 redirects and aborts the victim too;
- ``check``: the victim's state index names another request's slot before the step: the state check flags it, its
  flags ride the step's agreed verdict, and the commit guard (agreed again) redirects its commit on both ranks.

Both ranks abort exactly the victim, the victim's accepted state lands in the dummy slot 0 on both, the other requests'
states in their own slots, with no CPU all-reduce (two device agreements a step: the check's, the commit's); rank 1
explains and counts the violation, rank 0 names a peer's; step 2 runs the same two requests on both ranks; pools
balance. A clean run flags nothing on either rank. (With the commit's agreement skipped, rank 1 alone aborts the
victim and the ranks hang in their next collective.)
"""
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import two_ranks
from test_sglang_mamba_spec_commit import DRAFT_TOKENS, _state, _verify_metadata
from test_sglang_mamba_tp import PS, _balance, _balanced, _hybrid_rig, _prefill, _slot
from test_sglang_mamba_tp import _join as _join_tp
from test_sglang_spec_rig import RESERVE, _accept, _Spec
from two_ranks import of

pytestmark = pytest.mark.sglang

FAMILIES = {"nemotron_h": "Mamba2AttnBackend", "qwen3_next": "GDNAttnBackend"}  # model -> SGLang's linear backend
CALLS = {"cpu_all_reduce": 0, "device_agreement": 0}  # this rank's collectives (counted, then done as SGLang does)


def _join(rank: int, port: int) -> None:
    """test_sglang_mamba_tp's join (group, hooks, agreement), spec decoding on as a spec server publishes it (EAGLE
    3/1/4), the commit's CPU scatter, and this rank's collectives counted."""
    import sglang.srt.disaggregation.utils as dutils
    import sglang.srt.mem_cache.common as common

    import kvguard.sglang.runtime as runtime
    from faultlab.sglang_live import cpu_mamba_spec
    from kvguard.sglang import spec

    _join_tp(rank, port)
    spec._REFUSAL[:] = [None]  # this process's spec configuration: checked
    bag = common.get_spec  # (the bag is published by each rig's server args)
    common.get_spec = lambda: _Spec(bag())  # (SGLang's release frees the reserve past the committed length)
    assert cpu_mamba_spec.install()
    agreement, reduce_flags = runtime._GROUP[0][1], dutils.all_reduce_flags
    max_ = agreement.max_

    def _counted(name, fn):
        def call(*args, **kwargs):
            CALLS[name] += 1
            return fn(*args, **kwargs)
        return call
    agreement.max_ = _counted("device_agreement", max_)
    dutils.all_reduce_flags = _counted("cpu_all_reduce", reduce_flags)


def _spec_rig(model_path: str, family: str):
    """test_sglang_mamba_tp's rig with the pool's speculative buffers, and SGLang's hybrid backend holding what the
    commit reads: (rig, guard, backend)."""
    import sglang.srt.layers.attention.hybrid_linear_attn_backend as hybrid
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    rig, guard = _hybrid_rig(model_path, mamba_spec_state_size=8, speculative_num_draft_tokens=DRAFT_TOKENS,
                             speculative_eagle_topk=1, enable_overlap_schedule=False)
    cls = GDNAttnBackend if FAMILIES[family] == "GDNAttnBackend" else hybrid.Mamba2AttnBackend
    linear = cls.__new__(cls)
    linear.req_to_token_pool = rig.pool
    backend = hybrid.HybridLinearAttnBackend.__new__(hybrid.HybridLinearAttnBackend)
    backend.linear_attn_backend = linear
    temporal = rig.pool.get_speculative_mamba2_params_all_layers().temporal
    temporal.copy_(torch.arange(temporal.shape[1]).view(1, -1, *[1] * (temporal.dim() - 2)))  # slot s holds s
    return rig, guard, backend


def _accepted_state(step: int, i: int, j: int) -> int:
    """What the verify wrote for batch position ``i``'s draft step ``j`` at spec step ``step``."""
    return 1000 * step + 100 * (i + 1) + j


def _spec_step(rig, guard, backend, batch, step: int, after_check=None) -> dict:
    """One spec step as a TP server runs it (module docstring); ``after_check(h)``: a fault between the check and the
    commit. What this rank saw: the commit's destinations, each request's own slot's state and the dummy slot's after
    the commit, the verdict (clean before any wait, flagged), its collectives."""
    from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
    from sglang.srt.mem_cache.allocation_sizing import page_aligned_decode_alloc_lens

    from kvguard.sglang import spec

    reqs = list(batch.reqs)
    cur, nxt, needed = page_aligned_decode_alloc_lens(reqs, reserve=RESERVE, page_size=PS)
    cur, nxt = torch.tensor(cur, dtype=torch.int32), torch.tensor(nxt, dtype=torch.int32)
    alloc_for_spec_decode(rig.tree, rig.pool, reqs=batch.reqs, req_pool_indices=batch.req_pool_indices,
                          cur_kv_lens=cur, cur_kv_lens_cpu=cur, nxt_kv_lens=nxt, nxt_kv_lens_cpu=nxt,
                          num_needed_tokens=needed, batch=batch)
    pending = batch.__dict__["_kvguard"]
    armed = isinstance(pending.batch, spec.SpecStep) and pending.batch.agreement is not None
    calls = dict(CALLS)
    spec.fire(pending, batch.seq_lens)  # where the spec worker's forward hook fires it, before the draft forward
    caches = rig.pool.get_speculative_mamba2_params_all_layers()
    h = SimpleNamespace(linear=backend.linear_attn_backend, pool=rig.pool, rows=batch.req_pool_indices, reqs=reqs,
                        temporal=caches.temporal)
    _verify_metadata(h)  # the verify's state indices, from the table as the check left it
    read = h.linear.forward_metadata.mamba_cache_indices.tolist()
    inter = caches.intermediate_ssm  # the verify's per-draft-step states
    n, s = inter.shape[1], inter.shape[2]
    inter.copy_(_accepted_state(step, torch.arange(n).view(-1, 1), torch.arange(s).view(1, -1))
                .view(1, n, s, *[1] * (inter.dim() - 3)))
    if after_check is not None:
        after_check(h)
    accepted = [(i + step) % DRAFT_TOKENS for i in range(len(reqs))]
    backend.update_mamba_state_after_mtp_verify(last_correct_step_indices=torch.tensor(accepted),
                                                mamba_track_indices=None, mamba_steps_to_track=None, model=None,
                                                req_pool_indices=h.rows)
    out = {"read": read, "dst": h.linear.forward_metadata.mamba_cache_indices.tolist(), "accepted": accepted,
           "slots": [_slot(r) for r in reqs], "own": [_state(h, _slot(r)) for r in reqs], "dummy": _state(h, 0),
           "rids": [str(r.rid) for r in reqs], "armed": armed}
    out["clean"] = bool(guard._ring.agreed_clean(pending.slot, pending.cells))  # what the result hook reads first
    flagged = guard.resolve(pending, group=dist.group.WORLD)
    guard.abort(flagged, tree_cache=rig.tree, stream=None)
    out.update(flagged=[(str(r.rid), m) for r, m, _ in flagged], **{k: CALLS[k] - calls[k] for k in CALLS})
    batch.filter_batch()
    _accept(batch, 2)  # the survivors' accepted tokens committed (what SGLang's result processing does)
    return out


def _scenario(rank: int, model_path: str, family: str, fault: str | None = None) -> dict:
    """Three requests, three spec steps; at step 1 on rank 1 only, ``fault`` (module docstring)."""
    rig, guard, backend = _spec_rig(model_path, family)
    batch = _prefill(rig, guard, 40, 35, 20)[0]
    reqs = list(batch.reqs)
    victim, other = reqs[1], reqs[0]

    def _commit_fault(h):
        h.linear.forward_metadata.mamba_cache_indices[1] = _slot(other)  # the victim's destination: other's slot

    steps = []
    for step in range(3):
        hit = rank == 1 and step == 1
        if hit and fault == "check":
            rig.pool.req_index_to_mamba_index_mapping[victim.kv.req_pool_idx] = _slot(other)
        steps.append(_spec_step(rig, guard, backend, batch, step,
                                after_check=_commit_fault if hit and fault == "commit" else None))
    return {"victim": str(victim.rid), "steps": steps, "finished": victim.finished(),
            "state_violations": guard.tracker.metrics.violations.labels(reason="state_slot")._value.get(),
            **_balance(rig, guard, reqs)}


SCENARIOS = {"clean": None, "commit": "commit", "check": "check"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """{"scenario/family": {rank: what that rank reported}}: one 2-rank launch runs every scenario on every model."""
    from faultlab.sglang_live.families import FAMILIES as MODELS
    from faultlab.sglang_live.harness import write_model

    paths = {name: write_model(str(tmp_path_factory.mktemp(name)), MODELS[name]) for name in FAMILIES}
    return two_ranks.run(_join, {f"{name}/{family}": partial(_scenario, model_path=path, family=family, fault=fault)
                                 for family, path in paths.items() for name, fault in SCENARIOS.items()}, timeout=300)


def _committed_own(s: dict, step: int, skip: int | None = None) -> None:
    """Each request of step ``s`` (but batch position ``skip``) got its own accepted state in its own slot."""
    for i, (state, acc) in enumerate(zip(s["own"], s["accepted"])):
        if i != skip:
            assert state == _accepted_state(step, i, acc), (i, s)
    assert [d for i, d in enumerate(s["dst"][:len(s["slots"])]) if i != skip] == \
        [slot for i, slot in enumerate(s["slots"]) if i != skip], s


@pytest.mark.parametrize("family", FAMILIES)
def test_a_clean_spec_run_flags_nothing_on_either_rank(ranks, family):
    for r in of(ranks, f"clean/{family}"):
        for step, s in enumerate(r["steps"]):
            assert s["armed"] and s["flagged"] == [] and s["clean"], s
            _committed_own(s, step)
            assert s["cpu_all_reduce"] == 0 and s["device_agreement"] == 2, s  # the check's and the commit's
        assert r["kept"] == 0 and r["state_violations"] == 0
        _balanced(r)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fault", ["commit", "check"])
def test_a_bad_state_slot_on_one_rank_is_redirected_and_aborted_on_both(ranks, family, fault):
    r0, r1 = of(ranks, f"{fault}/{family}")
    assert r0["victim"] == r1["victim"]
    for r in (r0, r1):
        before, hit, after = r["steps"]
        assert before["flagged"] == [] and before["clean"]
        assert hit["rids"][1] == r["victim"]
        assert [rid for rid, _ in hit["flagged"]] == [r["victim"]], hit  # exactly the victim, on both ranks
        # the commit check alone saw it (the step's agreed check verdict is clean), or the state check did
        assert hit["clean"] == (fault == "commit"), hit
        assert hit["dst"][1] == 0  # the victim's commit went to the dummy slot on both ranks (agreed)...
        assert hit["dummy"] == _accepted_state(1, 1, hit["accepted"][1])  # ...with its accepted state
        assert hit["own"][1] == _accepted_state(0, 1, before["accepted"][1])  # its own slot kept step 0's state
        _committed_own(hit, 1, skip=1)  # the others' states in their own slots (the bad destination's included)
        assert all(s["cpu_all_reduce"] == 0 and s["device_agreement"] == 2 for s in r["steps"]), r["steps"]
        assert after["rids"] == [hit["rids"][0], hit["rids"][2]]  # the same batch on both ranks
        assert after["flagged"] == [] and after["clean"]
        _committed_own(after, 2)
        assert r["finished"] and r["kept"] == 0
        _balanced(r)
    assert r1["steps"][1]["read"][1] == (0 if fault == "check" else r1["steps"][1]["slots"][1])
    assert r0["steps"][1]["read"][1] == r0["steps"][1]["slots"][1]  # rank 0's table was intact
    assert "recurrent-state slot" in r1["steps"][1]["flagged"][0][1]  # explained where it broke...
    assert "peer tensor-parallel rank" not in r1["steps"][1]["flagged"][0][1]
    assert "peer tensor-parallel rank" in r0["steps"][1]["flagged"][0][1]  # ...named a peer's on the other rank
    assert r1["state_violations"] == 1 and r0["state_violations"] == 0  # counted (and logged) where it broke only
