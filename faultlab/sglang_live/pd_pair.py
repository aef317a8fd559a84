"""A PD-disaggregated pair on the CPU over SGLang's Mooncake backend (TCP): a prefill and a decode ``sglang.Engine``,
each in a process of its own, driven as SGLang's router drives them (tests only).

    python -m faultlab.sglang_live.pd_pair ROLE SPEC.json

runs one role (``prefill``: it also runs SGLang's bootstrap server; ``decode``) and serves JSON lines on stdin:
``{"op": "gen", "rid", "ids", "new", "room"}`` (a greedy request naming the prefill's bootstrap address and room;
answered by ``{"op": "gen", "rid", "output_ids", "error"}``), ``{"op": "abort", "rid"}`` (SGLang's
``abort_request``), ``{"op": "wake"}`` (its internal state: a scheduler asleep on idle wakes and logs its idle
accounting check) and ``{"op": "quit"}``. :class:`Pair` starts both and sends every request to both with one
bootstrap room, as SGLang's router does; the decode server's answer is the client's.

SPEC keys: ``model`` (a folder :func:`.harness.write_model` wrote), ``bootstrap_port``, ``port`` (SGLang's
port of this engine), ``env`` (extra environment: ``KVGUARD_MODE``, a fault plan, ...), ``engine`` (extra
``sglang.Engine`` keyword arguments). Every engine: the tiny dummy Llama, page size 1, the overlap scheduler off
(SGLang's prefill path under overlap records CUDA events), ``MOONCAKE_PROTOCOL=tcp``, faultlab's CPU shims
(:mod:`.cpu_rotary`, :mod:`.cpu_pd`), its scheduler and detokenizer forked (:mod:`.children`).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

from .plan import ENV_ACCOUNTING, ENV_DUMMY, ENV_LOG, ENV_ROTARY

BASE_ENV = {ENV_ROTARY: "1", "FAULTLAB_SGLANG_CPU_PD": "1", ENV_ACCOUNTING: "1", ENV_DUMMY: "1.0",
            "MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1", "SGLANG_HOST_IP": "127.0.0.1"}


def _engine(role: str, spec: dict):
    import sglang

    kwargs = dict(model_path=spec["model"], device="cpu", load_format="dummy", skip_tokenizer_init=True,
                  page_size=1, sampling_backend="pytorch", attention_backend="torch_native", dtype="float32",
                  sleep_on_idle=True, max_total_tokens=int(spec.get("max_total_tokens", 2048)),
                  log_level=spec.get("log_level", "error"), port=int(spec["port"]), disable_overlap_schedule=True,
                  disaggregation_mode=role, disaggregation_transfer_backend="mooncake",
                  disaggregation_bootstrap_port=int(spec["bootstrap_port"]))
    if role == "decode":
        kwargs["disaggregation_decode_retraction_backup"] = "none"
    kwargs.update(spec.get("engine", {}))
    from .children import children_forked

    children_forked()
    return sglang.Engine(**kwargs)


def serve(role: str, spec: dict) -> None:
    engine = _engine(role, spec)
    port = int(spec["bootstrap_port"])
    _say({"op": "ready", "role": role})

    async def gen(r):
        params = {"max_new_tokens": r["new"], "temperature": 0.0, "ignore_eos": True}
        try:
            out = await engine.async_generate(input_ids=r["ids"], rid=r["rid"], sampling_params=params,
                                              bootstrap_host="127.0.0.1", bootstrap_port=port,
                                              bootstrap_room=r["room"])
            reason = out["meta_info"].get("finish_reason") or {}
            error = reason.get("message") if reason.get("type") == "abort" else None
            _say({"op": "gen", "rid": r["rid"], "output_ids": None if error else out["output_ids"], "error": error})
        except Exception as exc:  # the client's view of an aborted request
            _say({"op": "gen", "rid": r["rid"], "output_ids": None,
                  "error": f"{type(exc).__name__}: {getattr(exc, 'detail', exc)}"})

    async def loop():
        reader = asyncio.StreamReader()
        await engine.loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        tasks = []
        while line := await reader.readline():
            r = json.loads(line)
            if r["op"] == "gen":
                tasks.append(asyncio.ensure_future(gen(r)))
            elif r["op"] == "abort":
                engine.tokenizer_manager.abort_request(rid=r["rid"])
            elif r["op"] == "wake":
                await engine.tokenizer_manager.get_internal_state()  # (Engine.get_server_info, inside the loop)
                _say({"op": "wake"})
            elif r["op"] == "quit":
                break
        await asyncio.gather(*tasks)

    try:
        engine.loop.run_until_complete(loop())
    finally:
        engine.shutdown()


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Role:
    """One engine process, its answers gathered by a reader thread."""

    def __init__(self, role: str, spec: dict, folder: str):
        self.role, self.log = role, os.path.join(folder, f"{role}.jsonl")
        path = os.path.join(folder, f"{role}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        env = {**os.environ, **BASE_ENV, ENV_LOG: self.log, **spec.get("env", {})}
        self.stderr = open(os.path.join(folder, f"{role}.stderr"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "faultlab.sglang_live.pd_pair", role, path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env,
                                     text=True)
        self.lines: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                pass

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def wait(self, test, timeout: float, what: str):
        t0 = time.time()
        while time.time() - t0 < timeout:
            found = [x for x in self.lines if test(x)]
            if found:
                return found
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.role} engine exited ({self.proc.returncode}) waiting for {what}")
            time.sleep(0.05)
        raise TimeoutError(f"the {self.role} engine: no {what} in {timeout} s")

    def events(self) -> list[dict]:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()  # SGLang's engine kills its scheduler processes on SIGTERM
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
        self.stderr.close()


class Pair:
    """A prefill and a decode server; ``generate`` sends each request to both, as SGLang's router does."""

    def __init__(self, folder: str, prefill_env: dict, decode_env: dict, base_port: int = 31000,
                 engine: dict | None = None, prefill_spec: dict | None = None, decode_spec: dict | None = None):
        """``engine``: sglang.Engine settings of both servers (e.g. the transfer backend; Mooncake by default);
        ``prefill_spec``, ``decode_spec``: SPEC keys of one server alone (e.g. ``max_total_tokens``; an ``engine``
        there adds to the common one)."""
        from .harness import write_model

        model = write_model(os.path.join(folder, "model"))
        common = {"model": model, "bootstrap_port": base_port + 998}

        def spec(port: int, env: dict, own: dict | None, **more) -> dict:
            own = dict(own or {})
            return {**common, "port": port, "env": env, **more, **own,
                    "engine": {**(engine or {}), **own.get("engine", {})}}

        self.prefill = Role("prefill", spec(base_port, prefill_env, prefill_spec), folder)
        # (the decode server logs warnings: SGLang's deferred-release timeout and kvguard's hold are warnings)
        self.decode = Role("decode", spec(base_port + 2000, decode_env, decode_spec, log_level="warning"), folder)
        self._room, self._aborted = 1000, set()
        for role in (self.prefill, self.decode):
            role.wait(lambda x: x.get("op") == "ready", 900, "start")

    def send(self, request: tuple[str, list[int], int]) -> None:
        """Send (rid, prompt ids, max_new_tokens) to both servers with a bootstrap room of its own."""
        rid, ids, new = request
        self._room += 1
        r = {"op": "gen", "rid": rid, "ids": ids, "new": new, "room": self._room}
        self.prefill.send(r)
        self.decode.send(r)

    def generate(self, requests: list[tuple[str, list[int], int]], timeout: float = 300.0) -> dict[str, dict]:
        """Send each request to both servers; the decode server's answers by rid."""
        for request in requests:
            self.send(request)
        return self.answers([rid for rid, _, _ in requests], timeout)

    def answers(self, rids: list[str], timeout: float = 300.0) -> dict[str, dict]:
        want = set(rids)

        def done(_):
            # NOTE: as SGLang's router does, a request the prefill server failed is aborted on the decode server
            # (SGLang's prefill does not tell the decode side: it would wait SGLANG_DISAGGREGATION_WAITING_TIMEOUT)
            for x in self.prefill.lines:
                if x.get("op") == "gen" and x["rid"] in want and x["error"] and x["rid"] not in self._aborted:
                    self._aborted.add(x["rid"])
                    self.decode.send({"op": "abort", "rid": x["rid"]})
            return {y["rid"] for y in self.decode.lines if y.get("op") == "gen"} >= want

        self.decode.wait(done, timeout, f"answers for {sorted(want)}")
        return {x["rid"]: x for x in self.decode.lines if x.get("op") == "gen" and x["rid"] in want}

    def prefill_answers(self) -> dict[str, dict]:
        """What the prefill server answered, by rid."""
        return {x["rid"]: x for x in self.prefill.lines if x.get("op") == "gen"}

    def idle_checks(self, since: float) -> dict[str, dict | None]:
        """Each server's first idle accounting check logged after ``since`` (woken first)."""
        out = {}
        for role in (self.prefill, self.decode):
            role.send({"op": "wake"})
            check, t0 = None, time.time()
            while check is None and time.time() - t0 < 20:
                check = next((e for e in role.events() if e["event"] == "idle_check" and e["time"] > since), None)
                time.sleep(0.1)
            out[role.role] = check
        return out

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        serve(sys.argv[1], json.load(f))
