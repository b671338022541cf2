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
from vllm_tiercache.shared.eviction import POLICIES, LFUPolicy, WTinyLFUPolicy
from vllm_tiercache.shared.store.tier_config import Allowed, Bool, validate

#: the encoder cache's eviction policies (`vllm_tiercache.shared.eviction.POLICIES`)
EncoderCachePolicy = Literal[POLICIES]  # type: ignore[valid-type]


def _as_given(path: Any) -> str | None:
    return str(path) if path else None


@dataclass(frozen=True)
class ECConnectorOptions:
    """The EC connector's own options (`TieredECConnector`)."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    encoder_cache_policy: Annotated[EncoderCachePolicy | None, Field(description=(
        "Eviction policy of vllm_tiercache.eccache.managers.PolicyEncoderCacheManager: lru, lfu or wtinylfu; "
        "null means the default, lfu. manager_config['policy'] wins over it.")),
        Allowed(", ".join(POLICIES) + " or null")] = None
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


def _default(policy: type, option: str) -> dict[str, Any]:
    """The schema's default of an option: the policy class's own (unset options keep it)."""
    return {"default": inspect.signature(policy.__init__).parameters[option].default}


@with_config(ConfigDict(extra="forbid"))
class ManagerOptions(TypedDict, total=False):
    """The options of vLLM's ``ec_manager_config.manager_config`` for the encoder cache managers of
    `vllm_tiercache.eccache.managers`: ``policy``, then the chosen policy's own options (a policy takes the
    keyword parameters of its class in `vllm_tiercache.shared.eviction`; lru takes none). Unset options keep
    the policy's defaults. `vllm_tiercache.eccache.managers.check_manager_options` checks them."""

    policy: Annotated[EncoderCachePolicy, Field(description=(
        "lru, lfu or wtinylfu; with PolicyEncoderCacheManager, else the EC connector's encoder_cache_policy, "
        "else lfu. The LRU/LFU/WTinyLFU managers fix it: another value is an error."))]
    aging_period: Annotated[int, Strict(), Field(ge=0, description=(
        "lfu: accesses between two halvings of every count (0: no aging)."),
        json_schema_extra=_default(LFUPolicy, "aging_period")),
        Allowed("an int >= 0 (accesses between two halvings; 0: no aging)")]
    history_size: Annotated[int, Strict(), Field(ge=0, description=(
        "lfu: how many evicted keys keep their count, a bounded ghost table."),
        json_schema_extra=_default(LFUPolicy, "history_size")),
        Allowed("an int >= 0 (evicted hashes that keep their count)")]
    size_aware: Annotated[Bool, Field(description=(
        "lfu, wtinylfu: compare counts per embedding (true) or per entry."),
        json_schema_extra=_default(LFUPolicy, "size_aware"))]
    window_fraction: Annotated[float, Strict(), Field(gt=0, lt=1, allow_inf_nan=False, description=(
        "wtinylfu: share of the capacity in the LRU window that takes every new entry."),
        json_schema_extra=_default(WTinyLFUPolicy, "window_fraction")),
        Allowed(_FRACTION)]
    protected_fraction: Annotated[float, Strict(), Field(gt=0, lt=1, allow_inf_nan=False, description=(
        "wtinylfu: share of the main area in its protected segment."),
        json_schema_extra=_default(WTinyLFUPolicy, "protected_fraction")), Allowed(_FRACTION)]
    victim_sample: Annotated[int, Strict(), Field(ge=1, description=(
        "wtinylfu: the victim is the least frequent of this many oldest probation entries."),
        json_schema_extra=_default(WTinyLFUPolicy, "victim_sample")),
        Allowed("an int >= 1")]


def check_manager_option(key: str, value: Any) -> None:
    """One `manager_config` option's value (a `ConfigError` naming ``manager_config.<key>`` otherwise); an
    option `ManagerOptions` does not declare is left to its policy."""
    if key in ManagerOptions.__optional_keys__:
        validate(ManagerOptions, {key: value}, "manager_config")
