"""One schema for the tiered store and the connector options that travel with it.

Why one schema: both connectors (KV cache and encoder cache) and the offline jobs build a store from the
same user-facing dict; validating it in one place gives one error style (field path, bad value, what is
allowed) and one normalized form, which `vllm_tiercache.shared.store.get_store` uses to hand every caller in a process
the same store object.

Sources, first match wins:

1. ``extra`` passed to :meth:`StoreConfig.load` (vLLM's ``kv_connector_extra_config``). If it has a
   ``config_file`` key, that YAML/JSON file is loaded and the other keys of ``extra`` override it.
2. When ``extra`` is empty or None: the YAML/JSON file named by env ``TIERCACHE_CONFIG``.
3. Nothing at all: a memory tier (2 GiB) and a disk tier under the user's cache dir
   (``$XDG_CACHE_HOME/vllm-tiercache`` or ``~/.cache/vllm-tiercache``).

Top-level keys and defaults:

- ``namespace`` (str, "default"): first field of every key; separates models/deployments sharing tiers.
- ``chunk_size`` (int, 256): tokens per KV record; a positive multiple of 16 (vLLM block sizes).
- ``save_partial_chunks`` (bool, true): also store the trailing chunk shorter than ``chunk_size``.
- ``save_decode`` (bool, false): also store KV produced while decoding.
- ``write_queue_size`` (int, 256): bound of the background queue for slower-tier writes.
- ``encoder_cache_policy`` (str or null, null): eviction policy of ``PolicyEncoderCacheManager``
  (lru, lfu, wtinylfu; null = ``vllm_tiercache.shared.eviction.DEFAULT_POLICY``).
- ``trust_multi_modal_uuids`` (bool, false): the operator vouches that user-supplied ``multi_modal_uuids``
  name their items' content, so records may be stored and served under them (see
  ``vllm_tiercache.shared.mm_identifiers``); without it, items named by a uuid are never cached.
- ``tiers`` (list): fastest first. Each item has ``kind`` (memory, disk, gds, redis) and ``policy``
  (memory: lru, wtinylfu; the shared tiers: lru only; default lru) plus:

  - memory: ``capacity`` (size, 2GiB)
  - disk / gds: ``path`` (user cache dir), ``capacity`` (size, 20GiB), ``fsync`` (bool, true)
  - redis: ``url`` (redis://, rediss://, redis+cluster://, rediss+cluster://; required),
    ``password`` (str, null; or in the URL), ``ttl_s`` (number, null = no expiry),
    ``part_size`` (size, 8MiB: larger values are split), ``timeout_s`` (number, 2.0),
    ``retry_after_s`` (number, 5.0: how long a down server is left alone), ``key_prefix``
    (str, "tiercache:"), and any ``ssl_*`` option of redis-py (``ssl_ca_certs``, ``ssl_cert_reqs``,
    ``ssl_certfile``, ``ssl_keyfile``, ...), passed through for TLS.
- ``x_*``: anything prefixed ``x_`` is kept in ``StoreConfig.extra`` for experiments; every other
  unknown key is an error (typos must not be silently ignored).

Sizes are ints (bytes) or strings: "8GiB", "500MB", "1.5GiB", "64KiB", "1024".

Environment overrides (applied last, over every source above):

- ``TIERCACHE_CONFIG``: config file used when ``extra`` is empty (no default).
- ``TIERCACHE_NAMESPACE``: overrides ``namespace``.
- ``TIERCACHE_CHUNK_SIZE``: overrides ``chunk_size``.
- ``TIERCACHE_CACHE_DIR``: directory of the default disk tier (default: the user cache dir above).
- ``TIERCACHE_MEMORY_CAPACITY``: capacity of the default memory tier (default 2GiB).
- ``TIERCACHE_DISK_CAPACITY``: capacity of the default disk tier (default 20GiB).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.eviction import POLICIES

TIER_KINDS = ("memory", "disk", "gds", "redis")
#: eviction policies per tier kind (shared.eviction): the shared tiers keep LRU in their cross-process index
#: (an in-process frequency sketch cannot see the other processes' accesses); "lfu" scans every entry per
#: eviction, fine for the encoder cache, too slow for a memory tier of many thousand records
TIER_POLICIES = {"memory": ("lru", "wtinylfu"), "disk": ("lru",), "gds": ("lru",), "redis": ("lru",)}
REDIS_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")

DEFAULT_MEMORY_CAPACITY = 2 << 30
DEFAULT_DISK_CAPACITY = 20 << 30
DEFAULT_PART_SIZE = 8 << 20

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
    "ti": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A wrong store configuration. The message names the field path, the bad value and what is allowed."""


