"""A CPU rig of SGLang 0.5.23's REAL bookkeeping classes, for kvguard's tests and bench/sglang_compare.py.

(Test tooling, so it lives with faultlab: kvguard/ holds only what a deployment runs. The pytest
fixtures built on it are in tests/conftest.py.)

ReqToTokenPool, PagedTokenToKVPoolAllocator (or TokenToKVPoolAllocator) over an FP8 MHATokenToKVPool,
a real RadixCache, real Req / ScheduleBatch objects, and SGLang's own prepare_for_extend /
prepare_for_decode (alloc_for_extend / alloc_for_decode, the CPU "naive" allocation kernels). Nothing here
stands in for SGLang except the model forward, which kvguard does not touch.
"""
from __future__ import annotations

import itertools
import types
from array import array

import torch

_ids = itertools.count(1)


def publish_server_args(page_size: int, device: str = "cpu") -> None:
    """SGLang reads its runtime config bags (get_exec(), get_spec() ...) from a published ServerArgs."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size, device=device))


class Rig:
    """Real SGLang pools + tree on the CPU (``device``: on a GPU, for a host-time micro-benchmark there), and helpers
    to run requests through prefill and decode."""

    def __init__(self, page_size: int, *, num_tokens: int = 2048, rows: int = 16, context: int = 512,
                 allocator: str = "paged", radix: bool = True, need_sort: bool = False, device: str = "cpu"):
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        publish_server_args(page_size, device)
        self.page_size, self.device = page_size, device
        self.kv = MHATokenToKVPool(size=num_tokens, page_size=page_size, dtype=torch.float8_e4m3fn,
                                   head_num=2, head_dim=16, layer_num=1, device=device,
                                   enable_memory_saver=False)
        if allocator == "token":
            assert page_size == 1
            self.allocator = TokenToKVPoolAllocator(num_tokens, dtype=torch.float8_e4m3fn, device=device,
                                                    kvcache=self.kv, need_sort=need_sort)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(num_tokens, page_size=page_size,
                                                         dtype=torch.float8_e4m3fn, device=device,
                                                         kvcache=self.kv, need_sort=need_sort)
        self.req_to_token_pool = ReqToTokenPool(size=rows, max_context_len=context, device=device,
                                                enable_memory_saver=False)
        self.tree = RadixCache(CacheInitParams(disable=not radix, req_to_token_pool=self.req_to_token_pool,
                                               token_to_kv_pool_allocator=self.allocator,
                                               page_size=page_size))
        self.model_config = types.SimpleNamespace(is_encoder_decoder=False, vocab_size=32000)
        self.guard = None

    # -- kvguard ---------------------------------------------------------------------------------------
    def install(self, registry=None):
        from kvguard.sglang.plugin import install

        self.guard = install(self.req_to_token_pool, self.allocator, self.tree, registry=registry)
        return self.guard

    # -- requests --------------------------------------------------------------------------------------
    def make_req(self, prompt_len: int, max_new_tokens: int = 256, tokens=None):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        n = next(_ids)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
        params.normalize(None)
        ids = list(tokens) if tokens is not None else [100 + (n * 997 + i) % 30000 for i in range(prompt_len)]
        req = Req(rid=f"req{n}", origin_input_text="", origin_input_ids=array("q", ids),
                  sampling_params=params, vocab_size=32000)
        req.init_next_round_input(self.tree)
        req.extend_end = len(req.full_untruncated_fill_ids)
        return req

    def prefill(self, *prompt_lens: int, reqs=None):
        """SGLang's own ScheduleBatch.prepare_for_extend (alloc_for_extend, write_cache_indices)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        reqs = list(reqs) if reqs is not None else [self.make_req(n) for n in prompt_lens]
        batch = ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.allocator, self.tree,
                                       self.model_config, False, SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        return batch

    def publish(self, tokens) -> list[int]:
        """Prefill one request of ``tokens`` and finish it into the radix tree; its pages (the tree's now)."""
        req = self.prefill(reqs=[self.make_req(0, tokens=tokens)]).reqs[0]
        pages = self.pages_of(req)
        self.release(req, checkpoint=True)
        return pages

    def running(self, *prompt_lens: int):
        """Prefill requests of these prompt lengths, merge them, run one clean decode step (checked)."""
        batch = self.to_decode(*[self.prefill(n) for n in prompt_lens])
        self.decode(batch)
        if set(self.verdict(batch).values()) != {0}:
            raise RuntimeError(f"a fault-free decode step was flagged: {self.verdict(batch)}")
        self.sample(batch)
        return batch

    def to_decode(self, *batches):
        """Merge prefilled batches into one running batch (what the scheduler does after prefill)."""
        running = batches[0]
        for other in batches[1:]:
            running.merge_batch(other)
        return running

    def sample(self, batch) -> None:
        """Stand-in for the model: commit one output token per request (what process_batch_result does)."""
        for req in batch.reqs:
            if not req.finished():
                req.output_ids.append(7)

    def decode(self, batch):
        """One real ScheduleBatch.prepare_for_decode (alloc_for_decode, req_to_token write) + the check."""
        batch.prepare_for_decode()
        return batch.__dict__.get("_kvguard")

    def verdict(self, batch) -> dict:
        """{rid: 1 if flagged else 0} for this step's check (read like the scheduler does)."""
        return {rid: int(n > 0) for rid, n in self.bad_entries(batch).items()}

    def bad_entries(self, batch) -> dict:
        """{rid: bad token entries (+1 for a stale row)} for this step's check."""
        pending = batch.__dict__.get("_kvguard")
        if pending is None:
            return {}
        counts = pending.guard.check_of(pending).verdict.cpu().reshape(len(pending.reqs), -1).sum(1).tolist()
        return {req.rid: int(c) + (1 if s else 0) for req, c, s in zip(pending.reqs, counts, pending.stale)}

    def release(self, req, checkpoint: bool = False) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree, checkpoint=checkpoint)

    def row(self, req) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]

    def pages_of(self, req) -> list[int]:
        n = -(-int(req.kv.kv_allocated_len) // self.page_size)
        return (self.row(req)[: n * self.page_size: self.page_size].long() // self.page_size).tolist()

    def page_slots(self, page: int) -> torch.Tensor:
        return page * self.page_size + torch.arange(self.page_size, dtype=torch.int64)


def apply_check_hooks() -> bool:
    """Register kvguard's hooks (KVGUARD_MODE=check) and let SGLang's HookRegistry apply them.

    These are the two calls ``sglang.srt.plugins.load_plugins`` makes for an installed plugin.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry

    # import the modules that hold the targets first, as a scheduler process has them at load time
    import sglang.srt.managers.scheduler_components.batch_result_processor  # noqa: F401
    import sglang.srt.managers.schedule_batch  # noqa: F401
    import sglang.srt.mem_cache.kv_cache_builder  # noqa: F401

    from kvguard.sglang.plugin import register

    ok = register(env={"KVGUARD_MODE": "check"})
    HookRegistry.apply_hooks()
    return ok
