"""The disk tier's config: `DiskTierConfig` (the GDS tier's, `tiers/gds/config.py`, is this one with another kind).

Why beside `tier.py` and not in it: the tier module imports lmdb and torch, and parsing a config must not;
the registry imports the tier module only when a tier is built.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, Strict

from vllm_tiercache.shared.store.admission_config import WRITE_THROUGH, AdmissionConfig, check_admission
from vllm_tiercache.shared.store.tier_config import (
    Allowed,
    Bool,
    Capacity,
    EnvDefault,
    PinBudget,
    Text,
    check_keys,
    default_cache_dir,
    field_path,
    format_bytes,
    schema_extra,
    section_keys,
    validate,
)

log = logging.getLogger(__name__)

DEFAULT_DISK_CAPACITY = 20 << 30
#: the largest ``half_life``, in capacities (beyond it the order is LFU for any traffic a disk sees)
MAX_HALF_LIFE = 1000.0
#: (directory, capacity) already warned about in this process: one line per process, not per parse
_WARNED: set[tuple[str, int]] = set()


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


@dataclass(frozen=True)
class DiskTierConfig:
    """A directory of record files with an LMDB index, shared by every process that opens it
    (`kind: disk`)."""

    # the default path depends on the environment: the schema has none, the description says it
    __pydantic_config__ = ConfigDict(extra="forbid", json_schema_extra=schema_extra(no_default=("path",)))
    #: the orders its cross-process index keeps (an in-process frequency sketch cannot see the other
    #: processes' accesses, so ``wtinylfu`` is not one): recency, or LRFU as a virtual time (`order`)
    POLICIES: ClassVar[tuple[str, ...]] = ("lru", "prefix")

    path: Annotated[Text, AfterValidator(_absolute), Field(
        description="Directory of the tier, owned by it: no two tiers of one store may share it; made "
                    "absolute. Default: <user cache dir>/<kind>, the user cache dir being $TIERCACHE_CACHE_DIR, "
                    "else $XDG_CACHE_HOME/vllm-tiercache or ~/.cache/vllm-tiercache.")] = ""
    capacity: Annotated[Capacity, EnvDefault("TIERCACHE_DISK_CAPACITY"), Field(
        description="Bytes the tier may hold: an int or a size string such as \"500GiB\". Default: "
                    "$TIERCACHE_DISK_CAPACITY, else 20GiB. At least 256 bytes (a disk record is at least 129 "
                    "bytes). More than the size or the free space of the filesystem holding the path (or its "
                    "nearest existing parent) is a WARNING, once per process: the tier would fill the "
                    "filesystem before it evicts and its writes would be skipped; not an error, because the "
                    "tier's own records count as used space and the directory may be mounted later.")
    ] = DEFAULT_DISK_CAPACITY
    fsync: Annotated[Bool, Field(description="fsync each record file before it is indexed (crash safety).")
                     ] = True
    policy: Annotated[Literal["lru", "prefix"], Field(
        description="Eviction policy, kept in the cross-process index: prefix (the default: decayed access "
                    "counts, LRFU, a record never seen before counting a tenth of an access, a parent ranked at "
                    "least as high as its children; the memory tier's prefix policy as a virtual time) or lru "
                    "(least recently used). Either way a victim's descendants go with it and pins are kept. "
                    "The directory records the policy it was first used with: a process configured with the "
                    "other one is refused at start (the two rank records on different scales), so every process "
                    "sharing a directory sets the same policy; to change it, start over in another directory.")
    ] = "prefix"
    half_life: Annotated[float, Strict(), Field(gt=0.0, le=MAX_HALF_LIFE, allow_inf_nan=False, description=(
        "With policy prefix: how fast an access's weight halves, in capacities of traffic (bytes put into and "
        "read from this directory, by every process sharing it). "
        f"Small is LRU, large is LFU; 1.0 (the default) measured best on the Mooncake trace. At most "
        f"{MAX_HALF_LIFE:g}.")), Allowed(f"a positive number of capacities, at most {MAX_HALF_LIFE:g}, e.g. 1.0")
    ] = 1.0
    pin_budget: PinBudget = 0.0
    admission: Annotated[AdmissionConfig, Field(description=(
        "Which puts are written to this tier: {\"policy\": \"always\"} (default), {\"policy\": \"seen\", "
        "\"min_seen\": 2} or {\"policy\": \"evicted\"} (exclusive of the memory tier); see its table below "
        "(default: write-through)."))] = WRITE_THROUGH
    kind: Annotated[Literal["disk"], Field(description="The tier kind.")] = "disk"

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any], path: str) -> DiskTierConfig:
        """Validate one ``tiers[i]`` item (a capacity above the filesystem's size or free space is a
        warning)."""
        check_keys(raw, path, cls.kind, section_keys(cls))
        check_admission(raw, path)
        config = validate(cls, raw, path, defaults={"path": str(default_cache_dir() / cls.kind)})
        warn_if_above_filesystem(config.path, config.capacity, field_path(cls, raw, path, "capacity"))
        return config


def nearest_existing_ancestor(path: str) -> str | None:
    """``path`` itself if it exists (a dangling symlink counts: it is in the way), else its nearest
    existing ancestor: where a tier would create the rest. None when no ancestor exists at all."""
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    return probe


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
        probe = nearest_existing_ancestor(directory)  # the tier creates the rest
        if probe is None:
            return
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
