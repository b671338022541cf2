"""`TieredECConnector`: vLLM's encoder-cache connector over the tiered store (memory -> disk -> Redis).

Configure it like any vLLM 0.32 EC connector::

    ECTransferConfig(
        ec_connector="TieredECConnector",
        ec_connector_module_path="vllm_tiercache.eccache.connector",   # not needed once the tiercache plugin is loaded
        ec_role="ec_both",                              # or ec_producer / ec_consumer
        ec_connector_extra_config={"namespace": "demo", "tiers": [...], "x_ec_stats_path": "/tmp/ec.json"},
    )

`ec_connector_extra_config` is the store config (`vllm_tiercache.shared.config.StoreConfig`) plus this
connector's own options (`vllm_tiercache.eccache.options.ECConnectorOptions`), in one dict. Roles: `ec_producer`
saves what it encodes and never loads (vLLM then runs the encoder only: an encode instance; an item
the store already holds is not encoded again),
`ec_consumer` loads and never saves, `ec_both` loads what is stored and saves what it computed.

Processes: vLLM builds a SCHEDULER-role connector in its engine-core process and a WORKER-role one in
each worker. With the uniproc executor they share one process (and one store); with the multiproc
executor (always on vLLM-CPU, and with more than one device) they do not, and the scheduler learns what
the worker's memory tier holds from the worker's residency reports (see `vllm_tiercache.eccache.scheduler`).

Counters: the supported view is vLLM's `/metrics` (`vllm:tiercache_ec_*_total`, see `vllm_tiercache.eccache.metrics`):
they reach vLLM's stats through `get_ec_connector_stats` of the scheduler-side connector, which also
carries what the workers counted (sent back with their residency reports). Diagnostics besides: every
process keeps its own totals (`process_stats()`); with env `TIERCACHE_STATS_DIR` set, each process writes
them, with its store's stats, to `$TIERCACHE_STATS_DIR/ec-<pid>.json` whenever they change
(`vllm_tiercache.shared.stats_dump`; sum the files for an engine's totals). `x_ec_stats_path` (optional, legacy) is one
more such file; `{pid}` in it is replaced by the process id, so that processes do not overwrite it.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
    PromMetric,
    PromMetricT,
)

from vllm_tiercache.eccache.encoder_reset import install as install_encoder_reset
from vllm_tiercache.eccache.metrics import TieredECPromMetrics
from vllm_tiercache.eccache.options import ECConnectorOptions
from vllm_tiercache.eccache.scheduler import ECSchedulerSide, TieredECMetadata, TieredECWorkerMetadata
from vllm_tiercache.eccache.worker import ECWorkerSide, worker_in_process
from vllm_tiercache.shared.config import ConfigError, StoreConfig
from vllm_tiercache.shared.counters import Counters
from vllm_tiercache.shared.naming.keys import EncoderIdentity, encoder_key, weights_of
from vllm_tiercache.shared.naming.mm_identifiers import MultiModalIdentifierPolicy
from vllm_tiercache.shared.stats_dump import ENV_VAR as STATS_DIR_ENV
from vllm_tiercache.shared.stats_dump import dump_stats, write_stats_file
from vllm_tiercache.shared.store import describe_tiers, get_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.counters import add_nested
from vllm_tiercache.shared.vllm_compat import check_vllm_version

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: Counter names; `*_seconds` are float sums, the rest ints.
COUNTER_NAMES = (
    "hits", "misses", "lookup_errors", "loads", "load_failures", "recomputed", "bytes_loaded",
    "load_seconds", "saves", "save_errors", "bytes_saved", "save_seconds", "generation_resets",
)


class ECCounters(Counters):
    """The EC connector's counters (`COUNTER_NAMES`), in the product's one counters shape."""

    def __init__(self) -> None:
        super().__init__(COUNTER_NAMES)


#: One per process: the scheduler-side and worker-side connector of a uniproc engine count together.
COUNTERS = ECCounters()


#: Roles of the EC connectors built in this process (both with vLLM's uniproc executor), for the stats files.
_ROLES: set[str] = set()


def process_stats() -> dict[str, float]:
    """Cumulative counters of this process (tests and `tiercache stats` read these)."""
    return COUNTERS.snapshot()


class TieredECStats(ECConnectorStats):
    """vLLM's EC stats hook (0.32 has one): increments since the last step, summed; vLLM logs `reduce()`
    and exports `data` on `/metrics` (`vllm_tiercache.eccache.metrics.TieredECPromMetrics`).

    `data`: the connector's counters by name (`COUNTER_NAMES`), ``write_queue_hits``, ``tiers`` ({tier:
    {counter: increment}}, summed per tier) and ``gauges`` ({source: report}: levels, a later report of a
    source replaces the earlier one)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        for k, v in other.data.items():
            if k == "tiers":
                self.data["tiers"] = add_nested(copy.deepcopy(self.data.get("tiers", {})), v)
            elif k == "gauges":
                self.data["gauges"] = {**self.data.get("gauges", {}), **v}
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k not in ("tiers", "gauges")}
        lookups = out.get("hits", 0) + out.get("misses", 0)
        if lookups:
            out["hit_rate"] = out.get("hits", 0) / lookups
        for tier, numbers in sorted(self.data.get("tiers", {}).items()):
            for name in ("hits", "bytes_written", "dropped_writes", "errors"):
                if numbers.get(name):
                    out[f"{tier}_{name}"] = numbers[name]
        return out

    def is_empty(self) -> bool:
        return not self.data


