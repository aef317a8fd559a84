"""The dry run of a launch line (kvguard.sglang.dryrun): the registry's verdict, nothing started.

Launch lines of the shapes operators use, parsed by SGLang's own parser, each with the verdict and the path
that decides it: in this process for speed (SGLang imported once), each as written (no accelerator here, so
SGLang's resolution does not run and the verdict is decided on the arguments) and with ``--device cpu``
(resolved the way ``launch_server`` resolves them). Two subprocesses, started at the top of the module and
read at its end, show the commands' exit codes: ``python -m kvguard.sglang.launch --dry-run`` (served, 0) and
the ``kvguard check`` console script (refused, 2).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard.sglang import paths
from kvguard.sglang.model_facts import MODEL_FACTS

pytestmark = pytest.mark.sglang

# A Qwen3-Next-shaped hybrid (gated delta net layers beside full attention), config only.
TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 1000,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "max_position_embeddings": 2048,
}

# (id, arguments after --model-path, model, served?, the path that must be active)
LINES = [
    ("plain", [], "llama", True, "extend_decode"),
    ("pd_decode_mooncake", ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"],
     "llama", True, "pd_decode_retraction_backup"),  # host_pool, SGLang's default for an MHA pool: checked
    ("pd_decode_host_receive", ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake",
                                "--disaggregation-decode-host-receive-threshold", "0.5"], "llama", False,
     "pd_decode_host_receive"),
    ("pd_decode_mooncake_cpu_tensor", ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend",
                                       "mooncake", "--disaggregation-decode-retraction-backup", "cpu_tensor"],
     "llama", True, "pd_decode_retraction_backup"),
    ("pd_prefill", ["--disaggregation-mode", "prefill"], "llama", True, "pd_prefill_mooncake"),
    ("pd_decode_nixl", ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl",
                        "--disaggregation-decode-retraction-backup", "none"], "llama", True, "pd_decode_nixl"),
    ("pd_decode_mori", ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mori",
                        "--disaggregation-decode-retraction-backup", "none"], "llama", False,
     "pd_decode_transfer_backend"),
    ("dp_attention", ["--enable-dp-attention", "--dp-size", "8", "--tp-size", "8"], "llama", True, "dp_attention"),
    ("dp_attention_attn_tp", ["--enable-dp-attention", "--dp-size", "4", "--tp-size", "8"], "llama", True,
     "dp_attention_attn_tp"),
    ("mtp_eagle", ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk",
                   "1", "--speculative-num-draft-tokens", "4"], "llama", True, "speculative_decoding"),
    ("tree_eagle", ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk",
                    "4", "--speculative-num-draft-tokens", "8"], "llama", False, "speculative_tree_drafting"),
    ("hicache", ["--enable-hierarchical-cache"], "llama", True, "hierarchical_cache"),
    ("hicache_eagle3", ["--enable-hierarchical-cache", "--speculative-algorithm", "EAGLE3",
                        "--speculative-draft-model-path", "/models/eagle3-draft", "--speculative-num-steps", "3",
                        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"], "llama", True,
     "hierarchical_cache_spec"),
    ("hicache_mtp", ["--enable-hierarchical-cache", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"], "llama", False,
     "hierarchical_cache_spec_packed"),
    ("hicache_file", ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"], "llama", False,
     "hierarchical_cache_storage"),
    ("no_overlap", ["--disable-overlap-schedule"], "llama", True, "normal_loop"),
    ("mixed_chunk", ["--enable-mixed-chunk"], "llama", True, "mixed_chunk"),
    ("tp2", ["--tp-size", "2"], "llama", True, "tensor_parallel"),
    ("pp2", ["--pp-size", "2"], "llama", False, "pipeline_parallel"),
    ("qwen3_next", [], "qwen3_next", False, "hybrid_linear_radix_cache"),
    ("qwen3_next_no_radix", ["--disable-radix-cache", "--mamba-radix-cache-strategy", "no_buffer",
                             "--disable-overlap-schedule"], "qwen3_next", True, "hybrid_linear_attention"),
]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD_", "FAULTLAB_SGLANG_", "SGLANG_"))}
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from faultlab.sglang_live.harness import write_model

    tmp = tmp_path_factory.mktemp("dryrun_models")
    (tmp / "qwen3_next").mkdir()
    (tmp / "qwen3_next" / "config.json").write_text(json.dumps(TINY_QWEN3_NEXT))
    return {"llama": write_model(str(tmp / "llama")), "qwen3_next": str(tmp / "qwen3_next")}


@pytest.fixture(scope="module", autouse=True)
def commands(models, tmp_path_factory):
    """The two commands, started before the in-process cases run (the import of SGLang is the slow part)."""
    tmp = tmp_path_factory.mktemp("dryrun_commands")
    script = Path(sys.executable).with_name("kvguard")
    started = {
        "launch_served": subprocess.Popen(
            [sys.executable, "-m", "kvguard.sglang.launch", "--dry-run", "--model-path", models["llama"],
             "--tp-size", "2"], cwd=tmp, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
    }
    if script.exists():
        started["check_refused"] = subprocess.Popen(
            [str(script), "check", "--model-path", models["llama"], "--disaggregation-mode", "prefill",
             "--disaggregation-transfer-backend", "mori"],
            cwd=tmp, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = {}

    def result(name):
        if name not in done:
            assert name in started, f"{script} is not installed: run make setup (pip install -e .)"
            out, err = started[name].communicate(timeout=120)
            done[name] = (started[name].returncode, out, err)
        return done[name]

    yield result
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def dryrun():
    from kvguard.sglang import dryrun

    return dryrun


@pytest.mark.parametrize("device", [[], ["--device", "cpu"]], ids=["as-written", "device-cpu"])
@pytest.mark.parametrize("name, extra, model, served, path", LINES, ids=[line[0] for line in LINES])
def test_launch_line_verdict(dryrun, models, name, extra, model, served, path, device):
    verdict = dryrun.check(["--model-path", models[model], *extra, *device])
    active = {p.name: p for p in verdict.active}
    assert path in active, (name, sorted(active))
    assert verdict.unknown == (), verdict.model  # the config was read
    assert (verdict.refusal is None) == served, verdict.refusal
    assert verdict.exit_code == (0 if served else 2)
    text = dryrun.report(verdict)
    for p in verdict.active:  # every active path is listed with its status and its reason
        assert f"{p.status:<8} {p.name} [" in text
    if not served:
        assert active[path].status == paths.REFUSED and path in verdict.refusal and active[path].why in verdict.refusal
        assert "verdict: refused (exit 2)" in text
    else:
        assert all(p.status == paths.CHECKED for p in verdict.active)
        assert "verdict: served" in text


def test_resolved_with_a_device_and_decided_as_written_without(dryrun, models):
    """``--device cpu`` lets SGLang resolve here (attention DP then reads as attn_dp_size); without an accelerator
    and no --device, the verdict is decided on the arguments as written, and says so."""
    resolved = dryrun.check(["--model-path", models["llama"], "--device", "cpu", "--enable-dp-attention",
                             "--dp-size", "8", "--tp-size", "8"])
    assert resolved.unresolved is None and "resolved by SGLang" in dryrun.report(resolved)
    as_written = dryrun.check(["--model-path", models["llama"]])
    assert as_written.unresolved is not None and "decided as written" in dryrun.report(as_written)


def test_model_facts_known_from_a_local_config(dryrun, models):
    verdict = dryrun.check(["--model-path", models["llama"]])
    assert verdict.unknown == () and "LlamaForCausalLM" in verdict.model
    assert not any(getattr(verdict.facts, name) for name in MODEL_FACTS)


def test_a_hub_id_is_not_fetched_and_its_model_facts_are_named(dryrun):
    """No local config: nothing is fetched, the model's facts are named as unknown with what each would turn on."""
    assert set(MODEL_FACTS) <= set(paths.FACT_NAMES)
    verdict = dryrun.check(["--model-path", "Qwen/Qwen3-8B", "--tp-size", "2"])
    assert verdict.unknown == tuple(MODEL_FACTS) and verdict.model.startswith("not read")
    assert verdict.exit_code == 0
    text = dryrun.report(verdict)
    for name in MODEL_FACTS:
        assert f"    {name}: would turn on " in text
    assert "hybrid_linear: would turn on hybrid_linear_attention (checked), hybrid_linear_radix_cache (refused)" \
        in text
    assert "the model facts above are not known" in text


