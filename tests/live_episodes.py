"""Reading the records of a live SGLang engine run (faultlab.sglang_live.harness), shared by the live tests."""
import json
import random
import socket
import time

import pytest


def label_of(fault: str) -> str:
    """A fault episode's label: the fault's name without underscores."""
    return fault.replace("_", "")


def fault_episodes(faults, seed: int) -> list[dict]:
    """The harness's episodes: a fault-free one (``clean``), then one per fault (labelled :func:`label_of`)."""
    return [{"label": "clean", "fault": None, "seed": seed}] + [
        {"label": label_of(f), "fault": f, "seed": seed} for f in faults]


def episode(run: dict, label: str) -> dict:
    """The episode's record; when the server died in it before its clients got their answers, fail."""
    if label not in run["episodes"]:
        pytest.fail(run["deaths"].get(label)
                    or f"{run.get('name', 'engine')}: episode {label!r} never ran: {run['deaths']}")
    return run["episodes"][label]


def by_index(ep: dict) -> dict:
    """The episode's requests by their index in the episode (``a0``, ``b1``, ...)."""
    return {req["rid"].split("-", 1)[1]: req for req in ep["requests"]}


def assert_victims_aborted(ep: dict, fault: str, where: str = "") -> set:
    """The injector armed and struck, and exactly its victims (its ground truth) got kvguard's error; the victims."""
    assert ep["armed"], f"{fault}: the injector never armed"
    assert not [e for e in ep["events"] if e["event"] == "skipped"], ep["events"]
    victims = set(ep["victims"])
    assert victims, f"{fault}: the injector reports no victim: {ep['events']}"
    errors = {r["rid"]: r["error"] for r in ep["requests"] if r["error"]}
    injected = [e for e in ep["events"] if e["event"] == "inject"]
    assert set(errors) == victims, (f"{where}{fault}: errors {errors} but victims (injector's ground truth) "
                                    f"{sorted(victims)}; events {injected or ep['events']}")
    assert all("kvguard" in msg for msg in errors.values()), errors
    return victims


def assert_others_unchanged(clean: dict, ep: dict, victims: set, what: str = "") -> None:
    """Every request of ``ep`` other than the ``victims`` returned the tokens of its namesake (by index) in the
    fault-free episode ``clean``."""
    ref = by_index(clean)
    wrong = {i: (r["output_ids"], ref[i]["output_ids"]) for i, r in by_index(ep).items()
             if r["rid"] not in victims and r["output_ids"] != ref[i]["output_ids"]}
    assert wrong == {}, f"{what}non-victims' tokens differ from the fault-free episode: {wrong}"


def assert_balanced(run: dict, ep: dict) -> None:
    """The episode left no server death and SGLang's own idle accounting balanced."""
    if ep["label"] in run["deaths"]:  # the clients got their answers, then the scheduler died
        pytest.fail(run["deaths"][ep["label"]])
    idle = ep["idle_check"]
    assert idle is not None, f"{run['name']} {ep['label']}: no idle accounting check was logged afterwards"
    assert idle["balanced"], f"{run['name']} {ep['label']}: SGLang's pool accounting afterwards: {idle}"


def assert_exact_fault(run: dict, fault: str, reason: str | None = None) -> set:
    """A fault episode against the run's fault-free one ("clean"): exactly the injector's victims aborted (each error
    naming ``reason``, when given), every other request's tokens unchanged, the pools balanced. The victims."""
    clean, ep = episode(run, "clean"), episode(run, label_of(fault))
    victims = assert_victims_aborted(ep, fault)
    assert_others_unchanged(clean, ep, victims, f"{fault}: ")
    if reason is not None:
        assert all(reason in r["error"] for r in ep["requests"] if r["error"]), ep["requests"]
    assert_balanced(run, ep)
    return victims


def print_run(run: dict, what: str, t0: float, steps: str = "decode") -> None:
    """An engine run's summary (``pytest -s``): its start, its time, each episode's steps, victims and errors."""
    print(f"{what}: startup {run['startup_s']:.0f} s, {time.time() - t0:.0f} s in all")
    for label, ep in run["episodes"].items():
        errors = {r["rid"]: r["error"] for r in ep["requests"] if r["error"]}
        print(f"  {label}: {ep['steps']} {steps} steps, victims {ep['victims']}, errors {errors}")


def assert_clean(run: dict, label: str) -> dict:
    """A fault-free episode: no request aborted, every one answered, pools balanced."""
    ep = episode(run, label)
    errors = {r["rid"]: r["error"] for r in ep["requests"] if r["error"]}
    assert errors == {}, f"{run['name']} {label}: false aborts {errors}"
    assert all(r["output_ids"] for r in ep["requests"])
    assert_balanced(run, ep)
    return ep


