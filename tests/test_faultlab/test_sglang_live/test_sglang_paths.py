"""kvguard on SGLang 0.5.23's serving paths beyond the plain one, each through SGLang's real code on the CPU.

kvguard's path registry (kvguard/sglang/paths.py) names this file as the evidence for ``pd_decode``,
``chunked_prefill``, ``mixed_chunk`` and ``mla``; it also runs the owner-identity class
``stale_batch_row``. One ``sglang.Engine`` per configuration, in a process of its own
(faultlab.sglang_live.harness, as in test_sglang_engine.py), serves many episodes: fault-free ones and
one per fault class, the injector's victims being ground truth (never read from kvguard).

Configurations (``KVGUARD_MODE=check`` unless said otherwise):

* ``pd``: PD-disaggregated decode, SGLang's fake transfer backend, requests with SGLang's fake bootstrap
  host and a bootstrap room each. faultlab plays the prefill side's KV writer (faultlab/sglang_live/pd.py:
  deterministic prompt K/V and handoff token, then kvguard's transfer stamp), so outputs are a function
  of the prompts. Fault-free episodes (>= 1,000 decode steps in all with FAULTLAB_PD_SOAK=2), decode-time classes, and
  ``late_transfer_write``: a finished request's transfer lands late in pages SGLang handed to a later
  request (wave 2 is sent once wave 1 finished and the cache was flushed, so it gets wave 1's pages).
  Clients stream, so what a victim received before its abort is checked too.
* ``pd_off``: the same with ``KVGUARD_MODE=off``: the late write is real (the victim's tokens change,
  nobody gets an error).
* ``chunked``: ``chunked_prefill_size=32`` with prompts of 43 to 80 tokens; ``mixed``: the same with
  ``enable_mixed_chunk=True``; ``mla``: a tiny DeepSeek-V2 (multi-head latent attention). Each runs a
  fault-free episode, ``swapped_entries``, ``index_shift``, ``premature_free`` and ``stale_batch_row``.

Asserted per fault episode: exactly the injector's victims get a kvguard error, every other request's
output tokens equal a fault-free episode's on the same engine, no decode step ran two requests on one
row, and SGLang's idle accounting is balanced afterwards. Per fault-free episode: no request aborted.

NOTE on MLA: SGLang's torch_native backend cannot run DeepSeek's MHA prefill (it reads K from the latent
cache: "Expected size for first two dimensions of batch2 tensor to be: [4, 32] but got: [4, 48]"), so the
``mla`` engine prefills with SGLang's Triton backend, interpreted on the CPU (TRITON_INTERPRET=1), and
decodes with torch_native. Its latent width is 256 + 32 (a width the Triton decode kernel handles
explicitly; 32 + 16 fails there with a shape error).
"""
from __future__ import annotations

import os
import time

import pytest
from live_episodes import (assert_balanced as _assert_balanced, assert_clean as _assert_clean,  # noqa: F401
                           assert_victims_aborted, by_index as _by_index, episode as _episode, episodes_with_steps)

from faultlab.sglang_live.harness import TINY_MLA

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

SEED = 1
ENGINE_TIMEOUT = 540
CLASSES = ["swapped_entries", "index_shift", "premature_free", "stale_batch_row"]
PD_CLASSES = ["swapped_entries", "index_shift"]  # premature_free etc. strike at alloc_for_extend: not in PD decode
PD_SOAK = {"n1": 8, "n2": 4, "new1": 200, "new2": 150, "wave2": "finished"}
# The soak (>= 1,000 fault-free decode steps in all) runs from the command line, on the same engine:
# FAULTLAB_PD_SOAK=2 pytest tests/test_faultlab/test_sglang_live/test_sglang_paths.py -k pd_clean -s
PD_SOAKS = int(os.environ.get("FAULTLAB_PD_SOAK", "0"))  # ~550 decode steps each (PD decode admits 7 of wave 1's 8
# at once: it reserves decode room)
FLUSHED = {"wave2": "flushed"}
CHUNKED = {"chunked_prefill_size": 32}
# prompts longer than one chunk: wave 1 43-60 tokens, wave 2 73-80
CHUNK_WORKLOAD = {"new1": 24, "new2": 10}


def _label(fault: str) -> str:
    return fault.replace("_", "")


