"""The disk and GDS tiers' configs: `DiskTierConfig` and `GdsTierConfig` (same fields, same layout).

Why beside `disk.py` / `gds.py` and not in them: those import lmdb, torch and (GDS) kvikio, and parsing a
config must not; the registry imports the tier module only when a tier is built. One module for both
because a GDS tier is a disk tier read through cuFile: its config is the disk config with another kind.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_tiercache.shared.store.tier_config import (
    as_bool,
    as_str,
    capacity_option,
    check_keys,
    check_policy,
    default_cache_dir,
    format_bytes,
)

log = logging.getLogger(__name__)

DEFAULT_DISK_CAPACITY = 20 << 30
#: (directory, capacity) already warned about in this process: one line per process, not per parse
_WARNED: set[tuple[str, int]] = set()


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
        ($TIERCACHE_DISK_CAPACITY, else 20GiB; at least `MIN_CAPACITY` bytes; more than the filesystem's
        size or free space is a warning), ``fsync`` (true)."""
        check_keys(raw, path, cls.kind, cls.FIELDS)
        policy = check_policy(raw, path, cls.POLICIES)
        raw_path = raw.get("path", str(default_cache_dir() / cls.kind))
        as_str(raw_path, f"{path}.path")
        norm = os.path.abspath(os.path.expanduser(raw_path))
        cap, field = capacity_option(raw, path, "TIERCACHE_DISK_CAPACITY", DEFAULT_DISK_CAPACITY)
        warn_if_above_filesystem(norm, cap, field)
        fsync = as_bool(raw.get("fsync", True), f"{path}.fsync")
        return cls(path=norm, capacity=cap, fsync=fsync, policy=policy)


@dataclass(frozen=True)
class GdsTierConfig(DiskTierConfig):
    """Same layout as disk, read through cuFile (kvikio) into GPU memory where available."""

    kind: str = "gds"


def warn_if_above_filesystem(directory: str, capacity: int, field: str) -> None:
    """One WARNING when ``capacity`` is more than the size, or the free space, of the filesystem that holds
    (or will hold) ``directory``.

    Not an error: the directory may be mounted later, or on the serving machine only, and the tier's own
    records count as used space. Such a tier fills the filesystem before it evicts: writes then fail for
    lack of space (counted and skipped, never an error to a request), and other users of the filesystem
    get none either. Nothing here raises: the config is valid whatever the filesystem says.
    """
    if (directory, capacity) in _WARNED:
        return
    try:
        probe = directory
        while not os.path.exists(probe):  # the nearest existing ancestor: the tier creates the rest
            parent = os.path.dirname(probe)
            if parent == probe:
                return
            probe = parent
        st = os.statvfs(probe)
    except (OSError, ValueError):  # unreadable, or a path the OS refuses (a NUL byte): nothing to say
        return
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if total <= 0 or capacity <= free:
        return
    _WARNED.add((directory, capacity))
    if capacity > total:
        log.warning("%s: %s is more than the whole filesystem holding %s (%s); the tier will run out of space "
                    "before it evicts anything, and writes will be skipped. Lower the capacity below the space "
                    "you can give the cache", field, format_bytes(capacity), directory, format_bytes(total))
    else:
        log.warning("%s: %s is more than the space free now on the filesystem holding %s (%s free of %s); "
                    "unless this tier's own records already use the difference, writes will be skipped for "
                    "lack of space before the tier evicts. Lower the capacity or free space", field,
                    format_bytes(capacity), directory, format_bytes(free), format_bytes(total))
