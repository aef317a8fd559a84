"""Drive a real ``sglang.Engine`` through fault episodes, one process per engine (tests, GPU harness).

    python -m faultlab.sglang_live.harness SPEC.json OUT.json

runs the engine described by ``SPEC.json`` and writes ``OUT.json`` after every episode (so a run whose
scheduler dies part-way still leaves the episodes before it). Why a process of its own: when SGLang's
scheduler raises (an out-of-range KV read, its strict idle accounting check), SGLang kills its whole
process tree, parent included; the test process must survive that to report it.

SPEC keys (all optional except ``episodes``):
``device`` ("cpu"), ``page_size`` (16), ``radix`` (true), ``overlap`` (true), ``env`` (extra environment,
e.g. ``{"KVGUARD_MODE": "check"}``, set before the engine starts: the scheduler inherits it),
``max_total_tokens`` (4096), ``dtype`` (on the CPU: "float32"), ``kv_dtype`` ("auto"), ``dummy_std`` (1.0; see ``FAULTLAB_SGLANG_DUMMY_INIT``), ``workload``
(``n1`` 4, ``n2`` 2, ``prefix`` 40, ``new1`` 32, ``new2`` 12, ``seed`` 0), ``model`` (a config dict
merged over :data:`TINY_LLAMA`), ``episodes``: a list of ``{"label", "fault" (null: no entry), "seed",
"workload" (optional overrides of the run's workload for this episode)}``.

An episode sends wave 1 (``n1`` requests sharing a ``prefix``-token prefix, rids ``<label>-a<i>``; a0
first, the others once a0 decodes, so they share a0's prefix pages through the radix tree),
waits for the injector's ``armed`` line (a fault-free episode arms a ``none`` entry), then sends wave 2
(``n2`` requests with the same prefix and at least two pages of their own, rids ``<label>-b<i>``;
the reusers), and gathers every request's outcome: ``output_ids`` or the ``error`` the client got.
Then it waits for SGLang's idle accounting line and flushes the radix cache, so every episode starts
cold and sees the same prompts as the fault-free one. Greedy decoding, ``ignore_eos``.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time

from .plan import ENV_ACCOUNTING, ENV_DUMMY, ENV_FAULTS, ENV_LOG, ENV_ROTARY

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "hidden_act": "silu",
}
WORKLOAD = {"n1": 4, "n2": 2, "prefix": 40, "new1": 32, "new2": 12, "seed": 0}


def write_model(directory: str, overrides: dict | None = None) -> str:
    """A config-only tiny Llama (load it with ``load_format="dummy"``, ``skip_tokenizer_init=True``)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**TINY_LLAMA, **(overrides or {})}, f)
    return directory


