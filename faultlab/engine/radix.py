"""A page-granular prefix cache: finished requests publish their full pages; new requests share them.

Each node holds one full page (``page_size`` tokens) and is keyed by those tokens under its parent, so
a path from the root spells a token prefix. Running requests lock the nodes they share
(``lock_ref``); only unlocked leaves are evicted, least recently used first, and eviction frees their
pages through the allocator. The cache owns the pages of its nodes.

Hit guard (``tagger``, set by an engine that has a tracker): a node records its page's tag when it is
inserted (``tagger(pages)`` -> a transfer-guard ticket, kvguard/transfer.py), and a request that hits
the node records *that* tag for the page (``hit_tags``), not the page's current one. A node whose page
was freed and handed out again while the tree still referenced it (a bug in a release path) then fails
its sharers' checks instead of passing them with the new owner's tag.
"""
import itertools
from dataclasses import dataclass, field

import torch

from .memory import PageAllocator


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    page: int
    parent: "Node | None"
    children: dict = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    tag: object = None  # the page's tag when the node was inserted (0-d tensor; None: unguarded)


class RadixCache:
    """Prefix cache over full pages. ``match`` + ``lock`` on admission, ``insert`` + ``unlock`` on finish."""

    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True):
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self.root = Node(key=(), page=-1, parent=None)
        self._clock = itertools.count(1)
        self.num_pages = 0
        self.evictions = 0  # pages evicted so far
        self.lock_underflows = 0
        self.tagger = None  # pages -> ticket with .tags (the tracker's transfer_issue), or None

    # -- lookup --------------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_pages: int) -> list[Node]:
        """Nodes of the longest cached prefix of ``tokens``, at most ``max_pages`` pages."""
        nodes, node, ps = [], self.root, self.page_size
        if not self.enabled:
            return nodes
        for j in range(min(max_pages, len(tokens) // ps)):
            child = node.children.get(tuple(tokens[j * ps:(j + 1) * ps]))
            if child is None:
                break
            nodes.append(child)
            node = child
        now = next(self._clock)
        for n in nodes:
            n.last_access = now
        return nodes

    def lock(self, nodes: list[Node]) -> None:
        for n in nodes:
            n.lock_ref += 1

    def unlock(self, nodes: list[Node]) -> None:
        for n in nodes:
            if n.lock_ref == 0:
                # NOTE: an unlock without a matching lock is a bookkeeping bug (faultlab injects it);
                # count it, as SGLang's tree sanity check flags a negative lock_ref, and keep serving.
                self.lock_underflows += 1
                continue
            n.lock_ref -= 1

    # -- publish -------------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Publish the full pages of a finished request; return pages the cache did NOT take (to free)."""
        ps = self.page_size
        n_full = min(len(pages), len(tokens) // ps) if self.enabled else 0
        node, rejected, now, created = self.root, [], next(self._clock), []
        for j in range(n_full):
            key = tuple(tokens[j * ps:(j + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = Node(key=key, page=pages[j], parent=node, last_access=now)
                node.children[key] = child
                self.num_pages += 1
                created.append(child)
            elif child.page != pages[j]:
                rejected.append(pages[j])  # the cache already holds this prefix page
            child.last_access = now
            node = child
        self._tag(created)
        return rejected + list(pages[n_full:])

    def _tag(self, nodes: list[Node]) -> None:
        """Record the current tag of each new node's page (one gather for the batch; no host sync)."""
        ticket = self.tagger(torch.tensor([n.page for n in nodes], dtype=torch.int64)) if self.tagger and nodes else None
        if ticket is not None:
            for n, tag in zip(nodes, ticket.tags):
                n.tag = tag

    def hit_tags(self, nodes: list[Node]):
        """The tags recorded when ``nodes`` were inserted (int64 [n]), or None when any is unguarded."""
        if not nodes or any(n.tag is None for n in nodes):
            return None
        return torch.stack([n.tag for n in nodes])

    # -- eviction ------------------------------------------------------------------------------------
    def evictable_pages(self) -> int:
        """Pages that eviction could free now: nodes whose whole subtree is unlocked (one pass)."""
        unlocked = {}
        for node in reversed(list(self.nodes())):  # pre-order reversed: children before parents
            unlocked[node] = node.lock_ref == 0 and all(unlocked[c] for c in node.children.values())
        return sum(unlocked.values())

    def evict(self, n_pages: int, *, allow_locked: bool = False) -> list[int]:
        """Free up to ``n_pages`` pages of LRU unlocked leaves; return the freed pages."""
        freed = []
        while len(freed) < n_pages:
            leaves = [n for n in self.nodes() if not n.children and (allow_locked or n.lock_ref == 0)]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_access)
            freed.append(self.remove(victim))
            self.evictions += 1
        if freed:
            self.allocator.free(torch.tensor(freed, dtype=torch.int64))
        return freed

    def remove(self, node: Node) -> int:
        """Unlink a leaf (its page is the caller's to free)."""
        assert not node.children, "only leaves are removed"
        del node.parent.children[node.key]
        self.num_pages -= 1
        return node.page

    def pages(self) -> list[int]:
        return [n.page for n in self.nodes()]

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
