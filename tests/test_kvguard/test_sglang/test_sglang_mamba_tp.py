"""Attention TP (2 gloo ranks) on a hybrid linear-attention model: the ranks agree on whom the recurrent-state check
aborts (kvguard/sglang/mamba.py: its flags folded into the KV check's device-agreed verdict).

Each rank is a process with SGLang 0.5.23's real ``HybridReqToTokenPool`` (a tiny NemotronH's mamba2 state and a tiny
Qwen3-Next's GDN state: its ``MambaPool`` and ``MambaSlotAllocator``), paged allocator, ``UnifiedRadixCache`` with its
FULL and MAMBA components disabled (as SGLang builds it with disable_radix_cache) and real ``Req`` / ``ScheduleBatch``
objects, kvguard's hooks applied by SGLang's own plugin loader. kvguard's attention-TP agreement over the two ranks is
set where its hooks read it (``runtime._GROUP``), so SGLang's prepare_for_extend / prepare_for_decode launch and arm
every check as on a TP server; a decode check is fired by the eager forward (a scheduler whose decode forwards all go
through runners kvguard hooks) or as the batch is prepared (one whose decode graphs do not carry the check: kvguard
captures none under attention TP), its verdict resolved as the result hooks resolve it.

The bug happens on rank 1 only; rank 0's pools are intact. Ranks that dropped different requests would run different
batches and hang in their next collective, so both must abort exactly the flagged request, each releasing it safely:
rank 1 without freeing a slot handed on since, rank 0 through SGLang's normal release. Afterwards every pool balances
on both ranks. A clean run aborts nothing, and its agreed verdict reads clean before any wait.
"""
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import two_ranks
from two_ranks import load_kvguard, of

pytestmark = pytest.mark.sglang

PS = 16  # page size
FAMILY_NAMES = ("nemotron_h", "qwen3_next")  # mamba2 and GDN state


def _join(rank: int, port: int) -> None:
    """This rank's process group and kvguard's hooks (two_ranks.load_kvguard), and kvguard's agreement over the two
    ranks where the hooks read it (the rig runs no SGLang model-parallel init to look it up from)."""
    torch.set_num_threads(1)
    load_kvguard(rank, port)
    import kvguard.sglang.runtime as runtime
    from kvguard.sglang.agree import VerdictAgreement

    runtime._GROUP[:] = [(dist.group.WORLD, VerdictAgreement(dist.group.WORLD, torch.device("cpu")))]
    runtime._ONE_RANK = False


def _hybrid_rig(model_path: str, **pool_args):
    """A fresh rig on hybrid pools for the tiny model at ``model_path``, kvguard installed: (rig, guard); ``rig.pool``
    is the row pool (``pool_args``: more of HybridReqToTokenPool's arguments, e.g. its speculative buffers)."""
    from prometheus_client import CollectorRegistry
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from faultlab.sglang_live.rig import Rig

    rig = Rig(PS, radix=False)
    args = ServerArgs(model_path=model_path, page_size=PS, device="cpu", load_format="dummy",
                      skip_tokenizer_init=True, disable_radix_cache=True)
    set_global_server_args_for_scheduler(args)  # (the tree's MAMBA component reads the model's chunk size)
    cfg = mambaish_config(ModelConfig.from_server_args(args))
    layers = list(getattr(cfg, "mamba_layer_ids", None) or cfg.linear_layer_ids)
    rig.pool = rig.req_to_token_pool = HybridReqToTokenPool(
        size=16, mamba_size=8, max_context_len=512, device="cpu", enable_memory_saver=False,
        cache_params=cfg.mamba2_cache_params, mamba_layer_ids=layers, enable_mamba_extra_buffer=False,
        **{"mamba_spec_state_size": 0, **pool_args})
    rig.tree = UnifiedRadixCache(CacheInitParams(disable=True, req_to_token_pool=rig.pool,
                                                 token_to_kv_pool_allocator=rig.allocator, page_size=PS,
                                                 tree_components=(ComponentType.FULL, ComponentType.MAMBA)))
    guard = rig.install(registry=CollectorRegistry())
    guard.defer = True  # as on a scheduler whose decode forwards all go through a runner kvguard hooks
    return rig, guard


def _slot(req) -> int:
    return int(req.kv.mamba_pool_idx)


def _prefill(rig, guard, *prompt_lens: int):
    """SGLang's prepare_for_extend (kvguard's hook launches the check, agreed across the ranks), its verdict resolved
    as the prefill result hook resolves it and the flagged requests discarded: (batch, flagged, per request: flagged
    in the verdict the ranks agreed on the device)."""
    import kvguard.sglang.runtime as runtime

    batch = rig.prefill(*prompt_lens)
    pending = batch._kvguard
    _, flagged = runtime._flagged(batch, None)
    guard.discard(flagged)
    agreed = (pending.agreed.reshape(len(pending.reqs), -1) > 0).any(1).tolist()
    return batch, [(str(r.rid), m) for r, m, _ in flagged], agreed