def _ep(label: str, fault: str | None = None, **workload) -> dict:
    ep = {"label": label, "fault": fault, "seed": SEED}
    if workload:
        ep["workload"] = workload
    return ep


def _run(tmp_path_factory, name: str, spec: dict, episodes: list[dict]) -> dict:
    """Every episode on one engine; after an episode that killed it, the rest on a fresh one (clean first)."""
    from faultlab.sglang_live.harness import spawn

    folder = str(tmp_path_factory.mktemp(name))
    todo, eps, deaths, runs, t0 = list(episodes), {}, {}, [], time.time()
    for attempt in range(3):
        rc, result, stderr = spawn({"log_level": "error", **spec, "episodes": todo}, folder, f"{name}{attempt}",
                                   ENGINE_TIMEOUT)
        if result is None or not result.get("started"):
            pytest.fail(f"{name}: sglang.Engine did not start (rc {rc}):\n{stderr}")
        runs.append({"rc": rc, "startup_s": result["startup_s"], "events": result.get("events", [])})
        eps.update(episodes_with_steps(result["episodes"]))
        died = result.get("died") or (None if rc == 0 else {"during": result.get("current")})
        if not died:
            break
        lines = [ln for ln in stderr.splitlines() if "Error" in ln or "kvguard" in ln]
        deaths[died.get("during")] = f"server died (rc {rc}) during {died.get('during')!r}:\n" + "\n".join(lines[-6:])
        rest = [e for e in todo if e["label"] not in eps and e["label"] != died.get("during")]
        if not rest:
            break
        todo = [episodes[0]] + rest
    run = {"name": name, "episodes": eps, "deaths": deaths, "runs": runs, "seconds": time.time() - t0}
    print(_summary(run))
    return run


def _summary(run: dict) -> str:
    """One line per episode: victims aborted / victims, non-victims' mismatches (vs 'clean'), errors, steps."""
    lines = [f"{run['name']}: {len(run['episodes'])} episodes, {run['seconds']:.0f} s, startup "
             + ", ".join(f"{r['startup_s']:.0f} s" for r in run["runs"]) + f", deaths {sorted(run['deaths'])}"]
    for label, ep in run["episodes"].items():
        victims = set(ep["victims"])
        errors = {r["rid"] for r in ep["requests"] if r["error"]}
        lines.append(f"  {label}: victims aborted {len(victims & errors)}/{len(victims)}, other errors "
                     f"{len(errors - victims)}, decode steps {ep['steps']}, {ep['seconds']:.1f} s")
    return "\n".join(lines)


def _events(ep: dict, kind: str) -> list[dict]:
    return [e for e in ep["events"] if e["event"] == kind]


def _mismatches(ep: dict, clean: dict, victims: set) -> dict:
    ref = _by_index(clean)
    return {i: (r["output_ids"], ref[i]["output_ids"]) for i, r in _by_index(ep).items()
            if r["rid"] not in victims and r["output_ids"] != ref[i]["output_ids"]}


def _assert_fault(run: dict, fault: str, clean_label: str = "clean", balanced: bool = True) -> dict:
    clean = _episode(run, clean_label)
    ep = _episode(run, _label(fault))
    victims = assert_victims_aborted(ep, fault, f"{run['name']} ")
    wrong = _mismatches(ep, clean, victims)
    assert wrong == {}, f"{run['name']} {fault}: non-victims' tokens differ from {clean_label!r}: {wrong}"
    assert _events(ep, "shared_row") == [], f"{fault}: decode steps prepared with a shared row"
    if balanced:
        _assert_balanced(run, ep)
    return ep


def _pools(run: dict) -> set[str]:
    return {e["kv_pool"] for r in run["runs"] for e in r["events"] if e["event"] == "pools"}


# ------------------------------------------------------------------------------------------------
# Engines (one process each, module-scoped)
# ------------------------------------------------------------------------------------------------
def _pd_spec(mode: str) -> dict:
    # NOTE: no shared prefix: a late write of A's K/V into B's page then always differs from B's own K/V
    # (with a shared prefix, A's and B's K/V at one prefix position are equal by construction).
    return {"pd": True, "stream": True, "env": {"KVGUARD_MODE": mode}, "workload": {"prefix": 0}}


