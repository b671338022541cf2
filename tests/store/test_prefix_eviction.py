"""The prefix policy (`shared.eviction.prefix`) on its own and in the memory tier: leaves first, no child
kept without its parent, orphans first, pins, rewrites in place, returning chains over newcomers.

The invariants every policy keeps under random traffic (capacity, pins, resident set) are in
test_eviction.py, which takes every registered policy, this one included.
"""

from __future__ import annotations

import random

import torch

from vllm_tiercache.shared.eviction import PrefixPolicy, make_policy
from vllm_tiercache.shared.eviction.lineage import PARENT_KEY, parent_of
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.tiers.memory.config import MemoryTierConfig
from vllm_tiercache.shared.store.tiers.memory.tier import MemoryTier


def _chain(p: PrefixPolicy, keys: list[str], parent: str | None = None) -> None:
    for key in keys:
        p.insert(key, 1, parent)
        parent = key


def test_leaves_go_first_and_a_parent_only_once_its_children_are_gone() -> None:
    p = PrefixPolicy(100)
    _chain(p, ["a", "b", "c"])  # a <- b <- c: the head is the oldest, yet only c is a leaf
    assert [p.is_leaf(k) for k in "abc"] == [False, False, True]
    assert p.parent_of("c") == "b" and p.parent_of("a") is None
    assert p.evict(1) == ["c"]
    assert p.evict(2) == ["b", "a"]
    assert len(p) == 0


def test_a_child_is_never_kept_while_its_parent_is_evicted_under_random_chains() -> None:
    """Random prefix trees, hits on random prefixes, evictions when full: every resident entry's parent
    is resident (no dead weight), and what is held stays within capacity."""
    rng = random.Random(7)
    p = PrefixPolicy(60)
    parent_of_key: dict[tuple[int, ...], tuple[int, ...] | None] = {}
    for _ in range(3000):
        path = tuple(rng.choice((0, 1, 2)) for _ in range(rng.randint(1, 12)))
        keys = [path[: i + 1] for i in range(len(path))]
        hit = 0
        while hit < len(keys) and keys[hit] in p:
            hit += 1
        for key in keys[:hit]:
            p.access(key)
        for i in range(hit, len(keys)):
            parent = keys[i - 1] if i else None
            parent_of_key[keys[i]] = parent
            p.insert(keys[i], 1, parent)
            if len(p) > 60:
                p.evict(len(p) - 60)
        assert len(p) <= 60
        for key in list(parent_of_key):
            if key in p and parent_of_key[key] is not None and not p.is_orphan(key):
                assert parent_of_key[key] in p, f"{key} kept after its parent {parent_of_key[key]} was evicted"


def test_removing_a_parent_orphans_its_descendants_and_they_go_first() -> None:
    p = PrefixPolicy(100)
    _chain(p, ["a", "b", "c"])
    p.insert("x", 1)  # a root, older than nothing: would go before the chain's leaf otherwise? not after this
    for _ in range(5):
        p.access("x")
    p.remove("a")  # an invalidation: b and c cannot be reached by a prefix lookup any more
    assert p.is_orphan("b") and p.is_orphan("c") and p.parent_of("b") is None
    assert p.evict(2) == ["c", "b"]
    assert "x" in p


def test_a_child_whose_parent_is_not_held_is_an_orphan_and_goes_first() -> None:
    p = PrefixPolicy(100)
    p.insert("root", 1)
    p.insert("stray", 1, parent="gone")
    assert p.is_orphan("stray")
    assert p.evict(1) == ["stray"]


def test_a_pinned_leaf_is_skipped_and_keeps_its_parent() -> None:
    p = PrefixPolicy(100)
    _chain(p, ["a", "b"])
    p.insert("z", 1)
    victims = p.evict(3, can_evict=lambda k: k != "b")
    assert victims == ["z"]  # a is not a leaf while b (pinned) holds on to it
    assert "a" in p and "b" in p
    assert p.evict(2) == ["b", "a"]  # unpinned, b leaves first, then a


def test_a_rewrite_in_place_keeps_the_children() -> None:
    p = PrefixPolicy(100)
    _chain(p, ["a", "b"])
    p.insert("a", 2)  # the same record written again
    assert p.parent_of("b") == "a" and not p.is_orphan("b") and not p.is_leaf("a")


def test_a_returning_chain_outranks_a_newcomer() -> None:
    """A key evicted before comes back with its remembered count: first-time chains go before it."""
    p = PrefixPolicy(4)
    _chain(p, ["d1", "d2"])
    for _ in range(3):
        p.access("d1")
        p.access("d2")
    assert p.evict(2) == ["d2", "d1"]
    _chain(p, ["d1", "d2"])  # the document again
    _chain(p, ["n1", "n2"])  # a one-off
    assert p.evict(2) == ["n2", "n1"]


def test_the_heap_stays_bounded_by_the_resident_leaves() -> None:
    """Stale heap entries are dropped once they outnumber the live ones: memory O(resident entries)."""
    p = PrefixPolicy(50)
    _chain(p, [f"k{i}" for i in range(50)])
    for _ in range(200):
        for i in range(50):
            p.access(f"k{i}")
    assert len(p._heap) <= 2 * len(p) + 64


def test_parent_of_reads_only_a_digest() -> None:
    digest = StoreKey("x").digest
    assert parent_of({PARENT_KEY: digest}) == digest
    assert parent_of({PARENT_KEY: "not bytes"}) is None and parent_of(None) is None and parent_of({}) is None


def test_the_memory_tier_defaults_to_it_and_never_holds_a_block_without_its_prefix() -> None:
    """Chains of 1 KiB records naming their parents, many times the capacity: whatever the tier holds of a
    chain is a prefix of it, and the eviction listeners hear of every record that left."""
    assert MemoryTierConfig().policy == "prefix"
    tier = MemoryTier(MemoryTierConfig(capacity=16 * 1024))
    evicted: list[bytes] = []
    tier.add_eviction_listener(evicted.append)
    record = torch.zeros(1024, dtype=torch.uint8)
    chains = {c: [StoreKey(f"chain{c}|{i}") for i in range(10)] for c in range(6)}
    rng = random.Random(3)
    for _ in range(60):
        keys = chains[rng.randrange(6)]
        present = tier.contains_many(keys)
        hit = present.index(False) if False in present else len(present)
        tier.get_many(keys[:hit])
        items = [(k, record, {PARENT_KEY: keys[i - 1].digest} if i else None)
                 for i, k in enumerate(keys) if i >= hit]
        tier.put_many(items)
        assert tier.usage()["bytes_used"] <= 16 * 1024
        for chain in chains.values():
            held = tier.contains_many(chain)
            assert held == sorted(held, reverse=True), f"a block held without its prefix: {held}"
    assert evicted and all(isinstance(d, bytes) for d in evicted)


def test_make_policy_builds_it_by_name() -> None:
    assert isinstance(make_policy("prefix", 10), PrefixPolicy)
