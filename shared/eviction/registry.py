"""The eviction-policy registry: each policy name maps to its class, by dotted path, and says where it serves.

Adding a policy is one module in this package (an `EvictionPolicy`, see `base`) and one entry in
`_POLICIES` below. Everything that lists policies reads them from here, never from a list of its own:

- `make_policy`, which both owners call (the store's memory tier, the encoder cache managers);
- the memory tier's ``policy`` field (`vllm_tiercache.shared.store.tiers.memory.config`: the entries with
  ``memory_tier``), hence its validation, its error messages and its JSON schema;
- the EC connector's ``encoder_cache_policy`` and the managers' ``manager_config`` (`vllm_tiercache.eccache.options`):
  their types, texts, errors and schema, and which policy takes which option (its constructor's keyword
  parameters after ``capacity``, `policy_options`);
- one encoder cache manager class per policy (`vllm_tiercache.eccache.managers`), named after the policy
  class (`LRUPolicy` -> `LRUEncoderCacheManager`);
- `tiercache bench policy`'s columns (`vllm_tiercache.tools.bench.policy`), headed by each ``label``.

Why dotted paths, imported on first use (as the tier registry, `vllm_tiercache.shared.store.registry`):
reading a config needs the names and the texts, not the code; this module imports only the standard
library and `base`.

Why no runtime registration (the tier registry has one): the config sections declare their policy fields
as Literals of these names, built when their modules are imported, so a policy added later would be
refused by the very configs meant to name it. A policy is registered here, in the package.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from vllm_tiercache.shared.eviction.base import EvictionPolicy


@dataclass(frozen=True)
class PolicyEntry:
    """One registered policy.

    Args:
        class_path: the `EvictionPolicy` subclass, ``module.Class`` (a leading "." is relative to this package);
            its class name ends in ``Policy``, which the encoder cache manager's name replaces.
        label: how tables and texts name it (`tiercache bench policy`'s column, e.g. "W-TinyLFU").
        memory_tier: whether the store's memory tier may use it. A policy whose eviction scans every entry
            is fine for the encoder cache (tens to hundreds of entries) and too slow for a memory tier of
            many thousand records.
        admission: whether it may refuse a new entry (an admission filter): the memory tier counts such
            refusals as ``admission_refused``, and the benchmark shows them.
    """

    class_path: str
    label: str
    memory_tier: bool
    admission: bool = False


#: name -> its entry, in the order errors, docs and tables list them
_POLICIES: dict[str, PolicyEntry] = {
    "lru": PolicyEntry(".lru.LRUPolicy", label="LRU", memory_tier=True),
    "lfu": PolicyEntry(".lfu.LFUPolicy", label="LFU", memory_tier=False),
    "wtinylfu": PolicyEntry(".wtinylfu.WTinyLFUPolicy", label="W-TinyLFU", memory_tier=True, admission=True),
    "prefix": PolicyEntry(".prefix.PrefixPolicy", label="Prefix", memory_tier=True),
}

#: The encoder cache's policy when none is configured: the best measured on `tiercache bench policy`.
DEFAULT_POLICY = "lfu"


def policy_names() -> tuple[str, ...]:
    """Every registered policy (what the encoder cache managers accept), in registration order."""
    return tuple(_POLICIES)


def memory_tier_policies() -> tuple[str, ...]:
    """The policies the store's memory tier accepts, in registration order."""
    return tuple(name for name, entry in _POLICIES.items() if entry.memory_tier)


def policy_entry(name: str, field: str = "policy") -> PolicyEntry:
    """The entry of policy ``name``; an unknown name is a `ValueError` naming ``field``, the value and the
    choices (the one error style of the configs)."""
    try:
        return _POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"{field}: invalid value {name!r}; allowed: {', '.join(_POLICIES)}") from None


def policy_class_name(name: str) -> str:
    """The class name of policy ``name`` (``"WTinyLFUPolicy"``), read off its dotted path: nothing imported."""
    return policy_entry(name).class_path.rpartition(".")[2]


def policy_class_path(name: str) -> str:
    """The absolute dotted path of policy ``name``'s class (``vllm_tiercache.shared.eviction.lru.LRUPolicy``)."""
    path = policy_entry(name).class_path
    return f"{__package__}{path}" if path.startswith(".") else path


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class of policy ``name`` (imports its module)."""
    module, _, attr = policy_class_path(name).rpartition(".")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise TypeError(f"policy {name!r}: {cls!r} is not an EvictionPolicy")
    return cls


def policy_options(name: str) -> tuple[str, ...]:
    """The options policy ``name`` takes: its constructor's keyword parameters after ``capacity`` (what the
    encoder cache managers' ``manager_config`` may set)."""
    params = inspect.signature(policy_class(name).__init__).parameters
    return tuple(param for param in params if param not in ("self", "capacity"))


def make_policy(name: str, capacity: int, field: str = "policy", **options: object) -> EvictionPolicy:
    """Build policy ``name`` with ``options``; an unknown name is a `ValueError` naming ``field``, the value
    and the choices."""
    policy_entry(name, field)
    return policy_class(name)(capacity, **options)  # type: ignore[arg-type]