def prompts(workload: dict, page_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Wave 1 and wave 2 token ids: one shared prefix; wave 2 has >= 2 pages past it."""
    rng = random.Random(workload["seed"])
    vocab = TINY_LLAMA["vocab_size"]

    def tokens(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = tokens(workload["prefix"])
    wave1 = [prefix + tokens(rng.randint(3, 20)) for _ in range(workload["n1"])]
    wave2 = [prefix + tokens(2 * page_size + rng.randint(1, 8)) for _ in range(workload["n2"])]
    return wave1, wave2


def _read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    # NOTE: the scheduler process appends while this reads: parse complete lines only (a line still being
    # written has no newline yet and is read again next time).
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


async def _one(engine, ids, new, rid):
    try:
        out = await engine.async_generate(input_ids=ids, rid=rid, sampling_params={
            "max_new_tokens": new, "temperature": 0.0, "ignore_eos": True})
        reason = out["meta_info"].get("finish_reason") or {}
        error = reason.get("message") if reason.get("type") == "abort" else None
        return {"rid": rid, "output_ids": out["output_ids"], "finish_reason": reason, "error": error}
    except Exception as exc:  # the client's view of an aborted request (HTTP 500 as an exception)
        return {"rid": rid, "output_ids": None, "finish_reason": None,
                "error": f"{type(exc).__name__}: {getattr(exc, 'detail', exc)}"}


async def _wait_for(event, label, log_path, tasks, timeout=60.0):
    t0 = time.time()
    while time.time() - t0 < timeout and not all(t.done() for t in tasks):
        if any(e["event"] == event and e.get("label") == label for e in _read_log(log_path)):
            return True
        await asyncio.sleep(0.01)
    return False


async def _episode(engine, label, wave1, wave2, workload, log_path):
    # a0 first; the rest of wave 1 once a0 decodes (its prompt is in the radix tree then), so that
    # wave 1 shares physical prefix pages, as wave 2 does later
    first = [asyncio.ensure_future(_one(engine, wave1[0], workload["new1"], f"{label}-a0"))]
    await _wait_for("decoding", label, log_path, first)
    first += [asyncio.ensure_future(_one(engine, ids, workload["new1"], f"{label}-a{i}"))
              for i, ids in enumerate(wave1) if i > 0]
    armed = await _wait_for("armed", label, log_path, first)
    second = [asyncio.ensure_future(_one(engine, ids, workload["new2"], f"{label}-b{i}"))
              for i, ids in enumerate(wave2)]
    results = await asyncio.gather(*first, *second)
    return results, armed


def run(spec: dict, out_path: str) -> int:
    import sglang

    device = spec.get("device", "cpu")
    page_size = int(spec.get("page_size", 16))
    workload = {**WORKLOAD, **spec.get("workload", {})}
    tmp = tempfile.mkdtemp(prefix="faultlab_sglang_")
    log_path = os.path.join(tmp, "inject.jsonl")
    model = write_model(os.path.join(tmp, "model"), spec.get("model"))
    episodes = spec["episodes"]
    plan = []
    for ep in episodes:
        plan.append({"fault": ep.get("fault") or "none", "seed": int(ep.get("seed", 0)),
                     "rid_prefix": f"{ep['label']}-a", "reuser_prefix": f"{ep['label']}-b",
                     "min_candidates": {**workload, **ep.get("workload", {})}["n1"], "label": ep["label"]})
    os.environ.update({ENV_FAULTS: json.dumps(plan), ENV_LOG: log_path, ENV_ACCOUNTING: "1",
                       ENV_DUMMY: str(spec.get("dummy_std", 1.0))})
    if device == "cpu":
        os.environ[ENV_ROTARY] = "1"
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    result = {"spec": spec, "log": log_path, "started": False, "episodes": []}

    def save():
        result["events"] = _read_log(log_path)
        with open(out_path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out_path + ".tmp", out_path)

    t = time.time()
    kwargs = dict(model_path=model, device=device, load_format="dummy", skip_tokenizer_init=True,
                  page_size=page_size, sampling_backend="pytorch",
                  max_total_tokens=int(spec.get("max_total_tokens", 4096)),
                  disable_radix_cache=not spec.get("radix", True),
                  disable_overlap_schedule=not spec.get("overlap", True),
                  log_level=spec.get("log_level", "error"), kv_cache_dtype=spec.get("kv_dtype", "auto"))
    kwargs["attention_backend"] = spec.get("attention_backend", "torch_native" if device == "cpu" else "triton")
    if device == "cpu":
        kwargs["dtype"] = spec.get("dtype", "float32")
    engine = sglang.Engine(**kwargs)
    result.update(started=True, startup_s=time.time() - t)
    save()
    watchdog(result, save)
    try:
        for ep in episodes:
            result["current"] = ep["label"]
            save()
            t = time.time()
            w = {**workload, **ep.get("workload", {})}
            wave1, wave2 = prompts(w, page_size)
            outs, armed = engine.loop.run_until_complete(_episode(engine, ep["label"], wave1, wave2, w, log_path))
            end = time.time()
            record = {"label": ep["label"], "fault": ep.get("fault"), "seed": ep.get("seed", 0), "armed": armed,
                      "requests": outs, "idle_check": None, "seconds": end - t}
            result["episodes"].append(record)
            _finish_record(record, log_path)
            save()  # what the clients got, before the idle check that may kill the server
            idle = None
            while time.time() - end < 10:
                idle = next((e for e in _read_log(log_path)[::-1]
                             if e["event"] == "idle_check" and e["time"] > end), None)
                if idle is not None:
                    break
                time.sleep(0.05)
            flushed = engine.flush_cache()
            record.update(idle_check=idle, flushed=getattr(flushed, "success", flushed))
            _finish_record(record, log_path)
            save()
        result["current"] = None
    finally:
        result["closing"] = True
        engine.shutdown()
    save()
    return 0


def _finish_record(record: dict, log_path: str) -> None:
    """The injector's lines for this episode, and its victims (ground truth from the injector)."""
    events = [e for e in _read_log(log_path) if e.get("label") == record["label"]]
    record["events"] = events
    record["victims"] = sorted({v for e in events if e["event"] == "inject" for v in e["victims"]}
                               | {e["rid"] for e in events if e["event"] == "victim"})


def watchdog(result: dict, save) -> None:
    """When an SGLang child process dies (its scheduler raised), save what we have and exit 3.

    SGLang's scheduler signals its parent on a crash, but a parent blocked on a reply that never comes
    may not act on it for minutes; this thread makes a dead server a prompt, visible failure.
    """
    import threading

    import psutil

    children = psutil.Process().children(recursive=True)

    def watch():
        while True:
            time.sleep(0.2)
            if result.get("closing"):
                return
            dead = [c.pid for c in children if not c.is_running() or c.status() == psutil.STATUS_ZOMBIE]
            if dead:
                result["died"] = {"during": result.get("current"), "pids": dead, "time": time.time()}
                save()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="faultlab-watchdog").start()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m faultlab.sglang_live.harness SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    return run(spec, argv[1])


if __name__ == "__main__":
    sys.exit(main())
