"""One schema for the tiered store, and the one split of a connector's extra config into its parts.

Why one schema: both connectors (KV cache and encoder cache) and the offline jobs build a store from the
same user-facing dict; validating it in one place gives one error style (field path, bad value, what is
allowed) and one normalized form, which `vllm_tiercache.shared.store.get_store` uses to hand every caller in a process
the same store object.

Who owns what: the dict holds the store's keys (below) beside each connector's own options. A
connector's options are parsed, defaulted and checked by the connector (`vllm_tiercache.kvcache.options`,
`vllm_tiercache.eccache.options`), which gets them from `split_connector_config`; this module only knows
their names (`CONNECTOR_KEYS`), so that a key another reader owns is told apart from a typo: users write
one dict for both connectors and the tools, and every reader skips what it does not own.

Sources, first match wins:

1. ``extra`` passed to :meth:`StoreConfig.load` (vLLM's ``kv_connector_extra_config``). If it has a
   ``config_file`` key, that YAML/JSON file is loaded and the other keys of ``extra`` override it.
2. When ``extra`` is empty or None: the YAML/JSON file named by env ``TIERCACHE_CONFIG``.
3. Nothing at all: a memory tier (2 GiB) and a disk tier under the user's cache dir
   (``$XDG_CACHE_HOME/vllm-tiercache`` or ``~/.cache/vllm-tiercache``).

The store's top-level keys and defaults:

- ``namespace`` (str, "default"): first field of every key; separates models/deployments sharing tiers.
- ``write_queue_size`` (int, 256; 1 to 1048576): bound of the background queue for slower-tier writes.
- ``lookup_budget_ms`` (number, 100; 1 to 60000): the longest a scheduler's lookup (``contains_many`` with
  ``shared_only``) waits on a network tier (Redis); what that tier has not answered by then is a miss, so
  a server that stops answering never stalls the engine (see `vllm_tiercache.shared.store.tiered`).
- ``model_version`` (str or null, null): names the served weights in every key instead of a digest of the
  model's files (see ``vllm_tiercache.shared.weights_identity``); the operator vouches that new weights get
  a new value. Without it the files are digested once per file and the digests remembered.
- ``trust_multi_modal_uuids`` (bool, false): the operator vouches that user-supplied ``multi_modal_uuids``
  name their items' content, so records may be stored and served under them (see
  ``vllm_tiercache.shared.mm_identifiers``); without it, items named by a uuid are never cached.
- ``tiers`` (list): fastest first. Each item has ``kind`` (memory, disk, gds, redis: the kinds of
  `vllm_tiercache.shared.store.registry`, whose config class validates the item) and ``policy``
  (memory: lru, wtinylfu; the shared tiers: lru only; default lru) plus:

  - memory: ``capacity`` (size, 2GiB; at least 256 bytes; more than the machine's memory: a warning)
  - disk / gds: ``path`` (user cache dir), ``capacity`` (size, 20GiB; at least 256 bytes; more than the
    filesystem's size or free space: a warning), ``fsync`` (bool, true)
  - redis: ``url`` (redis://, rediss://, redis+cluster://, rediss+cluster://; required),
    ``password`` (str, null; or in the URL), ``ttl_s`` (seconds, 0.001 to 365 days; null = no expiry),
    ``part_size`` (size, 8MiB, 1KiB to 512MiB: larger values are split), ``timeout_s`` (seconds, 2.0,
    0.001 to 300), ``retry_after_s`` (seconds, 5.0, 0 to 3600: how often a background thread probes a
    down server; requests never do), ``key_prefix`` (str, "tiercache:"), and the ``ssl_*`` options of the
    installed redis-py (``ssl_ca_certs``, ``ssl_cert_reqs``, ``ssl_certfile``, ``ssl_keyfile``, ...), passed
    through for TLS.
- ``x_*``: anything prefixed ``x_`` (and not a connector's own key) is kept in ``StoreConfig.extra`` for
  experiments; every other unknown key is an error (typos must not be silently ignored) that names the
  nearest known key (``chunksize: unknown key; did you mean 'chunk_size'? known keys: ...``).

The connectors' keys (`CONNECTOR_KEYS`): ``chunk_size``, ``save_partial_chunks``, ``save_decode``,
``load_failure_policy`` and ``warmup_cpu_attention`` (KV connector), ``encoder_cache_policy`` and
``x_ec_stats_path`` (EC connector).

Sizes are ints (bytes) or strings: "8GiB", "500MB", "1.5GiB", "64KiB", "1024"; at most 1EiB.

Environment overrides (applied last, over every source above):

- ``TIERCACHE_CONFIG``: config file used when ``extra`` is empty (no default).
- ``TIERCACHE_NAMESPACE``: overrides ``namespace``.
- ``TIERCACHE_CACHE_DIR``: directory of the default disk tier (default: the user cache dir above).
- ``TIERCACHE_MEMORY_CAPACITY``: capacity of the default memory tier (default 2GiB).
- ``TIERCACHE_DISK_CAPACITY``: capacity of the default disk tier (default 20GiB).
- ``TIERCACHE_CHUNK_SIZE`` overrides ``chunk_size``; the KV connector's options read it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vllm_tiercache.shared.eviction import POLICIES
from vllm_tiercache.shared.store import registry
from vllm_tiercache.shared.store.disk_config import DEFAULT_DISK_CAPACITY, DiskTierConfig, GdsTierConfig
from vllm_tiercache.shared.store.memory_config import DEFAULT_MEMORY_CAPACITY, MemoryTierConfig
from vllm_tiercache.shared.store.redis_config import DEFAULT_PART_SIZE, REDIS_SCHEMES, RedisTierConfig
from vllm_tiercache.shared.store.tier_config import ConfigError, default_cache_dir, did_you_mean, parse_size
from vllm_tiercache.shared.store.tier_config import as_bool as _bool
from vllm_tiercache.shared.store.tier_config import as_int as _int
from vllm_tiercache.shared.store.tier_config import as_str as _str
from vllm_tiercache.shared.store.tier_config import invalid as _err

# The tier config classes live beside their tiers (see `vllm_tiercache.shared.store.registry`); these
# names stay importable from here.
__all__ = [
    "CONNECTOR_KEYS", "DEFAULT_DISK_CAPACITY", "DEFAULT_MEMORY_CAPACITY", "DEFAULT_PART_SIZE", "POLICIES",
    "REDIS_SCHEMES", "STORE_KEYS", "TIER_KINDS", "ConfigError", "DiskTierConfig", "GdsTierConfig",
    "MemoryTierConfig", "RedisTierConfig", "StoreConfig", "TierConfig", "default_cache_dir", "default_tiers",
    "load_file", "parse_size", "read_sources", "split_connector_config",
]

#: the most writes the background queue may hold (each holds a record, often MiBs, until it is written)
MAX_WRITE_QUEUE_SIZE = 1 << 20

#: default and bounds of ``lookup_budget_ms``: below 1 ms a healthy server's answer rarely arrives in time;
#: above a minute it no longer protects the engine from a server that stopped answering
DEFAULT_LOOKUP_BUDGET_MS = 100.0
MIN_LOOKUP_BUDGET_MS, MAX_LOOKUP_BUDGET_MS = 1.0, 60000.0

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

#: The store's own top-level keys (``config_file`` is read by `read_sources`, before the store sees the dict).
STORE_KEYS = ("namespace", "write_queue_size", "lookup_budget_ms", "model_version", "trust_multi_modal_uuids", "tiers",
              "config_file")

#: Top-level keys of the user-facing dict that a connector owns, by connector. Only the names live here:
#: every reader of the one dict (either connector, the tools) skips another owner's keys instead of calling
#: them typos. Types, defaults and checks are the owner's (`vllm_tiercache.kvcache.options`,
#: `vllm_tiercache.eccache.options`, whose ``KEYS`` are these tuples).
CONNECTOR_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "TieredKVConnector": ("chunk_size", "save_partial_chunks", "save_decode", "load_failure_policy",
                          "warmup_cpu_attention"),
    "TieredECConnector": ("encoder_cache_policy", "x_ec_stats_path"),
})


def _connector_owned(key: Any) -> bool:
    return any(key in keys for keys in CONNECTOR_KEYS.values())


def _unknown_key(key: Any) -> ConfigError:
    """One message for a key nobody owns: the nearest known key, then every known key of the dict, by owner
    (a typo may be of any)."""
    owners = "; ".join(f"{', '.join(keys)} ({name})" for name, keys in CONNECTOR_KEYS.items())
    candidates = [*STORE_KEYS, "extra", *(k for keys in CONNECTOR_KEYS.values() for k in keys)]
    return ConfigError(f"{key}: unknown key; {did_you_mean(key, candidates)}known keys: {', '.join(STORE_KEYS)}, "
                       f"extra, x_* (anything prefixed x_ is kept in StoreConfig.extra); connector options: {owners}")


def read_sources(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The user-facing dict from a connector's extra config, its ``config_file``, ``$TIERCACHE_CONFIG``
    (when ``extra`` is empty) and ``$TIERCACHE_NAMESPACE``: every key, for every owner, not validated."""
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
    return raw


