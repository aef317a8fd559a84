"""memory = "sglang": the engine on SGLang 0.5.23's own ReqToTokenPool / PagedTokenToKVPoolAllocator /
MHATokenToKVPool (FP8), so chaos runs exercise SGLang's real bookkeeping code."""
import tomllib
from pathlib import Path

import pytest
import torch

from faultlab.chaos.runner import checking_tracker, run_case
from faultlab.engine.engine import Engine, EngineConfig
from faultlab.engine.requests import Request
from faultlab.faults.catalog import FAULTS
from faultlab.oracle import Oracle
from faultlab.chaos.scenario import parse

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

SMOKE = Path(__file__).resolve().parents[3] / "scenarios" / "smoke.toml"
CLASSES = [n for n, c in FAULTS.items() if c.requires is None]


def _scenario(memory: str, page_size: int = 16):
    """The smoke scenario on ``memory``; page size 1 keeps the same token capacity (768 slots)."""
    data = tomllib.loads(SMOKE.read_text())
    data["engine"].update(memory=memory, page_size=page_size, num_pages=768 // page_size)
    return parse(data, f"<smoke {memory} ps{page_size}>")


@pytest.fixture(scope="module")
def sglang_smoke():
    return _scenario("sglang")


@pytest.fixture(scope="module")
def baseline(sglang_smoke):
    return run_case(sglang_smoke, None, 0, False)


def test_engine_is_backed_by_sglang_classes():
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    engine = Engine(EngineConfig(memory="sglang", num_pages=8, max_running=2))
    assert isinstance(engine.allocator.sglang, PagedTokenToKVPoolAllocator)
    assert isinstance(engine.req_pool.sglang, ReqToTokenPool)
    pool = engine.kv.sglang_pool
    assert isinstance(pool, MHATokenToKVPool) and pool.store_dtype == torch.uint8
    assert engine.kv.k[0].dtype == torch.float8_e4m3fn
    assert engine.kv.k[0].data_ptr() == pool.k_buffer[0].data_ptr()  # the engine writes SGLang's buffer
    assert engine.kv.k[0].shape[0] == 8 + 1 + engine.kv.guard_pages  # guard pages past the allocator's
    engine.add_request(Request("a", list(range(3, 23)), 2))  # 20 tokens: 2 pages
    engine.step()
    row, ps = engine.running[0].row, engine.page_size
    pages = engine.table[row, :2].long()
    slots = engine.req_pool.sglang.req_to_token[row + 1, :2 * ps].long()  # SGLang row = engine row + 1
    assert torch.equal(slots, (pages[:, None] * ps + torch.arange(ps)).flatten())


@pytest.mark.parametrize("page_size", [16, 1], ids=["ps16", "ps1"])
def test_page_table_faults_write_req_to_token(page_size):
    engine = Engine(EngineConfig(memory="sglang", page_size=page_size, num_pages=128 // page_size, max_running=2))
    engine.add_request(Request("a", list(range(3, 23)), 2))
    engine.step()
    row, ps, req_to_token = engine.running[0].row, engine.page_size, engine.req_pool.sglang.req_to_token
    if ps == 1:  # the page table is SGLang's req_to_token itself (a view of rows 1..)
        assert engine.table.untyped_storage().data_ptr() == req_to_token.untyped_storage().data_ptr()
    engine.table[row, 1] = 7  # what a page-table fault does
    assert engine.table[row, 1] == 7  # the next access pushes it into SGLang's req_to_token
    assert torch.equal(req_to_token[row + 1, ps:2 * ps].long(), 7 * ps + torch.arange(ps))
    req_to_token[row + 1, 0:ps] = 5 * ps + torch.arange(ps, dtype=torch.int32)  # a write to req_to_token alone
    assert engine.table[row, 0] == 5  # ... is what the engine reads next


@pytest.mark.parametrize("page_size", [16, 1], ids=["ps16", "ps1"])
def test_fault_free_run_matches_native(page_size):
    native = run_case(_scenario("native", page_size), None, 0, False)
    sglang = run_case(_scenario("sglang", page_size), None, 0, True)
    assert all(o["status"] == "finished" for o in sglang.outputs.values())
    assert sglang.outputs == native.outputs
    assert sglang.false_positives == 0 and not any(sglang.sglang_checks.values())


def test_real_double_free_shares_a_page_and_the_earlier_owner_is_aborted():
    oracle = Oracle()
    engine = Engine(EngineConfig(memory="sglang", num_pages=8, max_running=2, prefix_cache=False),
                    tracker=checking_tracker(), observers=[oracle])
    engine.add_request(Request("gone", list(range(3, 13)), 1))
    engine.run()
    page = int(engine.allocator.free_pages[0])  # its page, just freed (LIFO)
    engine.allocator.free(torch.tensor([page]))  # the bug: a second, separate free
    assert engine.allocator.sglang.free_pages.tolist().count(page) == 2  # really twice in SGLang's list
    earlier, later = Request("earlier", list(range(20, 30)), 4), Request("later", list(range(40, 50)), 4)
    engine.add_request(earlier)
    engine.add_request(later)
    engine.step()  # both prefill: each takes one copy of the page
    assert engine.table[earlier.row, 0] == engine.table[later.row, 0] == page
    engine.run()
    assert earlier.status == "aborted" and later.status == "finished"
    report = oracle.report
    assert report.victims_aborted == ["earlier"] and not report.false_positives
    assert sum(report.corrupted_tokens.values()) == 0


def test_double_free_case_through_run_case(sglang_smoke, baseline):
    on = run_case(sglang_smoke, "double_free", 0, True, baseline=baseline)
    assert on.injected == 1 and on.sglang_checks["duplicate_free_pages"] is not None  # SGLang's free_pages
    assert on.victims >= 1 and on.victims_aborted == on.victims
    assert on.corrupted_tokens_returned == 0 and on.false_positives == 0 and on.nonvictim_mismatches == 0


@pytest.mark.parametrize("fault", CLASSES)
def test_smoke_fault_classes_on_sglang_with_the_tracker(fault, sglang_smoke, baseline):
    on = run_case(sglang_smoke, fault, 0, True, baseline=baseline)
    assert on.false_positives == 0 and on.nonvictim_mismatches == 0, on.to_json()
    if FAULTS[fault].detectable:
        assert on.victims >= 1 and on.victims_aborted == on.victims, on.to_json()
        assert on.corrupted_tokens_returned == 0


def test_kv_residual_on_sglang_pool_matches_native():
    """engine.kv_residual over SGLang's MHATokenToKVPool buffers: the same greedy tokens as the native
    backend (the residual pages are the engine's own; SGLang's pool holds the main FP8 bytes)."""
    config = dict(model="tiny", kv_dtype="fp8", weight_dtype="int4", page_size=16, num_pages=48, max_running=4,
                  kv_residual=True, kv_residual_window=32)
    outputs = {}
    for memory in ("native", "sglang"):
        engine = Engine(EngineConfig(memory=memory, **config))
        assert engine.kv.residual is not None
        requests = [Request(f"r{i}", list(range(3 + i, 60 + 7 * i)), 12) for i in range(3)]
        for r in requests:
            engine.add_request(r)
        engine.run()
        outputs[memory] = {r.rid: r.output for r in requests}
        assert all(r.status == "finished" for r in requests)
    assert outputs["sglang"] == outputs["native"]