def _err(path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{path}: invalid value {value!r}; allowed: {allowed}")


def parse_size(value: Any, path: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "500MB", "1.5GiB" (binary and decimal units)."""
    allowed = 'a non-negative int (bytes) or a string such as "8GiB", "500MB", "1.5GiB"'
    if isinstance(value, bool):
        raise _err(path, value, allowed)
    if isinstance(value, int):
        if value < 0:
            raise _err(path, value, allowed)
        return value
    if isinstance(value, float) and value >= 0 and math.isfinite(value):
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            size = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if math.isfinite(size):  # "1" * 400 + "GiB" overflows a float: an error, not a crash
                return int(size)
    raise _err(path, value, allowed)


def default_cache_dir() -> Path:
    """The user's cache dir for the default disk tier ($TIERCACHE_CACHE_DIR, $XDG_CACHE_HOME, ~/.cache)."""
    if os.environ.get("TIERCACHE_CACHE_DIR"):
        return Path(os.environ["TIERCACHE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "vllm-tiercache"


# ----------------------------------------------------------------------------------------------- tiers


@dataclass(frozen=True)
class MemoryTierConfig:
    """A bounded in-process LRU of tensors."""

    capacity: int = DEFAULT_MEMORY_CAPACITY
    policy: str = "lru"
    kind: str = "memory"


@dataclass(frozen=True)
class DiskTierConfig:
    """A directory of record files with an LMDB index; shared by every process that opens it."""

    path: str = ""
    capacity: int = DEFAULT_DISK_CAPACITY
    fsync: bool = True
    policy: str = "lru"
    kind: str = "disk"


@dataclass(frozen=True)
class GdsTierConfig(DiskTierConfig):
    """Same layout as disk, read through cuFile (kvikio) into GPU memory where available."""

    kind: str = "gds"


@dataclass(frozen=True)
class RedisTierConfig:
    """A Redis server or cluster shared by every process and host that can reach it."""

    url: str = ""
    password: str | None = None
    ttl_s: float | None = None
    part_size: int = DEFAULT_PART_SIZE
    timeout_s: float = 2.0
    retry_after_s: float = 5.0
    key_prefix: str = "tiercache:"
    ssl: Mapping[str, Any] = field(default_factory=dict)
    policy: str = "lru"
    kind: str = "redis"

    @property
    def cluster(self) -> bool:
        return "+cluster://" in self.url

    @property
    def address(self) -> str:
        """The URL without credentials, for log lines."""
        return re.sub(r"//[^@/]*@", "//", self.url)


TierConfig = MemoryTierConfig | DiskTierConfig | GdsTierConfig | RedisTierConfig

_TIER_FIELDS: dict[str, tuple[str, ...]] = {
    "memory": ("kind", "capacity", "policy"),
    "disk": ("kind", "path", "capacity", "fsync", "policy"),
    "gds": ("kind", "path", "capacity", "fsync", "policy"),
    "redis": ("kind", "url", "password", "ttl_s", "part_size", "timeout_s", "retry_after_s",
              "key_prefix", "policy"),
}


def _bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise _err(path, value, "true or false")


def _number(value: Any, path: str, *, positive: bool = True, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        if value > 0 or (not positive and value >= 0):
            return float(value)
    allowed = "a positive number of seconds" + (" or null" if optional else "")
    raise _err(path, value, allowed)


def _int(value: Any, path: str, allowed: str, ok: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and ok(value):
        return value
    raise _err(path, value, allowed)


def _str(value: Any, path: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, str) and value:
        return value
    raise _err(path, value, "a non-empty string" + (" or null" if optional else ""))


def _parse_tier(raw: Any, path: str) -> TierConfig:
    if not isinstance(raw, Mapping):
        raise _err(path, raw, "a mapping with a 'kind' key")
    kind = raw.get("kind")
    if kind not in TIER_KINDS:
        raise _err(f"{path}.kind", kind, ", ".join(TIER_KINDS))
    known = _TIER_FIELDS[kind]
    for name in raw:
        if name not in known and not (kind == "redis" and isinstance(name, str) and name.startswith("ssl_")):
            extra = ", ssl_* (redis-py TLS options)" if kind == "redis" else ""
            raise ConfigError(f"{path}.{name}: unknown key for a {kind} tier; known keys: "
                              f"{', '.join(known)}{extra}")
    policy = raw.get("policy", "lru")
    if policy not in TIER_POLICIES[kind]:
        raise _err(f"{path}.policy", policy, ", ".join(TIER_POLICIES[kind]))
    if kind == "memory":
        cap = parse_size(raw.get("capacity", _env_size("TIERCACHE_MEMORY_CAPACITY", DEFAULT_MEMORY_CAPACITY)),
                         f"{path}.capacity")
        return MemoryTierConfig(capacity=cap, policy=policy)
    if kind in ("disk", "gds"):
        raw_path = raw.get("path", str(default_cache_dir() / kind))
        _str(raw_path, f"{path}.path")
        norm = os.path.abspath(os.path.expanduser(raw_path))
        cap = parse_size(raw.get("capacity", _env_size("TIERCACHE_DISK_CAPACITY", DEFAULT_DISK_CAPACITY)),
                         f"{path}.capacity")
        fsync = _bool(raw.get("fsync", True), f"{path}.fsync")
        cls = GdsTierConfig if kind == "gds" else DiskTierConfig
        return cls(path=norm, capacity=cap, fsync=fsync, policy=policy)
    url = raw.get("url")
    if not isinstance(url, str) or not url.startswith(REDIS_SCHEMES):
        raise _err(f"{path}.url", url, "a URL starting with " + ", ".join(REDIS_SCHEMES))
    _check_redis_url(url, f"{path}.url")
    part_size = parse_size(raw.get("part_size", DEFAULT_PART_SIZE), f"{path}.part_size")
    if part_size < 1024:
        raise _err(f"{path}.part_size", raw.get("part_size"), "a size of at least 1KiB")
    ssl = {k: v for k, v in raw.items() if k.startswith("ssl_")}
    if ssl and not url.startswith("rediss"):
        first = sorted(ssl)[0]
        raise _err(f"{path}.{first}", ssl[first], "ssl_* options only with a rediss:// URL")
    return RedisTierConfig(
        url=url,
        password=_str(raw.get("password"), f"{path}.password", optional=True),
        ttl_s=_number(raw.get("ttl_s"), f"{path}.ttl_s", optional=True),
        part_size=part_size,
        timeout_s=_number(raw.get("timeout_s", 2.0), f"{path}.timeout_s"),  # type: ignore[arg-type]
        retry_after_s=_number(raw.get("retry_after_s", 5.0), f"{path}.retry_after_s",  # type: ignore[arg-type]
                              positive=False),
        key_prefix=_str(raw.get("key_prefix", "tiercache:"), f"{path}.key_prefix"),  # type: ignore[arg-type]
        ssl=ssl,
        policy=policy,
    )


def _check_redis_url(url: str, path: str) -> None:
    """Parse the URL as redis-py will (port, query options), so a bad one is a ConfigError here and not
    a ValueError out of the tier's constructor when the engine starts."""
    from redis.connection import parse_url

    try:
        parse_url(url.replace("+cluster://", "://", 1))
    except (ValueError, TypeError) as exc:
        shown = re.sub(r"//[^@/]*@", "//***@", url)  # never echo a password into a log
        raise _err(path, shown, f"a URL redis-py can parse, scheme://[user:password@]host[:port 0-65535][/db] "
                                f"({exc})") from exc


def _env_size(name: str, default: int) -> int | str:
    return os.environ.get(name) or default


def default_tiers() -> list[dict[str, Any]]:
    """What a user gets with no config at all: memory, then a disk tier in the user cache dir."""
    return [{"kind": "memory"}, {"kind": "disk", "path": str(default_cache_dir())}]


# ----------------------------------------------------------------------------------------------- store

_TOP_KEYS = ("namespace", "chunk_size", "save_partial_chunks", "save_decode", "write_queue_size",
             "encoder_cache_policy", "trust_multi_modal_uuids", "tiers", "config_file")


@dataclass(frozen=True)
class StoreConfig:
    """The validated, normalized configuration of one tiered store plus connector options."""

    namespace: str = "default"
    chunk_size: int = 256
    save_partial_chunks: bool = True
    save_decode: bool = False
    write_queue_size: int = 256
    encoder_cache_policy: str | None = None
    trust_multi_modal_uuids: bool = False
    tiers: tuple[TierConfig, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None = None) -> StoreConfig:
        """Build from a connector's extra config, its ``config_file``, ``$TIERCACHE_CONFIG`` or defaults."""
        if extra is not None and not isinstance(extra, Mapping):
            raise _err("<config>", extra, "a mapping (dict) of store options")
        raw: dict[str, Any] = {}
        if extra:
            raw = dict(extra)
            if "config_file" in raw:
                file_cfg = load_file(_str(raw.pop("config_file"), "config_file"))  # type: ignore[arg-type]
                raw = {**file_cfg, **raw}
        elif os.environ.get("TIERCACHE_CONFIG"):
            raw = load_file(os.environ["TIERCACHE_CONFIG"], origin="TIERCACHE_CONFIG")
        if os.environ.get("TIERCACHE_NAMESPACE"):
            raw["namespace"] = os.environ["TIERCACHE_NAMESPACE"]
        if os.environ.get("TIERCACHE_CHUNK_SIZE"):
            env = os.environ["TIERCACHE_CHUNK_SIZE"]
            raw["chunk_size"] = int(env) if env.strip().isdigit() else env
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StoreConfig:
        """Validate one dict (no file/env lookup). Unknown keys are errors unless prefixed ``x_``."""
        if not isinstance(raw, Mapping):
            raise _err("<config>", raw, "a mapping (dict) of store options")
        extra: dict[str, Any] = dict(raw.get("extra") or {}) if isinstance(raw.get("extra"), Mapping) else {}
        for key in raw:
            if key == "extra" and isinstance(raw[key], Mapping):
                bad = [k for k in raw[key] if not str(k).startswith("x_")]
                if bad:
                    raise _err(f"extra.{bad[0]}", raw[key][bad[0]], "only keys prefixed 'x_' in extra")
                continue
            if key in _TOP_KEYS:
                continue
            if isinstance(key, str) and key.startswith("x_"):
                extra[key] = raw[key]
                continue
            raise ConfigError(f"{key}: unknown key; known keys: {', '.join(_TOP_KEYS)}, extra, x_* "
                              "(anything prefixed x_ is kept in StoreConfig.extra)")
        if "config_file" in raw:
            raise _err("config_file", raw["config_file"],
                       "only in the connector's extra config (or $TIERCACHE_CONFIG), not inside a config file")
        namespace = raw.get("namespace", "default")
        if not isinstance(namespace, str) or not namespace or "|" in namespace:
            raise _err("namespace", namespace, "a non-empty string without '|'")
        chunk_size = _int(raw.get("chunk_size", 256), "chunk_size", "a positive multiple of 16",
                          lambda v: v > 0 and v % 16 == 0)
        wqs = _int(raw.get("write_queue_size", 256), "write_queue_size", "a positive int", lambda v: v > 0)
        ecp = raw.get("encoder_cache_policy")
        if ecp is not None and ecp not in POLICIES:
            raise _err("encoder_cache_policy", ecp, ", ".join(POLICIES) + " or null")
        tiers_raw = raw.get("tiers")
        if tiers_raw is None:
            tiers_raw = default_tiers()
        if not isinstance(tiers_raw, (list, tuple)) or not tiers_raw:
            raise _err("tiers", tiers_raw, "a non-empty list of tiers, fastest first")
        tiers = tuple(_parse_tier(t, f"tiers[{i}]") for i, t in enumerate(tiers_raw))
        seen_paths: set[str] = set()
        for i, t in enumerate(tiers):
            if isinstance(t, DiskTierConfig):
                if t.path in seen_paths:
                    raise _err(f"tiers[{i}].path", t.path, "a directory used by only one tier")
                seen_paths.add(t.path)
        return cls(
            namespace=namespace,
            chunk_size=chunk_size,
            save_partial_chunks=_bool(raw.get("save_partial_chunks", True), "save_partial_chunks"),
            save_decode=_bool(raw.get("save_decode", False), "save_decode"),
            write_queue_size=wqs,
            encoder_cache_policy=ecp,
            trust_multi_modal_uuids=_bool(raw.get("trust_multi_modal_uuids", False), "trust_multi_modal_uuids"),
            tiers=tiers,
            extra=extra,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able normalized form (sizes in bytes, absolute paths)."""
        d = asdict(self)
        d["tiers"] = [dict(asdict(t)) for t in self.tiers]
        for t in d["tiers"]:
            if t["kind"] == "redis":
                t["ssl"] = dict(t["ssl"])
        d["extra"] = dict(self.extra)
        return d

    def cache_key(self) -> str:
        """Stable identity of the store part: two configs with equal keys share one store per process."""
        d = self.to_dict()
        store_part = {"tiers": d["tiers"], "write_queue_size": d["write_queue_size"]}
        return json.dumps(store_part, sort_keys=True, default=str)


def load_file(path: str, origin: str = "config_file") -> dict[str, Any]:
    """Read a YAML or JSON config file (JSON is YAML, but .json uses the json module for clearer errors)."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{origin}: cannot read {str(p)!r} ({exc.strerror}); allowed: a readable "
                          "YAML or JSON file") from exc
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:
        raise ConfigError(f"{origin}: {str(p)!r} is not valid YAML/JSON: {exc}; allowed: a YAML or JSON "
                          "file holding a mapping of store options") from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise _err(origin, str(p), "a file holding a mapping of store options")
    return dict(data)
