"""The memory tier's config: `MemoryTierConfig`, parsed from one ``{"kind": "memory", ...}`` item.

Why beside `memory.py` and not in it: `memory.py` imports torch, and parsing a config (the scheduler
side, the CLI) must not; the registry imports the tier module only when a tier is built.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_tiercache.shared.store.tier_config import (
    capacity_option,
    check_keys,
    check_policy,
    format_bytes,
)

log = logging.getLogger(__name__)

DEFAULT_MEMORY_CAPACITY = 2 << 30
#: (capacity, machine memory) already warned about in this process: one line per process, not per parse
_WARNED: set[tuple[int, int]] = set()


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
        """Validate ``raw`` (``capacity`` defaults to $TIERCACHE_MEMORY_CAPACITY, else 2GiB; at least
        `MIN_CAPACITY` bytes; more than this machine's memory is a warning)."""
        check_keys(raw, path, cls.kind, cls.FIELDS)
        policy = check_policy(raw, path, cls.POLICIES)
        cap, field = capacity_option(raw, path, "TIERCACHE_MEMORY_CAPACITY", DEFAULT_MEMORY_CAPACITY)
        warn_if_above_machine_memory(cap, field)
        return cls(capacity=cap, policy=policy)


def warn_if_above_machine_memory(capacity: int, field: str) -> None:
    """One WARNING when ``capacity`` is more than this machine's physical memory (not an error: the config
    may be read on another machine than the one that serves with it)."""
    try:
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # not a POSIX system that reports it
        return
    if machine <= 0 or capacity <= machine or (capacity, machine) in _WARNED:
        return
    _WARNED.add((capacity, machine))
    log.warning("%s: %s is more than this machine's memory (%s); the process would swap or be killed "
                "before the memory tier evicts anything. Give the tier a part of the memory the engine "
                "leaves free", field, format_bytes(capacity), format_bytes(machine))
