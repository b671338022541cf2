"""shared.eviction on its own: the policy registry, policy invariants under random traffic, admission, scan
resistance, sketch aging.

Tests that take every policy read them from the registry, so a new policy is tested here by registering it.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import vllm_tiercache.shared.eviction as eviction
from vllm_tiercache.shared.eviction import (
    DEFAULT_POLICY,
    POLICIES,
    EvictionPolicy,
    FrequencySketch,
    LRUPolicy,
    WTinyLFUPolicy,
    make_policy,
    memory_tier_policies,
    policy_class,
    policy_class_name,
    policy_entry,
    policy_names,
)

REPO = Path(__file__).resolve().parents[2]
#: the policies this package ships, in the order errors list them (a new policy may come after them)
BUILT_IN = ["lru", "lfu", "wtinylfu"]


class _Owner:
    """A minimal cache owner: keeps sizes, pins some keys, asks the policy for room like the real owners."""

    def __init__(self, policy_name: str, capacity: int) -> None:
        self.capacity = capacity
        self.policy = make_policy(policy_name, capacity)
        self.sizes: dict[int, int] = {}
        self.pinned: set[int] = set()
        self.evicted: list[int] = []

    def used(self) -> int:
        return sum(self.sizes.values())

    def request(self, key: int, size: int) -> bool:
        if key in self.sizes:
            self.policy.access(key)
            return True
        need = self.used() + size - self.capacity
        for victim in self.policy.evict(need, lambda k: k not in self.pinned, size):
            assert victim not in self.pinned, "a pinned entry was evicted"
            self.evicted.append(victim)
            del self.sizes[victim]
        if self.used() + size <= self.capacity:
            self.sizes[key] = size
            self.policy.insert(key, size)
        return False


@pytest.mark.parametrize("name", POLICIES)
def test_invariants_under_random_traffic(name: str) -> None:
    """Capacity never exceeded, pinned entries never evicted, the policy tracks exactly the resident set."""
    rng = random.Random(1)
    owner = _Owner(name, capacity=200)
    for _ in range(5000):
        key = int(rng.paretovariate(0.8)) % 300
        owner.request(key, 4 + key % 5 * 8)
        if owner.sizes and rng.random() < 0.3:
            owner.pinned = set(rng.sample(sorted(owner.sizes), k=min(3, len(owner.sizes))))
        assert owner.used() <= owner.capacity
        assert len(owner.policy) == len(owner.sizes)
        assert all(k in owner.policy for k in owner.sizes)


def test_lru_order_and_pinned_skipped() -> None:
    p = LRUPolicy(3)
    for k in "abc":
        p.insert(k, 1)
    p.access("a")  # order now b, c, a
    assert p.evict(1, lambda k: k != "b") == ["c"]
    assert p.evict(2) == ["b", "a"]


def test_wtinylfu_rejects_cold_candidates_and_keeps_the_hot_set() -> None:
    owner = _Owner("wtinylfu", capacity=100)
    for _ in range(3):
        for k in range(100):
            owner.request(k, 1)
    for k in range(10):  # one-offs: each is judged against a hot entry when it leaves the window, and loses
        owner.request(f"cold-{k}", 1)
    assert owner.policy.rejections >= 9
    assert sum(k in owner.sizes for k in range(100)) >= 98


def test_wtinylfu_scan_does_not_flush_the_popular_set() -> None:
    owner = _Owner("wtinylfu", capacity=50)
    hot = list(range(40))
    for _ in range(20):
        for k in hot:
            owner.request(k, 1)
    for k in range(1000, 3000):  # a one-off sweep, 40x the capacity
        owner.request(k, 1)
    assert sum(k in owner.sizes for k in hot) >= 35
    lru = _Owner("lru", capacity=50)
    for _ in range(20):
        for k in hot:
            lru.request(k, 1)
    for k in range(1000, 3000):
        lru.request(k, 1)
    assert not any(k in lru.sizes for k in hot)  # what the admission filter saves us from


def _with_big_candidate(size: int, hits: int, size_aware: bool) -> tuple[WTinyLFUPolicy, list[Any]]:
    """95 cold entries and 10 warm ones in main, then a candidate of `size` units asked `hits` + 1 times."""
    p = WTinyLFUPolicy(100, window_fraction=0.05, size_aware=size_aware)  # window: 5 units
    p.sketch = FrequencySketch(1024)  # sized up front: growing the sketch while filling would forget counts
    for k in range(95):
        p.insert(k, 1)
    p.evict(0, incoming=5)  # fill: the whole window moves to main, admitted while there is room
    for k in range(10):  # ten warm entries
        for _ in range(3):
            p.access(k)
    p.insert("big", size)
    for _ in range(hits):
        p.access("big")
    return p, p.evict(size, incoming=5)  # "big" leaves the window alone and needs `size` units in main


def test_wtinylfu_size_aware_candidate_must_beat_every_victim_per_unit_of_size() -> None:
    p, victims = _with_big_candidate(size=4, hits=5, size_aware=True)  # 6 hits / 4 units > 1 hit / unit
    assert "big" not in victims and p.segment_of("big") == "probation"
    assert not any(v in range(10) for v in victims)  # warm entries (4 hits / unit) are not displaced
    p, victims = _with_big_candidate(size=40, hits=2, size_aware=True)  # 3 hits for 40 units: refused
    assert "big" in victims and p.rejections >= 1
    p, victims = _with_big_candidate(size=40, hits=2, size_aware=False)  # Caffeine: raw counts, admitted
    assert "big" not in victims


def test_pinned_loser_is_first_to_go_once_unpinned() -> None:
    p = WTinyLFUPolicy(10)
    for k in range(10):
        p.insert(k, 1)
        for _ in range(3):
            p.access(k)
    p.evict(0, incoming=1)  # the window is empty: "new" alone will leave it
    p.insert("new", 1)
    pinned = {"new"}
    victims = p.evict(1, lambda k: k not in pinned, incoming=1)  # "new" loses but is pinned
    assert "new" not in victims and len(victims) == 1
    assert p.rejections == 1
    assert p.evict(1) == ["new"]  # unpinned: it goes first


def test_sketch_counts_and_halves() -> None:
    s = FrequencySketch(1024)
    s.sample_size = 10
    for _ in range(8):
        s.increment("a")
    assert s.frequency("a") == 8 and s.frequency("never") == 0
    s.increment("b")
    s.increment("b")  # the 10th increment: every counter is halved
    assert s.frequency("a") == 4 and s.frequency("b") == 1


def test_unknown_policy_names_field_value_and_choices() -> None:
    allowed = re.escape(", ".join(policy_names()))
    with pytest.raises(ValueError, match=rf"^encoder_cache_policy: invalid value 'arc'; allowed: {allowed}$"):
        make_policy("arc", 10, "encoder_cache_policy")
    assert DEFAULT_POLICY in POLICIES


def test_the_built_in_policies_are_registered_in_order() -> None:
    """The names configs accept, and where: lfu scans every entry per eviction, so not in the memory tier."""
    assert [name for name in policy_names() if name in BUILT_IN] == BUILT_IN
    assert POLICIES == policy_names()
    assert [name for name in memory_tier_policies() if name in BUILT_IN] == ["lru", "wtinylfu"]
    assert [(name, policy_entry(name).label) for name in BUILT_IN] == [
        ("lru", "LRU"), ("lfu", "LFU"), ("wtinylfu", "W-TinyLFU")]
    assert [name for name in BUILT_IN if policy_entry(name).admission] == ["wtinylfu"]


@pytest.mark.parametrize("name", POLICIES)
def test_every_registered_policy_loads_by_its_dotted_path(name: str) -> None:
    """The entry names an `EvictionPolicy` whose class name ends in Policy (the manager's name is made from
    it), whose ``name`` is the registered one, and which the package exports under that class name."""
    cls = policy_class(name)
    assert issubclass(cls, EvictionPolicy) and cls.name == name
    assert cls.__name__ == policy_class_name(name) and cls.__name__.endswith("Policy")
    assert getattr(eviction, cls.__name__) is cls and cls.__name__ in eviction.__all__
    assert isinstance(make_policy(name, 10), cls)


def test_importing_the_package_imports_no_policy_module() -> None:
    """The registry imports a policy's module on first use, as the tier registry does."""
    code = ("import json, sys, vllm_tiercache.shared.eviction; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('vllm_tiercache.shared.eviction.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["vllm_tiercache.shared.eviction.base", "vllm_tiercache.shared.eviction.registry",
                         "vllm_tiercache.shared.eviction.sketch"]
