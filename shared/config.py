"""The store's config (`StoreConfig`), where the one config dict comes from, and its split by owner.

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

The keys: each is declared once, with its type, bounds, default and description, as an annotated field
of its section: `StoreConfig` below (``namespace``, ``write_queue_size``, ``lookup_budget_ms``,
``model_version``, ``trust_multi_modal_uuids``, ``tiers``, ``extra``), the config class of each tier kind
(`vllm_tiercache.shared.store.registry`; a ``tiers[i]`` item's ``kind`` picks it) and the connectors'
option classes. Pydantic validates them (`vllm_tiercache.shared.store.tier_config.validate`);
`vllm_tiercache.shared.config_schema` writes their JSON schema and the tables of docs/configuration.md.
Anything prefixed ``x_`` (and not a connector's own key) is kept in ``StoreConfig.extra`` for experiments;
every other unknown key is an error (typos must not be silently ignored) that names the nearest known key
(``chunksize: unknown key; did you mean 'chunk_size'? known keys: ...``).

Each `StoreConfig` field also says whether it shapes the store (`SHAPES_STORE`: it is part of
`StoreConfig.cache_key`, so configs that differ in it get two stores) or only what a reader does with it
(`NOT_STORE_SHAPING`); a field without either fails the import (`StoreIdentity`).

Environment overrides (applied last, over every source above):

- ``TIERCACHE_CONFIG``: config file used when ``extra`` is empty (no default).
- ``TIERCACHE_NAMESPACE``: overrides ``namespace``.
- ``TIERCACHE_CACHE_DIR``: directory of the default disk tier (default: the user cache dir above).
- ``TIERCACHE_MEMORY_CAPACITY``, ``TIERCACHE_DISK_CAPACITY``: capacity of a memory / disk tier that does not
  give one (defaults 2GiB, 20GiB).
- ``TIERCACHE_CHUNK_SIZE`` overrides ``chunk_size``; the KV connector's options read it.
"""

from __future__ import annotations

import functools
import json
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, get_type_hints

from pydantic import BeforeValidator, ConfigDict, Field, Strict, WrapValidator

from vllm_tiercache.shared.eviction import POLICIES
from vllm_tiercache.shared.store import registry
from vllm_tiercache.shared.store.admission_config import WRITE_THROUGH
from vllm_tiercache.shared.store.sealing.config import EncryptionConfig
from vllm_tiercache.shared.store.tier_config import (
    Allowed,
    Bool,
    ConfigError,
    default_cache_dir,
    did_you_mean,
    parse_size,
    validate,
)
from vllm_tiercache.shared.store.tier_config import invalid as _err
from vllm_tiercache.shared.store.tiers.disk.config import DEFAULT_DISK_CAPACITY, DiskTierConfig
from vllm_tiercache.shared.store.tiers.gds.config import GdsTierConfig
from vllm_tiercache.shared.store.tiers.memory.config import DEFAULT_MEMORY_CAPACITY, MemoryTierConfig
from vllm_tiercache.shared.store.tiers.redis.config import DEFAULT_PART_SIZE, REDIS_SCHEMES, RedisTierConfig

# The tier config classes live beside their tiers (see `vllm_tiercache.shared.store.registry`); these
# names stay importable from here.
__all__ = [
    "CONNECTOR_KEYS", "DEFAULT_DISK_CAPACITY", "DEFAULT_MEMORY_CAPACITY", "DEFAULT_PART_SIZE", "NOT_STORE_SHAPING",
    "POLICIES", "REDIS_SCHEMES", "SHAPES_STORE", "STORE_KEYS", "STORE_SHAPING_FIELDS", "TIER_KINDS", "ConfigError",
    "DiskTierConfig", "GdsTierConfig", "MemoryTierConfig", "RedisTierConfig", "StoreConfig", "StoreIdentity",
    "TierConfig", "default_cache_dir", "default_tiers", "load_file", "parse_size", "read_sources",
    "split_connector_config", "store_shaping_fields",
]

