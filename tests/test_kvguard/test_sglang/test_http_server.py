"""The real SGLang 0.5.23 HTTP server (``python -m kvguard.sglang.launch``, as operators run it) on the CPU,
with a tiny dummy Llama, kvguard on and faultlab's injector corrupting a page mapping live; asserted is
what its clients and its ``/metrics`` show.

Two servers, SGLang's overlap scheduler on and off, start side by side (``faultlab.sglang_live.server``);
each then runs two episodes with the harness's prompts and rids (wave 1 ``<label>-a0..a3`` sharing a
40-token prefix, all sent at once; wave 2 ``<label>-b0..b1`` after the injector's ``armed`` line), every
request through the OpenAI client's ``/v1/completions`` (token-id prompts, ``rid`` in ``extra_body``),
a0, a1, b0 streaming and the others not:
* ``clean``: a fault-free episode (its outputs are the reference);
* ``swap``: ``swapped_entries`` (seed 1): the page-table entries of one logical page are exchanged
  between two candidates' rows at their 3rd decode step. The injector's log names the victims (ground
  truth, never read from kvguard); with seed 1 they are a1 (streaming) and a3 (not).
Asserted, per scheduler: each victim's client gets kvguard's error, ``kvguard: request <rid> aborted: KV page
mapping broken at position ...`` (HTTP 500 without streaming; an error event with code 500 in the stream,
after only tokens of its fault-free output); every other request's tokens equal the fault-free
episode's; ``/metrics`` counts one abort and one violation per victim; SGLang's idle accounting
is balanced after each episode; the server still serves (native ``/generate``) and SIGTERM stops it
cleanly (return code 0, its scheduler and detokenizer gone, within 30 s).

Why a tokenizer: with ``--skip-tokenizer-init`` the OpenAI endpoints answer every request with HTTP 500
(``Internal server error: 'text'``); the model directory therefore carries a word-level tokenizer over the
model's vocabulary (``server.write_model_dir``), and prompts stay token ids.
"""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from faultlab.sglang_live import harness
from faultlab.sglang_live.server import (PortTaken, Server, free_port, launch_command, plan_entry, server_env,
                                         write_model_dir)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

FAULT, SEED = "swapped_entries", 1  # seed 1: the victims are a1 and a3
STREAMING = {"a0", "a1", "b0"}  # by request index: so that victims and others each see both transports
EPISODES = [("clean", None), ("swap", FAULT)]
# NOTE: wave 1's four requests arm the injector only while they decode together. Over HTTP on a loaded
# 2-core machine (CI runs two test files at once) they reach the scheduler one by one, and with the harness's
# 32 new tokens a0 once finished before a3 arrived ("the injector never armed"); with 96 it happened again
# once (a fresh-clone CI run, no overlap): 256 tokens keep them together through a longer stagger.
WORKLOAD = {**harness.WORKLOAD, "new1": 256}
PAGE_SIZE = 16
STARTUP_TIMEOUT = 300  # both servers start together: ~60 s on an idle 2-core machine
SHUTDOWN_TIMEOUT = 30


# -- clients ----------------------------------------------------------------------------------------
class OpenAICompletions:
    """The ``engine`` of ``harness._one`` over HTTP: each request through the OpenAI client's
    ``/v1/completions``, streaming or not by its index; what each client saw is kept in ``seen``."""

    def __init__(self, url: str, model: str):
        import openai

        # max_retries=0: the client retries HTTP 500 by default, which would resend an aborted rid
        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        self.model, self.seen = model, {}

    async def async_generate(self, input_ids, rid, sampling_params):
        import openai

        stream = rid.split("-", 1)[1] in STREAMING
        seen = self.seen[rid] = {"stream": stream, "tokens": [], "status": None, "error": None}
        kwargs = dict(model=self.model, prompt=input_ids, max_tokens=sampling_params["max_new_tokens"],
                      temperature=0.0, stream=stream,
                      extra_body={"rid": rid, "ignore_eos": True, "return_token_ids": True})
        finish = None
        try:
            out = await self.client.completions.create(**kwargs)
            if stream:
                async for chunk in out:
                    for choice in chunk.choices:
                        seen["tokens"] += choice.token_ids or []
                        finish = choice.finish_reason or finish
            else:
                seen["tokens"], finish = list(out.choices[0].token_ids), out.choices[0].finish_reason
        except openai.APIStatusError as exc:  # non-streaming: the HTTP status of the response
            seen.update(status=exc.status_code, error=exc.message)
            raise
        except openai.APIError as exc:  # streaming: an error event inside a 200 response
            body = exc.body if isinstance(exc.body, dict) else {}
            seen.update(status=body.get("code"), error=exc.message)
            raise
        return {"output_ids": seen["tokens"], "meta_info": {"finish_reason": {"type": finish}}}


