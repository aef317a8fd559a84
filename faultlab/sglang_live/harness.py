"""Drive a real ``sglang.Engine`` through fault episodes, one process per engine (tests, GPU harness).

    python -m faultlab.sglang_live.harness SPEC.json OUT.json

runs the engine described by ``SPEC.json`` and writes ``OUT.json`` after every episode (so a run whose
scheduler dies part-way still leaves the episodes before it). Why a process of its own: when SGLang's
scheduler raises (an out-of-range KV read, its strict idle accounting check), SGLang kills its whole
process tree, parent included; the test process must survive that to report it.

SPEC keys (all optional except ``episodes``):
``device`` ("cpu"), ``page_size`` (16), ``radix`` (true), ``overlap`` (true), ``env`` (extra environment,
e.g. ``{"KVGUARD_MODE": "check"}``, set before the engine starts: the scheduler inherits it),
``max_total_tokens`` (4096), ``dtype`` (on the CPU: "float32"; the CPU's engines sleep on idle), ``kv_dtype`` ("auto"), ``dummy_std`` (1.0; see ``FAULTLAB_SGLANG_DUMMY_INIT``), ``workload``
(``n1`` 4, ``n2`` 2, ``prefix`` 40, ``new1`` 32, ``new2`` 12, ``seed`` 0, ``wave2`` "armed"), ``model`` (a
config dict merged over :data:`TINY_LLAMA`), ``engine`` (extra ``sglang.Engine`` keyword arguments, merged
over the harness's own), ``pd`` (false; true: PD-disaggregated decode, see below), ``stream`` (false; true:
every request streams, and its record keeps ``streamed``: the tokens its client received, also when it was
aborted part-way), ``episodes``: a list of
``{"label", "fault" (null: no entry), "seed", "workload" (optional overrides of the run's workload for this
episode)}``; ``probes`` (optional): requests sent one at a time after the episodes, each ``{"rid", "new"
(max_new_tokens), "params" (sampling parameters over the harness's greedy ones)}`` on wave 1's first prompt,
recorded as ``probes`` in OUT.json the way episode requests are (a request a server turns away: its ``error``).

``pd``: the engine is a PD decode server with SGLang's fake transfer backend (:data:`PD_ENGINE`, under
``engine``); every request is sent with ``bootstrap_host`` = SGLang's ``FAKE_BOOTSTRAP_HOST`` and a
``bootstrap_room`` of its own, and faultlab plays the prefill side's KV writer (``FAULTLAB_SGLANG_PD_WRITER``,
:mod:`.pd`), so that outputs are a function of the prompts, as with a real prefill server.

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
import threading
import time

from .plan import ENV_ACCOUNTING, ENV_DUMMY, ENV_FAULTS, ENV_LOG, ENV_PD_WRITER, ENV_ROTARY

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "hidden_act": "silu",
}
# A tiny DeepSeek-V2 (multi-head latent attention, MoE) over TINY_LLAMA: write_model(folder, TINY_MLA)
TINY_MLA = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "num_key_value_heads": 4,
    "kv_lora_rank": 256, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
    "first_k_dense_replace": 2, "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": False, "scoring_func": "softmax", "attention_bias": False,
    "rope_scaling": {"rope_type": "deepseek_yarn", "factor": 1.0, "original_max_position_embeddings": 512,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
# The same as a DeepSeek-V3 with one MTP layer: SGLang's NEXTN draft (DeepseekV3ForCausalLMNextN) is the target's own
# checkpoint (speculative_draft_model_path resolves to the model path)
TINY_DEEPSEEK_MTP = {**TINY_MLA, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                     "num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
WORKLOAD = {"n1": 4, "n2": 2, "prefix": 40, "new1": 32, "new2": 12, "seed": 0, "wave2": "armed"}
# when wave 2 is sent: once the injector armed; once wave 1 finished; once wave 1 finished and the engine's
# cache was flushed (SGLang's flush_cache: the allocator's free list restarts sorted, so wave 2 gets the
# pages wave 1 held, first pages first)
WAVE2 = ("armed", "finished", "flushed")
# PD-disaggregated decode on SGLang's fake transfer backend, no retraction backup (the configuration kvguard checks)
PD_ENGINE = {"disaggregation_mode": "decode", "disaggregation_transfer_backend": "fake",
             "disaggregation_decode_retraction_backup": "none"}


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


_rooms = iter(range(1, 1 << 62))  # PD: every request's bootstrap_room, distinct over the engine's life


async def _one(engine, ids, new, rid, opts=None, sampling=None):
    """One request; what its client got: ``output_ids`` or the ``error`` (and, streaming, ``streamed``: every
    token the client received, also when the request was aborted part-way). ``sampling``: sampling parameters
    over the greedy ones."""
    opts = opts or {}
    extra = {}
    if opts.get("pd"):
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

        extra = {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": next(_rooms)}
    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True, **(sampling or {})}
    streamed = [] if opts.get("stream") else None
    try:
        if streamed is None:
            out = await engine.async_generate(input_ids=ids, rid=rid, sampling_params=params, **extra)
        else:
            out = None
            async for out in await engine.async_generate(input_ids=ids, rid=rid, sampling_params=params,
                                                         stream=True, **extra):
                streamed = _grown(streamed, out["output_ids"])
        reason = out["meta_info"].get("finish_reason") or {}
        error = reason.get("message") if reason.get("type") == "abort" else None
        output = streamed if streamed is not None else out["output_ids"]
        return {"rid": rid, "output_ids": None if error else output, "finish_reason": reason, "error": error,
                "streamed": streamed}
    except Exception as exc:  # the client's view of an aborted request (HTTP 500 as an exception)
        return {"rid": rid, "output_ids": None, "finish_reason": None, "streamed": streamed,
                "error": f"{type(exc).__name__}: {getattr(exc, 'detail', exc)}"}


def _grown(streamed: list, chunk: list) -> list:
    """The tokens streamed so far, after one more chunk (SGLang streams cumulative ids unless
    ``incremental_streaming_output``; a chunk that does not extend what came before is a segment)."""
    chunk = list(chunk)
    return chunk if chunk[:len(streamed)] == streamed else streamed + chunk


async def _wait_for(event, label, log_path, tasks, timeout=60.0):
    t0 = time.time()
    while time.time() - t0 < timeout and not all(t.done() for t in tasks):
        if any(e["event"] == event and e.get("label") == label for e in _read_log(log_path)):
            return True
        await asyncio.sleep(0.01)
    return False


async def _flush(engine, timeout=30.0):
    """SGLang's flush_cache, retried while the scheduler is not idle yet (it refuses then)."""
    t0 = time.time()
    while True:
        out = await engine.tokenizer_manager.flush_cache()
        if getattr(out, "success", True) or time.time() - t0 > timeout:
            return out
        await asyncio.sleep(0.05)


