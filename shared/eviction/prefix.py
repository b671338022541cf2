"""Prefix-aware eviction for KV records: leaves only, by decayed access counts (LRFU), newcomers last.

Why not LRU: a KV block is worth something only while every block before it is held (a lookup stops at
the first miss), yet LRU over single blocks evicts a prompt's *head* first (the connector reads a prefix
in order, so the head is the least recently touched) and keeps the tail as dead weight. Why not
W-TinyLFU: its admission judges blocks one by one and refuses links in the middle of a chain.

What this policy does instead:

- **Leaves only.** Every entry may name its parent (the record of the block before it: `insert`'s
  ``parent``); an entry with a resident child is never a victim, so a child is never kept after its
  parent is evicted. Keys without a known parent are roots (an encoder cache's entries, records written
  without the link): the policy is then LRFU with a newcomer discount.
- **Decayed counts (LRFU, Lee et al. 2001).** An entry's score is the sum over its accesses of
  2^-(age / half-life), the clock advancing by the size of every entry touched and the half-life a
  multiple of the capacity: recent reuse counts most, a prefix many requests read (a system prompt, a
  document's head: every request reading a child reads its parent too) collects all of their accesses.
  Ordered by ``log2(score) + rate x last access``, a key that never changes until the entry's next
  access, so the order lives in a heap.
- **Newcomers last.** A key never seen before starts at a fraction of one access (``newcomer``): on
  production traces most first-time chains are one-off prompts (82% of the Mooncake trace's documents are
  asked once), and a chain coming back (its count remembered) outranks them. This is admission by order,
  not by refusal: a newcomer is kept while there is room, and its chain stays whole.
- **Remembered counts.** An evicted entry's score is kept in a bounded ghost table; a popular prefix that
  comes back is not judged as a newcomer.
- **Orphans first.** When the owner removes an entry itself (an invalidation, a rewrite elsewhere), or
  a child arrives after its parent left, the descendants can no longer be reached by a prefix lookup:
  they are orphans and go before anything else.

Costs: a dict lookup and at most one heap push per insert and access, O(log n); `evict` pops leaves
off the heap, skipping stale entries (the heap is rebuilt when stale entries outnumber live ones, O(n)
amortised over as many pushes). `tiercache bench trace` prints the cost per put against LRU's.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from vllm_tiercache.shared.eviction.base import EvictionPolicy

#: heap priority of an orphan: below any live entry's (scores are logarithms: any real number)
_ORPHAN = -math.inf


class _Node:
    """One resident entry: its size, its parent node, its resident children, its score."""

    __slots__ = ("children", "crf", "key", "last", "orphan", "parent", "priority", "size", "version")

    def __init__(self, key: Any, size: int, parent: _Node | None) -> None:
        self.key = key
        self.size = size
        self.parent = parent
        self.children: set[_Node] | None = None
        self.crf = 0.0  # log2 of the decayed access count, as of `last`
        self.last = 0.0
        self.priority = 0.0
        self.orphan = False
        #: bumped on every change of priority or leafness: heap entries with another version are stale
        self.version = 0


class PrefixPolicy(EvictionPolicy):
    """Leaves-only LRFU over prefix chains, newcomers discounted (see the module docstring).

    Args:
        half_life: how fast an access's weight halves, in multiples of the capacity written or read (the
            clock advances by each touched entry's size): small is LRU, large is LFU. 1 measured best on
            the Mooncake trace from 1M to 10M tokens (docs/benchmarks-kv.md).
        history_size: how many evicted keys keep their score (a bounded ghost table); 0 disables it.
        newcomer: the weight of a never-seen key's first access (1: plain LRFU); 0.1 measured best.
    """

    name = "prefix"

    def __init__(self, capacity: int, half_life: float = 1.0, history_size: int = 65536,
                 newcomer: float = 0.1) -> None:
        super().__init__(capacity)
        if half_life <= 0 or not 0.0 < newcomer <= 1.0:
            raise ValueError("half_life must be positive and newcomer in (0, 1]")
        self.rate = 1.0 / (half_life * max(1, self.capacity))  # halvings per unit of the clock
        self.history_size = int(history_size)
        self.newcomer = float(newcomer)
        self._nodes: dict[Any, _Node] = {}
        self._heap: list[tuple[float, int, int, _Node]] = []
        self._ghost: OrderedDict[Any, tuple[float, float]] = OrderedDict()
        self._clock = 0.0  # units (bytes) touched so far
        self._seq = 0  # heap tie-break: older first

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    # ------------------------------------------------------------------------------------- queries
    def parent_of(self, key: Hashable) -> Any | None:
        """The resident parent's key (None for a root or an orphan): for tests and debugging."""
        node = self._nodes.get(key)
        return node.parent.key if node is not None and node.parent is not None else None

    def is_leaf(self, key: Hashable) -> bool:
        """Whether ``key`` is resident with no resident child, i.e. may be a victim."""
        node = self._nodes.get(key)
        return node is not None and not node.children

    def is_orphan(self, key: Hashable) -> bool:
        """Whether ``key`` is resident but cut off from its prefix (evicted before anything else)."""
        node = self._nodes.get(key)
        return node is not None and node.orphan

    def priority(self, key: Hashable) -> float:
        """The entry's eviction key (lowest goes first; orphans below every live entry)."""
        node = self._nodes[key]
        return _ORPHAN if node.orphan else node.priority

    # ------------------------------------------------------------------------------------ updates
    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        """``key`` is resident now; ``parent``: the key of the block before it (None: a root). A parent
        that is not resident makes the entry an orphan (it cannot be reached by a prefix lookup)."""
        node = self._nodes.get(key)
        if node is not None:  # rewritten in place: children stay attached
            node.size = int(size)
            self._touch(node)
            return
        parent_node = None
        orphan = False
        if parent is not None and parent != key:
            parent_node = self._nodes.get(parent)
            orphan = parent_node is None or parent_node.orphan
        node = _Node(key, int(size), parent_node)
        ghost = self._ghost.pop(key, None)
        if ghost is not None:
            node.crf, node.last = ghost
        else:
            node.crf, node.last = -math.inf, self._clock
        node.orphan = orphan
        self._nodes[key] = node
        if parent_node is not None:
            if parent_node.children is None:
                parent_node.children = set()
            if not parent_node.children:
                parent_node.version += 1  # no longer a leaf: its heap entry is stale
            parent_node.children.add(node)
        self._touch(node, self.newcomer if ghost is None else 1.0)

    def access(self, key: Hashable) -> None:
        node = self._nodes.get(key)
        if node is not None:
            self._touch(node)

    def remove(self, key: Hashable) -> None:
        """The owner dropped ``key``: its descendants become orphans (evicted before anything else)."""
        node = self._nodes.get(key)
        if node is None:
            return
        if node.children:
            stack = list(node.children)
            for child in stack:
                child.parent = None
            while stack:
                child = stack.pop()
                child.orphan = True
                child.version += 1
                if child.children:
                    stack.extend(child.children)
                else:
                    self._push(child)
            node.children = None
        self._forget(node)

    def evict(self, need: int, can_evict: Callable[[Any], bool] | None = None, incoming: int = 0) -> list[Any]:
        victims: list[Any] = []
        passed: list[_Node] = []
        freed = 0
        heap = self._heap
        while freed < need and heap:
            _prio, _seq, version, node = heapq.heappop(heap)
            if version != node.version or node.children or self._nodes.get(node.key) is not node:
                continue  # stale: re-scored, gained a child, or gone
            if can_evict is not None and not can_evict(node.key):
                passed.append(node)  # pinned: back on the heap once this eviction is done
                continue
            victims.append(node.key)
            freed += node.size
            self._forget(node)
        for node in passed:
            self._push(node)
        return victims

    # ----------------------------------------------------------------------------------- internals
    def _touch(self, node: _Node, weight: float = 1.0) -> None:
        """One more access of ``weight``: the score becomes weight + score x 2^-(rate x elapsed), in log2."""
        self._clock += node.size
        decayed = node.crf - self.rate * (self._clock - node.last)
        node.crf = decayed + math.log2(1.0 + weight * 2.0 ** -decayed) if decayed > -60.0 else math.log2(weight)
        node.last = self._clock
        # log2 of the score at any common later time t is crf - rate x (t - last): order by crf + rate x last
        node.priority = node.crf + self.rate * node.last
        node.version += 1
        if not node.children:
            self._push(node)

    def _push(self, node: _Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (_ORPHAN if node.orphan else node.priority, self._seq, node.version, node))
        if len(self._heap) > 2 * len(self._nodes) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        """The heap of live leaves only (stale entries dropped): O(n), amortised over the pushes that made it."""
        self._heap = [entry for entry in self._heap if entry[2] == entry[3].version and not entry[3].children
                      and self._nodes.get(entry[3].key) is entry[3]]
        heapq.heapify(self._heap)

    def _forget(self, node: _Node) -> None:
        """Drop ``node`` (a leaf, or one whose children were orphaned): its parent may become a leaf."""
        del self._nodes[node.key]
        node.version += 1
        parent = node.parent
        if parent is not None and parent.children is not None:
            parent.children.discard(node)
            if not parent.children and self._nodes.get(parent.key) is parent:
                parent.version += 1
                self._push(parent)
        node.parent = None
        if self.history_size > 0:
            self._ghost[node.key] = (node.crf, node.last)
            self._ghost.move_to_end(node.key)
            while len(self._ghost) > self.history_size:
                self._ghost.popitem(last=False)
