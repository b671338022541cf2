"""The EC connector's own options: the encoder cache's eviction policy and the legacy stats file.

Why here and not in the store config: the store (tiers, namespace, write queue) is shared with the KV
connector and the offline tools; these mean something only on the encoder-cache side. Users still write
them in ``ec_connector_extra_config`` next to ``tiers`` (one dict): `ECConnectorOptions.load` splits that
dict with `vllm_tiercache.shared.config.split_connector_config` and parses its own part.

The keys, their types, defaults and meaning are the annotated fields of `ECConnectorOptions`
(docs/configuration.md shows them, generated). ``x_ec_stats_path`` is kept as given: ``{pid}`` in it is
replaced by the process id when the file is written, so that processes do not overwrite each other's.

The encoder cache managers' ``manager_config`` (a vLLM setting, not a key of the dict) is declared here too,
as `ManagerOptions`, so that its schema and docs need no vLLM import; `vllm_tiercache.eccache.managers`
checks it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, ConfigDict, Field, Strict, with_config
from typing_extensions import TypedDict

from vllm_tiercache.shared.config import CONNECTOR_KEYS, StoreConfig, split_connector_config
from vllm_tiercache.shared.eviction import (
    DEFAULT_POLICY,
    policy_class,
    policy_class_name,
    policy_names,
    policy_options,
)
from vllm_tiercache.shared.store.tier_config import Allowed, Bool, validate

#: the encoder cache's eviction policies: every one registered (`vllm_tiercache.shared.eviction.registry`)
EncoderCachePolicy = Literal[policy_names()]  # type: ignore[valid-type]


def manager_class_name(policy: str) -> str:
    """The encoder cache manager class that fixes ``policy`` (`vllm_tiercache.eccache.managers` makes one per
    registered policy): the policy class's name with ``Policy`` replaced, ``LRUPolicy`` -> ``LRUEncoderCacheManager``.
    Here, not in `managers`, so that these texts need no vLLM import."""
    return policy_class_name(policy).removesuffix("Policy") + "EncoderCacheManager"


def _one_of(names: tuple[str, ...] | list[str]) -> str:
    """``"lru, lfu or wtinylfu"``."""
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _as_given(path: Any) -> str | None:
    return str(path) if path else None


@dataclass(frozen=True)
class ECConnectorOptions:
    """The EC connector's own options (`TieredECConnector`)."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    encoder_cache_policy: Annotated[EncoderCachePolicy | None, Field(description=(
        f"Eviction policy of vllm_tiercache.eccache.managers.PolicyEncoderCacheManager: {_one_of(policy_names())}; "
        f"null means the default, {DEFAULT_POLICY}. manager_config['policy'] wins over it.")),
        Allowed(", ".join(policy_names()) + " or null")] = None
    #: ``x_ec_stats_path`` as given (``{pid}`` not yet replaced); None: no legacy stats file
    stats_path: Annotated[str | None, BeforeValidator(_as_given), Field(
        alias="x_ec_stats_path", description=(
            "Legacy: one more file each connector process writes its counters to ({pid} is replaced by the "
            "process id); prefer $TIERCACHE_STATS_DIR."))] = None

    #: the keys this class parses, as `vllm_tiercache.shared.config.CONNECTOR_KEYS` lists them
    KEYS: ClassVar[tuple[str, ...]] = CONNECTOR_KEYS["TieredECConnector"]

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None) -> tuple[ECConnectorOptions, StoreConfig]:
        """(our options, the store config) from the connector's extra config and its sources."""
        own, store = split_connector_config(extra, cls.KEYS)
        return cls.from_dict(own), store

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ECConnectorOptions:
        """Validate our keys, skip the others' (no file/env lookup); errors name the key, the value and what
        is allowed."""
        return validate(cls, {key: raw[key] for key in cls.KEYS if key in raw})

    def stats_file(self, pid: int) -> str | None:
        """This process's legacy stats file: ``x_ec_stats_path`` with ``{pid}`` replaced."""
        return self.stats_path.replace("{pid}", str(pid)) if self.stats_path else None


