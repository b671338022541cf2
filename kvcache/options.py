"""The KV connector's own options: how prompts are cut into chunks, what is saved, how a failed load ends.

Why here and not in the store config: the store (tiers, namespace, write queue) is shared with the
encoder-cache connector and the offline tools; these options mean something only to the KV connector and
to `tiercache precompute docs`, which must store exactly what the connector would. Users still write them
next to ``tiers`` in ``kv_connector_extra_config`` (one dict): `KVConnectorOptions.load` splits that dict
with `vllm_tiercache.shared.config.split_connector_config` and parses its own part.

The keys, their types, bounds, defaults and meaning are the annotated fields of `KVConnectorOptions`
(docs/configuration.md shows them, generated). ``chunk_size`` must also be a multiple of the engine's
block size (`vllm_tiercache.kvcache.naming.ChunkGeometry` checks that); env ``TIERCACHE_CHUNK_SIZE``
overrides it, over every source; ``load_failure_policy`` only fills vLLM's ``kv_load_failure_policy`` when
the user did not set that (`vllm_tiercache.kvcache.connector.resolve_load_failure_policy`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BeforeValidator, ConfigDict, Field, Strict

from vllm_tiercache.shared.config import CONNECTOR_KEYS, StoreConfig, split_connector_config
from vllm_tiercache.shared.store.tier_config import Allowed, Bool, size, validate

#: Allowed values of ``load_failure_policy``.
FailurePolicy = Literal["recompute", "fail"]
FAILURE_POLICIES: tuple[str, ...] = get_args(FailurePolicy)
#: What a chunk that fails to load costs when neither vLLM's setting nor our option says: a recompute,
#: never a failed request (a bad or evicted record is a cache miss).
DEFAULT_LOAD_FAILURE_POLICY = "recompute"
#: Allowed values of ``load_mode``: when a step's hits are loaded (`vllm_tiercache.kvcache.worker`).
LoadMode = Literal["auto", "layerwise", "before_forward"]
LOAD_MODES: tuple[str, ...] = get_args(LoadMode)
#: Default and upper bound of ``handoff_wait_ms``: how long a consumer's prefill/decode hand-off waits for
#: the records its producer promised (`vllm_tiercache.kvcache.handoff.promise`); docs/serving.md says why 1 s.
DEFAULT_HANDOFF_WAIT_MS = 1000.0
MAX_HANDOFF_WAIT_MS = 60000.0
#: Default and upper bound of ``lookup_deadline_ms``: how long a request waits at most for its lookup and its
#: prefetch from far tiers (`vllm_tiercache.kvcache.lookup.far`): a far tier's answer and a chunk's fetch take a
#: few round trips; past 1 s, recomputing most prompts is cheaper than waiting on a slow store.
DEFAULT_LOOKUP_DEADLINE_MS = 1000.0
MAX_LOOKUP_DEADLINE_MS = 60000.0
#: The longest a request waits on far tiers after its turn, in deadlines: a store that answers (chunks of other
#: requests land while those of this one are queued behind them) restarts the deadline, up to this many.
MAX_WAIT_DEADLINES = 10
#: Default and lower bound of ``prefetch_buffer``: the host memory a worker holds far chunks in between their
#: fetch and their load (`vllm_tiercache.kvcache.load.staging`).
DEFAULT_PREFETCH_BUFFER = 1 << 30
MIN_PREFETCH_BUFFER = 1 << 20
#: Env var that overrides ``chunk_size`` (applied last, over every config source).
CHUNK_SIZE_ENV = "TIERCACHE_CHUNK_SIZE"


@dataclass(frozen=True)
class KVConnectorOptions:
    """The KV connector's own options (`TieredKVConnector`); `tiercache precompute docs` reads them too,
    to store what the connector would."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    chunk_size: Annotated[int, Strict(), Field(gt=0, multiple_of=16, description=(
        "Tokens per KV chunk (one record per layer and rank): a multiple of 16 and of the engine's block size. "
        "$TIERCACHE_CHUNK_SIZE overrides it, over every source.")), Allowed("a positive multiple of 16")] = 256
    save_partial_chunks: Annotated[Bool, Field(description=(
        "Also save the partial last chunk (shorter than chunk_size), at the last prefill step."))] = True
    save_decode: Annotated[Bool, Field(description="Also save chunks completed while decoding.")] = False
    #: None: the user did not set it (vLLM's own setting, or our default, decides)
    load_failure_policy: Annotated[FailurePolicy | None, Field(description=(
        "A chunk that fails to load is recomputed (recompute), or the request fails (fail, vLLM's own "
        "default). Only fills vLLM's kv_load_failure_policy when that is not set; with neither set the "
        "connector runs vLLM with recompute.")),
        Allowed(", ".join(FAILURE_POLICIES), path="kv_connector_extra_config.load_failure_policy")] = None
    load_mode: Annotated[LoadMode, Field(description=(
        "When a step's hits are loaded: layerwise (a loader thread, layer by layer while the forward runs; "
        "each layer waits for its own), before_forward (all of them before the forward starts, on the "
        "forward's thread), or auto: layerwise on a GPU, before_forward on a CPU, where the loader and the "
        "forward share the cores and the GIL and overlap bought nothing (docs/benchmarks-kv.md).")),
        Allowed(", ".join(LOAD_MODES), path="kv_connector_extra_config.load_mode")] = "auto"
    # Taken as truthy, as it always was (not a strict bool).
    warmup_cpu_attention: Annotated[bool, BeforeValidator(bool), Field(description=(
        "Run the CPU attention kernel once when the KV caches are registered (see "
        "vllm_tiercache.kvcache.load.cpu_warmup)."))] = True

    handoff_wait_ms: Annotated[float, Strict(), Field(ge=0, le=MAX_HANDOFF_WAIT_MS, allow_inf_nan=False, description=(
        "Prefill/decode hand-off (docs/serving.md): the longest a consumer's request that carries a producer's "
        "kv_transfer_params waits, in WAITING_FOR_REMOTE_KVS and without holding up the batch, for the "
        "records the producer promised but has not yet written to the shared tier, in ms. What has not "
        "arrived by then is recomputed and counted (handoff_fallbacks). 0: take what is there at once.")),
        Allowed(f"a number of milliseconds, at least 0, at most {MAX_HANDOFF_WAIT_MS:g}",
                path="kv_connector_extra_config.handoff_wait_ms")] = DEFAULT_HANDOFF_WAIT_MS

    lookup_deadline_ms: Annotated[float, Strict(), Field(ge=0, le=MAX_LOOKUP_DEADLINE_MS, allow_inf_nan=False,
                                                         description=(
        "Far tiers (Redis, Redis Cluster, the object tier; docs/architecture.md, \"far tiers\"): a request's "
        "lookup runs off the scheduling thread from its arrival, and the chunks found there are fetched into "
        "host memory (prefetch_buffer) before its turn, so neither the scheduler nor a forward pass waits on "
        "the network (not for models with several KV cache groups). The "
        "request waits for that at most this long once its turn came (vLLM first asks for it; its time "
        "queued behind others does not count) or since the last chunk landed, its own or another request's "
        f"(a slow but steady store is not cut, a stalled one is; at most {MAX_WAIT_DEADLINES} times this after "
        "its turn), in ms, "
        "without holding up the others; "
        "what has not come by then is computed (lookups_late, prefetches_late). 0: look far tiers up on the "
        "scheduling thread, bounded by lookup_budget_ms, and read their hits in the forward pass.")),
        Allowed(f"a number of milliseconds, at least 0, at most {MAX_LOOKUP_DEADLINE_MS:g}",
                path="kv_connector_extra_config.lookup_deadline_ms")] = DEFAULT_LOOKUP_DEADLINE_MS

    prefetch_buffer: Annotated[int, size(MIN_PREFETCH_BUFFER, out_of_range=(
        f'a size of at least {MIN_PREFETCH_BUFFER} bytes, e.g. "1GiB"')), Field(description=(
        "Far tiers: the host memory each worker may hold far chunks fetched ahead of their request in, until "
        "their load (beside the memory tier, whose eviction never drops them before); a chunk leaves it once the "
        "last request waiting for it has loaded it. A chunk that does not "
        "fit is computed instead (prefetch_failures).")),
        Allowed("a size such as 1GiB", path="kv_connector_extra_config.prefetch_buffer")] = DEFAULT_PREFETCH_BUFFER

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
        """Validate our keys, skip the others' (no file/env lookup); errors name the key, the value and what
        is allowed."""
        return validate(cls, {key: raw[key] for key in cls.KEYS if key in raw})
