"""The memory tier's config: `MemoryTierConfig`, parsed from one ``{"kind": "memory", ...}`` item.

Why beside `memory.py` and not in it: `memory.py` imports torch, and parsing a config (the scheduler
side, the CLI) must not; the registry imports the tier module only when a tier is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_tiercache.shared.store.tier_config import check_keys, check_policy, env_size, parse_size

DEFAULT_MEMORY_CAPACITY = 2 << 30


@dataclass(frozen=True)
class MemoryTierConfig:
    """A bounded in-process LRU of tensors."""

    #: keys a ``tiers[i]`` item of this kind may have
    FIELDS: ClassVar[tuple[str, ...]] = ("kind", "capacity", "policy")
    #: eviction policies (shared.eviction); "lfu" scans every entry per eviction, fine for the encoder
    #: cache, too slow for a memory tier of many thousand records
    POLICIES: ClassVar[tuple[str, ...]] = ("lru", "wtinylfu")

    capacity: int = DEFAULT_MEMORY_CAPACITY
    policy: str = "lru"
    kind: str = "memory"

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str) -> MemoryTierConfig:
        """Validate ``raw`` (``capacity`` defaults to $TIERCACHE_MEMORY_CAPACITY, else 2GiB)."""
        check_keys(raw, path, cls.kind, cls.FIELDS)
        policy = check_policy(raw, path, cls.POLICIES)
        cap = parse_size(raw.get("capacity", env_size("TIERCACHE_MEMORY_CAPACITY", DEFAULT_MEMORY_CAPACITY)),
                         f"{path}.capacity")
        return cls(capacity=cap, policy=policy)