#: the most writes the background queue may hold (each holds a record, often MiBs, until it is written)
MAX_WRITE_QUEUE_SIZE = 1 << 20
#: the longest a patient writer may wait out one tier (`vllm_tiercache.shared.store.writes.patience`): a day
MAX_WRITE_PATIENCE_S = 86400.0

#: default and bounds of ``lookup_budget_ms``: below 1 ms a healthy server's answer rarely arrives in time;
#: above a minute it no longer protects the engine from a server that stopped answering
DEFAULT_LOOKUP_BUDGET_MS = 100.0
MIN_LOOKUP_BUDGET_MS, MAX_LOOKUP_BUDGET_MS = 1.0, 60000.0
#: default and bounds of ``control_poll_s``: polls are one small read of each shared tier
DEFAULT_CONTROL_POLL_S = 5.0
MIN_CONTROL_POLL_S, MAX_CONTROL_POLL_S = 0.01, 3600.0

#: the built-in tier kinds (`registry.tier_kinds()` also lists kinds registered at runtime)
TIER_KINDS = registry.tier_kinds()
#: A slower tier's default admission, as `StoreConfig.to_dict` writes it (and then leaves it out).
_WRITE_THROUGH = asdict(WRITE_THROUGH)

#: the built-in tier configs, told apart by ``kind``: the config class of each kind the package registers,
#: read from the registry, so a built-in kind is one registry line here too (a kind registered at runtime
#: brings its own class, which the registry finds: `_parse_tiers`)
TierConfig = Annotated[functools.reduce(operator.or_, (registry.config_class(kind) for kind in TIER_KINDS)),
                       Field(discriminator="kind")]


def default_tiers() -> list[dict[str, Any]]:
    """What a user gets with no config at all: memory, then a disk tier in the user cache dir."""
    return [{"kind": "memory"}, {"kind": "disk", "path": str(default_cache_dir())}]


def _parse_tiers(raw: Any, _handler: Any) -> tuple[Any, ...]:
    """``tiers``: each item's ``kind`` picks the registered config class, whose ``from_raw`` validates the
    rest (so a kind registered at runtime is validated as the built-in ones); null means `default_tiers`."""
    if raw is None:
        raw = default_tiers()
    if not isinstance(raw, (list, tuple)) or not raw:
        raise _err("tiers", raw, "a non-empty list of tiers, fastest first")
    kinds = registry.tier_kinds()
    tiers = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise _err(f"tiers[{i}]", item, "a mapping with a 'kind' key")
        if item.get("kind") not in kinds:
            raise _err(f"tiers[{i}].kind", item.get("kind"), ", ".join(kinds))
        tiers.append(registry.config_class(item["kind"]).from_raw(item, f"tiers[{i}]"))
    front_config = tiers[0]  # a config class's own declaration (a ClassVar), not a tier's
    for i, t in enumerate(tiers[1:], 1):  # an exclusive tier is written only what the front tier evicts
        admission = getattr(t, "admission", None)
        if admission is not None and admission.evicted and not getattr(front_config, "HANDS_OVER_EVICTIONS", False):
            raise _err(f"tiers[{i}].admission.policy", admission.policy,
                       "always or seen (evicted needs a memory tier first: it is written what memory evicts)")
    seen_paths: set[str] = set()
    for i, t in enumerate(tiers):
        if isinstance(getattr(t, "path", None), str):  # a directory the tier owns (disk, gds)
            if t.path in seen_paths:
                raise _err(f"tiers[{i}].path", t.path, "a directory used by only one tier")
            seen_paths.add(t.path)
    return tuple(tiers)


def _x_keys_only(extra: Any) -> Any:
    if not isinstance(extra, Mapping):
        raise _err("extra", extra, "a mapping of keys prefixed 'x_'")
    bad = [k for k in extra if not str(k).startswith("x_")]
    if bad:
        raise _err(f"extra.{bad[0]}", extra[bad[0]], f"only keys prefixed 'x_' in extra, e.g. {'x_' + str(bad[0])!r}")
    return dict(extra)