def check_ec_config(vllm_config: VllmConfig) -> tuple[ECConnectorOptions, StoreConfig, MultiModalIdentifierPolicy]:
    """Everything `TieredECConnector` refuses at start, checked without opening a store or reading weights.

    The plugin calls it when vLLM builds its config (`vllm_tiercache.preflight`: before any weights
    load); the connector calls it again in each process, so the same rules hold where the plugin cannot
    hook. A mode where multimodal identifiers do not name content is refused here.
    """
    ec = vllm_config.ec_transfer_config
    if ec is None:
        raise ConfigError("TieredECConnector needs vLLM's ec_transfer_config (--ec-transfer-config)")
    options, config = ECConnectorOptions.load(dict(ec.ec_connector_extra_config or {}))
    identifiers = MultiModalIdentifierPolicy.for_engine(
        vllm_config, trust_user_uuids=config.trust_multi_modal_uuids, connector="TieredECConnector"
    )
    return options, config, identifiers


def _never(_identifier: str) -> bool:
    """Keeps every encoder output out of the store (`require_cache_salt`: an output names no tenant)."""
    return False


class TieredECConnector(ECConnectorBase):
    """Encoder outputs keyed by (namespace, encoder identity, full mm_hash) in the shared tiered store."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        check_vllm_version("TieredECConnector")  # one warning when vLLM is outside the verified range
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        assert ec is not None
        options, self._config, self._identifiers = check_ec_config(vllm_config)
        # One store per process and config: the KV connector in this process shares it (and its budget).
        self._store = get_store(self._config)
        weights = weights_of(vllm_config, self._config.model_version)
        self._identity = EncoderIdentity.from_vllm_config(vllm_config, weights=weights)
        self._stats_path = options.stats_file(os.getpid())
        self._stats_version = -1
        self._executor = str(vllm_config.parallel_config.distributed_executor_backend)
        _ROLES.add(role.name.lower())
        logger.info(
            "TieredECConnector: role=%s ec_role=%s pid=%d executor=%s world_size=%d model=%s weights=%s "
            "fingerprint=%s namespace=%s tiers=%s",
            role.name, ec.ec_role, os.getpid(), vllm_config.parallel_config.distributed_executor_backend,
            vllm_config.parallel_config.world_size, self._identity.model, weights.digest,
            self._identity.encoder_fingerprint, self._config.namespace, describe_tiers(self._config),
        )
        if role == ECConnectorRole.SCHEDULER:
            # vLLM's scheduler is building us: make its encoder-cache reset reach `reset_cache`.
            install_encoder_reset()
            # Whether the worker shares this process (and so its memory tier) is checked at lookup time:
            # the uniproc executor builds its worker here, the multiproc one in another process.
            store = self._store
            self._sched: ECSchedulerSide | None = ECSchedulerSide(
                self._store, self._key, load_enabled=self.is_consumer,
                same_process=lambda: worker_in_process(store), counters=COUNTERS,
                cacheable=_never if self._config.require_cache_salt else self._identifiers.cacheable,
            )
            if self._config.require_cache_salt:
                logger.warning("TieredECConnector: require_cache_salt is set: encoder outputs are neither loaded "
                               "nor saved (they are keyed by their media, which names no tenant; see "
                               "docs/operations.md, the trust boundary)")
            self._worker: ECWorkerSide | None = None
        else:
            self._sched = None
            mc = vllm_config.model_config
            self._worker = ECWorkerSide(
                self._store, self._key, device=_worker_device(), dtype=mc.dtype,
                hidden_size=mc.get_hidden_size(), save_enabled=self.is_producer, counters=COUNTERS,
                cacheable=self._identifiers.cacheable,
            )

    def _key(self, mm_hash: str) -> StoreKey:
        return encoder_key(self._config.namespace, self._identity, mm_hash)

    def stats(self, cached_usage: bool = False) -> dict[str, Any]:
        """Counters of this process plus the store's own stats (usage from its background refresh with
        ``cached_usage``, else asked now)."""
        out: dict[str, Any] = {"connector": process_stats(), "roles": sorted(_ROLES), "executor": self._executor}
        try:
            out["store"] = self._store.stats(cached_usage=cached_usage)
        except Exception as exc:  # stats must never break serving
            out["store"] = {"error": repr(exc)}
        return out

    def _maybe_write_stats(self, force: bool = False) -> None:
        """Write this process's counters when they changed since the last write (at most once a step).

        Only with a stats file to write (`$TIERCACHE_STATS_DIR`, `x_ec_stats_path`); per step the store's
        usage is the cached one, so no step waits on a Redis round trip."""
        if not self._stats_path and not os.environ.get(STATS_DIR_ENV):
            return
        version = COUNTERS.version
        if not force and version == self._stats_version:
            return
        self._stats_version = version
        payload = self.stats(cached_usage=not force)
        dump_stats("ec", payload, min_interval_s=0.0)
        if self._stats_path:
            write_stats_file(self._stats_path, {"pid": os.getpid(), **payload})

    # ------------------------------------------------------------------------------------ worker side

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        if self._worker is None or not self.is_consumer:
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TieredECMetadata)
        self._worker.start_load_caches(encoder_cache, metadata)

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        """vLLM binds each step's metadata before the step's loads and saves: the worker takes the weights
        generation it names records in (kept for saves until the next step's metadata)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, TieredECMetadata):
            self._worker.set_generation(connector_metadata)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_caches(encoder_cache, mm_hash)

    def build_connector_worker_meta(self) -> TieredECWorkerMetadata | None:
        """End of every model step (vLLM's worker -> scheduler channel): memory-tier residency changes."""
        if self._worker is None:
            return None
        self._maybe_write_stats()
        return self._worker.worker_meta()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads finish inside start_load_caches; saves never hold a request

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        """Scheduler side only: its counters plus the workers' (reported with `build_connector_worker_meta`).

        A worker returns None, so Model Runner V2 (which also asks workers) never counts anything twice.
        """
        data = self._sched.take_stats() if self._sched is not None else {}
        return TieredECStats(data=data) if data else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats | None:
        return TieredECStats(data=copy.deepcopy(dict(data or {})))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECConnectorPromMetrics | None:
        """`vllm:tiercache_ec_*` counters on `/metrics` (built by vLLM's front end)."""
        return TieredECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        try:
            self._store.flush(10.0)
        finally:
            self._maybe_write_stats(force=True)

    # --------------------------------------------------------------------------------- scheduler side

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self._sched is None:
            return True
        return self._sched.ensure_cache_available(request, num_computed_tokens)

    def has_cache_item(self, identifier: str) -> bool:
        return self._sched.has_cache_item(identifier) if self._sched is not None else False

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self._sched is not None:
            self._sched.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        if self._sched is None:
            return TieredECMetadata()
        self._maybe_write_stats()
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output.ec_connector_worker_meta)

    def reset_cache(self) -> bool:
        """Start a new weights generation: the encoder outputs stored before are no longer used by this
        engine (they stay for other engines). vLLM 0.32's EC connector interface has no reset hook; the
        plugin makes `Scheduler.reset_encoder_cache` call this (`vllm_tiercache.eccache.encoder_reset`), i.e. when
        vLLM drops its encoder cache because the weights were changed in place."""
        if self._sched is None:
            return True  # the worker takes the generation from each step's metadata
        self._sched.reset_cache()
        logger.warning("TieredECConnector: vLLM reset the encoder cache (e.g. after a weight update): started "
                       "weights generation %d; encoder outputs stored before are no longer used by this engine "
                       "(they stay in the store for other engines)", self._sched.generation.resets)
        return True

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is not None:
            self._sched.request_finished(request)
        return False, None


def _worker_device() -> torch.device:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(f"cuda:{current_platform.current_device()}")
    return torch.device(current_platform.device_type if current_platform.device_type else "cpu")
