"""Memory tier: put/get without copies, byte-bounded LRU eviction, refusal of oversized records."""

from __future__ import annotations

import torch

from vllm_tiercache.shared.config import MemoryTierConfig
from vllm_tiercache.shared.store import MemoryTier, StoreKey


def _k(i: int) -> StoreKey:
    return StoreKey(f"ns|mem|{i}")


def _t(nbytes: int, fill: int = 1) -> torch.Tensor:
    return torch.full((nbytes,), fill, dtype=torch.uint8)


def test_put_get_returns_same_object():
    tier = MemoryTier(MemoryTierConfig(capacity=1 << 20))
    t = _t(100)
    tier.put_many([(_k(1), t, {"a": 1})])
    rec = tier.get_many([_k(1), _k(2)])
    assert rec[0] is not None and rec[0].tensor is t and rec[0].meta == {"a": 1}
    assert rec[1] is None
    assert tier.contains_many([_k(1), _k(2)]) == [True, False]
    assert tier.usage() == {"entries": 1, "bytes_used": 100, "capacity": 1 << 20}


def test_lru_eviction_by_bytes():
    tier = MemoryTier(MemoryTierConfig(capacity=300))
    for i in range(3):
        tier.put_many([(_k(i), _t(100), None)])
    tier.get_many([_k(0)])  # 0 becomes most recent; 1 is now the oldest
    tier.put_many([(_k(3), _t(100), None)])
    assert tier.contains_many([_k(0), _k(1), _k(2), _k(3)]) == [True, False, True, True]
    assert tier.counters.get("evictions") == 1
    assert tier.usage()["bytes_used"] == 300


def test_oversized_refused_and_replacement_accounted():
    tier = MemoryTier(MemoryTierConfig(capacity=300))
    tier.put_many([(_k(0), _t(301), None)])
    assert tier.contains_many([_k(0)]) == [False] and tier.counters.get("refused") == 1
    tier.put_many([(_k(1), _t(200), None)])
    tier.put_many([(_k(1), _t(50, 2), None)])
    assert tier.usage()["bytes_used"] == 50
    assert tier.get_many([_k(1)])[0].tensor[0].item() == 2


def test_policy_from_config_capacity_in_bytes_and_listeners():
    """W-TinyLFU tier: bytes never exceed capacity, every record that leaves is reported to the listeners."""
    tier = MemoryTier(MemoryTierConfig(capacity=1000, policy="wtinylfu"))
    gone: list[bytes] = []
    tier.add_eviction_listener(gone.append)
    for i in range(200):
        tier.put_many([(_k(i), _t(30 + i % 4 * 20), None)])
        assert tier.usage()["bytes_used"] <= 1000
    resident = {i for i in range(200) if tier.contains_many([_k(i)])[0]}
    # Every record that was ever resident and is no longer is reported once; refused arrivals never were.
    assert len(gone) == len(set(gone))
    assert set(gone).isdisjoint({_k(i).digest for i in resident})
    assert tier.counters.get("evictions") == len(gone)


def test_wtinylfu_admission_refuses_cold_puts_and_counts_them():
    tier = MemoryTier(MemoryTierConfig(capacity=1000, policy="wtinylfu"))
    hot = [_k(i) for i in range(10)]
    attempts = 0
    for _ in range(3):
        for k in hot:
            if tier.contains_many([k])[0]:
                tier.get_many([k])
            else:
                tier.put_many([(k, _t(100), None)])
                attempts += 1
    for i in range(100, 150):  # a one-off sweep
        tier.put_many([(_k(i), _t(100), None)])
        attempts += 1
    assert sum(tier.contains_many(hot)) >= 9  # the sweep did not flush the hot set
    assert tier.counters.get("admission_refused") >= 40
    # A put refused on arrival is counted as refused, not as a put: every attempt is one or the other.
    assert tier.counters.get("puts") + tier.counters.get("refused") == attempts
    lru = MemoryTier(MemoryTierConfig(capacity=1000))
    for k in hot:
        lru.put_many([(k, _t(100), None)])
    for i in range(100, 150):
        lru.put_many([(_k(i), _t(100), None)])
    assert sum(lru.contains_many(hot)) == 0 and lru.counters.get("admission_refused") == 0
