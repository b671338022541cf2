"""The KV connector's own options: how prompts are cut into chunks, what is saved, how a failed load ends.

Why here and not in the store config: the store (tiers, namespace, write queue) is shared with the
encoder-cache connector and the offline tools; these options mean something only to the KV connector and
to `tiercache precompute docs`, which must store exactly what the connector would. Users still write them
next to ``tiers`` in ``kv_connector_extra_config`` (one dict): `KVConnectorOptions.load` splits that dict
with `vllm_tiercache.shared.config.split_connector_config` and parses its own part.

Keys and defaults:

- ``chunk_size`` (int, 256): tokens per KV chunk (one record per layer and rank); a positive multiple of
  16 and of the engine's block size (`vllm_tiercache.kvcache.naming.ChunkGeometry` checks the latter).
  Env ``TIERCACHE_CHUNK_SIZE`` overrides it, over every source.
- ``save_partial_chunks`` (bool, true): also store the trailing chunk shorter than ``chunk_size``.
- ``save_decode`` (bool, false): also store KV produced while decoding.
- ``load_failure_policy`` ("recompute", "fail" or unset): only fills vLLM's ``kv_load_failure_policy``
  when the user did not set that (`vllm_tiercache.kvcache.connector.resolve_load_failure_policy`).
- ``warmup_cpu_attention`` (default true): see `vllm_tiercache.kvcache.cpu_warmup`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_tiercache.shared.config import CONNECTOR_KEYS, ConfigError, StoreConfig, split_connector_config
from vllm_tiercache.shared.store.tier_config import as_bool, as_int

#: Allowed values of ``load_failure_policy``.
FAILURE_POLICIES = ("recompute", "fail")
#: What a chunk that fails to load costs when neither vLLM's setting nor our option says: a recompute,
#: never a failed request (a bad or evicted record is a cache miss).
DEFAULT_LOAD_FAILURE_POLICY = "recompute"
#: Env var that overrides ``chunk_size`` (applied last, over every config source).
CHUNK_SIZE_ENV = "TIERCACHE_CHUNK_SIZE"


@dataclass(frozen=True)
class KVConnectorOptions:
    """The validated KV-connector part of ``kv_connector_extra_config``."""

    chunk_size: int = 256
    save_partial_chunks: bool = True
    save_decode: bool = False
    #: None: the user did not set it (vLLM's own setting, or our default, decides)
    load_failure_policy: str | None = None
    warmup_cpu_attention: bool = True

    #: the keys this class parses, as `vllm_tiercache.shared.config.CONNECTOR_KEYS` lists them
    KEYS: ClassVar[tuple[str, ...]] = CONNECTOR_KEYS["TieredKVConnector"]

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None) -> tuple[KVConnectorOptions, StoreConfig]:
        """(our options, the store config) from the connector's extra config, its sources and env."""
        own, store = split_connector_config(extra, cls.KEYS)
        env = os.environ.get(CHUNK_SIZE_ENV)
        if env:
            own["chunk_size"] = int(env) if env.strip().isdigit() else env
        return cls.from_dict(own), store

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVConnectorOptions:
        """Validate our keys (no file/env lookup); errors name the key, the value and what is allowed."""
        chunk_size = as_int(raw.get("chunk_size", 256), "chunk_size", "a positive multiple of 16",
                            lambda v: v > 0 and v % 16 == 0)
        policy = raw.get("load_failure_policy")
        if policy is not None and policy not in FAILURE_POLICIES:
            raise ConfigError(
                f"kv_connector_extra_config.load_failure_policy={policy!r} is not allowed; "
                f"allowed: {', '.join(FAILURE_POLICIES)}"
            )
        return cls(
            chunk_size=chunk_size,
            save_partial_chunks=as_bool(raw.get("save_partial_chunks", True), "save_partial_chunks"),
            save_decode=as_bool(raw.get("save_decode", False), "save_decode"),
            load_failure_policy=policy,
            # Taken as truthy, as it always was (not a strict bool).
            warmup_cpu_attention=bool(raw.get("warmup_cpu_attention", True)),
        )
