"""The path registry (kvguard.sglang.paths): every SGLang path checked or refused, and a refusal reaches
the person who starts the server, through SGLang's real start-up code (no scheduler is spawned).

- ``sglang.Engine(...)`` with KVGUARD_MODE=check and a refused path raises ``KVGuardRefused`` naming the
  path and why, from SGLang's own ``ServerArgs.check_server_args`` (hooked), before any scheduler starts;
  a model property (sliding window) is read from the model's config there too;
- ``python -m kvguard.sglang.launch`` exits 2 with the same message before SGLang starts;
- docs/sglang.md's coverage table is the registry's;
- after SGLang applied the hooks, kvguard's self-check finds every hook, and names a target SGLang left
  unhooked.
"""
from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard.sglang import paths
from kvguard.sglang.paths import BY_NAME, CHECKED, PATHS, REFUSED, Facts, active, refusal

ROOT = Path(__file__).resolve().parents[3]

# A Facts for each refused path, and the Engine arguments that turn it on (None: not startable on this CPU:
# HiSparse needs a DSA model, PD decode's KV offload a HiCache storage backend, the
# rest a model of that kind: their Facts are checked here, and their schedulers refuse at install).
REFUSED_FACTS = {
    # (Mori is not installed here)
    "pd_decode_transfer_backend": (Facts(disaggregation_mode="decode", transfer_backend="mori"), None),
    "pd_prefill": (Facts(disaggregation_mode="prefill", transfer_backend="mori"), None),
    "speculative_other_algorithms": (Facts(speculative_algorithm="NGRAM"), {"speculative_algorithm": "NGRAM"}),
    "speculative_tree_drafting": (Facts(speculative_algorithm="EAGLE", spec_topk=4), None),  # (needs a draft model)
    "speculative_multi_layer_eagle": (Facts(speculative_algorithm="EAGLE", spec_multi_layer=True), None),
    "hierarchical_cache_storage": (Facts(hierarchical_cache=True, hicache_storage=True),
                                   {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}),
    "hierarchical_cache_buffer_only": (Facts(hierarchical_cache=True, hicache_buffer_only=True), None),
    "hierarchical_cache_pd": (Facts(hierarchical_cache=True, disaggregation_mode="prefill"), None),
    "hierarchical_cache_spec_packed": (Facts(hierarchical_cache=True, speculative_algorithm="NEXTN", spec_mtp=True),
                                       None),
    "hierarchical_cache_model": (Facts(hierarchical_cache=True, mla=True), None),
    "hisparse": (Facts(hisparse=True), None),
    "sliding_window_own_pool": (Facts(hybrid_swa=True, swa_compress=True), None),  # (Gemma4 / MiMo: not on this CPU)
    "sliding_window_pd": (Facts(hybrid_swa=True, disaggregation_mode="decode"), None),
    # (no live launch: SGLang itself cannot run extra_buffer, or "auto" resolved to it, on the CPU)
    "hybrid_linear_radix_cache": (Facts(hybrid_linear=True, mamba_strategy="extra_buffer"), None),
    "hybrid_linear_state_pool": (Facts(hybrid_linear=True, radix=False, disaggregation_mode="decode",
                                       transfer_backend="fake", decode_retraction_backup="none"), None),
    "hybrid_linear_spec_own_state": (Facts(hybrid_linear=True, radix=False, speculative_algorithm="EAGLE",
                                            linear_replayssm=True), None),
    "pipeline_parallel": (Facts(pp_size=2), {"pp_size": 2}),
    "encoder_decoder": (Facts(encoder_decoder=True), None),
    "dllm": (Facts(dllm=True), None),
    "pd_multiplexing": (Facts(pdmux=True), {"enable_pdmux": True, "chunked_prefill_size": -1,
                                            "disable_overlap_schedule": True}),
    "streaming_session": (Facts(streaming_session=True), {"enable_streaming_session": True}),
    "session_radix_cache": (Facts(session_radix_cache=True), {"enable_session_radix_cache": True}),
    "lmcache": (Facts(lmcache=True), {"enable_lmcache": True}),
    "decode_context_parallel": (Facts(dcp_size=2), {"dcp_size": 2, "tp_size": 2}),
    "attention_context_parallel": (Facts(attn_cp_size=2), {"attn_cp_size": 2, "tp_size": 2}),
    "pd_decode_kv_offload": (Facts(disaggregation_mode="decode", transfer_backend="fake", decode_kv_offload=True),
                             None),  # SGLang needs a HiCache storage backend for it
    "pd_decode_host_receive": (Facts(disaggregation_mode="decode", transfer_backend="fake",
                                     decode_host_receive=True), None),  # (a decode server does not start here)
    "flexkv": (Facts(flexkv=True), {"enable_flexkv": True}),
    "radix_cache_backend": (Facts(radix_cache_backend="flexkv"), {"radix_cache_backend": "flexkv"}),
    "unified_cache_external_linker": (Facts(external_cache_linker=True),
                                      {"enable_unified_cache_external_linker": True}),
}


