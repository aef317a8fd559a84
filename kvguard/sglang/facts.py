"""What kvguard decides a server's paths on (:mod:`kvguard.sglang.paths`): the facts of one launch, read once.

The server's facts are read from SGLang's ``ServerArgs`` (resolved or raw), the model's through
:mod:`kvguard.sglang.model_facts` (SGLang's own tests, imported when a model config is given). Stdlib only at import.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .model_facts import model_facts


@dataclass(frozen=True)
class Facts:
    """What kvguard decides on, read once from SGLang's server arguments and the model's config."""

    disaggregation_mode: str = "null"
    transfer_backend: str = "mooncake"
    speculative_algorithm: str | None = None
    spec_topk: int = 1  # speculative_eagle_topk: 1 is chain drafting, more is tree drafting
    spec_multi_layer: bool = False  # enable_multi_layer_eagle (MultiLayerEagleWorkerV2)
    # the draft is the target's own MTP / NextN layers (NEXTN, or EAGLE with no draft model named): what SGLang packs
    # into the target's HiCache host pool (an EAGLE draft path naming a NextN checkpoint is found at install)
    spec_mtp: bool = False
    hierarchical_cache: bool = False
    hicache_storage: bool = False  # hicache_storage_backend set (file, mooncake, 3fs, nixl, ...)
    hicache_buffer_only: bool = False  # hicache_host_memory_mode=buffer_only
    hisparse: bool = False
    pp_size: int = 1
    tp_size: int = 1
    dp_attention: bool = False
    attn_dp_size: int = 1  # attention-DP ranks (tp_size // attn_dp_size: each DP rank's attention-TP ranks)
    dllm: bool = False
    pdmux: bool = False
    overlap: bool = True
    radix: bool = True
    chunked: bool = True
    mixed_chunk: bool = False
    mla: bool = False
    hybrid_swa: bool = False
    swa_compress: bool = False  # an SWA-compress hybrid (Gemma4, MiMo-V2)
    deepseek_v4: bool = False  # DeepSeek-V4's own hybrid pool
    hybrid_linear: bool = False
    mamba_strategy: str = "auto"  # mamba_radix_cache_strategy as given on the launch line (SGLang resolves "auto" later)
    linear_replayssm: bool = False  # enable_linear_replayssm or enable_linear_replayssm_spec: ReplaySSM state rings
    encoder_decoder: bool = False
    streaming_session: bool = False
    session_radix_cache: bool = False
    lmcache: bool = False
    dcp_size: int = 1
    attn_cp_size: int = 1
    decode_kv_offload: bool = False
    decode_retraction_backup: str | None = None  # PD decode: where a retracted request's KV is kept (None: inferred)
    decode_host_receive: bool = False  # PD decode: disaggregation_decode_host_receive_threshold < 1
    flexkv: bool = False
    radix_cache_backend: str | None = None
    external_cache_linker: bool = False
    priority_scheduling: bool = False


def _get(args: Any, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def facts_of(server_args: Any, model_config: Any = None) -> Facts:
    """Facts from SGLang's ``ServerArgs`` (resolved or raw) and, if given, its ``ModelConfig``."""
    spec = _get(server_args, "speculative_algorithm")
    spec = None if spec in (None, "", "NONE", "none") else str(spec)
    model = model_facts(model_config)  # the model's own facts, read as SGLang decides them ({}: not known)
    chunk = _get(server_args, "chunked_prefill_size", -1)
    return Facts(
        disaggregation_mode=str(_get(server_args, "disaggregation_mode", "null")),
        transfer_backend=str(_get(server_args, "disaggregation_transfer_backend", "mooncake")),
        speculative_algorithm=spec,
        spec_topk=int(_get(server_args, "speculative_eagle_topk", 1)),
        spec_multi_layer=bool(_get(server_args, "enable_multi_layer_eagle", False)),
        spec_mtp=spec is not None and (spec.upper() == "NEXTN" or (
            spec.upper() == "EAGLE" and _get(server_args, "speculative_draft_model_path") in (None, ""))),
        hierarchical_cache=bool(_get(server_args, "enable_hierarchical_cache", False)),
        hicache_storage=_get(server_args, "hicache_storage_backend") not in (None, ""),
        hicache_buffer_only=str(_get(server_args, "hicache_host_memory_mode", "cache")) == "buffer_only",
        hisparse=bool(_get(server_args, "enable_hisparse", False)),
        pp_size=int(_get(server_args, "pp_size", 1)),
        tp_size=int(_get(server_args, "tp_size", 1)),
        # attn_dp_size > 1 is attention DP (--attn-dp-size N, and what SGLang resolves the deprecated
        # --dp-size N --enable-dp-attention into: it sets enable_dp_attention back to False then).
        dp_attention=bool(_get(server_args, "enable_dp_attention", False))
        or int(_get(server_args, "attn_dp_size", 1)) > 1,
        attn_dp_size=max(int(_get(server_args, "attn_dp_size", 1)), int(_get(server_args, "dp_size", 1))
                         if _get(server_args, "enable_dp_attention", False) else 1),
        dllm=_get(server_args, "dllm_algorithm") is not None,
        pdmux=bool(_get(server_args, "enable_pdmux", False)),
        overlap=not bool(_get(server_args, "disable_overlap_schedule", False)),
        radix=not bool(_get(server_args, "disable_radix_cache", False)),
        mamba_strategy=str(_get(server_args, "mamba_radix_cache_strategy", "auto")),
        linear_replayssm=bool(_get(server_args, "enable_linear_replayssm", False))
        or bool(_get(server_args, "enable_linear_replayssm_spec", False)),
        chunked=isinstance(chunk, int) and chunk > 0,
        mixed_chunk=bool(_get(server_args, "enable_mixed_chunk", False)),
        **model,
        streaming_session=bool(_get(server_args, "enable_streaming_session", False)),
        session_radix_cache=bool(_get(server_args, "enable_session_radix_cache", False)),
        lmcache=bool(_get(server_args, "enable_lmcache", False)),
        dcp_size=int(_get(server_args, "dcp_size", 1)),
        attn_cp_size=int(_get(server_args, "attn_cp_size", 1)),
        decode_kv_offload=bool(_get(server_args, "disaggregation_decode_enable_offload_kvcache", False)),
        decode_retraction_backup=None if _get(server_args, "disaggregation_decode_retraction_backup") is None
        else str(_get(server_args, "disaggregation_decode_retraction_backup")),
        decode_host_receive=float(_get(server_args, "disaggregation_decode_host_receive_threshold", 1.0)) < 1,
        flexkv=bool(_get(server_args, "enable_flexkv", False)),
        radix_cache_backend=None if _get(server_args, "radix_cache_backend") in (None, "")
        else str(_get(server_args, "radix_cache_backend")),
        external_cache_linker=bool(_get(server_args, "enable_unified_cache_external_linker", False)),
        priority_scheduling=bool(_get(server_args, "enable_priority_scheduling", False)),
    )


def retraction_backup(f: Facts) -> str:
    """Where a PD decode server keeps a retracted request's KV: the launch line's choice, else what SGLang 0.5.23
    resolves once the pools exist (``kv_cache_builder.resolve_decode_retraction_backup``): ``cpu_tensor`` for an MLA
    pool, a recurrent-state model, decode context parallel or decode KV offload, else ``host_pool``. NOTE: read
    at start from the facts; SGLang may resolve the other backend once the pools exist (both are checked)."""
    if f.decode_retraction_backup is not None:
        return f.decode_retraction_backup
    return "cpu_tensor" if f.mla or f.hybrid_linear or f.dcp_size > 1 or f.decode_kv_offload else "host_pool"


FACT_NAMES = tuple(f.name for f in fields(Facts))
