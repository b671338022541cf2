"""The EC connector's own options: the encoder cache's eviction policy and the legacy stats file.

Why here and not in the store config: the store (tiers, namespace, write queue) is shared with the KV
connector and the offline tools; these mean something only on the encoder-cache side. Users still write
them in ``ec_connector_extra_config`` next to ``tiers`` (one dict): `ECConnectorOptions.load` splits that
dict with `vllm_tiercache.shared.config.split_connector_config` and parses its own part.

Keys and defaults:

- ``encoder_cache_policy`` (str or null, null): eviction policy of
  `vllm_tiercache.eccache.managers.PolicyEncoderCacheManager` (lru, lfu, wtinylfu; null =
  ``vllm_tiercache.shared.eviction.DEFAULT_POLICY``).
- ``x_ec_stats_path`` (str, optional, legacy): one more file the connector writes its counters to;
  ``{pid}`` in it is replaced by the process id, so that processes do not overwrite each other's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_tiercache.shared.config import CONNECTOR_KEYS, StoreConfig, split_connector_config
from vllm_tiercache.shared.eviction import POLICIES
from vllm_tiercache.shared.store.tier_config import invalid


@dataclass(frozen=True)
class ECConnectorOptions:
    """The validated EC-connector part of ``ec_connector_extra_config``."""

    encoder_cache_policy: str | None = None
    #: ``x_ec_stats_path`` as given (``{pid}`` not yet replaced); None: no legacy stats file
    stats_path: str | None = None

    #: the keys this class parses, as `vllm_tiercache.shared.config.CONNECTOR_KEYS` lists them
    KEYS: ClassVar[tuple[str, ...]] = CONNECTOR_KEYS["TieredECConnector"]

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None) -> tuple[ECConnectorOptions, StoreConfig]:
        """(our options, the store config) from the connector's extra config and its sources."""
        own, store = split_connector_config(extra, cls.KEYS)
        return cls.from_dict(own), store

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ECConnectorOptions:
        """Validate our keys (no file/env lookup); errors name the key, the value and what is allowed."""
        policy = raw.get("encoder_cache_policy")
        if policy is not None and policy not in POLICIES:
            raise invalid("encoder_cache_policy", policy, ", ".join(POLICIES) + " or null")
        path = raw.get("x_ec_stats_path")
        return cls(encoder_cache_policy=policy, stats_path=str(path) if path else None)

    def stats_file(self, pid: int) -> str | None:
        """This process's legacy stats file: ``x_ec_stats_path`` with ``{pid}`` replaced."""
        return self.stats_path.replace("{pid}", str(pid)) if self.stats_path else None