def _late() -> dict:
    # last on its engine: wave 2 after wave 1 finished and a flush, so SGLang hands wave 2 wave 1's pages
    return _ep(_label("late_transfer_write"), "late_transfer_write", **FLUSHED)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    episodes = ([_ep("clean")] + [_ep(f"soak{i}", **PD_SOAK) for i in range(PD_SOAKS)]
                + [_ep(_label(c), c) for c in PD_CLASSES]
                + [_ep("cleanflushed", **FLUSHED), _late()])
    return _run(tmp_path_factory, "pd", _pd_spec("check"), episodes)


@pytest.fixture(scope="module")
def pd_off(tmp_path_factory):
    episodes = [_ep("cleanflushed", **FLUSHED), _late()]
    return _run(tmp_path_factory, "pd_off", _pd_spec("off"), episodes)


def _engine(tmp_path_factory, name: str, engine: dict, **spec) -> dict:
    episodes = [_ep("clean")] + [_ep(_label(c), c) for c in CLASSES]
    base = {"env": {"KVGUARD_MODE": "check", **spec.pop("env", {})}, "engine": engine,
            "workload": CHUNK_WORKLOAD, **spec}
    return _run(tmp_path_factory, name, base, episodes)


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    return _engine(tmp_path_factory, "chunked", CHUNKED)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return _engine(tmp_path_factory, "mixed", {**CHUNKED, "enable_mixed_chunk": True})


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    return _engine(tmp_path_factory, "mla", {"prefill_attention_backend": "triton",
                                             "decode_attention_backend": "torch_native"},
                   model=TINY_MLA, env={"TRITON_INTERPRET": "1"})


# ------------------------------------------------------------------------------------------------
# PD-disaggregated decode
# ------------------------------------------------------------------------------------------------
def test_pd_clean_episodes_no_false_aborts(pd):
    labels = ["clean"] + [f"soak{i}" for i in range(PD_SOAKS)] + ["cleanflushed"]
    eps = [_assert_clean(pd, label) for label in labels]
    soak = [{i: r["output_ids"] for i, r in _by_index(_episode(pd, f"soak{i}")).items()} for i in range(PD_SOAKS)]
    assert all(s == soak[0] for s in soak), "fault-free soak episodes decoded different tokens"
    assert _mismatches(_episode(pd, "cleanflushed"), _episode(pd, "clean"), set()) == {}, (
        "wave 2 after a flush decoded other tokens than wave 2 alongside wave 1: outputs depend on placement")
    # every request went through SGLang's PD transfer path, written and stamped by faultlab's writer
    for ep in eps:
        stamped = {e["rid"] for e in _events(ep, "transfer") if e["ticket"]}
        assert stamped == {r["rid"] for r in ep["requests"]}, f"{ep['label']}: transfers {stamped}"
    steps = sum(ep["steps"] for ep in eps)
    print(f"pd: {steps} fault-free decode steps, no false abort")
    assert steps >= (1000 if PD_SOAKS >= 2 else 20), f"only {steps} fault-free decode steps"


@pytest.mark.parametrize("fault", PD_CLASSES)
def test_pd_decode_fault_exactly_victims_aborted(pd, fault):
    _assert_fault(pd, fault)


def test_pd_late_transfer_write_is_real_with_kvguard_off(pd_off):
    clean, ep = _episode(pd_off, "cleanflushed"), _episode(pd_off, "latetransferwrite")
    [inject] = _events(ep, "inject")
    assert not inject["stamped"]  # no ticket: kvguard is off
    errors = {r["rid"]: r["error"] for r in ep["requests"] if r["error"]}
    assert errors == {}, f"with kvguard off nobody is aborted, got {errors}"
    victims = set(ep["victims"])
    assert victims and _mismatches(ep, clean, victims) == {}
    ref = _by_index(clean)
    changed = {r["rid"] for i, r in _by_index(ep).items() if r["rid"] in victims
               and r["output_ids"] != ref[i]["output_ids"]}
    assert changed == victims, f"victims {sorted(victims)}, tokens changed: {sorted(changed)}"


# ------------------------------------------------------------------------------------------------
# Chunked prefill, mixed chunk, MLA
# ------------------------------------------------------------------------------------------------
def _idle(run: dict, label: str) -> dict:
    return _episode(run, label)["idle_check"] or {}


def test_chunked_prefill_clean(chunked):
    _assert_clean(chunked, "clean")
    assert _idle(chunked, "clean").get("chunk_continuations", 0) > 0, "no prefill was chunked"


