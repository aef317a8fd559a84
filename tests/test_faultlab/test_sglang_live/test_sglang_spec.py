"""SGLang 0.5.23's speculative decoding (chain 3/1/4, its spec v2 worker) on the CPU, checked by kvguard.

A real ``sglang.Engine`` per configuration, each in a process of its own (``faultlab.sglang_live.harness``; built
by :func:`faultlab.sglang_live.spec_run.engine_spec`): EAGLE with the overlap scheduler (a one-layer dummy EAGLE
draft, whose drafts the target rejects) and STANDALONE without it (a draft of the target's own config and dummy
weights, whose drafts are accepted: steps commit up to 4 tokens) on a tiny dummy Llama target (NEXTN on an MLA
model: test_sglang_spec_mla.py); SGLang's Triton
attention and its own Triton spec-tree ops under Triton's interpreter (faultlab's test-only ``cpu_spec`` shim),
``KVGUARD_MODE=check``. One engine serves a fault-free
episode, then one episode per spec fault (faultlab's live injector strikes between two spec steps, in the region
``alloc_for_spec_decode`` reserved past the committed length, and logs its victims: ground truth).

Asserted: the fault-free episode runs spec steps with no error (no false abort) and balanced pools; per fault,
exactly the injector's victims get kvguard's error, every other request's tokens equal the fault-free episode's,
and SGLang's idle accounting check (logged by the injector) is balanced afterwards. The registry's spec entries
are checked without an engine. The clean-step sweep (>= 1,000 verify steps) is ``python -m
faultlab.sglang_live.spec_run``.
"""
from __future__ import annotations

import pytest
from live_episodes import assert_victims_aborted, by_index, episode

from faultlab.sglang_live.harness import spawn
from faultlab.sglang_live.plan import SPEC_FAULTS
from faultlab.sglang_live.spec_run import WORKLOAD, engine_spec
from kvguard.sglang.paths import BY_NAME, REFUSED, facts_of, refusal

SEED = 1
ENGINE_TIMEOUT = 1200
FAULTS_ON = list(SPEC_FAULTS)  # overlap on: every spec fault
FAULTS_OFF = ["spec_region_entry"]  # overlap off: the write-guarded one (CI time: few engines, few episodes)
# (every fault also ran on STANDALONE without the overlap scheduler: python -m faultlab.sglang_live.spec_run OUT
#  --episodes 1 --no-overlap --algorithm STANDALONE --faults spec_region_entry,rejected_page_freed,draft_slot_reused)


def _run(tmp_path_factory, name: str, overlap: bool, faults: list, algorithm: str) -> dict:
    folder = tmp_path_factory.mktemp(name)
    episodes = [{"label": "clean", "fault": None}] + [{"label": f.replace("_", ""), "fault": f, "seed": SEED}
                                                       for f in faults]
    rc, result, stderr = spawn(engine_spec(str(folder), overlap=overlap, mode="check", episodes=episodes,
                                           algorithm=algorithm),
                               str(folder), name, ENGINE_TIMEOUT)
    if result is None or not result.get("started"):
        pytest.fail(f"{name}: the spec engine did not start (rc {rc}): {stderr}")
    died = result.get("died")
    deaths = {died["during"]: f"{name}: the server died during {died['during']}: {stderr}"} if died else {}
    return {"name": name, "episodes": {e["label"]: e for e in result["episodes"]}, "deaths": deaths}


@pytest.fixture(scope="module")
def spec_on(tmp_path_factory):
    return _run(tmp_path_factory, "spec_overlap", True, FAULTS_ON, "EAGLE")


@pytest.fixture(scope="module")
def spec_off(tmp_path_factory):
    return _run(tmp_path_factory, "spec_normal", False, FAULTS_OFF, "STANDALONE")


def _engine(request, which):
    return request.getfixturevalue(which)


@pytest.mark.sglang
@pytest.mark.timeout(ENGINE_TIMEOUT)
@pytest.mark.parametrize("which", ["spec_on", "spec_off"])
def test_clean_spec_steps_have_no_false_abort(request, which):
    run = _engine(request, which)
    ep = episode(run, "clean")
    errors = {r["rid"]: r["error"] for r in ep["requests"] if r["error"]}
    assert not errors, f"{which}: false aborts over clean spec steps: {errors}"
    assert all(len(r["output_ids"]) == WORKLOAD["new1"] for r in ep["requests"]), ep["requests"]
    assert ep["idle_check"] and ep["idle_check"]["balanced"], ep["idle_check"]
    assert ep["idle_check"]["decode_steps"] >= 3, ep["idle_check"]  # spec steps ran (prepare_for_decode calls)
    if which == "spec_off":  # STANDALONE's drafts are accepted: fewer verify steps than tokens
        assert ep["idle_check"]["decode_steps"] < WORKLOAD["new1"] - 1, ep["idle_check"]


@pytest.mark.sglang
@pytest.mark.timeout(ENGINE_TIMEOUT)
@pytest.mark.parametrize("which,fault", [("spec_on", f) for f in FAULTS_ON] + [("spec_off", f) for f in FAULTS_OFF])
def test_spec_fault_caught_only_victims_aborted(request, which, fault):
    run = _engine(request, which)
    clean = by_index(episode(run, "clean"))
    ep = episode(run, fault.replace("_", ""))
    victims = assert_victims_aborted(ep, fault, f"{which}: ")
    for key, req in by_index(ep).items():
        if req["rid"] in victims:
            continue
        assert req["output_ids"] == clean[key]["output_ids"], \
            f"{which} {fault}: {req['rid']} differs from the fault-free run (victims {sorted(victims)})"
    assert ep["idle_check"] and ep["idle_check"]["balanced"], f"{which} {fault}: pools unbalanced: {ep['idle_check']}"


class _Args:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE"])
def test_chain_drafting_is_checked(algorithm):
    facts = facts_of(_Args(speculative_algorithm=algorithm, speculative_eagle_topk=1))
    assert refusal(facts) is None
    assert BY_NAME["speculative_decoding"].applies(facts)


@pytest.mark.parametrize("args,path", [
    ({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 4}, "speculative_tree_drafting"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 1}, "speculative_other_algorithms"),
    ({"speculative_algorithm": "FROZEN_KV_MTP"}, "speculative_other_algorithms"),
    ({"speculative_algorithm": "DFLASH"}, "speculative_other_algorithms"),
    ({"speculative_algorithm": "EAGLE", "enable_multi_layer_eagle": True}, "speculative_multi_layer_eagle"),
])
def test_unchecked_spec_configurations_are_refused(args, path):
    facts = facts_of(_Args(**args))
    assert BY_NAME[path].status == REFUSED and BY_NAME[path].applies(facts)
    message = refusal(facts)
    assert message is not None and path in message
    assert not BY_NAME["speculative_decoding"].applies(facts)
