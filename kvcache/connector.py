"""TieredKVConnector: vLLM's KV connector interface over the tiered store, as a thin shell.

vLLM builds one instance in the scheduler process (role SCHEDULER) and one in each worker (role
WORKER). The shell reads the configuration, then forwards every call to `KVSchedulerSide` or
`KVWorkerSide`, which hold all the logic. Configure it with

    --kv-transfer-config '{"kv_connector": "TieredKVConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {...store config and KV options...}}'

The extra config is one dict: the store config (`vllm_tiercache.shared.config`) and this connector's own
options (`vllm_tiercache.kvcache.options`: chunk size, save flags, `load_failure_policy`,
`warmup_cpu_attention`), split by `KVConnectorOptions.load`. `load_failure_policy` ("recompute": a chunk
that fails to load is recomputed by vLLM; "fail": vLLM fails the request) only fills a default: vLLM's own
`KVTransferConfig.kv_load_failure_policy`, when the user set it, wins, and the two set to different values
is a `ConfigError` (`resolve_load_failure_policy`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_tiercache.kvcache.events.ledger import events_enabled
from vllm_tiercache.kvcache.load.cpu_warmup import allow_amx_tiles, warm_cpu_attention
from vllm_tiercache.kvcache.metrics import TieredKVPromMetrics, TieredKVStats, copy_stats_data
from vllm_tiercache.kvcache.naming import ChunkGeometry, KVNaming
from vllm_tiercache.kvcache.options import DEFAULT_LOAD_FAILURE_POLICY, KVConnectorOptions
from vllm_tiercache.kvcache.plan import TieredKVMetadata
from vllm_tiercache.kvcache.scheduler import KVSchedulerSide
from vllm_tiercache.kvcache.worker import KVWorkerSide
from vllm_tiercache.shared.config import ConfigError, StoreConfig
from vllm_tiercache.shared.naming.hashing import check_seed_is_stable
from vllm_tiercache.shared.naming.mm_identifiers import MultiModalIdentifierPolicy
from vllm_tiercache.shared.store import describe_tiers, get_store
from vllm_tiercache.shared.vllm_compat import (
    CacheHitSource,
    TransferResults,
    check_vllm_version,
    has_state_layers,
    is_encode_only,
    is_explicitly_set,
    uses_eagle,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

def resolve_load_failure_policy(vllm_policy: str, vllm_explicit: bool, option: str | None) -> str:
    """The `kv_load_failure_policy` vLLM runs with: the user's vLLM setting, else our option, else ours.

    An explicit vLLM setting wins; `kv_connector_extra_config.load_failure_policy` only fills the default;
    both set to different values is a contradiction the user must resolve, so it is an error naming both.
    How "explicit" is known on vLLM 0.32/0.33, where an explicit "fail" equals vLLM's default value:
    `vllm_tiercache.shared.vllm_compat.is_explicitly_set` (the server's command line; the Python API leaves no record).
    """
    if vllm_explicit:
        if option is not None and option != vllm_policy:
            raise ConfigError(
                f"kv_load_failure_policy conflict: KVTransferConfig.kv_load_failure_policy={vllm_policy!r} but "
                f"kv_connector_extra_config.load_failure_policy={option!r}. Set one of them, or both to the "
                "same value (the vLLM setting wins when only it is set)."
            )
        return vllm_policy
    return option if option is not None else DEFAULT_LOAD_FAILURE_POLICY


def check_not_encode_only(vllm_config: VllmConfig) -> None:
    """Refuse a KV connector on an encoder-only instance, naming the role and the fixes.

    vLLM 0.32+ runs an `ec_role="ec_producer"` instance as encoder only: it allocates no KV cache, so the
    worker side would die at start in `register_kv_caches` with no hint at the cause.
    """
    if not is_encode_only(vllm_config):
        return
    ec = vllm_config.ec_transfer_config
    role = getattr(ec, "ec_role", None) if ec is not None else None
    raise ConfigError(
        f"TieredKVConnector cannot run on an encoder-only instance (ec_role={role!r}): vLLM runs only the "
        "multimodal encoder there and allocates no KV cache. Use ec_role='ec_both' to run the language "
        "model and the KV connector on this instance, or drop kv_transfer_config on the encoder instance "
        "and put TieredKVConnector on the instance that runs the language model."
    )


@dataclass(frozen=True)
class CheckedKVConfig:
    """What `check_kv_config` found valid: the connector starts from it without reading the config again."""

    options: KVConnectorOptions
    store: StoreConfig
    #: the `kv_load_failure_policy` vLLM must run with, and where it came from (for the start-up line)
    load_failure_policy: str
    policy_source: str
    identifiers: MultiModalIdentifierPolicy
    geometry: ChunkGeometry | None


def check_kv_config(vllm_config: VllmConfig, transfer: Any | None = None, *,
                    final_block_size: bool = True) -> CheckedKVConfig:
    """Everything `TieredKVConnector` refuses at start, checked without opening a store or reading weights.

    The plugin calls it when vLLM builds its config (`vllm_tiercache.preflight`), so a wrong setting stops
    the server in its first seconds, before any weights load; the connector calls it again in every
    process it runs in, so the same rules hold on a vLLM the plugin cannot hook. ``transfer`` is the
    connector's own `KVTransferConfig` (a MultiConnector child's), by default the engine's. While vLLM
    builds its config the block size is not final yet (the attention backend may change it), so the
    chunk geometry is checked only with ``final_block_size`` (in the connector).
    """
    transfer = transfer if transfer is not None else vllm_config.kv_transfer_config
    check_not_encode_only(vllm_config)
    options, store = KVConnectorOptions.load(dict(transfer.kv_connector_extra_config or {}))
    vllm_explicit = is_explicitly_set(transfer, "kv_load_failure_policy", cli_flag="kv-transfer-config")
    policy = resolve_load_failure_policy(transfer.kv_load_failure_policy, vllm_explicit,
                                         options.load_failure_policy)
    if vllm_explicit:
        source = "vLLM's kv_load_failure_policy"
    elif options.load_failure_policy is not None:
        source = "kv_connector_extra_config"
    else:
        source = "TieredKVConnector's default"
    # A mode where multimodal identifiers do not name content is refused here, before a store is opened.
    identifiers = MultiModalIdentifierPolicy.for_engine(
        vllm_config, trust_user_uuids=store.trust_multi_modal_uuids, connector="TieredKVConnector"
    )
    cache_config = vllm_config.cache_config
    check_seed_is_stable(cache_config.prefix_caching_hash_algo)
    block_size = getattr(cache_config, "block_size", None) if final_block_size else None
    geometry = None
    if block_size and not has_state_layers(vllm_config):
        geometry = ChunkGeometry(int(block_size), options.chunk_size)
    # A model with mamba (state) layers gets no loads or saves (`vllm_tiercache.kvcache.groups`), so the
    # attention block size vLLM picks to match the state's page size never has to fit chunk_size.
    return CheckedKVConfig(options, store, policy, source, identifiers, geometry)


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Layerwise KV save/load of 256-token prefix chunks over memory, disk, GDS and Redis.

    `SupportsHMA`: vLLM keeps its hybrid KV cache manager on with this connector. Full-attention groups
    load and save whole chunks, sliding-window groups only the window at a hit's end, and a model with a
    group it cannot load (mamba state, ...) runs with no external hits (`vllm_tiercache.kvcache.groups`).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        check_vllm_version("TieredKVConnector")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        checked = check_kv_config(vllm_config, transfer)
        self._options, config = checked.options, checked.store
        # The scheduler reads this right after building us (and before any request).
        transfer.kv_load_failure_policy = checked.load_failure_policy
        if role == KVConnectorRole.SCHEDULER:  # the process whose value vLLM reads; one line per engine
            log.info("TieredKVConnector: kv_load_failure_policy=%s (from %s)", transfer.kv_load_failure_policy,
                     checked.policy_source)
        identifiers = checked.identifiers
        naming = KVNaming.from_configs(vllm_config, config, self._options, kv_cache_config)
        identity = naming.identities[0]
        log.info("TieredKVConnector: role=%s model=%s weights=%s fingerprint=%s namespace=%s chunk_size=%d "
                 "tiers=%s", role.name, identity.model, identity.weights, identity.fingerprint, naming.namespace,
                 self._options.chunk_size, describe_tiers(config))
        self._block_size = naming.geometry.block_size
        self._store = get_store(config)
        self._scheduler: KVSchedulerSide | None = None
        self._worker: KVWorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVSchedulerSide(
                store=self._store,
                naming=naming,
                can_load=transfer.is_kv_consumer,
                can_save=transfer.is_kv_producer,
                save_decode=self._options.save_decode,
                volatile_decode_tail=uses_eagle(vllm_config),
                request_cacheable=identifiers.request_cacheable,
                publish_events=events_enabled(vllm_config),
                handoff_wait_s=self._options.handoff_wait_ms / 1000.0,
                engine_id=str(transfer.engine_id or ""),
                require_cache_salt=config.require_cache_salt,
                lookup_deadline_s=self._options.lookup_deadline_ms / 1000.0,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = KVWorkerSide(
                store=self._store,
                naming=naming,
                rank=get_tensor_model_parallel_rank(),
                use_mla=bool(getattr(vllm_config.model_config, "use_mla", False)),
                load_mode=self._options.load_mode,
                prefetch_buffer_bytes=self._options.prefetch_buffer,
            )

    # ------------------------------------------------------------------------------- vLLM capabilities
    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache. A dropped save is a later miss, never a lost hand-off, and saves
        are private copies taken within the step, so a preempted request's output need not be dropped."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: `wait_for_layer_load` / `save_kv_layer` run per layer inside the forward pass, which a
        full CUDA graph replay would skip (vLLM then uses PIECEWISE graphs)."""
        return True

    # ------------------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        layout = self._worker.register_kv_caches(kv_caches, getattr(self._kv_cache_config, "num_blocks", None))
        if layout is not None and layout.device.type == "cpu":
            # Before any load: the first step may attend over loaded KV with vLLM's AMX kernel.
            self._worker.totals["amx_allowed"] = int(allow_amx_tiles())
            if self._options.warmup_cpu_attention:
                warmed = warm_cpu_attention(self._vllm_config, layout.dtype, self._block_size)
                self._worker.totals["cpu_attention_warmed"] = int(warmed)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredKVMetadata)
        self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.loader.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredKVMetadata)
        if meta.has_saves:
            self._worker.save_layer(layer_name, kv_layer, meta)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Whole-request loads (models with several KV cache groups) that are over, failed ones included."""
        assert self._worker is not None
        finished, _ = self._worker.loader.take_transfer_results()
        return None, finished or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's receive results: whole-request loads that are over, and those that failed (vLLM then
        recomputes or fails the request, by `kv_load_failure_policy`)."""
        assert self._worker is not None
        finished, failed = self._worker.loader.take_transfer_results()
        return TransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        self._worker.loader.finish_load()
        return self._worker.loader.take_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> TieredKVStats | None:
        """This step's numbers for vLLM's stats (`/metrics`, the "KV Transfer metrics" log line).

        Worker: the connector's counters, what the process's store counted since the last step (the
        background writes that finished meanwhile too: they make the step non-empty), and the gauge
        reports when they changed. Scheduler: its store's increments (lookups in the shared tiers, Redis
        errors). Every step's increments are handed out once and never dropped: a step with nothing to
        report returns None without having taken anything.
        """
        if self._worker is None:
            moved = dict(self._store.take_counter_deltas())
            if self._scheduler is not None:
                moved.update(self._scheduler.take_counters())
            return TieredKVStats(data=moved) if moved else None
        data = self._worker.take_counters()
        data.update(self._store.take_counter_deltas())
        data.update(self._worker.gauge_reports(force=bool(data)))  # a step that did something looks now
        if not data:  # most decode steps: nothing built, nothing for vLLM to send
            return None
        data["block_size"] = self._worker.block_size  # hit tokens = loaded blocks x block size
        stats = TieredKVStats(data=data)
        if stats.is_empty() and not any(data.get(name) for name in ("gauges", "save_queue")):
            return None
        return stats

    def wait_saves_stored(self, timeout_s: float = 120.0) -> bool:
        """Worker side: wait until every save this worker was handed is in the store (its memory tier, and
        the slower tiers' queued writes too); False when ``timeout_s`` passed first, or on the scheduler side.

        Why: a save is stored by the saver thread after the step that computed it, and the scheduler hears
        of the chunks the memory tier took with a later step's report. A benchmark (``tiercache bench kv``,
        through a worker extension) asking for a hit right after the request that saved it must wait for
        the save itself, not for a guessed time: on a loaded machine the saver thread may not have run yet."""
        if self._worker is None:
            return False
        return self._worker.saver.flush(timeout_s)

    def shutdown(self) -> None:
        """vLLM stops the engine: each side hands the store what it still holds, then the store's queued
        writes reach the slower tiers (bounded: 30 s). vLLM gives this only as long as its
        ``shutdown_timeout`` lets the engine process live (`vllm_tiercache.preflight` warns at 0)."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        self._store.flush(30.0)

    # ---------------------------------------------------------------------------------- scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        return self._scheduler.hit_sources(request, num_external_tokens)

    def update_state_after_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
        num_computed_tokens: int | None = None,
    ) -> None:
        """Record how many blocks the scheduler allocated for our load (`num_external_tokens` decides,
        never whether `blocks` is empty). `num_computed_tokens` is what newer vLLM passes; the plan
        already knows the local hit from `get_num_new_matched_tokens`, so it is accepted and unused."""
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output.kv_connector_worker_meta)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV cache events for what the tiers can serve; empty unless vLLM's kv_events_config enables them."""
        assert self._scheduler is not None
        return self._scheduler.take_events()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def reset_cache(self) -> bool:
        """vLLM's connector reset (``reset_prefix_cache(reset_connector=True)``: a weight update through
        ``pause_generation(clear_cache=True)``, sleep level 1+, ``/reset_prefix_cache?reset_external=true``).
        Starts a new weights generation; no record is deleted (`KVSchedulerSide.reset_cache`)."""
        if self._scheduler is None:
            return True  # vLLM calls it on the scheduler's connector only; a worker names no chunk itself
        return self._scheduler.reset_cache()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`'s end of a request (every group at once): as `request_finished`, the blocks are
        free at once (saves are private copies taken within the step)."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # --------------------------------------------------------------------------------------- metrics
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TieredKVStats:
        return TieredKVStats(data=copy_stats_data(data))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TieredKVPromMetrics:
        return TieredKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