def _step(rig, guard, batch) -> dict:
    """One decode step as a TP server runs it: armed by SGLang's prepare_for_decode (kvguard's hook, with the ranks'
    agreement) and fired by the eager forward, or fired there (``guard.defer`` off): state check, KV check, the
    agreement; resolved as the result hook resolves it, the flagged requests aborted through kvguard (SGLang's
    per-request abort, released safely)."""
    batch.prepare_for_decode()
    pending = batch._kvguard
    armed = pending.batch is not None
    if armed:  # the eager forward fires it
        guard.fire_armed(SimpleNamespace(req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                                         out_cache_loc=batch.out_cache_loc, batch_size=len(batch.reqs)))
    table = [int(rig.pool.req_index_to_mamba_index_mapping[r.kv.req_pool_idx]) for r in batch.reqs]
    clean = bool(guard._ring.agreed_clean(pending.slot, pending.cells))  # what the result hook reads before any wait
    flagged = guard.resolve(pending, group=dist.group.WORLD)
    guard.abort(flagged, tree_cache=rig.tree, stream=None)
    rig.sample(batch)
    batch.filter_batch()
    return {"flagged": [(str(r.rid), m) for r, m, _ in flagged], "clean": clean, "table": table,
            "agreed": pending.agreed is not None, "armed": armed}


def _balance(rig, guard, reqs) -> dict:
    """Every request released (the aborted ones were, by their abort); what each pool has back."""
    for req in reqs:
        if req.kv.holds_kv:
            rig.release(req)
    mamba = rig.pool.mamba_allocator
    return {"rows_free": len(rig.pool.free_slots), "rows": rig.pool.size,
            "pages_free": len(rig.allocator.get_all_free_pages()), "pages": rig.allocator.num_pages,
            "slots_free": sorted(mamba.free_slots.tolist()), "slots": rig.pool.mamba_pool.size,
            "kept": guard.mamba.kept}


def _clean(rank: int, model_path: str) -> dict:
    """No fault: three requests prefilled, a fourth joining, four decode steps."""
    rig, guard = _hybrid_rig(model_path)
    batch, first, agreed = _prefill(rig, guard, 40, 35, 20)
    steps = [_step(rig, guard, batch) for _ in range(2)]
    newcomer, second, _ = _prefill(rig, guard, 24)
    batch = rig.to_decode(batch, newcomer)
    steps += [_step(rig, guard, batch) for _ in range(2)]
    return {"prefills": [first, second], "prefill_agreed": agreed, "steps": steps, **_balance(rig, guard, batch.reqs)}


def _index_swap(rank: int, model_path: str, defer: bool = True) -> dict:
    """Rank 1 only, before decode step 1: the victim's state index names another running request's slot."""
    rig, guard = _hybrid_rig(model_path)
    guard.defer = defer
    batch = _prefill(rig, guard, 40, 35, 20)[0]
    reqs = list(batch.reqs)
    victim, other = reqs[1], reqs[0]
    steps = []
    for step in range(3):
        if rank == 1 and step == 1:  # the bug, on this rank only
            rig.pool.req_index_to_mamba_index_mapping[victim.kv.req_pool_idx] = _slot(other)
        steps.append(_step(rig, guard, batch))
    return {"victim": str(victim.rid), "steps": steps, "finished": victim.finished(), **_balance(rig, guard, reqs)}


def _slot_reuse(rank: int, model_path: str) -> dict:
    """Rank 1 only: the victim's state slot goes back on the free list while it runs (a double free's effect), and
    a newcomer's prefill is handed it; the next decode step checks both."""
    rig, guard = _hybrid_rig(model_path)
    batch = _prefill(rig, guard, 40, 35)[0]
    victim = batch.reqs[0]
    allocator = rig.pool.mamba_allocator
    if rank == 1:  # the bug, on this rank only
        allocator.free_slots = torch.cat((torch.tensor([_slot(victim)]), allocator.free_slots))
    newcomer, at_prefill, _ = _prefill(rig, guard, 24)  # its own slot and generation: its check passes
    shared = _slot(newcomer.reqs[0]) == _slot(victim)
    batch = rig.to_decode(batch, newcomer)
    reqs = list(batch.reqs)
    steps = [_step(rig, guard, batch) for _ in range(2)]
    return {"victim": str(victim.rid), "shared": shared, "at_prefill": at_prefill, "steps": steps,
            "finished": victim.finished(), **_balance(rig, guard, reqs)}


def _at_prefill(rank: int, model_path: str) -> dict:
    """Rank 1 only: SGLang's row pool writes a wrong state index for the first new request of a prefill (its alloc,
    inside prepare_for_extend); the prefill's check, launched by kvguard's prepare_for_extend hook, is resolved as the
    prefill result hook resolves it, and the flagged request discarded."""
    rig, guard = _hybrid_rig(model_path)
    pool = rig.pool
    if rank == 1:  # the bug, on this rank only
        alloc = pool.alloc

        def _broken_alloc(reqs, *args, **kwargs):
            rows = alloc(reqs, *args, **kwargs)
            pool.req_index_to_mamba_index_mapping[rows[0]] = _slot(reqs[1])
            return rows
        pool.alloc = _broken_alloc
    try:
        batch, flagged, agreed = _prefill(rig, guard, 40, 35, 20)
    finally:
        pool.__dict__.pop("alloc", None)
    victim = batch.reqs[0]
    discarded = [str(r.rid) for r in batch.reqs if r.discard_output_reason is not None]
    return {"victim": str(victim.rid), "flagged": flagged, "agreed": agreed, "discarded": discarded,
            **_balance(rig, guard, batch.reqs)}


