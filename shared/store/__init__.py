"""The tiered store: `get_store` for the process-wide store, `build_store` for a private one.

Both connectors (KV cache and encoder cache) may live in one process; `get_store` gives them the SAME
`TieredStore` for equal store configs, so they share one memory budget, one writer thread and one
handle per disk index (LMDB forbids opening an environment twice in a process).
"""

from __future__ import annotations

import atexit
import importlib
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.store.api import KEY_DIGEST_SIZE, Record, Store, StoreKey, Tier
    from vllm_tiercache.shared.store.counters import TierCounters
    from vllm_tiercache.shared.store.tiered import TieredStore, make_tier
    from vllm_tiercache.shared.store.tiers.disk.tier import DiskTier
    from vllm_tiercache.shared.store.tiers.gds.tier import GdsTier
    from vllm_tiercache.shared.store.tiers.memory.tier import MemoryTier
    from vllm_tiercache.shared.store.tiers.redis.tier import RedisTier

__all__ = [
    "KEY_DIGEST_SIZE",
    "DiskTier",
    "GdsTier",
    "MemoryTier",
    "Record",
    "RedisTier",
    "Store",
    "StoreKey",
    "Tier",
    "TierCounters",
    "TieredStore",
    "build_store",
    "describe_tiers",
    "get_store",
    "make_tier",
]

#: name -> module it comes from, imported on first access (PEP 562). Why lazy: `shared.config` imports the
#: tier config modules of this package, and importing any module of a package runs its __init__ first;
#: eager imports here would make reading a config import torch, lmdb and redis-py (and `shared.config`
#: itself, half-initialized: an import cycle).
_LAZY = {
    "KEY_DIGEST_SIZE": "api", "Record": "api", "Store": "api", "StoreKey": "api", "Tier": "api",
    "TierCounters": "counters", "DiskTier": "tiers.disk.tier", "GdsTier": "tiers.gds.tier",
    "MemoryTier": "tiers.memory.tier", "RedisTier": "tiers.redis.tier", "TieredStore": "tiered", "make_tier": "tiered",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


_LOCK = threading.Lock()
_STORES: dict[str, TieredStore] = {}


def _as_config(config: StoreConfig | Mapping[str, Any] | None) -> StoreConfig:
    from vllm_tiercache.shared.config import StoreConfig

    if isinstance(config, StoreConfig):
        return config
    return StoreConfig.load(config)


def build_store(config: StoreConfig | Mapping[str, Any] | None = None) -> TieredStore:
    """A fresh store the caller owns and must `close()` (tests, offline tools)."""
    from vllm_tiercache.shared.store.tiered import TieredStore

    return TieredStore(_as_config(config))


def get_store(config: StoreConfig | Mapping[str, Any] | None = None) -> TieredStore:
    """The process-wide store for this config (one per normalized store config; closed at exit)."""
    from vllm_tiercache.shared.store.tiered import TieredStore

    cfg = _as_config(config)
    key = cfg.cache_key()
    with _LOCK:
        store = _STORES.get(key)
        if store is None or store.closed:
            store = TieredStore(cfg)
            _STORES[key] = store
        return store


@atexit.register
def _close_all() -> None:
    with _LOCK:
        stores = list(_STORES.values())
        _STORES.clear()
    for store in stores:
        store.close(timeout=10.0)


def describe_tiers(config: StoreConfig) -> str:
    """The store's tiers for a start-up log line, fastest first: kind, capacity, directory or address
    (credentials left out), e.g. ``memory 2GiB lru > disk /var/cache/tc 20GiB > redis redis://cache:6379``."""
    from vllm_tiercache.shared.store.tier_config import format_bytes

    parts = []
    for tier_config in config.tiers:  # configs, not tiers: each kind's config class has its own fields
        words = [tier_config.kind]
        for name in ("path", "address"):
            value = getattr(tier_config, name, None)
            if isinstance(value, str) and value:
                words.append(value)
        capacity = getattr(tier_config, "capacity", None)
        if isinstance(capacity, int):
            words.append(format_bytes(capacity))
        policy = getattr(tier_config, "policy", None)
        if isinstance(policy, str):
            words.append(policy)
        admission = getattr(tier_config, "admission", None)
        if admission is not None and admission.evicted:
            words.append("admits memory's evictions")
        elif admission is not None and not admission.always:  # write-through is the default: not worth a word
            words.append(f"admits seen>={admission.min_seen}" + (
                f" or reused>={admission.reused_prompt_share:g}" if admission.reused_prompt_share is not None else ""))
        parts.append(" ".join(words))
    return " > ".join(parts)