async def _episode(engine, label, wave1, wave2, workload, log_path, opts=None):
    # a0 first; the rest of wave 1 once a0 decodes (its prompt is in the radix tree then), so that
    # wave 1 shares physical prefix pages, as wave 2 does later
    first = [asyncio.ensure_future(_one(engine, wave1[0], workload["new1"], f"{label}-a0", opts))]
    await _wait_for("decoding", label, log_path, first)
    first += [asyncio.ensure_future(_one(engine, ids, workload["new1"], f"{label}-a{i}", opts))
              for i, ids in enumerate(wave1) if i > 0]
    armed = await _wait_for("armed", label, log_path, first)
    wave2_when = workload.get("wave2", "armed")
    if wave2_when in ("finished", "flushed"):
        await asyncio.wait(first)
    if wave2_when == "flushed":
        await _flush(engine)
    second = [asyncio.ensure_future(_one(engine, ids, workload["new2"], f"{label}-b{i}", opts))
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
    pd = bool(spec.get("pd", False))
    opts = {"pd": pd, "stream": bool(spec.get("stream", False))}
    plan = []
    for ep in episodes:
        w = {**workload, **ep.get("workload", {})}
        if w["wave2"] not in WAVE2:
            raise ValueError(f"episode {ep['label']!r}: workload wave2 {w['wave2']!r} is not one of {WAVE2}")
        plan.append({"fault": ep.get("fault") or "none", "seed": int(ep.get("seed", 0)),
                     "rid_prefix": f"{ep['label']}-a", "reuser_prefix": f"{ep['label']}-b",
                     "min_candidates": w["n1"], "min_reusers": w["n2"], "label": ep["label"]})
    os.environ.update({ENV_FAULTS: json.dumps(plan), ENV_LOG: log_path, ENV_ACCOUNTING: "1",
                       ENV_DUMMY: str(spec.get("dummy_std", 1.0))})
    if device == "cpu":
        os.environ[ENV_ROTARY] = "1"
    if pd:
        os.environ[ENV_PD_WRITER] = "1"
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    result = {"spec": spec, "log": log_path, "started": False, "episodes": []}

    lock = threading.Lock()  # the watchdog thread saves too

    def save():
        with lock:
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
        # NOTE: SGLang's scheduler spins a core while idle unless sleep_on_idle (it then polls its sockets, after
        # the idle housekeeping and SGLang's accounting check): on a 2-core machine running two engines at once,
        # idle spinning took the cores from the engines that had work. No KV path depends on it.
        kwargs["sleep_on_idle"] = True
    kwargs.update({**(PD_ENGINE if pd else {}), **spec.get("engine", {})})
    if device == "cpu":
        from .children import children_forked

        children_forked()
    engine = sglang.Engine(**kwargs)
    result.update(started=True, startup_s=time.time() - t)
    save()
    watchdog(result, save, engine)
    try:
        for ep in episodes:
            result["current"] = ep["label"]
            save()
            t = time.time()
            w = {**workload, **ep.get("workload", {})}
            wave1, wave2 = prompts(w, page_size)
            outs, armed = engine.loop.run_until_complete(_episode(engine, ep["label"], wave1, wave2, w, log_path,
                                                                  opts))
            end = time.time()
            record = {"label": ep["label"], "fault": ep.get("fault"), "seed": ep.get("seed", 0), "armed": armed,
                      "requests": outs, "idle_check": None, "seconds": end - t}
            result["episodes"].append(record)
            _finish_record(record, log_path)
            save()  # what the clients got, before the idle check that may kill the server
            engine.get_server_info()  # wakes a scheduler asleep on idle: its next idle check is logged (inject.py)
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
        result["current"] = "probes"
        first = prompts(workload, page_size)[0][0]
        for probe in spec.get("probes", []):
            result.setdefault("probes", []).append(engine.loop.run_until_complete(
                _one(engine, first, int(probe["new"]), probe["rid"], opts, probe.get("params"))))
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


GRACE_S = 5.0  # after a scheduler died: how long its last answers, already sent, may take to reach the clients


def watchdog(result: dict, save, engine) -> None:
    """When an SGLang child process dies (its scheduler raised), save what we have and exit 3.

    SGLang's scheduler signals its parent on a crash, but a parent blocked on a reply that never comes
    may not act on it for minutes; this thread makes a dead server a prompt, visible failure.

    NOTE: SGLang's own handler of that signal (SIGQUIT; the tokenizer manager's
    ``running_phase_sigquit_handler``, installed on the engine's event loop at its first request) kills
    this process tree at once, possibly before the episode's last answers, sent before the crash (e.g. by
    an idle accounting check that raised after the last request finished), reached their clients. It is
    replaced, through the tokenizer manager's ``signal_handler_class``, by one that only notes the signal:
    this thread then waits up to :data:`GRACE_S` for the current episode's record, saves, stops the
    engine's remaining child processes and exits.
    """
    import signal
    import threading

    import psutil
    from sglang.srt.managers.tokenizer_manager import SignalHandler

    class NotingHandler(SignalHandler):
        def running_phase_sigquit_handler(self, signum=None, frame=None):
            result.setdefault("sigquit", time.time())  # this watchdog ends the process

    manager = engine.tokenizer_manager
    manager.signal_handler_class = NotingHandler
    if manager.event_loop is not None:  # its handlers are installed already
        manager.event_loop.add_signal_handler(signal.SIGQUIT, NotingHandler(manager).running_phase_sigquit_handler)
    children = psutil.Process().children(recursive=True)

    def recorded(label):
        return label is None or any(e["label"] == label for e in result["episodes"])

    def watch():
        while True:
            time.sleep(0.2)
            if result.get("closing"):
                return
            dead = [c.pid for c in children if not c.is_running() or c.status() == psutil.STATUS_ZOMBIE]
            if dead:
                label, t0 = result.get("current"), time.time()
                while not recorded(label) and time.time() - t0 < GRACE_S:
                    time.sleep(0.05)
                result["died"] = {"during": label, "pids": dead, "time": time.time()}
                for _ in range(10):  # the main thread may be filling a record in (dict changed size)
                    try:
                        save()
                        break
                    except RuntimeError:
                        time.sleep(0.05)
                for child in children:
                    try:
                        child.kill()
                    except psutil.NoSuchProcess:
                        pass
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="faultlab-watchdog").start()


def spawn(spec: dict, folder: str, name: str, timeout: float) -> tuple[int, dict | None, str]:
    """Run one engine in a process of its own (``python -m faultlab.sglang_live.harness``), in ``folder``.

    The child gets this process's environment without any ``KVGUARD_*`` / ``FAULTLAB_SGLANG_*``, and the spec's
    ``env`` on top. Returns (return code, the result written so far or None, the last 6,000 characters of stderr).
    """
    import subprocess

    spec_path, out_path = os.path.join(folder, f"{name}.spec.json"), os.path.join(folder, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD_", "FAULTLAB_SGLANG_"))}
    # NOTE: the spec's env from the child's start: Triton reads TRITON_INTERPRET at import, and SGLang's forked
    # schedulers inherit the child's modules (a CLI sweep died at its first prefill before this)
    env.update({k: str(v) for k, v in spec.get("env", {}).items()})
    proc = subprocess.run([sys.executable, "-m", "faultlab.sglang_live.harness", spec_path, out_path],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    result = None
    if os.path.exists(out_path):
        with open(out_path) as f:
            result = json.load(f)
    return proc.returncode, result, proc.stderr[-6000:]


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
