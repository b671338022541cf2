"""Memory tier: put/get without copies, byte-bounded LRU eviction, refusal of oversized records."""

from __future__ import annotations

import torch

from shared.config import MemoryTierConfig
from shared.store import MemoryTier, StoreKey


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