# ------------------------------------------------------------------------------------ manager_config
_FRACTION = "a number strictly between 0 and 1"


def _takers(option: str) -> list[str]:
    """The registered policies whose constructor takes ``option``, in registration order."""
    takers = [name for name in policy_names() if option in policy_options(name)]
    if not takers:
        raise TypeError(f"manager_config option {option!r}: no registered policy takes it")
    return takers


def _for(option: str, meaning: str) -> str:
    """An option's description: the policies that take it, then what it means (``"lfu, wtinylfu: ..."``)."""
    return f"{', '.join(_takers(option))}: {meaning}"


def _default(option: str) -> dict[str, Any]:
    """The schema's default of an option: the class's own default of the first policy that takes it (unset
    options keep their policy's default)."""
    return {"default": inspect.signature(policy_class(_takers(option)[0]).__init__).parameters[option].default}


_FIXED_MANAGERS = "/".join(manager_class_name(name).removesuffix("EncoderCacheManager") for name in policy_names())


@with_config(ConfigDict(extra="forbid"))
class ManagerOptions(TypedDict, total=False):
    """The options of vLLM's ``ec_manager_config.manager_config`` for the encoder cache managers of
    `vllm_tiercache.eccache.managers`: ``policy``, then the chosen policy's own options (a policy takes the
    keyword parameters of its class in `vllm_tiercache.shared.eviction`; lru takes none). Unset options keep
    the policy's defaults. `vllm_tiercache.eccache.managers.check_manager_options` checks them."""

    policy: Annotated[EncoderCachePolicy, Field(description=(
        f"{_one_of(policy_names())}; with PolicyEncoderCacheManager, else the EC connector's encoder_cache_policy, "
        f"else {DEFAULT_POLICY}. The {_FIXED_MANAGERS} managers fix it: another value is an error."))]
    aging_period: Annotated[int, Strict(), Field(ge=0, description=_for(
        "aging_period", "accesses between two halvings of every count (0: no aging)."),
        json_schema_extra=_default("aging_period")),
        Allowed("an int >= 0 (accesses between two halvings; 0: no aging)")]
    history_size: Annotated[int, Strict(), Field(ge=0, description=_for(
        "history_size", "how many evicted keys keep their count, a bounded ghost table."),
        json_schema_extra=_default("history_size")),
        Allowed("an int >= 0 (evicted hashes that keep their count)")]
    size_aware: Annotated[Bool, Field(description=_for(
        "size_aware", "compare counts per embedding (true) or per entry."),
        json_schema_extra=_default("size_aware"))]
    window_fraction: Annotated[float, Strict(), Field(gt=0, lt=1, allow_inf_nan=False, description=_for(
        "window_fraction", "share of the capacity in the LRU window that takes every new entry."),
        json_schema_extra=_default("window_fraction")),
        Allowed(_FRACTION)]
    protected_fraction: Annotated[float, Strict(), Field(gt=0, lt=1, allow_inf_nan=False, description=_for(
        "protected_fraction", "share of the main area in its protected segment."),
        json_schema_extra=_default("protected_fraction")), Allowed(_FRACTION)]
    victim_sample: Annotated[int, Strict(), Field(ge=1, description=_for(
        "victim_sample", "the victim is the least frequent of this many oldest probation entries."),
        json_schema_extra=_default("victim_sample")),
        Allowed("an int >= 1")]


def check_manager_option(key: str, value: Any) -> None:
    """One `manager_config` option's value (a `ConfigError` naming ``manager_config.<key>`` otherwise); an
    option `ManagerOptions` does not declare is left to its policy."""
    if key in ManagerOptions.__optional_keys__:
        validate(ManagerOptions, {key: value}, "manager_config")
