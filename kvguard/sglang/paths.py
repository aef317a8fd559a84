"""Every SGLang 0.5.23 serving path kvguard knows, each ``checked`` or ``refused``: written once.

A path writes, reads and releases KV through its own code, so a property shown on one path is not shown on another.
kvguard serves a configuration only when every path it turns on is ``checked``; a path that is ``refused`` stops the
server at start, with the reason, before SGLang launches a scheduler (:func:`refusal`: the launcher, exit 2; the
``ServerArgs.check_server_args`` hook for ``sglang.Engine`` and ``launch_server``), and again at install in each
scheduler, on the model it loaded (the last line of defence, with the uncovered-allocator check). A path a request
turns on (``per_request``: beam search) is refused for each such request, before any of its KV is written. There is no
third state: nothing is served with a warning.

The same list makes the ``kvguard_path_active{path,status}`` gauge (set in each scheduler at install) and the coverage
table in docs/sglang.md (:func:`coverage_table`, ``python -m kvguard.sglang.paths``, kept equal by a test). Stdlib
only at import; what each path is decided on (:class:`Facts`, from ``ServerArgs`` and the model): :mod:`.facts`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .facts import FACT_NAMES, Facts, facts_of, retraction_backup  # noqa: F401  (the registry decides on them)

CHECKED, REFUSED = "checked", "refused"


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
_PD_TRANSFER_TEST = "tests/test_faultlab/test_sglang_live/test_sglang_pd_transfer.py"  # Mooncake and NIXL pairs
_STALE_RELEASE = "tests/test_kvguard/test_sglang/test_sglang_stale_release.py"
_SPEC = "tests/test_faultlab/test_sglang_live/test_sglang_spec.py"
_MAMBA = "tests/test_faultlab/test_sglang_live/test_sglang_mamba.py"
# speculative algorithms kvguard checks (kvguard/sglang/spec.py)
SPEC_CHECKED = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")


def _standalone(f: "Facts") -> bool:
    return (f.speculative_algorithm or "").upper() == "STANDALONE"


def _spec_checked(f: "Facts") -> bool:
    return f.speculative_algorithm is not None and f.speculative_algorithm.upper() in SPEC_CHECKED \
        and f.spec_topk <= 1 and not f.spec_multi_layer

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
         "a retracted request is released through kvguard's safe release (schedule_batch.release_req: only the pages "
         "it legitimately holds, its row last checked a step before; a row not its own is never freed), then "
         "recorded again when SGLang readmits it (alloc_for_extend)",
         "tests/test_faultlab/test_sglang_live/test_sglang_retract.py", lambda f: True),
    Path("pause_generation_retract", CHECKED, "a /pause_generation call with mode=retract (any server, per call at "
         "runtime: it cannot be refused at start)",
         "every running request is retracted (Scheduler.pause_generation -> retract_all -> release_req) through "
         "kvguard's safe release, as a retraction, and recorded again when readmitted",
         f"{_STALE_RELEASE} (test_pause_generation_retract_frees_only_legitimate_pages)", lambda f: True),
    Path("priority_scheduling", CHECKED, "enable_priority_scheduling=True",
         "the waiting queue is ordered by priority (no KV path of its own); a running request preempted for a "
         "higher-priority one (PrefillAdder.preempt_to_schedule, unless disable_priority_preemption) is released "
         "through kvguard's safe release (release_req), re-queued and recorded again when readmitted",
         f"{_STALE_RELEASE} (test_priority_preemption_frees_only_legitimate_pages)", lambda f: f.priority_scheduling),
    Path("chunked_prefill", CHECKED, "chunked_prefill_size > 0",
         "a continuing chunk keeps its recorded prefix entries", _PATHS_TEST, lambda f: f.chunked),
    Path("mixed_chunk", CHECKED, "enable_mixed_chunk=True",
         "the running part's check travels with the mixed batch (mix_with_running); a running request whose row is "
         "not its own is aborted before the running part is prepared (Scheduler._reqs_finishing_inflight)",
         f"{_PATHS_TEST} (a stale row in a mixed step: {_STALE_RELEASE})", lambda f: f.mixed_chunk),
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
    Path("pd_decode_mooncake", CHECKED, "disaggregation_mode=decode, transfer backend mooncake",
         "rows recorded at DecodePreallocQueue._pre_alloc; the transfer's ticket stamped at commit (Mooncake "
         "reports Success only after every write of the room returned), so a page that changed hands while its "
         "transfer ran fails its next check; an aborted transfer's destination is held until every prefill rank "
         "acked its drain, never released on SGLang's timeout (kvguard.sglang.pd)", _PD_TRANSFER_TEST,
         lambda f: f.disaggregation_mode == "decode" and f.transfer_backend == "mooncake"),
    Path("pd_decode_nixl", CHECKED, "disaggregation_mode=decode, transfer backend nixl",
         "as pd_decode_mooncake (kvguard.sglang.pd): SGLang's NIXL worker sends a room's Success only after every "
         "WRITE handle of it (KV and aux) read DONE, which NIXL's UCX backend reports once its endpoint flush "
         "completed (every write landed), so the ticket stamped at commit is current; an aborted transfer's "
         "destination is held until every prefill rank acked its drain (SGLang's common deferred release, which "
         "NIXL declares), never released on SGLang's timeout", _PD_TRANSFER_TEST,
         lambda f: f.disaggregation_mode == "decode" and f.transfer_backend == "nixl"),
    Path("pd_decode_transfer_backend", REFUSED, "disaggregation_mode=decode with a transfer backend other than "
         "fake, mooncake or nixl (mori, ascend)",
         "kvguard's hold of an aborted transfer's destination and its commit stamp are shown on Mooncake and NIXL "
         "only: no test runs the other backends here, so a late write from an earlier transfer into a reallocated "
         "page is not shown caught there", "",
         lambda f: f.disaggregation_mode == "decode" and f.transfer_backend not in ("fake", "mooncake", "nixl")),
    Path("pd_prefill_mooncake", CHECKED, "disaggregation_mode=prefill, transfer backend mooncake",
         "extend batches recorded and checked like any other; the verdict is read before the batch's last chunk "
         "is queued for sending (process_batch_result_disagg_prefill), a flagged request aborted through SGLang's "
         "discard path, its sender failed: the decode server commits a transfer only on the prefill's Success, "
         "which the Mooncake worker sends after the room's last write and only for a room not failed, so KV sent "
         "early (cached prefix) or read from pages freed mid-send (released once the room failed) is never "
         "committed; a send's page tags, taken as it is queued, are compared when its room concludes: a page "
         "handed on before its read ended fails the room (kvguard.sglang.pd)", _PD_TRANSFER_TEST,
         lambda f: f.disaggregation_mode == "prefill" and f.transfer_backend == "mooncake"),
    Path("pd_prefill_nixl", CHECKED, "disaggregation_mode=prefill, transfer backend nixl",
         "as pd_prefill_mooncake (kvguard.sglang.pd): the verdict is read before the batch's last chunk is queued; "
         "SGLang's NIXL worker skips a chunk of a failed room and turns a Success into Failed for a room failed "
         "meanwhile (CommonKVManager.conclude_transfer, shared with Mooncake), and sends Success only after every "
         "handle of the room read DONE (and the same tag comparison at conclusion)", _PD_TRANSFER_TEST,
         lambda f: f.disaggregation_mode == "prefill" and f.transfer_backend == "nixl"),
    Path("pd_prefill", REFUSED, "disaggregation_mode=prefill with a transfer backend other than mooncake or nixl",
         "the verdict-before-send order and the Success-only-for-a-live-room order are shown on Mooncake and NIXL "
         "only: no test runs the other backends here", "",
         lambda f: f.disaggregation_mode == "prefill" and f.transfer_backend not in ("mooncake", "nixl")),
    Path("speculative_decoding", CHECKED, "speculative_algorithm EAGLE, EAGLE3, NEXTN (MTP: SGLang resolves it to "
         "EAGLE, the target's own MTP layer as the draft) or STANDALONE with speculative_eagle_topk 1 (chain drafting; "
         "SGLang's spec v2 worker, overlap on or off)",
         "the region alloc_for_spec_decode reserves past the committed length is recorded from the allocator's output "
         "with its tags; one batched check of every entry [0, nxt) of each row before the step's first forward "
         "covers the draft, verify and draft-extend reads of both pools (the draft pool shares slot ids), and "
         "redirects a flagged request's row to the padding slot; the verdict is read before the step's tokens are "
         "committed (kvguard/sglang/spec.py)", f"{_SPEC} (NEXTN on MLA: test_sglang_spec_mla.py)", _spec_checked),
    Path("speculative_tree_drafting", REFUSED, "speculative_algorithm set with speculative_eagle_topk > 1",
         "tree drafting: with page_size > 1 each branch gets its own page-aligned region and the prefix tail is "
         "copied into it, and the accepted path's KV is moved after verify; kvguard records the chain layout only",
         "", lambda f: f.speculative_algorithm is not None and f.spec_topk > 1),
    Path("speculative_other_algorithms", REFUSED, "speculative_algorithm NGRAM, DFLASH, UNO, DSPARK, "
         "FROZEN_KV_MTP (also what SGLang makes of NEXTN or EAGLE with a Gemma4 assistant draft) or a plugin's",
         "their workers prepare and verify steps outside the EAGLE v2 worker kvguard hooks (NGRAM does not run on a "
         "plain CPU: see docs/sglang.md)", "",
         lambda f: f.speculative_algorithm is not None and f.speculative_algorithm.upper() not in SPEC_CHECKED),
    Path("speculative_multi_layer_eagle", REFUSED, "enable_multi_layer_eagle=True",
         "MultiLayerEagleWorkerV2 runs its own draft steps outside the worker kvguard hooks", "",
         lambda f: f.speculative_algorithm is not None and f.spec_multi_layer),
    Path("hierarchical_cache", CHECKED, "enable_hierarchical_cache=True with host memory only (no "
         "hicache_storage_backend, hicache_host_memory_mode=cache; any write policy), on an aggregated server (with "
         "speculative decoding: hierarchical_cache_spec), for a model of MHA full-attention layers",
         "a load-back's new device pages expect LOADING until their host-to-device copy is submitted "
         "(HiCacheController.start_loading), then the tree adopts them with their allocation's tags "
         "(HybridCacheController.load); a batch prepared before the submission is flagged; evictions free device "
         "pages through the release kvguard wraps (tags bumped): a request still mapping one is flagged "
         "(kvguard.sglang.hicache)",
         "tests/test_kvguard/test_sglang/test_sglang_hicache.py (SGLang's UnifiedRadixCache, HybridCacheController "
         "and MHATokenToKVPoolHost, admission through its scheduler)", lambda f: f.hierarchical_cache),
    Path("hierarchical_cache_storage", REFUSED, "enable_hierarchical_cache=True with hicache_storage_backend set "
         "(file, mooncake, 3fs, nixl, ...)",
         "pages prefetched from storage enter the tree from the controller's background threads (storage control "
         "queues, insert_host) and are loaded back from there; no storage backend runs in the rig that shows the "
         "host-memory path, so this one is not shown", "",
         lambda f: f.hierarchical_cache and f.hicache_storage),
    Path("hierarchical_cache_buffer_only", REFUSED, "enable_hierarchical_cache=True with "
         "hicache_host_memory_mode=buffer_only",
         "host memory is only a staging buffer between device and storage: admission and load-back go through the "
         "buffer pipeline (BufferModePipeline.init_load_back), which is not shown", "",
         lambda f: f.hierarchical_cache and f.hicache_buffer_only),
    Path("hierarchical_cache_pd", REFUSED, "enable_hierarchical_cache=True with disaggregation_mode set",
         "a PD prefill server sends a request's cached prefix KV early while a load-back may still write it "
         "(maybe_send_cached_prefix_chunk), and a PD decode server's HiCache restore fills a gap of the preallocated "
         "row (decode_hicache_mixin) that kvguard's PD record does not follow; neither is shown", "",
         lambda f: f.hierarchical_cache and f.disaggregation_mode != "null"),
    Path("hierarchical_cache_spec", CHECKED, "enable_hierarchical_cache=True (host memory only) with chain "
         "speculative decoding (EAGLE, EAGLE3 or STANDALONE, speculative_eagle_topk 1) whose draft is a model of its "
         "own (SGLang's HiCacheDraftMode.SIDECAR)",
         "the draft model's KV is backed up and loaded back in the target's own operations on the target's device "
         "slots (a sidecar host pool with indices_from_pool=KV: one CacheOperation per HybridCacheController.load, "
         "submitted by the same start_loading), so hierarchical_cache's expectations cover both pools; the draft's "
         "reads run behind the target forward that waited for the layer events (kvguard.sglang.hicache)",
         "tests/test_kvguard/test_sglang/test_sglang_hicache_spec.py (SGLang's UnifiedRadixCache, "
         "HybridCacheController, its draft plan and sidecar host pool, alloc_for_spec_decode)",
         lambda f: f.hierarchical_cache and _spec_checked(f) and not f.spec_mtp),
    Path("hierarchical_cache_spec_packed", REFUSED, "enable_hierarchical_cache=True with an MTP / NextN draft (NEXTN, "
         "or EAGLE with no draft model: the target's own MTP layers; also an EAGLE draft path naming a NextN "
         "checkpoint, found at install)",
         "SGLang packs the draft's layers into the target's host pool (HiCacheDraftMode.PACKED) and moves them "
         "through extra transfers of their own (HybridCacheController._l2_load_transfers), which is not shown; "
         "refused at start from the launch line, and at install on the tree SGLang built "
         "(kvguard.sglang.model_facts.hicache_refusal)", "",
         lambda f: f.hierarchical_cache and f.spec_mtp),
    Path("hierarchical_cache_model", REFUSED, "enable_hierarchical_cache=True for an MLA, sliding-window, "
         "DeepSeek-V4 or hybrid linear-attention model",
         "their host pools (MLA latent rows, SWA pages and the full-to-SWA mapping, mamba state slots) move state "
         "through component transfers of their own; only the MHA host pool's load-back is shown", "",
         lambda f: f.hierarchical_cache and (f.mla or f.hybrid_swa or f.deepseek_v4 or f.hybrid_linear)),
    Path("hisparse", REFUSED, "enable_hisparse=True", "host-resident logical indices are not followed", "",
         lambda f: f.hisparse),
    Path("sliding_window", CHECKED, "a hybrid sliding-window model on SGLang's paged SWA pools "
         "(SWATokenToKVPoolAllocator: GPT-OSS, Gemma-2/3 style)",
         "SWA page tags bumped at every SWA alloc and release (the window sliding, tree eviction, retraction); each "
         "full slot's SWA peer recorded where the allocator pairs them; every position a sliding-window layer reads "
         "is checked through req_to_token and full_to_swa_index_mapping to that peer, with its tag, in one extra "
         "launch per forward into the same verdict (kvguard.sglang.swa)",
         "tests/test_faultlab/test_sglang_live/test_sglang_swa.py",
         lambda f: f.hybrid_swa and not (f.swa_compress or f.deepseek_v4)),
    Path("sliding_window_own_pool", REFUSED, "an SWA-compress hybrid (Gemma4, MiMo-V2) or DeepSeek-V4, or an SWA pool "
         "other than the paged SWATokenToKVPoolAllocator (per-request SWA ring, unified memory, HiSparse)",
         "these keep their SWA (and compressed) state in pools and maps of their own, which kvguard does not follow",
         "", lambda f: f.hybrid_swa and (f.swa_compress or f.deepseek_v4)),
    Path("sliding_window_spec", CHECKED, "a hybrid sliding-window model on SGLang's paged SWA pools with "
         "speculative_algorithm EAGLE, EAGLE3, NEXTN or STANDALONE, speculative_eagle_topk 1 (chain drafting)",
         "the spec reserve's SWA peers recorded where the allocator pairs them (kvguard.sglang.swa); each spec step's "
         "check (kvguard/sglang/spec.py) also reads, in one extra launch into the same verdict, every position a "
         "sliding-window layer of the step's draft and verify forwards reads, [seq_lens - window, nxt), through "
         "full_to_swa_index_mapping to that peer, with its tag (kvguard.sglang.swa)",
         "tests/test_faultlab/test_sglang_live/test_sglang_swa_spec.py",
         lambda f: f.hybrid_swa and not (f.swa_compress or f.deepseek_v4) and _spec_checked(f)),
    Path("sliding_window_pd", REFUSED, "a hybrid sliding-window model with disaggregation_mode set",
         "a PD transfer's ticket stamps full pages only, not the SWA pages it writes", "",
         lambda f: f.hybrid_swa and f.disaggregation_mode != "null"),
    Path("hybrid_linear_attention", CHECKED, "a hybrid linear-attention / mamba model (NemotronH, Qwen3-Next, "
         "Qwen3.5, ...: HybridReqToTokenPool)",
         "each request's recurrent-state slot carries a generation bumped when the slot allocator hands it out; the "
         "(slot, generation) a request was given is recorded where its row is (HybridReqToTokenPool.alloc) and, beside "
         "every KV check, one launch (captured beside it in the decode CUDA graphs) checks that the state index the "
         "forward reads is its own slot at its own generation (a bad one is pointed at the dummy slot before the "
         "forward); an aborted request never frees a slot handed on since (kvguard/sglang/mamba.py). Full-attention "
         "pages as for any model", f"{_MAMBA} (a NemotronH engine); tests/test_kvguard/test_sglang/"
         "test_sglang_mamba_state.py (SGLang's pools, mamba2 and GDN state); test_sglang_mamba_graph.py (decode graphs)",
         lambda f: f.hybrid_linear),
    Path("hybrid_linear_radix_no_buffer", CHECKED, "a hybrid linear-attention / mamba model with the radix cache on "
         "and mamba_radix_cache_strategy=no_buffer named on the launch line (page_size 1, overlap scheduler off)",
         "the generation of each state slot the tree takes (a finished request's own, or a copy in a fresh slot) is "
         "recorded (MambaComponent.cleanup_after_caching_req), read where a request matches the node, and each staged "
         "copy's source is checked against it on the device before the forward's copy "
         "(ScheduleBatch._collect_deferred_mamba_cow_and_clear): a source handed on since is pointed at the dummy slot "
         "and its request flagged in the state check beside the extend's KV check (kvguard/sglang/mamba_radix.py)",
         "tests/test_kvguard/test_sglang/test_sglang_mamba_radix.py (SGLang's UnifiedRadixCache, Rust tree core, "
         "mamba2 and GDN state); tests/test_faultlab/test_sglang_live/test_sglang_mamba_radix_engine.py (a NemotronH "
         "engine, radix cache on)", lambda f: f.hybrid_linear and f.radix and f.mamba_strategy == "no_buffer"),
    Path("hybrid_linear_radix_cache", REFUSED, "a hybrid linear-attention / mamba model with the radix cache on and "
         "any other mamba_radix_cache_strategy ('auto', SGLang's default, not yet resolved when kvguard decides: it "
         "resolves to extra_buffer with the overlap scheduler on a platform that supports it, a default Qwen3.5 / "
         "NemotronH launch on GPUs; extra_buffer; extra_buffer_lazy), or an int8 checkpoint pool",
         "extra_buffer's ping-pong tracking slots are donated to the tree (donate_mamba_ping_pong_slot) and the int8 "
         "checkpoint pool keeps states in slots of its own: neither is recorded", "",
         lambda f: f.hybrid_linear and f.radix and f.mamba_strategy != "no_buffer"),
    Path("hybrid_linear_state_pool", REFUSED, "a hybrid model whose row pool is not SGLang's plain "
         "HybridReqToTokenPool (PD decode's, the unified memory pool's virtual slot ids)",
         "state slots handed out or translated outside HybridReqToTokenPool.alloc are not recorded", "",
         lambda f: f.hybrid_linear and f.disaggregation_mode != "null"),
    Path("hybrid_linear_speculative", CHECKED, "a hybrid linear-attention model with EAGLE, EAGLE3 or NEXTN (MTP) "
         "chain drafting, no ReplaySSM", "each spec step's recurrent-state check rides beside its KV check, "
         "before the step's first forward (a bad state index pointed at the dummy slot before the verify reads it); "
         "the commit (HybridLinearAttnBackend.update_mamba_state_after_mtp_verify) scatters only into each request's "
         "recorded slot, any other destination pointed at the dummy slot and flagged (kvguard/sglang/mamba_spec.py)",
         "tests/test_faultlab/test_sglang_live/test_sglang_mamba_spec.py (NemotronH with an MTP layer, NEXTN 3/1/4); "
         "tests/test_kvguard/test_sglang/test_sglang_mamba_spec_commit.py; test_sglang_mamba_spec_tp.py (2 ranks)",
         lambda f: f.hybrid_linear and _spec_checked(f) and not f.linear_replayssm and not _standalone(f)),
    Path("hybrid_linear_spec_own_state", REFUSED, "a hybrid linear-attention model with speculative decoding and "
         "enable_linear_replayssm[_spec], or a STANDALONE draft", "ReplaySSM's commit folds per-slot rings of its own "
         "(and KDA's fused-accept pool) instead of scattering into the recorded slots; a STANDALONE draft of a hybrid "
         "model keeps recurrent state of its own: neither is followed", "",
         lambda f: f.hybrid_linear and f.speculative_algorithm is not None and (f.linear_replayssm or _standalone(f))),
    Path("hybrid_linear_tensor_parallel", CHECKED, "a hybrid linear-attention model with tp_size > 1",
         "each rank checks its own recurrent-state table and slots; the state check is launched right before the KV "
         "check's verdict is agreed and its per-request flags are MAXed into that verdict ahead of the ranks' one "
         "device all-reduce (no collective of its own, no host sync), so every rank aborts (or discards at prefill) "
         "the same requests, each releasing its slot safely: a slot handed on since is not freed "
         "(kvguard/sglang/mamba.py, VerdictRing.agree). Shown on 2 gloo ranks on the CPU (SGLang's "
         "HybridReqToTokenPool with mamba2 and GDN state, the fault on one rank); the NCCL agreement on GPUs is "
         "tensor_parallel's, not run with a hybrid model",
         "tests/test_kvguard/test_sglang/test_sglang_mamba_tp.py", lambda f: f.hybrid_linear and f.tp_size > 1),
    Path("dp_attention", CHECKED, "attn_dp_size > 1 with tp_size == attn_dp_size (one attention-TP rank per DP "
         "rank: --tp N --dp N --enable-dp-attention, or --tp N --attn-dp-size N)",
         "each attention-DP rank checks its own requests on its own pools, its verdict its own (SGLang's MLP sync "
         "re-counts every rank's batch before each forward); idle batches (ForwardMode.IDLE) carry no request; an "
         "eager decode check runs on the rank's own rows before SGLang pads its batch to the group's largest "
         "(kvguard/sglang/dp_attention.py). Shown with eager forwards on the CPU (a dense model); a decode graph "
         "replay carries the captured check as on one server, not run under DP attention",
         "tests/test_faultlab/test_sglang_live/test_sglang_dp_attention.py",
         lambda f: f.dp_attention and f.tp_size <= f.attn_dp_size),
    Path("dp_attention_attn_tp", CHECKED, "attn_dp_size > 1 with tp_size > attn_dp_size (attention TP inside each "
         "DP rank: --tp 8 --dp 4 --enable-dp-attention, or --tp 8 --attn-dp-size 4)",
         "as dp_attention, per DP rank; the tp_size / attn_dp_size attention-TP ranks of one DP rank (a scheduler "
         "process each, each with its own pools) run its one batch and each check it, and their verdicts are MAX "
         "all-reduced over SGLang's attention-TP group (get_attn_tp_group: that DP rank's ranks only; the "
         "tensor_parallel agreement), so a fault one rank sees aborts the same requests on all of them and on no "
         "other DP rank. Shown with eager forwards on the CPU (a dense model; tp_size=4, attn_dp_size=2; a fault "
         "struck in one scheduler process); not run on GPUs (the agreement's NCCL communicator over an "
         "attention-TP subgroup) or with decode graphs",
         "tests/test_faultlab/test_sglang_live/test_sglang_dp_attn_tp.py",
         lambda f: f.dp_attention and f.tp_size > f.attn_dp_size),
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
    Path("pd_decode_retraction_backup", CHECKED, "disaggregation_mode=decode with "
         "disaggregation_decode_retraction_backup=cpu_tensor or host_pool, or unset (SGLang resolves host_pool for an MHA pool, cpu_tensor for an MLA or "
         "hybrid linear-attention model, decode context parallel or decode KV offload)",
         "a retracted request's row [0, seqlen - 1) is checked before its KV is copied out through it (cpu_tensor: "
         "Req.offload_kv_cache; host_pool: UnifiedRadixCache.backup_kv_cache; broken: nothing copied, the request "
         "aborted, released safely), and its new row, recorded at _pre_alloc with that allocation's tags, is checked "
         "before the saved KV is written back through it (kvguard.sglang.pd_backup)",
         "tests/test_kvguard/test_sglang/test_sglang_pd_backup.py (SGLang's PD decode scheduling, retract and resume, "
         "on its real pools and decode tree; host_pool on its HybridCacheController and MHATokenToKVPoolHost)",
         lambda f: f.disaggregation_mode == "decode" and retraction_backup(f) in ("cpu_tensor", "host_pool")),
    Path("pd_decode_host_receive", REFUSED,
         "disaggregation_mode=decode with disaggregation_decode_host_receive_threshold < 1 (decode host KV "
         "buffering; SGLang runs it only with the host_pool retraction backup)",
         "the KV transfer writes a request's KV into host pool pages, restored through its row at its prebuilt step "
         "(get_new_prebuilt_batch): the restore is checked, but kvguard's transfer ticket and its hold of an aborted "
         "transfer's destination follow device pages only, so a late write into a reused host page is not shown "
         "caught", "",
         lambda f: f.disaggregation_mode == "decode" and f.decode_host_receive),
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


def coverage_table() -> str:
    """The docs' coverage table (markdown), from :data:`PATHS`."""
    rows = ["| path | kvguard | turned on by | what is followed / why refused | shown by |",
            "|---|---|---|---|---|"]
    for p in PATHS:
        rows.append(f"| `{p.name}` | **{p.status}** | {p.turned_on_by} | {p.why} | {p.evidence or '–'} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m kvguard.sglang.paths: the coverage table for docs/sglang.md
    print(coverage_table())