# ----------------------------------------------------------------------------------------------- store


@dataclass(frozen=True)
class StoreIdentity:
    """Annotation metadata that every `StoreConfig` field carries: whether it shapes the store itself.

    Why every field says so: `vllm_tiercache.shared.store.get_store` hands every caller in a process the
    one store built for an equal `StoreConfig.cache_key`, which holds exactly the fields marked
    `SHAPES_STORE`. A field that changes what the store holds or how it behaves (its tiers, its write
    queue, its lookup budget) must give another store; a field that only changes what a reader does with
    the store (the keys it builds: namespace, model version, uuid trust) must not, or two connectors with
    different namespaces would split one memory budget into two stores. A field without a marking is an
    error when this module is imported (`store_shaping_fields`), so that no one has to remember a list.
    """

    shapes_store: bool


#: marks a `StoreConfig` field that makes two stores different (part of `StoreConfig.cache_key`)
SHAPES_STORE = StoreIdentity(shapes_store=True)
#: marks a `StoreConfig` field that shapes only what a reader does with the store, not the store
NOT_STORE_SHAPING = StoreIdentity(shapes_store=False)


@dataclass(frozen=True)
class StoreConfig:
    """The store: the tiers and how keys are built, shared by both connectors and the tools."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    namespace: Annotated[str, Strict(), Field(min_length=1, pattern=r"^[^|]+$", description=(
        "First field of every key: deployments with different namespaces never share entries. "
        "$TIERCACHE_NAMESPACE overrides it.")), Allowed("a non-empty string without '|'"),
        NOT_STORE_SHAPING] = "default"
    write_queue_size: Annotated[int, Strict(), Field(gt=0, le=MAX_WRITE_QUEUE_SIZE, description=(
        "Bound of the background queue for slower-tier writes; when it is full, writes are dropped and "
        "counted.")), Allowed(f"a positive int, at most {MAX_WRITE_QUEUE_SIZE}"), SHAPES_STORE] = 256
    write_patience_s: Annotated[float, Strict(), Field(ge=0, le=MAX_WRITE_PATIENCE_S, allow_inf_nan=False, description=(
        "For batch writers only (the precompute jobs set it from --store-patience): how long a write may wait out "
        "a slower tier that is down, hangs or throttles (S3 503 SlowDown, Redis OOM) before its records are "
        "dropped, in seconds without any record written to that tier. Meanwhile what the tier left unwritten "
        "is put again after an exponential backoff, and a full write queue makes the writer wait instead of "
        "dropping. 0, the serving default: a write never waits, what a tier does not take at once is dropped "
        "and counted (a request never waits for a store).")),
        Allowed(f"a number of seconds, 0 (serving: never wait) to {MAX_WRITE_PATIENCE_S:g}"), SHAPES_STORE] = 0.0
    lookup_budget_ms: Annotated[float, Strict(), Field(
        ge=MIN_LOOKUP_BUDGET_MS, le=MAX_LOOKUP_BUDGET_MS, allow_inf_nan=False, description=(
            "The longest a lookup made on the engine's scheduling thread (contains_many with shared_only: the "
            "encoder-cache connector's, and the KV connector's where it does not look far tiers up in the "
            "background, see lookup_deadline_ms) waits on a network tier (Redis, S3), in ms. What Redis has not "
            "answered by then is a miss (the request computes it), never a hit; while a timed-out call is "
            "still outstanding, further lookups skip Redis at once. Raise it when Redis is far away or prompts "
            "are long (one lookup asks for every layer and rank of every chunk) and "
            "store.stats()['lookup']['past_budget'] grows while Redis is healthy. Below 1 ms a "
            "healthy server rarely answers in time; beyond a minute the budget no longer protects the engine.")),
        Allowed(f"a number of milliseconds, at least {MIN_LOOKUP_BUDGET_MS:g}, at most {MAX_LOOKUP_BUDGET_MS:g}"),
        SHAPES_STORE] = DEFAULT_LOOKUP_BUDGET_MS
    control_poll_s: Annotated[float, Strict(), Field(
        ge=MIN_CONTROL_POLL_S, le=MAX_CONTROL_POLL_S, allow_inf_nan=False, description=(
            "Seconds between two reads of the shared control entries (invalidations by `tiercache evict --tag`, "
            "pins) by each store's background thread: a memory tier stops serving an invalidated tag at most "
            "this long (plus one read of the shared tiers) after the command returned, and sees a new pin as "
            "late. Each read is one small LMDB read per disk tier and one HGETALL per Redis tier.")),
        Allowed(f"a number of seconds, at least {MIN_CONTROL_POLL_S:g}, at most {MAX_CONTROL_POLL_S:g}"),
        SHAPES_STORE] = DEFAULT_CONTROL_POLL_S
    model_version: Annotated[Annotated[str, Strict(), Field(pattern=r"^[^|\n\r\t]*[^|\s][^|\n\r\t]*$")] | None,
                             Field(description=(
        "Names the served weights in every key instead of a digest of the model's files (no file is read): "
        "you vouch that new weights get a new value. Without it, weights rewritten in place are detected by "
        "content. `tiercache identity` prints what a config uses.")),
        Allowed("null, or a non-empty string without '|' or line breaks naming the weights' version"),
        NOT_STORE_SHAPING] = None
    trust_multi_modal_uuids: Annotated[Bool, Field(description=(
        "The operator vouches that user-supplied multi_modal_uuids name their items' content: records may "
        "then be stored and served under them; without it, items named by a uuid are never cached. Required "
        "in vLLM's counter-naming mode (mm_processor_cache_gb=0 with prefix caching off): see "
        "docs/architecture.md, modes the connectors refuse.")), NOT_STORE_SHAPING] = False
    encryption: Annotated[EncryptionConfig | None, Field(description=(
        "Seal every record a tier outside the process keeps (disk, gds, redis) with AES-256-GCM under a "
        "per-tenant subkey of a key ring (docs/operations.md, encryption at rest); the memory tier stays "
        "plaintext. null: records are stored in plaintext. A record that does not open (unknown or retired "
        "key, bad tag, another tenant's) is a miss, counted in sealed_rejected.")),
        Allowed('null, or a mapping {"ring": "/path/to/ring.json" or "env:NAME"}'), SHAPES_STORE] = None
    require_cache_salt: Annotated[Bool, Field(description=(
        "Where tenants share a store: a request without vLLM's cache_salt neither loads nor saves KV records "
        "(counted), and encoder outputs are neither loaded nor saved at all (an encoder output is keyed by its "
        "media, which carries no tenant). The salt must be set by a gateway from an authenticated tenant "
        "(docs/operations.md, the trust boundary), never taken from the client's body.")),
        NOT_STORE_SHAPING] = False
    tiers: Annotated[tuple[TierConfig, ...], WrapValidator(_parse_tiers), Field(
        json_schema_extra={"minItems": 1, "default": [{"kind": "memory"}, {"kind": "disk"}]}, description=(
            "The tiers, fastest first; each item's kind picks its keys (see the tier tables). Default: a "
            "memory tier, then a disk tier in the user cache dir.")), SHAPES_STORE] = ()
    extra: Annotated[Mapping[str, Any], BeforeValidator(_x_keys_only), Field(
        json_schema_extra={"propertyNames": {"pattern": "^x_"}}, description=(
            "Kept for experiments (StoreConfig.extra), keys prefixed x_ only; a top-level key prefixed x_ "
            "lands here too.")), NOT_STORE_SHAPING] = field(default_factory=dict)

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
        own = {f.name for f in fields(cls)}
        x_keys = {}
        for key in raw:
            if key in own or key == "config_file" or _connector_owned(key):
                continue
            if not (isinstance(key, str) and key.startswith("x_")):
                raise _unknown_key(key)
            x_keys[key] = raw[key]
        if "config_file" in raw:
            raise _err("config_file", raw["config_file"],
                       "only in the connector's extra config (or $TIERCACHE_CONFIG), not inside a config file")
        data = {"tiers": None, **{k: v for k, v in raw.items() if k in own}}
        if x_keys:
            data["extra"] = {**raw["extra"], **x_keys} if isinstance(raw.get("extra"), Mapping) else \
                raw.get("extra", x_keys)
        return validate(cls, data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able normalized form (sizes in bytes, absolute paths)."""
        d = asdict(self)
        d["tiers"] = [dict(asdict(t)) for t in self.tiers]
        for t in d["tiers"]:
            for name, value in t.items():
                if isinstance(value, Mapping):  # redis: ssl
                    t[name] = dict(value)
            if t.get("admission") == _WRITE_THROUGH:  # the default is left out: configs written before a tier
                del t["admission"]                    # had admission keep their form, and their cache key
        d["extra"] = dict(self.extra)
        if d["encryption"] is None:  # left out: configs without it keep their form, and their cache key
            del d["encryption"]
        if not d["write_patience_s"]:  # the same for a serving store's patience (none)
            del d["write_patience_s"]
        return d

    def cache_key(self) -> str:
        """Stable identity of the store itself: two configs with equal keys share one store per process.

        It holds the fields marked `SHAPES_STORE`, normalized (`to_dict`); the others (the namespace, the
        uuid trust, ``extra``...) only shape what a reader does with the store (see `StoreIdentity`).
        """
        d = self.to_dict()
        return json.dumps({name: d[name] for name in STORE_SHAPING_FIELDS if name in d}, sort_keys=True,
                          default=str)