@pytest.mark.parametrize("fault", CLASSES)
def test_chunked_prefill_fault(chunked, fault):
    _assert_fault(chunked, fault)


def test_mixed_chunk_clean(mixed):
    _assert_clean(mixed, "clean")
    idle = _idle(mixed, "clean")
    assert idle.get("chunk_continuations", 0) > 0 and idle.get("mixed_batches", 0) > 0, idle


@pytest.mark.parametrize("fault", CLASSES)
def test_mixed_chunk_fault(mixed, fault):
    _assert_fault(mixed, fault)


def test_mla_clean(mla):
    _assert_clean(mla, "clean")
    assert _pools(mla) == {"MLATokenToKVPool"}, _pools(mla)


@pytest.mark.parametrize("fault", CLASSES)
def test_mla_fault(mla, fault):
    _assert_fault(mla, fault)


# ------------------------------------------------------------------------------------------------
# The new classes' plan and the PD writer's values, without an engine
# ------------------------------------------------------------------------------------------------
def test_new_classes_parse_and_draw_from_the_seed():
    from faultlab.sglang_live.plan import parse_plan

    [late, again, row] = parse_plan('[{"fault": "late_transfer_write", "seed": 4, "min_reusers": 3}, '
                                    '{"fault": "late_transfer_write", "seed": 4}, {"fault": "stale_batch_row"}]')
    assert late.min_reusers == 3 and late.reuser_step in (1, 2) and late.reuser_step == again.reuser_step
    assert row.fault == "stale_batch_row" and row.reuser_step == 0


def test_pd_writer_values_are_a_pure_function_of_token_position_layer():
    import torch

    from faultlab.sglang_live import pd

    k1, v1 = pd.kv_values([5, 7, 5], [0, 1, 2], 0, 2, 8, 8, 100)  # [3, 2, 8] each
    k2, _ = pd.kv_values([5], [0], 0, 2, 8, 8, 100)
    k3, _ = pd.kv_values([5], [0], 1, 2, 8, 8, 100)
    assert k1.shape == v1.shape == (3, 2, 8) and torch.equal(k1[:1], k2)
    assert not torch.equal(k1[0], k1[2]) and not torch.equal(k2, k3)  # position and layer matter
    assert pd.handoff_token([4, 5, 6], 100) == pd.handoff_token([4, 5, 6], 100) != pd.handoff_token([4, 5], 100)
    assert 3 <= pd.handoff_token([4, 5, 6], 100) < 100


def test_streamed_tokens_cumulative_or_segments():
    from faultlab.sglang_live.harness import _grown

    assert _grown(_grown([], [1]), [1, 2]) == [1, 2]  # cumulative chunks
    assert _grown([1, 2], [3]) == [1, 2, 3]  # a segment


# ------------------------------------------------------------------------------------------------
# PD decode: late_transfer_write with kvguard on
# ------------------------------------------------------------------------------------------------
def test_pd_late_transfer_write_aborts_the_new_owner(pd):
    """Last in the file: it fails while kvguard's release of the aborted owner leaks the late-stamped page."""
    ep = _assert_fault(pd, "late_transfer_write", "cleanflushed", balanced=False)
    [inject] = _events(ep, "inject")
    assert inject["stamped"] and inject["reused"], inject
    late = inject["late"]
    assert late.startswith("latetransferwrite-a") and all(v.startswith("latetransferwrite-b") for v in ep["victims"])
    assert _by_index(ep)[late.split("-", 1)[1]]["error"] is None  # A itself finished long before
    # nothing computed from the overwritten KV reached a victim's client: what it streamed before its abort
    # is the fault-free run's, and no more than the tokens computed before the late write (its handoff token
    # and decode tokens, one of them possibly still in flight under the overlap scheduler)
    clean = _by_index(_episode(pd, "cleanflushed"))
    for i, r in _by_index(ep).items():
        if r["rid"] in ep["victims"]:
            streamed = r["streamed"]
            assert streamed and streamed == clean[i]["output_ids"][:len(streamed)], (r["rid"], streamed)
            assert len(streamed) <= inject["step"] + 1, (r["rid"], streamed, inject["step"])
    _assert_balanced(pd, ep)  # the aborted owner's pages, the late-stamped one included, went back
