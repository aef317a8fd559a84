"""Hypothesis strategies and a state machine for page allocators: point them at your own allocator.

An allocator is driven through a tiny adapter protocol (:class:`AllocatorAdapter`):

- ``alloc(n) -> pages``: hand out ``n`` pages (any iterable of ints);
- ``free(pages)``: take pages back;
- ``available() -> int``: how many pages are free;
- optionally ``free_pages() -> list[int]``: the free list itself, which enables the two checks that
  need to see it (no page both free and owned; no duplicate in the free list).

A reference model (:class:`AllocatorModel`) keeps the truth the allocator must agree with: which pages
are in use and how many owners share each. Owners (think: requests) are created by ``alloc``, grow by
``extend``, shrink by ``free`` (their last pages), copy a prefix by ``share`` (prefix caching) and drop
everything by ``release``; a page goes back to the allocator when its last owner lets go. After every
operation the model checks:

1. an allocation never returns a page that is already owned, nor the same page twice
   (no page owned twice except through sharing);
2. ``available() + pages in use == total``;
3. no page is both free and owned (needs ``free_pages``);
4. no page appears twice in the free list (needs ``free_pages``).

Two ways to run it: ``@given(allocator_ops())`` + :func:`run_ops`, or the stateful
:class:`AllocatorStateMachine` (see :func:`allocator_machine`). :class:`PageAllocatorAdapter` adapts
faultlab's own ``PageAllocator``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, runtime_checkable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

OP_KINDS = ("alloc", "extend", "share", "free", "release")


class AllocatorInvariantError(AssertionError):
    """The allocator disagrees with the reference model; the message says how."""


@runtime_checkable
class AllocatorAdapter(Protocol):
    """What the model needs from an allocator (``free_pages()`` is optional)."""

    def alloc(self, n: int) -> Iterable[int]: ...

    def free(self, pages: list[int]) -> None: ...

    def available(self) -> int: ...


class PageAllocatorAdapter:
    """Adapter for faultlab's ``PageAllocator`` (pages 1..num_pages; tensors in, lists out)."""

    def __init__(self, num_pages: int = 16, allocator=None):
        from faultlab.engine.memory import PageAllocator

        self.allocator = allocator if allocator is not None else PageAllocator(num_pages)

    def alloc(self, n: int) -> list[int]:
        return self.allocator.alloc(n).tolist()

    def free(self, pages: list[int]) -> None:
        import torch

        self.allocator.free(torch.tensor(pages, dtype=torch.int64))

    def available(self) -> int:
        return self.allocator.available()

    def free_pages(self) -> list[int]:
        return self.allocator.free_pages.tolist()


