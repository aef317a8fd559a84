"""The model's own facts kvguard decides on, read the way SGLang 0.5.23 decides them.

SGLang picks a model's pools from its ``ModelConfig``, not from attributes a config happens to carry: a
hybrid linear-attention or mamba model (Qwen3-Next, Qwen3.5, NemotronH, Falcon-H1, Kimi-Linear, ...) gets a
recurrent-state pool because ``kv_cache_builder.uses_ssm_state(model_config)`` says so (a set of functions
in ``configs/hybrid_arch.py`` that test the config's class); a sliding-window hybrid because
``ModelConfig.is_hybrid_swa``; MLA because ``ModelConfig.attention_arch`` is ``AttentionArch.MLA`` (an
``IntEnum``: its ``str()`` is its number, so it is compared by name here). kvguard asks the same questions.

:data:`MODEL_FACTS` names the :class:`kvguard.sglang.facts.Facts` fields that come from the model, not from
the server arguments: without the model's config they are unknown (the dry run says so; a scheduler decides
them again at install, on the model it loaded, and on the pools it built: :func:`pool_refusal`).

Imports SGLang only inside :func:`linear_state`.
"""
from __future__ import annotations

from typing import Any

MODEL_FACTS = ("mla", "hybrid_swa", "swa_compress", "deepseek_v4", "hybrid_linear", "encoder_decoder")


def arch_name(model_config: Any) -> str:
    """``ModelConfig.attention_arch`` by name (``"MLA"``, ``"MHA"``, ``"SSM"``), or ``""``."""
    arch = getattr(model_config, "attention_arch", None)
    if arch is None:
        return ""
    name = getattr(arch, "name", None)
    return name if isinstance(name, str) else str(arch).rsplit(".", 1)[-1]


def linear_state(model_config: Any) -> bool:
    """The model keeps recurrent (linear-attention / mamba) state beside its KV: SGLang's own test.

    A pure SSM model (``attention_arch`` SSM) too. An object that is not SGLang's ``ModelConfig`` (no
    ``hf_config``) is asked for ``is_hybrid_ssm`` only. SGLang's test raising is not swallowed: kvguard does
    not serve a model it cannot classify.
    """
    if arch_name(model_config) == "SSM":
        return True
    if getattr(model_config, "hf_config", None) is None:
        return bool(getattr(model_config, "is_hybrid_ssm", False))
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state

    return bool(uses_ssm_state(model_config))


def model_facts(model_config: Any) -> dict[str, bool]:
    """The :data:`MODEL_FACTS` of a model (``{}`` when its config is not known)."""
    if model_config is None:
        return {}
    return {
        "mla": arch_name(model_config) == "MLA",
        "hybrid_swa": bool(getattr(model_config, "is_hybrid_swa", False)),
        # SWA-compress (Gemma4, MiMo-V2) and DeepSeek-V4 hybrids: pools of their own (ModelConfig._derive_hybrid_model)
        "swa_compress": bool(getattr(model_config, "is_hybrid_swa_compress", False)),
        "deepseek_v4": bool(getattr(model_config, "is_deepseek_v4_arch", False)),
        "hybrid_linear": linear_state(model_config),
        "encoder_decoder": bool(getattr(model_config, "is_encoder_decoder", False)),
    }


def pool_refusal(req_to_token_pool: Any, allocator: Any, build_result: Any = None,
                 tree_cache: Any = None) -> str | None:
    """The structural backstop at install: the pools SGLang built carry state kvguard does not follow.

    Whatever the facts said: a row pool with a recurrent-state pool (``HybridReqToTokenPool.mamba_pool``),
    a build result SGLang marked ``is_hybrid_ssm`` / ``is_hybrid_swa``, or a HiCache tree
    with packed draft layers (:func:`hicache_refusal`), names its registry path; None
    when the pools are plain, or hold state kvguard follows (:func:`kvguard.sglang.mamba.pool_refusal`: a plain
    ``HybridReqToTokenPool`` with no tree of state slots).
    """
    ssm = getattr(req_to_token_pool, "mamba_pool", None) is not None \
        or bool(getattr(build_result, "is_hybrid_ssm", False))
    swa = bool(getattr(build_result, "is_hybrid_swa", False)) \
        or callable(getattr(allocator, "translate_loc_from_full_to_swa", None))
    if ssm:
        from .mamba import pool_refusal as state_refusal

        refused = state_refusal(req_to_token_pool, build_result, tree_cache)
        if refused is not None:
            return refused
    refused = hicache_refusal(tree_cache if tree_cache is not None else getattr(build_result, "tree_cache", None))
    if refused is not None:
        return refused
    if swa:
        from .swa import follows

        if not follows(allocator):  # (kvguard.sglang.swa: SGLang's paged SWATokenToKVPoolAllocator only)
            return "sliding_window_own_pool"
    return None


def hicache_refusal(tree_cache: Any) -> str | None:
    """The registry path that refuses this tree's HiCache draft layout, or None (no HiCache, no draft, or a draft
    sidecar: its own host pool, moved in the target's load operation on the target's device slots:
    :mod:`kvguard.sglang.hicache`).

    Packed draft layers (``HiCacheDraftMode.PACKED``: an MTP / NextN draft, ``BaseSpecWorker._build_hicache_draft_plan``)
    ride the target's host pool as extra layers and reach the device through extra transfers
    (``HybridCacheController._l2_load_transfers``), which kvguard's evidence does not cover."""
    group = getattr(getattr(tree_cache, "cache_controller", None), "mem_pool_host", None)
    if any(getattr(entry, "packed_draft_device_pools", ()) for entry in getattr(group, "entries", ())):
        return "hierarchical_cache_spec_packed"
    return None