def test_every_path_is_checked_with_evidence_or_refused():
    assert {p.status for p in PATHS} == {CHECKED, REFUSED}
    assert set(REFUSED_FACTS) == {p.name for p in PATHS if p.status == REFUSED and not p.per_request}
    assert all(p.status == REFUSED and not p.applies(Facts()) for p in PATHS if p.per_request)
    for p in PATHS:
        if p.status == CHECKED:
            test_file = p.evidence.split(" ")[0]
            assert (ROOT / test_file).is_file(), f"{p.name}: evidence {p.evidence!r} is not a test file here"


@pytest.mark.parametrize("name", sorted(REFUSED_FACTS))
def test_a_refused_path_is_named_in_the_refusal(name):
    facts, _ = REFUSED_FACTS[name]
    assert BY_NAME[name] in active(facts)
    message = refusal(facts)
    assert message is not None and name in message and BY_NAME[name].why in message


def test_the_default_configuration_is_served():
    assert refusal(Facts()) is None
    assert refusal(Facts(hierarchical_cache=True)) is None  # HiCache on host memory: checked
    assert refusal(Facts(disaggregation_mode="decode", transfer_backend="fake", decode_retraction_backup="none",
                         tp_size=2, mla=True, mixed_chunk=True, overlap=False)) is None
    assert refusal(Facts(disaggregation_mode="decode", transfer_backend="mooncake", decode_retraction_backup="none",
                         overlap=False)) is None
    assert refusal(Facts(disaggregation_mode="prefill", transfer_backend="mooncake", overlap=False)) is None
    # PD decode's retraction backup: cpu_tensor or host_pool (named, or what SGLang resolves) is checked
    assert refusal(Facts(disaggregation_mode="decode", transfer_backend="mooncake", decode_retraction_backup="cpu_tensor",
                         overlap=False)) is None
    assert refusal(Facts(disaggregation_mode="decode", transfer_backend="mooncake", mla=True, overlap=False)) is None
    assert refusal(Facts(disaggregation_mode="decode", transfer_backend="mooncake", overlap=False)) is None
    assert refusal(Facts(disaggregation_mode="decode", transfer_backend="mooncake", decode_retraction_backup="host_pool",
                         overlap=False)) is None
    assert "pd_decode_host_receive" in refusal(Facts(disaggregation_mode="decode", transfer_backend="mooncake",
                                                     decode_host_receive=True, overlap=False))


def test_docs_coverage_table_is_the_registry():
    docs = (ROOT / "docs" / "sglang.md").read_text()
    assert paths.coverage_table() in docs, "regenerate docs/sglang.md's table: python -m kvguard.sglang.paths"


_ENGINE_SCRIPT = r"""
import json, os, sys
os.environ["FAULTLAB_SGLANG_CPU_ROTARY"] = "1"
def main():
    import sglang
    out = {}
    for name, model, extra in json.loads(sys.argv[1]):
        try:
            engine = sglang.Engine(model_path=model, device="cpu", load_format="dummy", skip_tokenizer_init=True,
                                   page_size=1, sampling_backend="pytorch", max_total_tokens=4096,
                                   attention_backend="torch_native", dtype="float32", **extra)
            engine.shutdown()
            out[name] = {"started": True}
        except BaseException as exc:
            out[name] = {"type": type(exc).__name__, "message": str(exc)}
    print("RESULT " + json.dumps(out))
if __name__ == "__main__":
    main()
"""