def _generate(url: str, ids: list[int], new: int, rid: str) -> dict:
    """SGLang's native ``/generate`` (non-streaming)."""
    import requests

    r = requests.post(f"{url}/generate", timeout=120, json={
        "input_ids": ids, "rid": rid,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}})
    return {"status": r.status_code, "body": r.json() if r.headers.get("content-type", "").startswith(
        "application/json") else r.text}


def _kvguard_metrics(url: str) -> dict[str, float]:
    """kvguard's counters on ``/metrics``, summed over labels (``kvguard_violations_total`` over reasons);
    the violations by reason too. A labelled counter no request has touched yet is absent: 0."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"violations_by_reason": {}}
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name.startswith("kvguard_") and s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
                if s.name == "kvguard_violations_total":
                    out["violations_by_reason"][s.labels.get("reason")] = s.value
    return out


# -- one episode, as the harness runs it, over HTTP -----------------------------------------------
def _flush(url: str, timeout: float = 20.0) -> bool:
    """``/flush_cache`` (refused while requests run): every episode starts with a cold radix tree."""
    import requests

    t = time.time()
    while time.time() - t < timeout:
        if requests.post(f"{url}/flush_cache", timeout=30).status_code == 200:
            return True
        time.sleep(0.2)
    return False


def _idle_check_after(log_path: str, end: float, timeout: float = 10.0) -> dict | None:
    t = time.time()
    while time.time() - t < timeout:
        idle = next((e for e in harness._read_log(log_path)[::-1]
                     if e["event"] == "idle_check" and e["time"] > end), None)
        if idle is not None:
            return idle
        time.sleep(0.05)
    return None


async def _episode(clients: OpenAICompletions, label: str, log_path: str):
    """Wave 1 (the candidates) at once, wave 2 once the injector armed; every request's outcome.

    NOTE: not harness._episode, which sends a0 first and the others once a0 decodes: over HTTP on a loaded
    2-core machine a0 finished its 32 tokens before the others reached the scheduler, so the four
    candidates never decoded together and the entry never armed (seen once, without overlap).
    """
    wave1, wave2 = harness.prompts(WORKLOAD, PAGE_SIZE)
    first = [asyncio.ensure_future(harness._one(clients, ids, WORKLOAD["new1"], f"{label}-a{i}"))
             for i, ids in enumerate(wave1)]
    armed = await harness._wait_for("armed", label, log_path, first)
    second = [asyncio.ensure_future(harness._one(clients, ids, WORKLOAD["new2"], f"{label}-b{i}"))
              for i, ids in enumerate(wave2)]
    return await asyncio.gather(*first, *second), armed


def _run_episode(server: Server, log_path: str, label: str, model: str) -> dict:
    async def go():
        clients = OpenAICompletions(server.url, model)
        try:
            outs, armed = await _episode(clients, label, log_path)
        finally:
            await clients.client.close()
        return outs, armed, clients.seen

    t = time.time()
    outs, armed, seen = asyncio.run(go())
    end = time.time()
    import requests

    requests.get(f"{server.url}/server_info", timeout=30)  # wakes a scheduler asleep on idle: its idle check is logged
    record = {"label": label, "armed": armed, "requests": outs, "seen": seen, "seconds": end - t}
    record["idle_check"] = _idle_check_after(log_path, end)
    harness._finish_record(record, log_path)  # the injector's events of this label, and its victims
    record["flushed"] = _flush(server.url)
    return record


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers (overlap on / off), started side by side; killed at the end if still running."""
    model = write_model_dir(str(tmp_path_factory.mktemp("model")))
    plan = [plan_entry(label, fault, SEED, WORKLOAD["n1"]) for label, fault in EPISODES]
    started = {}

    def start(overlap):
        d = tmp_path_factory.mktemp("overlap" if overlap else "no_overlap")
        os.mkdir(d / "prom")
        log_path, port = str(d / "inject.jsonl"), free_port()
        env = server_env(dict(os.environ), plan, log_path, str(d / "prom"))
        started[overlap] = (Server(launch_command(model, port, overlap=overlap), env, str(d), port), log_path)

    try:
        for overlap in (True, False):
            start(overlap)
        ready = {}
        for overlap in (True, False):
            for attempt in range(3):
                try:
                    ready[overlap] = started[overlap][0].wait_ready(STARTUP_TIMEOUT)
                    break
                except PortTaken as err:  # free_port() to bind is a race other processes on this machine can win
                    if attempt == 2:
                        pytest.fail(f"overlap={overlap}: {err}")
                    started[overlap][0].kill()  # what is left of it (its scheduler)
                    start(overlap)  # a fresh port, log and metrics folder
                except RuntimeError as err:
                    pytest.fail(f"overlap={overlap}: {err}")
        yield {"model": model, "servers": started, "startup_s": ready}
    finally:
        for server, _ in started.values():
            server.kill()


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "no_overlap"])
def run(request, servers):
    """Everything one server shows: both episodes, /metrics after each, a request after the fault, and
    its SIGTERM shutdown."""
    overlap = request.param
    server, log_path = servers["servers"][overlap]
    out = {"overlap": overlap, "startup_s": servers["startup_s"][overlap]}
    try:
        assert _flush(server.url), "the radix cache could not be flushed after start-up (warm-up request?)"
        for label, _ in EPISODES:
            out[label] = _run_episode(server, log_path, label, servers["model"])
            out[f"metrics_{label}"] = _kvguard_metrics(server.url)
        wave1, _ = harness.prompts(WORKLOAD, PAGE_SIZE)
        out["after"] = _generate(server.url, wave1[0], WORKLOAD["new1"], "after-a0")
        out["metrics_after"] = _kvguard_metrics(server.url)
    except Exception as exc:
        pytest.fail(f"overlap={overlap}: {type(exc).__name__}: {exc}\nserver stderr:\n{server.stderr_tail()}")
    out["shutdown"] = server.terminate(SHUTDOWN_TIMEOUT)
    out["stderr"] = server.stderr_tail()
    seen = out["swap"]["seen"]
    victims = {v: {"stream": seen[v]["stream"], "status": seen[v]["status"],
                   "tokens_before_error": len(seen[v]["tokens"])} for v in out["swap"]["victims"]}
    print(f"overlap={overlap}: startup {out['startup_s']:.1f} s; episodes "
          f"{ {label: round(out[label]['seconds'], 1) for label, _ in EPISODES} } s; victims {victims}; "
          f"metrics after the fault {out['metrics_swap']}; shutdown {out['shutdown']}")
    return out


