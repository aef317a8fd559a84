"""A SGLang 0.5.23 ``Scheduler`` shell over a rig's real pools and tree, for tests that drive SGLang's own scheduling
methods step by step (admission, retraction, pause, HiCache load-back) without a server."""
from __future__ import annotations

from types import SimpleNamespace as NS


def scheduler_shell(rig, *, mixed: bool = False, priority: bool = False, overlap: bool = True,
                    hierarchical: bool = False, running=None):
    """A ``Scheduler`` without its ``__init__``: the rig's pools and tree, SGLang's own scheduling methods.

    Stand-ins (none of them touches KV): the grammar queue (empty), the policy's ordering (as queued), the
    admission budget (every free row; ``budget`` overrides it), metrics, and the output streamer (records what
    is streamed in ``streamed``)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    s = Scheduler.__new__(Scheduler)
    streamed: list = []
    fields = dict(
        grammar_manager=NS(has_waiting_grammars=lambda: False), enable_priority_preemption=priority,
        enable_priority_scheduling=priority, is_hybrid_swa=False, waiting_queue=[], chunked_req=None,
        min_free_slots_delayer=None, policy=NS(calc_priority=lambda *a, **k: None), processed_tokens_counter=None,
        chunked_prefill_size=None, dynamic_chunk_sizer=None,
        tp_worker=NS(model_runner=NS(attn_backend=NS(), prefill_aware_swa=False)), page_size=rig.page_size,
        tree_cache=rig.tree, token_to_kv_pool_allocator=rig.allocator, req_to_token_pool=rig.req_to_token_pool,
        new_token_ratio_tracker=NS(current=0.0, decay_step=lambda: None), max_prefill_tokens=16384,
        is_mixed_chunk=mixed, priority_scheduling_preemption_threshold=0, max_prefill_bs=1 << 30,
        max_running_requests=64, dllm_config=None, enable_lora=False, enable_hicache_storage=False,
        enable_lmcache=False, truncation_align_size=None, model_config=rig.model_config, enable_overlap=overlap,
        spec_algorithm=SpeculativeAlgorithm.NONE, enable_hierarchical_cache=hierarchical,
        enable_unified_cache_external_linker=False, hisparse_coordinator=None,
        load_inquirer=NS(_get_num_pending_tokens=lambda **k: 0), enable_skip_finishing_decode=False,
        result_queue=[], device="cpu", forward_ct=1, decode_offload_manager=None,
        output_streamer=NS(stream_output=lambda reqs, *a, **k: streamed.extend(reqs)),
        # pause_generation
        _engine_paused=False, enable_overlap_mlx=False, _pause_started_at=None, last_batch=None,
        cur_batch_for_debug=None, disaggregation_mode=DisaggregationMode.NULL,
        metrics_reporter=NS(last_gen_throughput=0.0, current_scheduler_metrics_enabled=False),
        kv_events_publisher=NS(publish_kv_events=lambda: None),
        running_batch=running if running is not None else ScheduleBatch(reqs=[]),
    )
    for name, value in fields.items():
        setattr(s, name, value)
    s.streamed = streamed
    s.budget = None  # the admission budget (None: every free row)
    s.get_num_allocatable_reqs = lambda running_bs, *a, **k: \
        rig.req_to_token_pool.available_size() if s.budget is None else s.budget
    s._add_request_to_queue = lambda req, is_retracted=False: s.waiting_queue.append(req)
    return s
