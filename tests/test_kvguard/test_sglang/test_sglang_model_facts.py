"""The model's facts read the way SGLang 0.5.23 decides them, and kvguard's entry point failing closed (issue 47,
items 1 and 7).

- ``facts_of`` on SGLang's own ``ModelConfig`` of tiny configs of each family: a Qwen3-Next (GDN) or NemotronH
  (mamba) hybrid is ``hybrid_linear`` (SGLang's ``uses_ssm_state``), DeepSeek-V3 is MLA (``attention_arch`` is an
  IntEnum whose ``str()`` is a number), GPT-OSS a sliding-window hybrid, Whisper an encoder-decoder; a Llama none
  of them. Before the fix the hybrid models read as plain (served) and MLA was never true.
- a hybrid linear-attention model is served with the radix cache off (kvguard.sglang.mamba follows its state
  slots) and refused with it on (the tree's state slots are not followed), named.
- the structural backstop at install: a real ``HybridReqToTokenPool`` is followed (the state follower attached)
  with no live tree; with a live tree, or as a subclass kvguard does not follow (PD decode's), it is refused
  whatever the facts said.
- SGLang's loader swallows an ImportError from a plugin: with ``KVGUARD_MODE=check`` and a dependency of kvguard
  that fails to import, ``load_plugins()`` must stop the process, not return with the server unguarded.
- attention TP: "one rank" is never concluded from a failed group lookup in a world of several ranks.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from faultlab.sglang_live import families
from kvguard.sglang.paths import BY_NAME, active, facts_of, refusal

pytestmark = pytest.mark.sglang

FAMILIES = {  # name: (the tiny config's overrides, the model facts SGLang's ModelConfig gives it)
    "llama": (families.FAMILIES["llama"], set()),
    "qwen3_next": (families.QWEN3_NEXT, {"hybrid_linear"}),
    "nemotron_h": (families.NEMOTRON_H, {"hybrid_linear"}),
    "deepseek_v3": (families.DEEPSEEK_V3, {"mla"}),
    "gpt_oss": (families.GPT_OSS, {"hybrid_swa"}),
}
MODEL_FACTS = ("mla", "hybrid_swa", "hybrid_linear", "encoder_decoder")


def _model_config(directory: str, overrides: dict):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    from faultlab.sglang_live.harness import write_model

    path = write_model(directory, overrides)
    args = ServerArgs(model_path=path, device="cpu", load_format="dummy", skip_tokenizer_init=True)
    return args, ModelConfig.from_server_args(args)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: _model_config(str(root / name), over) for name, (over, _) in FAMILIES.items()}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_model_facts_are_sglangs(configs, name):
    args, model_config = configs[name]
    facts = facts_of(args, model_config)
    on = {f for f in MODEL_FACTS if getattr(facts, f)}
    assert on == FAMILIES[name][1], (name, on)


@pytest.mark.parametrize("name, path", [("qwen3_next", "hybrid_linear_radix_cache"),
                                        ("nemotron_h", "hybrid_linear_radix_cache")])
def test_a_hybrid_model_is_refused_at_start_with_the_reason(configs, name, path):
    from kvguard.sglang.plugin import server_refusal

    args, _ = configs[name]
    message = server_refusal(args)  # what check_server_args and the launcher ask: the model's config read by SGLang
    assert message is not None and path in message and BY_NAME[path].why in message, message


def test_a_sliding_window_model_is_served_and_an_own_pool_one_refused(configs):
    from kvguard.sglang.paths import Facts
    from kvguard.sglang.plugin import server_refusal

    args, model_config = configs["gpt_oss"]
    assert server_refusal(args) is None  # kvguard.sglang.swa follows SGLang's paged SWA pools
    assert BY_NAME["sliding_window"] in active(facts_of(args, model_config))
    for own in (Facts(hybrid_swa=True, swa_compress=True), Facts(hybrid_swa=True, deepseek_v4=True)):
        message = refusal(own)
        assert message is not None and "sliding_window_own_pool" in message, message


@pytest.mark.parametrize("name", ["qwen3_next", "nemotron_h"])
def test_a_hybrid_linear_model_is_served_without_the_radix_cache(configs, name):
    import dataclasses

    from kvguard.sglang.paths import active
    from kvguard.sglang.plugin import server_refusal

    args, model_config = configs[name]
    args = dataclasses.replace(args, disable_radix_cache=True) if dataclasses.is_dataclass(args) else args
    if not dataclasses.is_dataclass(args):
        args.disable_radix_cache = True
    assert server_refusal(args) is None
    assert "hybrid_linear_attention" in {p.name for p in active(facts_of(args, model_config))}


def test_mla_is_read_from_the_enum_by_name(configs):
    from sglang.srt.configs.model_config import AttentionArch

    args, model_config = configs["deepseek_v3"]
    assert model_config.attention_arch == AttentionArch.MLA and not str(model_config.attention_arch).endswith("MLA")
    assert facts_of(args, model_config).mla
    assert refusal(facts_of(args, model_config)) is None  # MLA is checked: served


def test_a_plain_llama_is_served(configs):
    from kvguard.sglang.plugin import server_refusal

    assert server_refusal(configs["llama"][0]) is None


def test_an_encoder_decoder_model_config_is_read_so(tmp_path):
    from kvguard.sglang.model_facts import model_facts

    class _Whisper:  # SGLang's ModelConfig reads is_encoder_decoder from the architecture list only
        pass

    from sglang.srt.configs.model_config import is_encoder_decoder_model

    probe = _Whisper()
    probe.is_encoder_decoder = is_encoder_decoder_model(["WhisperForConditionalGeneration"])
    assert model_facts(probe)["encoder_decoder"] and not model_facts(probe)["hybrid_linear"]


def _hybrid_pool(configs, cls=None):
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    cfg = mambaish_config(configs["qwen3_next"][1])
    return (cls or HybridReqToTokenPool)(
        size=4, mamba_size=4, mamba_spec_state_size=0, max_context_len=64, device="cpu", enable_memory_saver=False,
        cache_params=cfg.mamba2_cache_params, mamba_layer_ids=list(cfg.linear_layer_ids),
        enable_mamba_extra_buffer=False)


def test_the_backstop_follows_a_plain_hybrid_row_pool_and_refuses_the_rest(configs, make_rig):
    """A plain HybridReqToTokenPool with no live tree is followed; with a live tree (its state slots), or a subclass
    kvguard does not follow, it is refused at install whatever the facts said, named."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from kvguard.sglang.plugin import KVGuardStartupError, install

    rig = make_rig(1)
    pool = _hybrid_pool(configs)
    with pytest.raises(KVGuardStartupError, match="hybrid_linear_radix_cache"):
        install(pool, rig.allocator, rig.tree, registry=rig.registry)  # a live radix tree: its state slots

    class _Other(HybridReqToTokenPool):  # e.g. PD decode's HybridMambaDecodeReqToTokenPool
        pass

    with pytest.raises(KVGuardStartupError, match="hybrid_linear_state_pool"):
        install(_hybrid_pool(configs, _Other), rig.allocator, None, registry=rig.registry)
    followed = make_rig(1)
    guard = install(pool, followed.allocator, None, registry=followed.registry)
    assert guard.mamba is pool._kvguard_mamba and pool.mamba_allocator._kvguard_mamba is guard.mamba
    pool = _hybrid_pool(configs, _Other)
    rig = make_rig(1)
    # The install before SGLang's graph capture stops the scheduler too: before, it returned None on any refusal
    # and left the install to build_kv_cache's hook (none at all, were that hook the one SGLang failed to apply).
    from types import SimpleNamespace

    from kvguard.sglang.plugin import _install_before_capture

    runner = SimpleNamespace(req_to_token_pool=pool, token_to_kv_pool_allocator=rig.allocator)
    with pytest.raises(KVGuardStartupError, match="hybrid_linear_state_pool"):
        _install_before_capture(SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner), server_args=None,
                                                model_config=None))
    assert install(rig.req_to_token_pool, rig.allocator, rig.tree, registry=rig.registry) is not None