def episodes_with_steps(episodes: list) -> dict:
    """The engine's episode records by label, each with ``steps``: the decode steps it ran (SGLang's step count
    at its idle check minus the previous episode's)."""
    out, previous = {}, 0
    for ep in episodes:
        steps = (ep.get("idle_check") or {}).get("decode_steps")
        ep["steps"] = None if steps is None else steps - previous
        previous = steps if steps is not None else previous
        out[ep["label"]] = ep
    return out


def engine_run(name: str, what: str, rc: int, result: dict | None, stderr: str) -> dict:
    """One engine's run (``harness.spawn``'s answer) read back: its episodes, the episode the server died in (with
    its error lines), its events; fails when the engine never started."""
    if result is None or not result.get("started"):
        pytest.fail(f"sglang.Engine ({what}) did not start (rc {rc}):\n{stderr[-4000:]}")
    died = result.get("died") or (None if rc == 0 else {"during": result.get("current")})
    deaths = {} if not died else {died.get("during"): f"server died (rc {rc}):\n" + "\n".join(
        ln for ln in stderr.splitlines()[-40:] if "Error" in ln or "kvguard" in ln)}
    return {"name": name, "episodes": episodes_with_steps(result["episodes"]), "deaths": deaths,
            "events": result.get("events", []), "stderr": stderr, "startup_s": result["startup_s"]}


def dp_plan(episodes: list) -> str:
    """A DP-attention engine's fault plan, armed per scheduler process: each DP rank's injector sees its own requests
    only (the DP controller sends them round robin), so an entry arms once 2 of them decode, not all of wave 1. An
    episode's ``tp_rank`` (optional) names the one process it strikes in (faultlab/sglang_live/inject.py)."""
    return json.dumps([{"fault": e["fault"] or "none", "seed": e.get("seed", 0), "rid_prefix": f"{e['label']}-a",
                        "reuser_prefix": f"{e['label']}-b", "min_candidates": 2, "min_reusers": 1,
                        "label": e["label"], "tp_rank": e.get("tp_rank")} for e in episodes])


def decoding_ranks(run: dict) -> set:
    """The scheduler processes that decoded (the injector's ``decoding`` lines carry their pid)."""
    return {e["pid"] for e in run["events"] if e["event"] == "decoding"}


def assert_balanced_on_every_rank(run: dict, after: float) -> None:
    """Each scheduler process's SGLang idle accounting, every check it logged after ``after`` (its own pools), is
    balanced."""
    for pid in decoding_ranks(run):
        checks = [e for e in run["events"] if e["event"] == "idle_check" and e["pid"] == pid and e["time"] > after]
        assert checks, f"rank pid {pid}: no idle accounting check logged after {after}"
        bad = [e for e in checks if not e["balanced"]]
        assert bad == [], f"rank pid {pid}: SGLang's pool accounting: {bad}"


def dp_port() -> int:
    """A ``port`` for a DP-attention engine: SGLang derives its TCP ports from it (port + 233 ..., the ZMQ channels
    between its DP controller and ranks), so two such engines started at once on the default port collide ("Address
    already in use"). A random base whose derived range binds now."""
    for _ in range(200):
        port = random.randrange(20000, 40000)
        try:
            for p in range(port + 233, port + 245):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port range for a DP-attention engine")


# A dense model whose vocabulary embedding follows the attention-TP group under DP attention, as SGLang's DP-attention
# models' do (Llama's all-reduces over the full TP group, and the ranks' gloo collectives desynchronise)
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}


def run_dp_engine(folder: str, name: str, tp_size: int, attn_dp_size: int, episodes: list, workload: dict,
              timeout: float) -> dict:
    """One CPU ``sglang.Engine`` with DP attention (``tp_size`` scheduler processes, ``attn_dp_size`` DP ranks, a
    tiny :data:`QWEN2`, eager forwards, one core per process in turn, SGLang's collectives over gloo:
    ``FAULTLAB_SGLANG_CPU_DP``), ``KVGUARD_MODE=check``, serving ``episodes`` with :func:`dp_plan`; its record
    (:func:`engine_run`)."""
    import time

    from faultlab.sglang_live.harness import spawn

    spec = {"log_level": "error", "model": QWEN2, "workload": workload, "episodes": episodes,
            "engine": {"tp_size": tp_size, "attn_dp_size": attn_dp_size, "port": dp_port()},
            "env": {"KVGUARD_MODE": "check", "FAULTLAB_SGLANG_CPU_DP": "1",
                    "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % 2) for r in range(tp_size)),
                    "FAULTLAB_SGLANG_FAULTS": dp_plan(episodes)}}
    t0 = time.time()
    rc, result, stderr = spawn(spec, folder, name, timeout)
    run = engine_run(name, f"tp_size={tp_size}, attn_dp_size={attn_dp_size}", rc, result, stderr)
    print(f"{name}: startup {run['startup_s']:.0f} s, {time.time() - t0:.0f} s in all")
    return run
