"""Every SGLang 0.5.23 serving path kvguard knows, each ``checked`` or ``refused``: written once.

A path writes, reads and releases KV through its own code, so a property shown on one path is not shown
on another. kvguard serves a configuration only when every path it turns on is ``checked``; a path that
is ``refused`` stops the server at start, with the reason, before SGLang launches a scheduler
(:func:`refusal`: the launcher, exit 2; the ``ServerArgs.check_server_args`` hook for ``sglang.Engine``
and ``launch_server``), and again at install in each scheduler, on the model it loaded (the last line of
defence, with the uncovered-allocator check). A path a request turns on (``per_request``: beam search) is
refused for each such request, before any of its KV is written. There is no third state: nothing is served
with a warning.

The same list makes the ``kvguard_path_active{path,status}`` gauge (set in each scheduler at install) and
the coverage table in docs/sglang.md (:func:`coverage_table`, ``python -m kvguard.sglang.paths``; a test
checks the docs against it).

Stdlib only at import: the server's facts are read from SGLang's ``ServerArgs`` here, the model's through
:mod:`kvguard.sglang.model_facts` (SGLang's own tests, imported when a model config is given).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

from .model_facts import model_facts

CHECKED, REFUSED = "checked", "refused"


@dataclass(frozen=True)
class Facts:
    """What kvguard decides on, read once from SGLang's server arguments and the model's config."""

    disaggregation_mode: str = "null"
    transfer_backend: str = "mooncake"
    speculative_algorithm: str | None = None
    hierarchical_cache: bool = False
    hisparse: bool = False
    pp_size: int = 1
    tp_size: int = 1
    dp_attention: bool = False
    dllm: bool = False
    pdmux: bool = False
    overlap: bool = True
    radix: bool = True
    chunked: bool = True
    mixed_chunk: bool = False
    mla: bool = False
    hybrid_swa: bool = False
    hybrid_linear: bool = False
    encoder_decoder: bool = False
    streaming_session: bool = False
    session_radix_cache: bool = False
    lmcache: bool = False
    dcp_size: int = 1
    attn_cp_size: int = 1
    decode_kv_offload: bool = False
    decode_retraction_backup: str | None = None  # PD decode: where a retracted request's KV is kept (None: inferred)
    flexkv: bool = False
    radix_cache_backend: str | None = None
    external_cache_linker: bool = False


@dataclass(frozen=True)
class Path:
    name: str
    status: str  # CHECKED or REFUSED
    turned_on_by: str  # the server setting or model property that selects the path
    why: str  # checked: what kvguard follows there; refused: what it does not follow
    evidence: str  # checked: the test through SGLang's real code that shows a fault caught there
    applies: Callable[[Facts], bool]
    per_request: bool = False  # turned on by a request, not a server setting: refused per request, never at start


_LIVE = "tests/test_faultlab/test_sglang_live/test_sglang_engine.py"
_PATHS_TEST = "tests/test_faultlab/test_sglang_live/test_sglang_paths.py"

PATHS: tuple[Path, ...] = (
    Path("extend_decode", CHECKED, "always",
         "rows recorded at alloc_for_extend / alloc_for_decode; every token entry checked before each forward",
         _LIVE, lambda f: True),
    Path("overlap_scheduler", CHECKED, "default (disable_overlap_schedule=False)",
         "the check travels with the batch copy; an in-flight batch's verdict is read with its sampled ids",
         f"{_LIVE} (page 16)", lambda f: f.overlap),
    Path("normal_loop", CHECKED, "disable_overlap_schedule=True", "as above, without the in-flight batch",
         f"{_LIVE} (page 1)", lambda f: not f.overlap),
    Path("radix_cache", CHECKED, "default (disable_radix_cache=False)",
         "prefix pages expect the tag the tree adopted them with (checkpoint)", _LIVE, lambda f: f.radix),
    Path("retraction", CHECKED, "the KV pool running out during decode (any server; SGLANG_TEST_RETRACT=1 forces it)",
         "a retracted request is released through kvguard's safe release (only the pages it legitimately holds: its "
         "row was last checked a step before), then recorded again when SGLang readmits it (alloc_for_extend)",
         "tests/test_faultlab/test_sglang_live/test_sglang_retract.py", lambda f: True),
    Path("chunked_prefill", CHECKED, "chunked_prefill_size > 0",
         "a continuing chunk keeps its recorded prefix entries", _PATHS_TEST, lambda f: f.chunked),
    Path("mixed_chunk", CHECKED, "enable_mixed_chunk=True",
         "the running part's check travels with the mixed batch (mix_with_running)", _PATHS_TEST,
         lambda f: f.mixed_chunk),
    Path("tensor_parallel", CHECKED, "tp_size > 1",
         "each rank checks its own pools; verdicts agree by one device all-reduce (MAX) per check over kvguard's own NCCL communicator (`kvguard/sglang/agree.py`), stale rows by a CPU one when rows or the batch change",
         "tests/test_kvguard/test_sglang/test_sglang_tp_stale.py", lambda f: f.tp_size > 1),
    Path("mla", CHECKED, "a model with multi-head latent attention (DeepSeek-V2/V3 style)",
         "MLATokenToKVPool shares req_to_token and the allocators kvguard follows", _PATHS_TEST,
         lambda f: f.mla),
    Path("pd_decode", CHECKED, "disaggregation_mode=decode, transfer backend fake",
         "rows recorded at DecodePreallocQueue._pre_alloc; transfer tags: a late write from an earlier "
         "transfer stamps its stale tag on the page, and the page's next check fails", _PATHS_TEST,
         lambda f: f.disaggregation_mode == "decode" and f.transfer_backend == "fake"),
    Path("pd_decode_transfer_backend", REFUSED, "disaggregation_mode=decode with a real transfer backend",
         "the backend does not stamp kvguard's transfer tags after the KV lands, so a late write from an "
         "earlier transfer into a reallocated page would go unseen", "",
         lambda f: f.disaggregation_mode == "decode" and f.transfer_backend != "fake"),
    Path("pd_prefill", REFUSED, "disaggregation_mode=prefill",
         "the prefill side's send path (early send, HiCache load-back racing the RDMA) is not followed", "",
         lambda f: f.disaggregation_mode == "prefill"),
    Path("speculative_decoding", REFUSED, "speculative_algorithm set (EAGLE, EAGLE3, NGRAM, STANDALONE, ...)",
         "verify and draft forwards read the region alloc_for_spec_decode reserves past the committed "
         "length, which kvguard does not record", "", lambda f: f.speculative_algorithm is not None),
    Path("hierarchical_cache", REFUSED, "enable_hierarchical_cache=True",
         "pages loaded back from host are allocated without the tree's checkpoint, so their expectation "
         "is not recorded (a healthy request could be aborted)", "", lambda f: f.hierarchical_cache),
    Path("hisparse", REFUSED, "enable_hisparse=True", "host-resident logical indices are not followed", "",
         lambda f: f.hisparse),
    Path("sliding_window", REFUSED, "a hybrid sliding-window model (SWATokenToKVPoolAllocator)",
         "SWA layers read through full_to_swa_index_mapping, a second namespace kvguard does not record", "",
         lambda f: f.hybrid_swa),
    Path("hybrid_linear_attention", REFUSED, "a hybrid linear-attention / mamba model",
         "mamba state slots are not followed", "", lambda f: f.hybrid_linear),
    Path("dp_attention", REFUSED, "attn_dp_size > 1 (or the deprecated dp_size > 1 with enable_dp_attention=True)",
         "per-DP-rank batches and their agreement are not followed", "", lambda f: f.dp_attention),
    Path("pipeline_parallel", REFUSED, "pp_size > 1", "micro-batches across stages are not followed", "",
         lambda f: f.pp_size > 1),
    Path("encoder_decoder", REFUSED, "an encoder-decoder model",
         "cross-attention rows and their multi-token decode are not followed", "", lambda f: f.encoder_decoder),
    Path("dllm", REFUSED, "dllm_algorithm set", "diffusion blocks reuse rows outside alloc_for_extend", "",
         lambda f: f.dllm),
    Path("pd_multiplexing", REFUSED, "enable_pdmux=True", "split prefill/decode streams are not followed", "",
         lambda f: f.pdmux),
    Path("streaming_session", REFUSED, "enable_streaming_session=True",
         "a streaming session lends one KV record (row, pages, tree lock) to each of its turns, a new request each "
         "time, and keeps or releases it on its own path; kvguard follows a row per request, not a record lent "
         "across requests", "", lambda f: f.streaming_session),
    Path("session_radix_cache", REFUSED, "enable_session_radix_cache=True",
         "a session's radix subtree is opened and released by the session, outside the request releases and tree "
         "checkpoints kvguard follows", "", lambda f: f.session_radix_cache),
    Path("lmcache", REFUSED, "enable_lmcache=True",
         "LMCache's radix cache stores KV out and loads it back into pages outside the tree checkpoint, so their "
         "expectations are not recorded", "", lambda f: f.lmcache),
    Path("decode_context_parallel", REFUSED, "dcp_size > 1",
         "each rank holds a slice of every request's tokens, so a req_to_token entry does not name a page this "
         "rank's pools hold", "", lambda f: f.dcp_size > 1),
    Path("attention_context_parallel", REFUSED, "attn_cp_size > 1",
         "a prefill split across context-parallel ranks writes KV through per-rank metadata kvguard does not read",
         "", lambda f: f.attn_cp_size > 1),
    Path("pd_decode_kv_offload", REFUSED, "disaggregation_decode_enable_offload_kvcache=True",
         "the PD decode side offloads finished KV to host storage and back outside the tree checkpoint", "",
         lambda f: f.decode_kv_offload),
    Path("pd_decode_retraction_backup", REFUSED,
         "disaggregation_mode=decode without disaggregation_decode_retraction_backup=none (SGLang infers a backup)",
         "a retracted request's KV is copied to the host through its req_to_token row, unchecked since the step "
         "before, and restored later into new pages, where its mapping is intact: a row broken in between would "
         "restore another request's KV unseen (with 'none' a retracted PD request is turned away with HTTP 503)", "",
         lambda f: f.disaggregation_mode == "decode" and f.decode_retraction_backup != "none"),
    Path("flexkv", REFUSED, "enable_flexkv=True",
         "FlexKVRadixCache allocates slots in match_prefix / init_load_back, loads FlexKV's stored KV into them and "
         "hangs them on the tree as a new node, outside the tree checkpoint, so their expectations are not recorded",
         "",
         lambda f: f.flexkv),
    Path("radix_cache_backend", REFUSED, "radix_cache_backend set (flexkv, or a tree registered with "
         "register_radix_cache_backend)",
         "a tree cache built by a registered factory instead of SGLang's default chain: kvguard follows the "
         "checkpoint of the trees it knows, not what a plug-in tree allocates, loads or frees", "",
         lambda f: f.radix_cache_backend is not None),
    Path("unified_cache_external_linker", REFUSED, "enable_unified_cache_external_linker=True",
         "the external linker (UnifiedCacheLinkerWrapper.load_back) loads KV from an external store (mooncake, mori) "
         "into device slots it gives the request as prefix, outside alloc_for_extend and the tree checkpoint, so "
         "their expectations are not recorded", "",
         lambda f: f.external_cache_linker),
    Path("beam_search", REFUSED, "a request with sampling_params beam_width > 1 (page_size 1)",
         "a beam group's member rows are forked and extended outside alloc_for_extend / alloc_for_decode and ride "
         "the decode batch past its requests (append_beam_tail), none of which kvguard records; each such request "
         "is turned away (HTTP 400) by SGLang's own beam validation before any of its KV is written",
         "tests/test_faultlab/test_sglang_live/test_sglang_engine.py", lambda f: False, per_request=True),
)
BY_NAME = {p.name: p for p in PATHS}
assert len(BY_NAME) == len(PATHS)


class KVGuardRefused(ValueError):
    """KVGUARD_MODE=check with a serving path kvguard does not check: the server must not start."""


def active(facts: Facts) -> list[Path]:
    """The paths this configuration turns on."""
    return [p for p in PATHS if p.applies(facts)]


def refusal(facts: Facts) -> str | None:
    """None if every active path is checked; otherwise one message naming each refused path and why."""
    refused = [p for p in active(facts) if p.status == REFUSED]
    if not refused:
        return None
    parts = "; ".join(f"{p.name} ({p.turned_on_by}): {p.why}" for p in refused)
    return (f"kvguard: refusing to start: KVGUARD_MODE=check, and this configuration turns on "
            f"{'a path' if len(refused) == 1 else 'paths'} kvguard does not check: {parts}. "
            f"Serve without {'it' if len(refused) == 1 else 'them'}, or with KVGUARD_MODE=off")


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
        hierarchical_cache=bool(_get(server_args, "enable_hierarchical_cache", False)),
        hisparse=bool(_get(server_args, "enable_hisparse", False)),
        pp_size=int(_get(server_args, "pp_size", 1)),
        tp_size=int(_get(server_args, "tp_size", 1)),
        # attn_dp_size > 1 is attention DP (--attn-dp-size N, and what SGLang resolves the deprecated
        # --dp-size N --enable-dp-attention into: it sets enable_dp_attention back to False then).
        dp_attention=bool(_get(server_args, "enable_dp_attention", False))
        or int(_get(server_args, "attn_dp_size", 1)) > 1,
        dllm=_get(server_args, "dllm_algorithm") is not None,
        pdmux=bool(_get(server_args, "enable_pdmux", False)),
        overlap=not bool(_get(server_args, "disable_overlap_schedule", False)),
        radix=not bool(_get(server_args, "disable_radix_cache", False)),
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
        flexkv=bool(_get(server_args, "enable_flexkv", False)),
        radix_cache_backend=None if _get(server_args, "radix_cache_backend") in (None, "")
        else str(_get(server_args, "radix_cache_backend")),
        external_cache_linker=bool(_get(server_args, "enable_unified_cache_external_linker", False)),
    )


def coverage_table() -> str:
    """The docs' coverage table (markdown), from :data:`PATHS`."""
    rows = ["| path | kvguard | turned on by | what is followed / why refused | shown by |",
            "|---|---|---|---|---|"]
    for p in PATHS:
        rows.append(f"| `{p.name}` | **{p.status}** | {p.turned_on_by} | {p.why} | {p.evidence or '–'} |")
    return "\n".join(rows)


FACT_NAMES = tuple(f.name for f in fields(Facts))


if __name__ == "__main__":  # python -m kvguard.sglang.paths: the coverage table for docs/sglang.md
    print(coverage_table())