def _env(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD_", "FAULTLAB_SGLANG_"))}
    env["KVGUARD_MODE"] = mode
    return env


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from faultlab.sglang_live.harness import write_model

    tmp = tmp_path_factory.mktemp("models")
    from faultlab.sglang_live.families import QWEN3_NEXT

    return {"plain": write_model(str(tmp / "plain")),
            "swa_model": write_model(str(tmp / "swa"), {"is_hybrid_swa": True, "sliding_window": 16}),
            "linear_model": write_model(str(tmp / "linear"), QWEN3_NEXT)}


@pytest.mark.sglang
@pytest.mark.timeout(300)
def test_engine_refuses_each_refused_path_before_a_scheduler_starts(models, tmp_path):
    cases = []
    for name, (_, how) in REFUSED_FACTS.items():
        if how is None:
            continue
        model, extra = (models[how], {}) if isinstance(how, str) else (models[how[0]], how[1]) \
            if isinstance(how, tuple) else (models["plain"], how)
        cases.append([name, model, extra])
    script = tmp_path / "engines.py"
    script.write_text(_ENGINE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), json.dumps(cases)], env=_env("check"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=280)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-4000:]
    result = json.loads(line[len("RESULT "):])
    for name, _, _ in cases:
        got = result[name]
        assert got.get("type") == "KVGuardRefused", f"{name}: {got}"
        assert name in got["message"] and BY_NAME[name].why in got["message"]
    assert len(cases) >= 7


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    from faultlab.sglang_live.harness import write_model

    return write_model(str(tmp_path_factory.mktemp("facts_model") / "plain"))


@pytest.mark.sglang
@pytest.mark.parametrize("name, extra", [
    ("dp_attention_attn_tp", {"attn_dp_size": 2, "tp_size": 4}),
    ("dp_attention_attn_tp", {"dp_size": 2, "enable_dp_attention": True, "tp_size": 4}),  # the deprecated spelling
    ("flexkv", {"enable_flexkv": True}),
    ("radix_cache_backend", {"radix_cache_backend": "flexkv"}),
    ("unified_cache_external_linker", {"enable_unified_cache_external_linker": True}),
])
def test_facts_of_a_real_server_args_turns_on_the_path(plain_model, name, extra):
    """From SGLang's own ServerArgs, raw and resolved (what kvguard reads at check_server_args and at install), the
    path is turned on, and refused by name if the registry refuses it (else served): SGLang resolves ``--dp-size N
    --enable-dp-attention`` into ``attn_dp_size=N`` with enable_dp_attention set back to False, so attention DP is
    read from attn_dp_size."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.server_args import ServerArgs

    from kvguard.sglang.paths import active, facts_of

    args = ServerArgs(model_path=plain_model, device="cpu", load_format="dummy", skip_tokenizer_init=True, **extra)
    views = [args]
    args.resolve_once()
    views.append(resolving_view(args))
    for view in views:
        facts = facts_of(view)
        assert name in [p.name for p in active(facts)], (extra, facts)
        message = refusal(facts)
        if BY_NAME[name].status == REFUSED:
            assert message is not None and name in message and BY_NAME[name].why in message, (extra, message)
        else:
            assert message is None, (extra, message)
    assert refusal(facts_of(resolving_view(ServerArgs(model_path=plain_model, device="cpu", load_format="dummy",
                                                         skip_tokenizer_init=True, tp_size=2)))) is None


@pytest.mark.sglang
@pytest.mark.timeout(120)
def test_launcher_exits_2_naming_the_refused_path(models, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvguard.sglang.launch", "--model-path", models["plain"],
                           "--device", "cpu", "--load-format", "dummy", "--speculative-algorithm", "NGRAM"],
                          env=_env("check"), cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2, proc.stderr[-3000:]
    path = BY_NAME["speculative_other_algorithms"]
    assert path.name in proc.stderr and path.why in proc.stderr


def test_self_check_finds_every_hook_and_names_one_sglang_skipped(check_hooks, monkeypatch):
    from kvguard.sglang.plugin import TARGETS, self_check

    assert self_check() == []
    import sglang.srt.mem_cache.allocation as allocation

    hooked = allocation.alloc_for_decode
    original = hooked
    while getattr(original, "__wrapped__", None) is not None:
        original = original.__wrapped__
    monkeypatch.setattr(allocation, "alloc_for_decode", original)  # as if apply_hooks had skipped it
    assert pkgutil.resolve_name(TARGETS["alloc_for_decode"]) is original
    problems = self_check()
    assert any(TARGETS["alloc_for_decode"] in p and "not applied" in p for p in problems), problems