def split_connector_config(extra: Mapping[str, Any] | None, own_keys: Sequence[str]
                           ) -> tuple[dict[str, Any], StoreConfig]:
    """(the connector's own options, raw; the validated store config) from one connector's extra config.

    ``own_keys`` are the connector's names in `CONNECTOR_KEYS`; the connector's options class parses the
    first part. Keys of the other connector are skipped (users give both connectors one dict); any other
    unknown key is a `ConfigError` that names the known keys of every part.
    """
    raw = read_sources(extra)
    own = {key: raw[key] for key in own_keys if key in raw}
    return own, StoreConfig.from_dict(raw)


@dataclass(frozen=True)
class StoreConfig:
    """The validated, normalized configuration of one tiered store (no connector options: see above)."""

    namespace: str = "default"
    write_queue_size: int = 256
    lookup_budget_ms: float = DEFAULT_LOOKUP_BUDGET_MS
    model_version: str | None = None
    trust_multi_modal_uuids: bool = False
    tiers: tuple[TierConfig, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None = None) -> StoreConfig:
        """Build from a connector's extra config, its ``config_file``, ``$TIERCACHE_CONFIG`` or defaults."""
        return cls.from_dict(read_sources(extra))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StoreConfig:
        """Validate one dict (no file/env lookup). A connector's keys (`CONNECTOR_KEYS`) are skipped, left
        to their owner; any other unknown key is an error unless prefixed ``x_``."""
        if not isinstance(raw, Mapping):
            raise _err("<config>", raw, "a mapping (dict) of store options")
        extra: dict[str, Any] = dict(raw.get("extra") or {}) if isinstance(raw.get("extra"), Mapping) else {}
        for key in raw:
            if key == "extra" and isinstance(raw[key], Mapping):
                bad = [k for k in raw[key] if not str(k).startswith("x_")]
                if bad:
                    raise _err(f"extra.{bad[0]}", raw[key][bad[0]],
                               f"only keys prefixed 'x_' in extra, e.g. {'x_' + str(bad[0])!r}")
                continue
            if key in STORE_KEYS or _connector_owned(key):
                continue
            if isinstance(key, str) and key.startswith("x_"):
                extra[key] = raw[key]
                continue
            raise _unknown_key(key)
        if "config_file" in raw:
            raise _err("config_file", raw["config_file"],
                       "only in the connector's extra config (or $TIERCACHE_CONFIG), not inside a config file")
        namespace = raw.get("namespace", "default")
        if not isinstance(namespace, str) or not namespace or "|" in namespace:
            raise _err("namespace", namespace, "a non-empty string without '|'")
        wqs = _int(raw.get("write_queue_size", 256), "write_queue_size",
                   f"a positive int, at most {MAX_WRITE_QUEUE_SIZE}", lambda v: 0 < v <= MAX_WRITE_QUEUE_SIZE)
        budget = raw.get("lookup_budget_ms", DEFAULT_LOOKUP_BUDGET_MS)
        if not (isinstance(budget, int | float) and not isinstance(budget, bool)
                and MIN_LOOKUP_BUDGET_MS <= budget <= MAX_LOOKUP_BUDGET_MS):  # NaN fails both comparisons
            raise _err("lookup_budget_ms", budget, f"a number of milliseconds, at least {MIN_LOOKUP_BUDGET_MS:g}, "
                       f"at most {MAX_LOOKUP_BUDGET_MS:g}")
        model_version = raw.get("model_version")
        if model_version is not None and (not isinstance(model_version, str) or not model_version.strip()
                                          or any(c in model_version for c in "|\n\r\t")):
            raise _err("model_version", model_version,
                       "null, or a non-empty string without '|' or line breaks naming the weights' version")
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
            write_queue_size=wqs,
            lookup_budget_ms=float(budget),
            model_version=model_version,
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
        """Stable identity of the store itself: two configs with equal keys share one store per process.

        The namespace, the uuid trust and ``extra`` only shape the keys a reader builds, not the store.
        """
        d = self.to_dict()
        store_part = {"tiers": d["tiers"], "write_queue_size": d["write_queue_size"],
                      "lookup_budget_ms": d["lookup_budget_ms"]}
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