def test_a_bad_argument_exits_2_with_sglangs_message(dryrun, models, capsys):
    assert dryrun.main(["--model-path", models["llama"], "--tp-size", "banana"]) == 2
    err = capsys.readouterr().err
    assert "invalid int value: 'banana'" in err and "nothing would start" in err
    assert len(err.splitlines()) <= 3  # SGLang's error line, not its whole usage text
    assert dryrun.main(["--tp-size", "2"]) == 2
    assert "--model-path" in capsys.readouterr().err


def test_a_bad_kvguard_setting_exits_2(dryrun, models, monkeypatch, capsys):
    monkeypatch.setenv("KVGUARD_MODE", "chekc")
    assert dryrun.main(["--model-path", models["llama"]]) == 2
    assert "KVGUARD_MODE='chekc' is not valid" in capsys.readouterr().err


def test_console_script_usage(dryrun, capsys):
    for argv, code in ([], 2), (["serve"], 2), (["--help"], 0), (["check"], 2):
        with pytest.raises(SystemExit) as exc:
            dryrun.cli(argv)
        assert exc.value.code == code, argv
    assert "usage: kvguard check" in capsys.readouterr().err


def test_the_dry_run_leaves_the_environment_as_it_was(dryrun, models):
    before = dict(os.environ)
    dryrun.check(["--model-path", models["llama"], "--device", "cpu", "--disaggregation-mode", "decode"])
    assert dict(os.environ) == before


# -- the commands, as an operator runs them ----------------------------------------------------------------------
def test_launch_dry_run_exits_0_when_served(commands):
    code, out, err = commands("launch_served")
    assert code == 0, err[-3000:]
    assert "checked  tensor_parallel [" in out and "verdict: served" in out


def test_kvguard_check_exits_2_when_refused(commands):
    code, out, err = commands("check_refused")
    assert code == 2, err[-3000:]
    assert "refused  pd_prefill [" in out and paths.BY_NAME["pd_prefill"].why in out

