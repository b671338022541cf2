"""The tier registry: each tier kind names its config class and its tier class, by dotted path.

A built-in tier kind is a folder `tiers/<kind>/` (its `config.py`, its `tier.py`, its parts) and one line
in `_TIERS` below (the full list of what it touches: docs/architecture.md, "Where each kind of change
goes"); from outside the package, one
`register_tier(kind, config_path, tier_path)` call before the store config is read. This is the one module
that knows kinds: everything else uses the tier contract of `vllm_tiercache.shared.store.api` (the tier's
declared capabilities), never a kind name. `vllm_tiercache.shared.config` parses a ``tiers[i]`` item with
``config_class(kind).from_raw(raw, path)``; `TieredStore` builds each tier with `make_tier`, i.e.
``tier_class(config.kind)(config, name)``.

Why dotted paths, imported on first use (as vLLM's KVConnectorFactory and kv_offload factory register
by module path): a tier class pulls in its backend (lmdb, redis-py, kvikio, torch), and reading a config
must not import any of it; this module imports only the standard library. Each built-in kind is one folder,
`tiers/<kind>/`, whose config class lives in its own small module (`config.py`, on `tier_config`) apart
from the tier class (`tier.py`) for the same reason: every tier module imports torch, through `api` at
least.

The contract (see `vllm_tiercache.shared.store.tier_config`):

- config class: a frozen dataclass, ``kind`` defaulting to the registered kind, a ``policy`` field and
  ``from_raw(raw: Mapping, path: str) -> config`` raising `ConfigError` (``path`` is e.g. "tiers[1]").
  The built-in classes annotate their fields (``Annotated[type, Field(...)]``, ``kind`` a ``Literal``) and
  their ``from_raw`` is `check_keys` then `validate` (pydantic); a class written by hand works as well,
  but only the annotated built-in kinds appear in the JSON schema (`vllm_tiercache.shared.config_schema`).
  A ``path`` attribute is a directory the tier owns: no two tiers of one store may share it.
- tier class: ``TierClass(config, name)`` implementing `vllm_tiercache.shared.store.api.Tier`.
"""

from __future__ import annotations

import importlib
from typing import Any

#: kind -> (config class, tier class), fastest kinds first; a leading "." is relative to this package
_TIERS: dict[str, tuple[str, str]] = {
    "memory": (".tiers.memory.config.MemoryTierConfig", ".tiers.memory.tier.MemoryTier"),
    "disk": (".tiers.disk.config.DiskTierConfig", ".tiers.disk.tier.DiskTier"),
    "gds": (".tiers.gds.config.GdsTierConfig", ".tiers.gds.tier.GdsTier"),
    "redis": (".tiers.redis.config.RedisTierConfig", ".tiers.redis.tier.RedisTier"),
    "object": (".tiers.object.config.ObjectTierConfig", ".tiers.object.tier.ObjectTier"),
}


def tier_kinds() -> tuple[str, ...]:
    """The registered tier kinds, in registration order."""
    return tuple(_TIERS)


def register_tier(kind: str, config_path: str, tier_path: str) -> None:
    """Register a tier kind by the dotted paths of its config class and tier class (imported on use)."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"a tier kind is a non-empty string, not {kind!r}")
    if kind in _TIERS:
        raise ValueError(f"tier kind {kind!r} is already registered")
    for dotted in (config_path, tier_path):
        if not isinstance(dotted, str) or "." not in dotted.strip("."):
            raise ValueError(f"{dotted!r} is not a dotted path module.Class")
    _TIERS[kind] = (config_path, tier_path)


def unregister_tier(kind: str) -> None:
    """Forget a registered tier kind (tests)."""
    _entry(kind)
    del _TIERS[kind]


def config_class(kind: str) -> Any:
    """The config class of ``kind`` (imports its module; KeyError for an unknown kind)."""
    return _load(_entry(kind)[0])


def tier_class(kind: str) -> Any:
    """The tier class of ``kind`` (imports its module and so its backend)."""
    return _load(_entry(kind)[1])


def make_tier(config: Any, name: str | None = None) -> Any:
    """Instantiate one tier from its config (imports the backend lazily)."""
    kind = getattr(config, "kind", None)
    if not isinstance(kind, str) or kind not in _TIERS or not isinstance(config, config_class(kind)):
        raise TypeError(f"not a tier config: {config!r}")
    return tier_class(kind)(config, name or kind)


def _entry(kind: str) -> tuple[str, str]:
    try:
        return _TIERS[kind]
    except (KeyError, TypeError):
        raise KeyError(f"unknown tier kind {kind!r}; registered: {', '.join(_TIERS)}") from None


def _load(dotted: str) -> Any:
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module, __package__ if module.startswith(".") else None), attr)
