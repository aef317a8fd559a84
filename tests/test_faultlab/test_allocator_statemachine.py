"""faultlab.testing.strategies: the allocator state machine passes on our PageAllocator and catches buggy ones."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import run_state_machine_as_test

from faultlab.testing.strategies import (AllocatorInvariantError, AllocatorModel, AllocatorStateMachine, Op,
                                 PageAllocatorAdapter, allocator_machine, allocator_ops, run_ops)

FAST = settings(max_examples=40, stateful_step_count=30, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
HUNT = settings(FAST, max_examples=300)  # the bug hunts: enough room to find, still well under a second


class ListAllocator:
    """A plain free-list allocator (pages 1..n, LIFO reuse) with optional, deliberate bugs."""

    def __init__(self, num_pages: int = 12, bug: str | None = None):
        self.free_list = list(range(1, num_pages + 1))
        self.bug = bug

    def alloc(self, n):
        pages, self.free_list = self.free_list[:n], self.free_list[n:]
        return pages

    def free(self, pages):
        self.free_list[:0] = pages
        if self.bug == "double_free" and len(pages) >= 2:
            self.free_list.insert(0, pages[0])  # the batch free path frees its first page again

    def available(self):
        return len(self.free_list)


class ListedAllocator(ListAllocator):
    """The same allocator, exposing its free list (enables the free-list invariants)."""

    def free_pages(self):
        return list(self.free_list)


# -- our allocator passes ----------------------------------------------------------------------------
def test_state_machine_passes_on_page_allocator():
    run_state_machine_as_test(AllocatorStateMachine, settings=FAST)


def test_state_machine_passes_on_small_pool():
    machine = allocator_machine(lambda: PageAllocatorAdapter(num_pages=5), "SmallPool")
    run_state_machine_as_test(machine, settings=FAST)


def test_state_machine_passes_on_correct_list_allocator():
    run_state_machine_as_test(allocator_machine(lambda: ListedAllocator(12)), settings=FAST)


@FAST
@given(allocator_ops())
def test_op_sequences_on_page_allocator(ops):
    model = run_ops(PageAllocatorAdapter(num_pages=10), ops)
    assert model.adapter.available() == 10 and not model.refs


# -- buggy allocators are caught -----------------------------------------------------------------------
@pytest.mark.parametrize("cls, match", [(ListedAllocator, "duplicate pages in the free list"),
                                        (ListAllocator, "free \\+ in use != total")])
def test_state_machine_finds_double_free(cls, match):
    machine = allocator_machine(lambda: cls(12, bug="double_free"), "DoubleFree")
    with pytest.raises(AllocatorInvariantError, match=match):
        run_state_machine_as_test(machine, settings=HUNT)


def test_op_sequences_find_double_free():
    @HUNT
    @given(allocator_ops())
    def replay(ops):
        run_ops(ListedAllocator(12, bug="double_free"), ops)

    with pytest.raises(AllocatorInvariantError, match="double free"):
        replay()


def test_model_catches_double_free_in_page_allocator():
    """A double free in faultlab's PageAllocator (the fault catalog's `double_free`) breaks the model."""
    adapter = PageAllocatorAdapter(num_pages=6)
    model = AllocatorModel(adapter)
    assert Op("alloc", 2).apply(model) and Op("free", 1).apply(model)
    freed = adapter.free_pages()[0]
    adapter.free([freed])  # the bug: the same page freed again
    with pytest.raises(AllocatorInvariantError, match="duplicate pages in the free list"):
        model.check()


def test_model_catches_page_owned_twice():
    adapter = PageAllocatorAdapter(num_pages=6)
    model = AllocatorModel(adapter)
    assert Op("alloc", 2).apply(model)
    owned = model.owners[model.pick(0)][0]
    adapter.allocator.free_pages[0] = owned  # a corrupted free list hands an owned page out again
    with pytest.raises(AllocatorInvariantError, match="owned|both free and owned"):
        model.check()
        model.alloc(1)


def test_sharing_is_not_double_ownership():
    model = AllocatorModel(PageAllocatorAdapter(num_pages=6))
    assert Op("alloc", 3).apply(model) and Op("share", 2, target=0).apply(model)
    assert sorted(model.refs.values()) == [1, 2, 2]
    assert Op("release", target=0).apply(model)  # the first owner leaves; the shared pages stay
    model.check()
    assert model.adapter.available() == 4
    assert Op("release", target=0).apply(model)
    model.check()
    assert model.adapter.available() == 6


def test_allocator_ops_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="unknown op kind"):
        allocator_ops(kinds=("alloc", "steal"))