def store_shaping_fields(cls: type) -> tuple[str, ...]:
    """The fields of the dataclass ``cls`` marked `SHAPES_STORE`, in declaration order; a field with no
    `StoreIdentity` marking, or with two, is a `TypeError` naming it (each field must say which it is)."""
    hints = get_type_hints(cls, include_extras=True)
    shaping = []
    for f in fields(cls):
        marks = [m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, StoreIdentity)]
        if len(marks) != 1:
            raise TypeError(f"{cls.__name__}.{f.name}: {len(marks)} StoreIdentity markings; give it exactly one, "
                            "SHAPES_STORE (two configs that differ in it need two stores) or NOT_STORE_SHAPING")
        if marks[0].shapes_store:
            shaping.append(f.name)
    return tuple(shaping)


#: The fields `StoreConfig.cache_key` holds (checked here, at import: an unmarked field fails at once).
STORE_SHAPING_FIELDS = store_shaping_fields(StoreConfig)


#: The store's own top-level keys (``config_file`` is read by `read_sources`, before the store sees the dict).
STORE_KEYS = (*(f.name for f in fields(StoreConfig) if f.name != "extra"), "config_file")

#: Top-level keys of the user-facing dict that a connector owns, by connector. Only the names live here:
#: every reader of the one dict (either connector, the tools) skips another owner's keys instead of calling
#: them typos. Types, defaults and checks are the owner's (`vllm_tiercache.kvcache.options`,
#: `vllm_tiercache.eccache.options`, whose ``KEYS`` are these tuples).
CONNECTOR_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "TieredKVConnector": ("chunk_size", "save_partial_chunks", "save_decode", "load_failure_policy", "load_mode",
                          "warmup_cpu_attention", "handoff_wait_ms", "lookup_deadline_ms",
                          "prefetch_buffer"),
    "TieredECConnector": ("encoder_cache_policy", "x_ec_stats_path"),
})

#: ``config_file`` as the JSON schema of the whole config shows it (`read_sources` reads it)
CONFIG_FILE_SCHEMA = {"type": "string", "description": (
    "A YAML or JSON file holding more of these keys; the other keys of the connector's extra config override "
    "it. Only in the connector's extra config, not inside a config file.")}


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
            path = raw.pop("config_file")
            if not isinstance(path, str) or not path:
                raise _err("config_file", path, "a non-empty string")
            raw = {**load_file(path), **raw}
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