# -- assertions -------------------------------------------------------------------------------------
def _by_index(record: dict) -> dict:
    return {r["rid"].split("-", 1)[1]: r for r in record["requests"]}


def _assert_balanced(run: dict, label: str) -> None:
    idle = run[label]["idle_check"]
    assert idle is not None, f"{label}: no idle accounting check was logged after the episode:\n{run['stderr']}"
    assert idle["balanced"], f"{label}: SGLang's pool accounting after the episode: {idle}"
    assert run[label]["flushed"], f"{label}: /flush_cache refused after the episode"


def test_fault_free_episode_completes(run):
    clean = run["clean"]
    assert clean["armed"], f"the control entry never armed: {clean['events']}"
    errors = {r["rid"]: r["error"] for r in clean["requests"] if r["error"]}
    assert errors == {}, f"fault-free episode: requests failed: {errors}"
    lengths = {i: len(r["output_ids"]) for i, r in _by_index(clean).items()}
    assert lengths == {f"a{i}": WORKLOAD["new1"] for i in range(WORKLOAD["n1"])} | {
        f"b{i}": WORKLOAD["new2"] for i in range(WORKLOAD["n2"])}, lengths
    _assert_balanced(run, "clean")


def test_victims_get_kvguard_error(run):
    ep, clean = run["swap"], _by_index(run["clean"])
    assert ep["armed"], f"{FAULT}: the injector never armed: {ep['events']}"
    victims = set(ep["victims"])
    assert len(victims) == 2, f"{FAULT}: the injector's victims: {ep['events']}"
    assert {ep["seen"][v]["stream"] for v in victims} == {True, False}, (
        f"victims {sorted(victims)} do not cover both transports: change SEED or STREAMING")
    errors = {r["rid"]: r["error"] for r in ep["requests"] if r["error"]}
    assert set(errors) == victims, f"errors {errors}, but the injector's victims are {sorted(victims)}"
    for rid in victims:
        seen, reference = ep["seen"][rid], clean[rid.split("-", 1)[1]]["output_ids"]
        how = "streaming: the error event" if seen["stream"] else "non-streaming: the HTTP status"
        assert seen["status"] == 500, f"{rid} ({how}): status {seen['status']}, error {seen['error']!r}"
        # kvguard's text (kvguard.violations.KVGuardViolation), naming the request
        assert f"kvguard: request {rid} aborted: KV page mapping broken at position " in (seen["error"] or ""), (
            f"{rid}: {seen['error']!r}")
        # no token of a broken mapping reaches the client: what streamed before the error is fault-free
        assert seen["tokens"] == reference[:len(seen["tokens"])], (rid, seen["tokens"], reference)
        assert len(seen["tokens"]) < len(reference), f"{rid}: got all its tokens and an error"


