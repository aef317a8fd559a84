"""kvguard when SGLang retracts decode requests (its answer to a full KV pool), through SGLang 0.5.23's real code.

SGLang retracts inside ``update_running_batch``, before the step is prepared: each retracted request is released
through its ``req_to_token`` row (last checked one step earlier), re-queued, and later prefilled again from its
tokens. ``SGLANG_TEST_RETRACT=1`` is SGLang's own switch for this path (a retraction every few forward steps, the
same ``retract_decode`` a full pool runs), so one engine (page 16, overlap scheduler, radix cache, the tiny dummy
Llama of faultlab.sglang_live.harness) retracts all the time, with ``KVGUARD_MODE=check``, through a fault-free
episode and one per fault class. The injector logs which requests SGLang retracted (``retract`` lines).

Asserted: no episode kills the server (before kvguard released retracted requests safely, ``swapped_entries``
leaked a page there and SGLang's strict idle check stopped it; with kvguard off the same episode stayed
balanced and returned corrupted tokens); SGLang's idle accounting is balanced after every episode; every request
that got an error is one of the injector's victims, with kvguard's error; every other request's tokens equal the
fault-free episode's, so nothing corrupted reaches a client; a victim without an error was retracted (its KV was
recomputed from its tokens before its broken mapping was read), never simply missed.
"""
from __future__ import annotations

import pytest
from live_episodes import by_index

from faultlab.sglang_live.harness import spawn
from faultlab.sglang_live.plan import DECODE_FAULTS, REUSER_FAULTS, ROW_FAULTS

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

CLASSES = list(DECODE_FAULTS + ROW_FAULTS + REUSER_FAULTS)  # every class of the aggregated serving path
SEED = 1


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    episodes = [{"label": "clean", "fault": None}] + [
        {"label": c.replace("_", ""), "fault": c, "seed": SEED} for c in CLASSES]
    spec = {"page_size": 16, "radix": True, "overlap": True, "log_level": "error", "episodes": episodes,
            "env": {"KVGUARD_MODE": "check", "SGLANG_TEST_RETRACT": "1"}}
    rc, result, stderr = spawn(spec, str(tmp_path_factory.mktemp("retract")), "retract", 540)
    if result is None or not result.get("started"):
        pytest.fail(f"sglang.Engine did not start (rc {rc}):\n{stderr}")
    return {"rc": rc, "result": result, "stderr": stderr,
            "episodes": {ep["label"]: ep for ep in result["episodes"]}}


def _retracted(ep: dict) -> set[str]:
    return {e["rid"] for e in ep["events"] if e["event"] == "retract"}


def test_the_server_lives_through_every_episode(run):
    died = run["result"].get("died")
    assert run["rc"] == 0 and not died, f"the server died (rc {run['rc']}, during {died}):\n{run['stderr']}"
    assert set(run["episodes"]) == {"clean"} | {c.replace("_", "") for c in CLASSES}


def test_sglang_retracted_requests_in_every_episode(run):
    quiet = [label for label, ep in run["episodes"].items() if not _retracted(ep)]
    assert quiet == [], f"episodes without a retraction (SGLANG_TEST_RETRACT had no effect?): {quiet}"


def test_clean_episode_no_false_aborts(run):
    ep = run["episodes"]["clean"]
    errors = {r["rid"]: r["error"] for r in ep["requests"] if r["error"]}
    assert errors == {}, f"false aborts under retraction: {errors}"
    assert (ep["idle_check"] or {}).get("balanced"), ep["idle_check"]


@pytest.mark.parametrize("fault", CLASSES)
def test_fault_under_retraction(run, fault):
    label = fault.replace("_", "")
    if label not in run["episodes"]:
        pytest.fail(f"{fault}: the episode never finished:\n{run['stderr']}")
    ep, clean = run["episodes"][label], by_index(run["episodes"]["clean"])
    assert ep["armed"], f"{fault}: the injector never armed: {ep['events']}"
    victims = set(ep["victims"])
    assert victims, f"{fault}: the injector reports no victim: {ep['events']}"
    errors = {r["rid"]: r["error"] for r in ep["requests"] if r["error"]}
    assert set(errors) <= victims, f"{fault}: errors {errors}, victims (injector's ground truth) {sorted(victims)}"
    assert all("kvguard" in msg for msg in errors.values()), errors
    wrong = {i: (r["output_ids"], clean[i]["output_ids"]) for i, r in by_index(ep).items()
             if not r["error"] and r["output_ids"] != clean[i]["output_ids"]}
    assert wrong == {}, f"{fault}: tokens that differ from the fault-free episode reached clients: {wrong}"
    missed = victims - set(errors) - _retracted(ep)
    assert missed == set(), f"{fault}: victims neither aborted nor retracted: {sorted(missed)}"
    assert (ep["idle_check"] or {}).get("balanced"), f"{fault}: SGLang's accounting afterwards: {ep['idle_check']}"


def test_kvguard_aborted_victims_under_retraction(run):
    """Retraction does not simply cure every fault: kvguard still caught some victim in most classes."""
    caught = [label for label, ep in run["episodes"].items()
              if any(r["error"] for r in ep["requests"])]
    assert len(caught) >= len(CLASSES) // 2, f"episodes with a kvguard abort: {caught}"