def _index_swap_prepared(rank: int, model_path: str) -> dict:
    """As :func:`_index_swap`, each decode check fired as its batch is prepared."""
    return _index_swap(rank, model_path, defer=False)


SCENARIOS = {"clean": _clean, "index_swap": _index_swap, "index_swap_prepared": _index_swap_prepared,
             "slot_reuse": _slot_reuse, "at_prefill": _at_prefill}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """{"scenario/family": {rank: what that rank reported}}: one 2-rank launch runs every scenario on every model."""
    from faultlab.sglang_live.families import FAMILIES
    from faultlab.sglang_live.harness import write_model

    models = {name: write_model(str(tmp_path_factory.mktemp(name)), FAMILIES[name]) for name in FAMILY_NAMES}
    return two_ranks.run(_join, {f"{name}/{family}": partial(scenario, model_path=path) for family, path in
                                 models.items() for name, scenario in SCENARIOS.items()}, timeout=300)


def _balanced(r: dict) -> None:
    assert r["rows_free"] == r["rows"], r  # every row back
    assert r["pages_free"] == r["pages"], r  # every page back
    assert r["slots_free"] == list(range(1, r["slots"] + 1)), r  # every state slot back, once


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_clean_run_aborts_nothing_and_reads_clean_before_any_wait(ranks, family):
    for r in of(ranks, f"clean/{family}"):
        assert r["prefills"] == [[], []] and r["prefill_agreed"] == [False] * 3
        assert [s["flagged"] for s in r["steps"]] == [[]] * 4
        assert all(s["agreed"] and s["clean"] for s in r["steps"])  # agreed on the device, clean on both ranks
        assert r["kept"] == 0
        _balanced(r)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("fired", ["index_swap", "index_swap_prepared"])
def test_a_state_index_broken_on_one_rank_aborts_that_request_on_both(ranks, family, fired):
    r0, r1 = of(ranks, f"{fired}/{family}")
    assert r0["victim"] == r1["victim"]
    for r in (r0, r1):
        steps = r["steps"]
        assert [s["armed"] for s in steps] == [fired == "index_swap"] * 3  # fired by the forward, or as prepared
        assert steps[0]["flagged"] == [] and steps[0]["clean"]
        assert [rid for rid, _ in steps[1]["flagged"]] == [r["victim"]]  # exactly the victim, on both ranks
        # the agreed verdict carries the state flag: rank 0's own check passed, and it still reads "not clean"
        assert steps[1]["agreed"] and not steps[1]["clean"]
        assert steps[2]["flagged"] == [] and steps[2]["clean"]  # gone from the batch on both ranks: same batches
        assert len(steps[2]["table"]) == 2
        assert r["finished"] and r["kept"] == 0  # its slot was still its own: freed on both ranks
        _balanced(r)
    assert "recurrent-state slot" in r1["steps"][1]["flagged"][0][1]  # explained where it broke
    assert "peer tensor-parallel rank" in r0["steps"][1]["flagged"][0][1]
    assert r1["steps"][1]["table"][1] == 0  # rank 1's forward reads the dummy slot for the victim, never another's


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_slot_handed_on_on_one_rank_aborts_its_first_holder_on_both_and_never_frees_it_there(ranks, family):
    r0, r1 = of(ranks, f"slot_reuse/{family}")
    assert r0["victim"] == r1["victim"]
    assert r1["shared"] and not r0["shared"]  # the newcomer got the victim's slot on rank 1 only
    for r in (r0, r1):
        assert r["at_prefill"] == []
        assert r["steps"][0]["flagged"] and [rid for rid, _ in r["steps"][0]["flagged"]] == [r["victim"]]
        assert not r["steps"][0]["clean"]
        assert r["steps"][1]["flagged"] == [] and r["steps"][1]["clean"]
        assert r["finished"]
        _balanced(r)
    assert r1["kept"] == 1 and r0["kept"] == 0  # rank 1: the slot stayed with the newcomer; rank 0: freed as usual
    assert "handed to another request since" in r1["steps"][0]["flagged"][0][1]
    assert "peer tensor-parallel rank" in r0["steps"][0]["flagged"][0][1]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_state_index_broken_at_prefill_on_one_rank_is_discarded_on_both(ranks, family):
    r0, r1 = of(ranks, f"at_prefill/{family}")
    assert r0["victim"] == r1["victim"]
    for r in (r0, r1):
        assert r["agreed"] == [True, False, False]  # rank 0's own check passed: the state flag came in the agreement
        assert [rid for rid, _ in r["flagged"]] == [r["victim"]] == r["discarded"]
        _balanced(r)
    assert "recurrent-state slot" in r1["flagged"][0][1] and "peer tensor-parallel rank" in r0["flagged"][0][1]