def test_other_requests_match_fault_free_episode(run):
    ep, clean = run["swap"], _by_index(run["clean"])
    others = {i: r for i, r in _by_index(ep).items() if r["rid"] not in ep["victims"]}
    assert {ep["seen"][r["rid"]]["stream"] for r in others.values()} == {True, False}
    wrong = {i: (r["error"], r["output_ids"], clean[i]["output_ids"]) for i, r in others.items()
             if r["error"] or r["output_ids"] != clean[i]["output_ids"]}
    assert wrong == {}, f"{FAULT}: non-victims differ from the fault-free episode: {wrong}"
    _assert_balanced(run, "swap")


def test_metrics_count_aborts_and_violations(run):
    before, after, n = run["metrics_clean"], run["metrics_swap"], len(run["swap"]["victims"])
    assert before.get("kvguard_checks_total", 0) > 0, f"kvguard's counters never reached /metrics: {before}"
    assert before.get("kvguard_requests_aborted_total") == 0 and before.get("kvguard_violations_total", 0) == 0, (
        f"fault-free episode: {before}")
    assert after["kvguard_checks_total"] > before["kvguard_checks_total"], after
    assert after.get("kvguard_requests_aborted_total") == n, f"{n} victims; /metrics: {after}"
    assert after.get("kvguard_violations_total", 0) == n, (
        f"one violation per flagged request: {n} victims; /metrics: {after}")


def test_server_keeps_serving(run):
    after, reference = run["after"], _by_index(run["clean"])["a0"]["output_ids"]
    assert after["status"] == 200, after
    assert after["body"]["output_ids"] == reference, (after["body"]["output_ids"], reference)
    assert run["metrics_after"].get("kvguard_requests_aborted_total") == run["metrics_swap"].get(
        "kvguard_requests_aborted_total"), (run["metrics_swap"], run["metrics_after"])


def test_sigterm_shuts_down_cleanly(run):
    down = run["shutdown"]
    assert down["rc"] is not None, f"still running {SHUTDOWN_TIMEOUT} s after SIGTERM:\n{run['stderr']}"
    assert down["rc"] == 0, f"SIGTERM: return code {down['rc']}:\n{run['stderr']}"
    assert down["alive"] == [], f"SGLang processes left after SIGTERM: {down['alive']}"