_LOADER = textwrap.dedent("""
    from sglang.srt.plugins import load_plugins
    load_plugins()
    print("SERVED")
""")


@pytest.mark.parametrize("mode", ["check", "off"])
def test_a_kvguard_dependency_that_fails_to_import_stops_the_loader(tmp_path, mode):
    broken = tmp_path / "shadow" / "prometheus_client"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('prometheus_client is broken on this machine')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD_", "FAULTLAB_SGLANG_"))}
    env.update(KVGUARD_MODE=mode, SGLANG_PLUGINS="kvguard", PYTHONPATH=str(tmp_path / "shadow"))
    proc = subprocess.run([sys.executable, "-c", _LOADER], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    if mode == "check":
        assert proc.returncode != 0 and "SERVED" not in proc.stdout, proc.stdout[-2000:]
        assert "kvguard: refusing to start" in proc.stderr and "prometheus_client is broken" in proc.stderr
    else:  # kvguard off: SGLang runs as shipped
        assert proc.returncode == 0 and "SERVED" in proc.stdout, proc.stderr[-3000:]


def _tp_lookup(rank: int, world: int, port: int, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world)
    from kvguard.sglang import plugin, runtime  # noqa: F401

    try:  # SGLang's attention-TP group was never made in this process: the lookup fails
        result = "one rank" if runtime._attn_tp()[0] is None else "group"
    except SystemExit as err:
        result = f"stopped: {err}"
    with open(f"{out}.{rank}", "w") as f:
        f.write(result)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_attention_tp_never_degrades_to_one_rank_on_a_failed_lookup(tmp_path, world):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_tp_lookup, args=(world, port, str(tmp_path / "r")), nprocs=world, join=True)
    results = [(tmp_path / f"r.{r}").read_text() for r in range(world)]
    if world == 1:
        assert results == ["one rank"]
    else:
        assert all(r.startswith("stopped: kvguard: refusing to serve") for r in results), results


def test_an_allocation_kvguard_cannot_attribute_is_flagged_not_trusted(make_rig):
    """An extend whose allocator handed out more pages than the rows took (here: one page leaked inside the call,
    as a buggy allocator would): kvguard cannot tell which tag each new page got, so the extend's new entries
    expect nothing and are flagged; before, the pages' current tags were recorded (a page handed out twice passes)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    rig = make_rig(16)
    allocator = rig.allocator
    alloc_extend = allocator.alloc_extend

    def leaky_alloc_extend(*args, **kwargs):
        out = alloc_extend(*args, **kwargs)
        PagedTokenToKVPoolAllocator.alloc(allocator, 16)  # one more page off the free list, given to nobody
        return out

    allocator.alloc_extend = leaky_alloc_extend
    rig.install(registry=rig.registry)
    batch = rig.prefill(20, 35)
    assert set(rig.verdict(batch).values()) == {1}, rig.verdict(batch)
