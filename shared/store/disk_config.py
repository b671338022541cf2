"""The disk and GDS tiers' configs: `DiskTierConfig` and `GdsTierConfig` (same fields, same layout).

Why beside `disk.py` / `gds.py` and not in them: those import lmdb, torch and (GDS) kvikio, and parsing a
config must not; the registry imports the tier module only when a tier is built. One module for both
because a GDS tier is a disk tier read through cuFile: its config is the disk config with another kind.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_tiercache.shared.store.tier_config import (
    as_bool,
    as_str,
    check_keys,
    check_policy,
    default_cache_dir,
    env_size,
    parse_size,
)

DEFAULT_DISK_CAPACITY = 20 << 30


@dataclass(frozen=True)
class DiskTierConfig:
    """A directory of record files with an LMDB index; shared by every process that opens it.

    ``path`` is owned by this tier: `StoreConfig` refuses two tiers with the same ``path``.
    """

    #: keys a ``tiers[i]`` item of this kind may have
    FIELDS: ClassVar[tuple[str, ...]] = ("kind", "path", "capacity", "fsync", "policy")
    #: a shared tier keeps LRU in its cross-process index (an in-process frequency sketch cannot see the
    #: other processes' accesses)
    POLICIES: ClassVar[tuple[str, ...]] = ("lru",)

    path: str = ""
    capacity: int = DEFAULT_DISK_CAPACITY
    fsync: bool = True
    policy: str = "lru"
    kind: str = "disk"

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str) -> DiskTierConfig:
        """Validate ``raw``: ``path`` (made absolute; default <user cache dir>/<kind>), ``capacity``
        ($TIERCACHE_DISK_CAPACITY, else 20GiB), ``fsync`` (true)."""
        check_keys(raw, path, cls.kind, cls.FIELDS)
        policy = check_policy(raw, path, cls.POLICIES)
        raw_path = raw.get("path", str(default_cache_dir() / cls.kind))
        as_str(raw_path, f"{path}.path")
        norm = os.path.abspath(os.path.expanduser(raw_path))
        cap = parse_size(raw.get("capacity", env_size("TIERCACHE_DISK_CAPACITY", DEFAULT_DISK_CAPACITY)),
                         f"{path}.capacity")
        fsync = as_bool(raw.get("fsync", True), f"{path}.fsync")
        return cls(path=norm, capacity=cap, fsync=fsync, policy=policy)


@dataclass(frozen=True)
class GdsTierConfig(DiskTierConfig):
    """Same layout as disk, read through cuFile (kvikio) into GPU memory where available."""

    kind: str = "gds"