# -- the reference model ---------------------------------------------------------------------------
class AllocatorModel:
    """Reference truth (owners and per-page share counts) driving an adapter, checking it each step."""

    def __init__(self, adapter: AllocatorAdapter):
        missing = [m for m in ("alloc", "free", "available") if not callable(getattr(adapter, m, None))]
        if missing:
            raise TypeError(f"allocator adapter {type(adapter).__name__} lacks {missing}; it needs alloc(n), "
                            f"free(pages) and available() (see AllocatorAdapter)")
        self.adapter = adapter
        self.total = adapter.available()  # a fresh allocator: every page is free
        if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total < 1:
            raise ValueError(f"allocator adapter {type(adapter).__name__}: available() = {self.total!r} on a "
                             f"fresh allocator; it must be an int >= 1 (every page free)")
        self.refs: dict[int, int] = {}  # page -> number of owners
        self.owners: dict[int, list[int]] = {}  # owner id -> its pages, in logical order
        self._next_owner = 0

    # -- queries -----------------------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        """Pages the model believes are free."""
        return self.total - len(self.refs)

    def owner_ids(self) -> list[int]:
        return sorted(self.owners)

    def pick(self, index: int) -> int | None:
        """The live owner at ``index`` (modulo their number), or None when there is none."""
        ids = self.owner_ids()
        return ids[index % len(ids)] if ids else None

    # -- operations (each returns False when it is not possible now) --------------------------------
    def alloc(self, n: int) -> bool:
        """A new owner with ``n`` fresh pages."""
        if n > self.free_count:
            return False
        owner = self._new_owner()
        self.owners[owner] = self._take(n)
        return True

    def extend(self, owner: int, n: int) -> bool:
        """``owner`` grows by ``n`` fresh pages."""
        if owner not in self.owners or n > self.free_count:
            return False
        self.owners[owner].extend(self._take(n))
        return True

    def share(self, owner: int, k: int) -> bool:
        """A new owner shares the first ``k`` pages of ``owner`` (a prefix-cache hit)."""
        pages = self.owners.get(owner, [])[:k]
        if not pages:
            return False
        for p in pages:
            self.refs[p] += 1
        self.owners[self._new_owner()] = list(pages)
        return True

    def free(self, owner: int, k: int) -> bool:
        """``owner`` drops its last ``k`` pages."""
        pages = self.owners.get(owner)
        if not pages:
            return False
        k = min(k, len(pages))
        dropped, self.owners[owner] = pages[len(pages) - k:], pages[:len(pages) - k]
        self._drop(dropped)
        return True

    def release(self, owner: int) -> bool:
        """``owner`` drops all its pages and goes away."""
        if owner not in self.owners:
            return False
        self._drop(self.owners.pop(owner))
        return True

    # -- checks ------------------------------------------------------------------------------------
    def check(self) -> None:
        """Invariants 2-4 (1 is checked on every allocation); the free-list ones first (more precise)."""
        listing = getattr(self.adapter, "free_pages", None)
        if listing is not None:
            self._check_free_list([int(p) for p in listing()])
        available = self.adapter.available()
        if available + len(self.refs) != self.total:
            raise AllocatorInvariantError(
                f"free + in use != total: available()={available}, in use={len(self.refs)}, "
                f"total={self.total} (a double free or a leak)")

    def _check_free_list(self, free: list[int]) -> None:
        dup = sorted({p for p in free if free.count(p) > 1})
        if dup:
            raise AllocatorInvariantError(f"duplicate pages in the free list: {dup} (a double free)")
        both = sorted(set(free) & set(self.refs))
        if both:
            raise AllocatorInvariantError(f"pages both free and owned: {both} (freed while in use)")

    # -- internals ---------------------------------------------------------------------------------
    def _new_owner(self) -> int:
        self._next_owner += 1
        return self._next_owner

    def _take(self, n: int) -> list[int]:
        """Allocate ``n`` pages and check invariant 1 on them."""
        if n == 0:
            return []
        pages = [int(p) for p in self.adapter.alloc(n)]
        if len(pages) != n:
            raise AllocatorInvariantError(f"alloc({n}) returned {len(pages)} pages: {pages}")
        if len(set(pages)) != n:
            raise AllocatorInvariantError(f"alloc({n}) returned a page twice: {pages}")
        owned = sorted(set(pages) & set(self.refs))
        if owned:
            raise AllocatorInvariantError(f"alloc({n}) returned pages already owned: {owned} "
                                          f"(owned twice without sharing)")
        for p in pages:
            self.refs[p] = 1
        return pages

    def _drop(self, pages: list[int]) -> None:
        """Decrement share counts; pages whose last owner left go back to the allocator together."""
        freed = []
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                del self.refs[p]
                freed.append(p)
        if freed:
            self.adapter.free(freed)


# -- operation sequences ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """One allocator operation. ``target`` picks a live owner (modulo their number); ``n`` is a count."""

    kind: str
    n: int = 1
    target: int = 0

    def apply(self, model: AllocatorModel) -> bool:
        """Run this op on ``model``; False when it is not possible now (e.g. no owner, no room)."""
        if self.kind == "alloc":
            return model.alloc(self.n)
        owner = model.pick(self.target)
        if owner is None:
            return False
        if self.kind == "release":
            return model.release(owner)
        return getattr(model, self.kind)(owner, self.n)


