"""The memory tier's config: `MemoryTierConfig`, parsed from one ``{"kind": "memory", ...}`` item.

Why beside `tier.py` and not in it: `tier.py` imports torch, and parsing a config (the scheduler
side, the CLI) must not; the registry imports the tier module only when a tier is built.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import ConfigDict, Field

from vllm_tiercache.shared.eviction.registry import memory_tier_policies, policy_entry
from vllm_tiercache.shared.store.tier_config import (
    Capacity,
    EnvDefault,
    PinBudget,
    check_keys,
    field_path,
    format_bytes,
    section_keys,
    validate,
)

log = logging.getLogger(__name__)

DEFAULT_MEMORY_CAPACITY = 2 << 30
#: the memory tier's policy when none is configured: prefix-aware, the best measured on a production KV
#: trace (`tiercache bench trace`, docs/benchmarks-kv.md); records without a parent are roots to it
DEFAULT_MEMORY_POLICY = "prefix"
#: (capacity, machine memory) already warned about in this process: one line per process, not per parse
_WARNED: set[tuple[int, int]] = set()
#: the eviction policies registered for the memory tier (`vllm_tiercache.shared.eviction.registry`: a
#: policy whose eviction scans every entry, as lfu, serves only the encoder cache)
MemoryPolicy = Literal[memory_tier_policies()]  # type: ignore[valid-type]


def _policy_description() -> str:
    """The ``policy`` field's text, from the registry: ``lru, or wtinylfu (W-TinyLFU; may refuse ...)``."""
    names = [name + (f" ({policy_entry(name).label}; may refuse a record by admission, counted as "
                     "admission_refused)" if policy_entry(name).admission else "")
             + (" (the default: keeps KV prefix chains whole, evicting leaves first)"
                if name == DEFAULT_MEMORY_POLICY else "")
             for name in memory_tier_policies()]
    return "Eviction policy: " + (", ".join(names[:-1]) + ", or " if len(names) > 1 else "") + names[-1] + "."


@dataclass(frozen=True)
class MemoryTierConfig:
    """A bounded in-process cache of tensors (`kind: memory`), evicting by its ``policy``."""

    __pydantic_config__ = ConfigDict(extra="forbid")
    POLICIES: ClassVar[tuple[str, ...]] = get_args(MemoryPolicy)
    #: the tier hands the records it evicts to the store (`HandsOverEvictions`): a slower tier behind it may
    #: be exclusive of it (admission ``evicted``)
    HANDS_OVER_EVICTIONS: ClassVar[bool] = True

    capacity: Annotated[Capacity, EnvDefault("TIERCACHE_MEMORY_CAPACITY"), Field(
        description="Bytes the tier may hold: an int or a size string such as \"8GiB\". Default: "
                    "$TIERCACHE_MEMORY_CAPACITY, else 2GiB. At least 256 bytes (a smaller tier holds no record "
                    "and would refuse every put without a word). More than the machine's memory is a WARNING, "
                    "once per process (the config may be read on another machine than the one that serves). On "
                    "a CUDA worker the KV connector's records here are pinned host memory (docs/gpu.md).")
    ] = DEFAULT_MEMORY_CAPACITY
    policy: Annotated[MemoryPolicy, Field(description=_policy_description())] = DEFAULT_MEMORY_POLICY
    pin_budget: PinBudget = 0.0
    kind: Annotated[Literal["memory"], Field(description="The tier kind.")] = "memory"

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str) -> MemoryTierConfig:
        """Validate one ``tiers[i]`` item (a capacity above this machine's memory is a warning)."""
        check_keys(raw, path, cls.kind, section_keys(cls))
        config = validate(cls, raw, path)
        warn_if_above_machine_memory(config.capacity, field_path(cls, raw, path, "capacity"))
        return config


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
