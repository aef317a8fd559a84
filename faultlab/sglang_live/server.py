"""The real SGLang HTTP server on the CPU (``python -m kvguard.sglang.launch``, what operators run), with the
tiny dummy Llama of :mod:`.harness` and faultlab's live injector (:mod:`.inject`); tests drive it over HTTP.

:func:`write_model_dir` writes the model: :func:`.harness.write_model`'s config plus a word-level tokenizer
over the same vocabulary (token ``i`` is the word ``t<i>``), so the OpenAI endpoints, which need a tokenizer,
serve token-id prompts. :class:`Server` starts one server process (its own session, so that its
scheduler and detokenizer can be stopped with it), waits for ``/health`` and stops it with SIGTERM.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from .harness import TINY_LLAMA, write_model
from .plan import ENV_ACCOUNTING, ENV_DUMMY, ENV_FAULTS, ENV_LOG, ENV_ROTARY

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: TINY_LLAMA's bos_token_id 1 and eos_token_id 2


def write_model_dir(directory: str, overrides: dict | None = None) -> str:
    """A config-only tiny Llama with a tokenizer (serve it with ``--load-format dummy``)."""
    write_model(directory, overrides)
    vocab_size = {**TINY_LLAMA, **(overrides or {})}["vocab_size"]
    write_tokenizer(directory, vocab_size)
    return directory


def write_tokenizer(directory: str, vocab_size: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json``: a word-level tokenizer, id ``i`` <-> ``t<i>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(SPECIALS)} | {f"t{i}": i for i in range(len(SPECIALS), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": SPECIALS[0], "bos_token": SPECIALS[1],
              "eos_token": SPECIALS[2], "model_max_length": TINY_LLAMA["max_position_embeddings"]}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def plan_entry(label: str, fault: str | None, seed: int, min_candidates: int) -> dict:
    """One ``FAULTLAB_SGLANG_FAULTS`` entry, as the harness writes it: candidates ``<label>-a*``, reusers
    ``<label>-b*`` (a fault-free episode arms a ``none`` entry)."""
    return {"fault": fault or "none", "seed": seed, "rid_prefix": f"{label}-a", "reuser_prefix": f"{label}-b",
            "min_candidates": min_candidates, "label": label}


def server_env(base: dict, plan: list[dict], log_path: str, prom_dir: str, *, mode: str = "check",
               dummy_std: float = 1.0) -> dict:
    """``base`` without any inherited ``KVGUARD_*`` / ``FAULTLAB_SGLANG_*``, plus kvguard's mode, the
    injector's variables as the harness sets them on the CPU, and ``PROMETHEUS_MULTIPROC_DIR``.

    NOTE: SGLang's ``/metrics`` (server process) reads the scheduler's counters only through
    prometheus_client's multiprocess files: without ``PROMETHEUS_MULTIPROC_DIR`` kvguard's counters,
    which live in the scheduler process, never reach it.
    """
    env = {k: v for k, v in base.items() if not k.startswith(("KVGUARD_", "FAULTLAB_SGLANG_"))}
    env.update({"KVGUARD_MODE": mode, "PROMETHEUS_MULTIPROC_DIR": prom_dir, ENV_FAULTS: json.dumps(plan),
                ENV_LOG: log_path, ENV_ACCOUNTING: "1", ENV_DUMMY: str(dummy_std), ENV_ROTARY: "1"})
    return env


def launch_command(model_dir: str, port: int, *, overlap: bool, page_size: int = 16,
                   max_total_tokens: int = 4096) -> list[str]:
    """``python -m kvguard.sglang.launch`` with SGLang's CPU options for the tiny model."""
    cmd = [sys.executable, "-m", "kvguard.sglang.launch", "--model-path", model_dir, "--load-format", "dummy",
           "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
           "--sampling-backend", "pytorch", "--page-size", str(page_size),
           "--max-total-tokens", str(max_total_tokens), "--host", "127.0.0.1", "--port", str(port),
           "--enable-metrics",
           # NOTE: an idle SGLang scheduler busy-polls a whole core; on a 2-core CI machine an idle server
           # would starve a second one. --sleep-on-idle parks it on its sockets (SGLang's own option).
           "--sleep-on-idle"]
    return cmd + ([] if overlap else ["--disable-overlap-schedule"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """The server could not bind its port: another process took it between free_port() and the bind."""


class Server:
    """One server process; its output goes to ``<log_dir>/server.{out,err}``."""

    def __init__(self, cmd: list[str], env: dict, log_dir: str, port: int):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.err_path = os.path.join(log_dir, "server.err")
        with open(os.path.join(log_dir, "server.out"), "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=log_dir, start_new_session=True)
        self.started = time.time()

    def stderr_tail(self, chars: int = 6000) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()[-chars:]

    def wait_ready(self, timeout: float) -> float:
        """Seconds from start until ``/health`` answers 200; RuntimeError (with the stderr tail) if the
        process exits or the timeout passes first."""
        import requests

        while time.time() - self.started < timeout:
            if self.proc.poll() is not None:
                tail = self.stderr_tail()
                kind = PortTaken if "address already in use" in tail else RuntimeError
                raise kind(f"server exited with {self.proc.returncode} before /health answered:\n{tail}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.time() - self.started
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.stderr_tail()}")

    def children(self) -> list:
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def terminate(self, timeout: float) -> dict:
        """SIGTERM; the return code (None: still running after ``timeout``), the seconds it took, and the
        pids of the server's processes still alive afterwards."""
        import psutil

        children = self.children()
        t = time.time()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        seconds = time.time() - t
        _, alive = psutil.wait_procs(children, timeout=max(1.0, timeout - seconds))
        return {"rc": rc, "seconds": seconds, "alive": [p.pid for p in alive]}

    def kill(self) -> None:
        """SIGKILL the server's process group (it is its own session), if anything of it still runs."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
