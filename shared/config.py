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
- ``tiers`` (list): fastest first. Each item has ``kind`` (memory, disk, gds, redis: the kinds of
  `vllm_tiercache.shared.store.registry`, whose config class validates the item) and ``policy``
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
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.eviction import POLICIES
from vllm_tiercache.shared.store import registry
from vllm_tiercache.shared.store.disk_config import DEFAULT_DISK_CAPACITY, DiskTierConfig, GdsTierConfig
from vllm_tiercache.shared.store.memory_config import DEFAULT_MEMORY_CAPACITY, MemoryTierConfig
from vllm_tiercache.shared.store.redis_config import DEFAULT_PART_SIZE, REDIS_SCHEMES, RedisTierConfig
from vllm_tiercache.shared.store.tier_config import ConfigError, default_cache_dir, parse_size
from vllm_tiercache.shared.store.tier_config import as_bool as _bool
from vllm_tiercache.shared.store.tier_config import as_int as _int
from vllm_tiercache.shared.store.tier_config import as_str as _str
from vllm_tiercache.shared.store.tier_config import invalid as _err

# The tier config classes live beside their tiers (see `vllm_tiercache.shared.store.registry`); these
# names stay importable from here.
__all__ = [
    "DEFAULT_DISK_CAPACITY", "DEFAULT_MEMORY_CAPACITY", "DEFAULT_PART_SIZE", "POLICIES", "REDIS_SCHEMES",
    "TIER_KINDS", "ConfigError", "DiskTierConfig", "GdsTierConfig", "MemoryTierConfig",
    "RedisTierConfig", "StoreConfig", "TierConfig", "default_cache_dir", "default_tiers", "load_file",
    "parse_size",
]

#: the built-in tier kinds (`registry.tier_kinds()` also lists kinds registered at runtime)
TIER_KINDS = registry.tier_kinds()

#: the built-in tier configs (a kind registered at runtime brings its own class)
TierConfig = MemoryTierConfig | DiskTierConfig | GdsTierConfig | RedisTierConfig


def _parse_tier(raw: Any, path: str) -> TierConfig:
    """One ``tiers[i]`` item: its ``kind`` picks the registered config class, which validates the rest."""
    if not isinstance(raw, Mapping):
        raise _err(path, raw, "a mapping with a 'kind' key")
    kind = raw.get("kind")
    kinds = registry.tier_kinds()
    if kind not in kinds:
        raise _err(f"{path}.kind", kind, ", ".join(kinds))
    return registry.config_class(kind).from_raw(raw, path)


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
            if isinstance(getattr(t, "path", None), str):  # a directory the tier owns (disk, gds)
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
            for name, value in t.items():
                if isinstance(value, Mapping):  # redis: ssl
                    t[name] = dict(value)
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