def allocator_ops(max_pages_per_op: int = 4, min_size: int = 1, max_size: int = 40,
                  kinds: Iterable[str] = OP_KINDS) -> st.SearchStrategy[list[Op]]:
    """Lists of :class:`Op` (alloc n / extend / share / free / release), replayable by :func:`run_ops`."""
    kinds = tuple(kinds)
    unknown = sorted(set(kinds) - set(OP_KINDS))
    if unknown:
        raise ValueError(f"unknown op kind(s) {unknown}; valid: {list(OP_KINDS)}")
    op = st.builds(Op, kind=st.sampled_from(kinds), n=st.integers(1, max_pages_per_op),
                   target=st.integers(0, 63))
    return st.lists(op, min_size=min_size, max_size=max_size)


def run_ops(adapter: AllocatorAdapter, ops: Iterable[Op], release_all: bool = True) -> AllocatorModel:
    """Replay ``ops`` against ``adapter``, checking the invariants after every one; with
    ``release_all`` every owner is released at the end (the allocator must then be whole again)."""
    model = AllocatorModel(adapter)
    model.check()
    for op in ops:
        op.apply(model)
        model.check()
    if release_all:
        for owner in model.owner_ids():
            model.release(owner)
            model.check()
    return model


# -- the state machine -----------------------------------------------------------------------------
class AllocatorStateMachine(RuleBasedStateMachine):
    """Stateful test of an allocator against :class:`AllocatorModel`; invariants after every step.

    Point it at an allocator by subclassing and setting ``adapter_factory`` (a zero-argument callable
    returning a fresh adapter), or with :func:`allocator_machine`. Run it with
    ``hypothesis.stateful.run_state_machine_as_test`` or through its ``TestCase`` attribute.
    """

    adapter_factory: Callable[[], AllocatorAdapter] = staticmethod(lambda: PageAllocatorAdapter(16))
    def __init__(self):
        super().__init__()
        self.model = AllocatorModel(type(self).adapter_factory())

    def _has_owner(self) -> bool:
        return bool(self.model.owners)

    @rule(n=st.integers(1, 4))
    def alloc(self, n):
        self.model.alloc(n)

    @precondition(_has_owner)
    @rule(pick=st.integers(0, 63), n=st.integers(1, 4))
    def extend(self, pick, n):
        self.model.extend(self.model.pick(pick), n)

    @precondition(_has_owner)
    @rule(pick=st.integers(0, 63), k=st.integers(1, 8))
    def share(self, pick, k):
        self.model.share(self.model.pick(pick), k)

    @precondition(_has_owner)
    @rule(pick=st.integers(0, 63), k=st.integers(1, 4))
    def free(self, pick, k):
        self.model.free(self.model.pick(pick), k)

    @precondition(_has_owner)
    @rule(pick=st.integers(0, 63))
    def release(self, pick):
        self.model.release(self.model.pick(pick))

    @invariant()
    def allocator_agrees_with_model(self):
        self.model.check()

    @precondition(_has_owner)
    @rule()
    def release_all(self):
        """Every owner lets go: a correct allocator is whole again (checked by the invariant)."""
        for owner in self.model.owner_ids():
            self.model.release(owner)


def allocator_machine(adapter_factory: Callable[[], AllocatorAdapter],
                      name: str = "UserAllocatorMachine") -> type[AllocatorStateMachine]:
    """An :class:`AllocatorStateMachine` subclass driving adapters made by ``adapter_factory``."""
    if not callable(adapter_factory):
        raise TypeError(f"adapter_factory must be a zero-argument callable returning a fresh adapter, got "
                        f"{adapter_factory!r}")
    return type(name, (AllocatorStateMachine,), {"adapter_factory": staticmethod(adapter_factory)})
