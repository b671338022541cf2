"""Worker side of `TieredECConnector`: load promised encoder outputs, save computed ones off the forward path.

Where vLLM 0.32 calls it (`v1/worker/ec_connector_model_runner_mixin.py`, used by the GPU and CPU model
runners): inside `execute_model`, `start_load_caches(encoder_cache)` runs right before
`_execute_mm_encoder(scheduler_output)` and `_gather_mm_embeddings`; `save_caches(encoder_cache, mm_hash)`
runs from `_cache_encoder_output` for every item the encoder just produced (whatever the role).
`encoder_cache` is the model runner's own `dict[mm_hash, Tensor]` on the model's device.

A failed load must not crash and must not feed garbage: if an item vLLM was promised is absent from
`encoder_cache` at gather time, vLLM raises `RuntimeError("Encoder cache miss ...")`. So every record is
validated (checksummed by the store; shape, dtype and width checked here) and an item that fails is
added to this step's `scheduled_encoder_inputs`, which the metadata carries by reference (the very dict
of the worker's `SchedulerOutput`: see `eccache.scheduler.TieredECMetadata` for why it is the same object).
Both of vLLM's model runners read that dict only after `start_load_caches` (the V1 runner in
`_execute_mm_encoder`; Model Runner V2 holds the same dict in a local and passes it to
`prepare_inputs_embeds`), so vLLM re-encodes the item in the same step and the tokens are those of a run
without the connector. vLLM gives a connector no in-contract way to do this: `take_unavailable_requests`
would fail the request instead, which a cache must not do.

Residency reports: vLLM usually runs the scheduler in another process, which cannot see this process's
memory tier. Every item saved into (or promoted into, by a load) the memory tier is reported back as
added, every one the memory tier evicts (`store.add_eviction_listener`) as evicted, through
`worker_meta()` (vLLM's `build_connector_worker_meta`, called at the end of every model step), with this
worker's counter increments for vLLM's stats (`/metrics`), what its store counted per tier since the last
report (`TieredStore.take_counter_deltas`: nothing twice when the KV connector shares the store) and the
store's gauge report when it changed (in-process reads; usage comes from the store's background refresh).

`cacheable(identifier)` False (optional) keeps an item out of the store: never loaded, never saved.

Weights generations: records are named `generation_mm_name(mm_hash, salt)` with the salt of the last
metadata vLLM bound (`set_generation`): the scheduler side sends its current one every step, and
`save_caches` is given only the mm_hash, so the salt is kept from step to step. Residency is reported
under the same names, so a report of an old generation never makes a new one's lookup a hit.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from vllm_tiercache.eccache.metrics import PendingCounts
from vllm_tiercache.eccache.scheduler import LoadItem, TieredECMetadata, TieredECWorkerMetadata
from vllm_tiercache.shared.generations import generation_mm_name
from vllm_tiercache.shared.residency import ResidencyReporter
from vllm_tiercache.shared.store.api import Store, StoreKey
from vllm_tiercache.shared.store.counters import GaugeChanges
from vllm_tiercache.shared.store.tags import TAGS_KEY

logger = logging.getLogger(__name__)

#: Stores an EC worker side of this process uses (the scheduler side then sees that worker's memory tier).
_WORKER_STORES: weakref.WeakSet[Any] = weakref.WeakSet()


def worker_in_process(store: Store) -> bool:
    """True when a worker-side EC connector of this process uses `store` (vLLM's uniproc executor)."""
    return store in _WORKER_STORES


class ECWorkerSide:
    """Batched loads into the device encoder cache; saves handed to the store's background writer."""

    def __init__(
        self,
        store: Store,
        key_of: Callable[[str], StoreKey],
        *,
        device: torch.device,
        dtype: torch.dtype,
        hidden_size: int | None,
        save_enabled: bool,
        counters: Any,
        cacheable: Callable[[str], bool] | None = None,
    ) -> None:
        self._store = store
        self._key_of = key_of
        self._device = device
        self._dtype = dtype
        self._hidden = hidden_size
        self._save_enabled = save_enabled
        self._counters = counters
        self._cacheable = cacheable
        #: Counter increments not yet sent to the scheduler side (with the next residency report).
        self._unsent = PendingCounts()
        # Residency reports (see the module docstring): only with a memory tier, the only unshared one.
        self._residency: ResidencyReporter[str] = ResidencyReporter(store)
        self._gauges = GaugeChanges(store)
        #: the weights generation's salt of the last bound metadata (None before the engine's first reset)
        self.generation: bytes | None = None
        #: mm_hash -> its requests' tags, from the last bound metadata (`TieredECMetadata.tags`)
        self._tags: dict[str, tuple[str, ...]] = {}
        _WORKER_STORES.add(store)

    def set_generation(self, metadata: TieredECMetadata) -> None:
        """Take the generation and the requests' tags of this step's metadata (vLLM binds it before the
        step's loads and saves)."""
        self.generation = metadata.generation
        self._tags = metadata.tags

    def _record_key(self, mm_hash: str) -> StoreKey:
        """The key of `mm_hash`'s record in the current generation."""
        return self._key_of(generation_mm_name(mm_hash, self.generation))

    def _count(self, **deltas: float) -> None:
        """Count in the process-wide counters (stats files) and in what the next report carries."""
        self._counters.add(**deltas)
        self._unsent.add(deltas)

    def _is_cacheable(self, identifier: str) -> bool:
        return self._cacheable is None or self._cacheable(identifier)

    # ------------------------------------------------------------------------------------------- load

    def _valid(self, tensor: torch.Tensor | None, item: LoadItem) -> bool:
        if tensor is None or tensor.dtype != self._dtype or tensor.dim() < 1:
            return False
        if tensor.shape[0] != item.num_embeds:
            return False
        return not (tensor.dim() == 2 and self._hidden is not None and tensor.shape[1] != self._hidden)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], metadata: TieredECMetadata) -> None:
        todo: list[LoadItem] = []
        refused: list[LoadItem] = []  # never promised; should one arrive, it is encoded, never read
        for item in metadata.loads:
            if item.mm_hash not in encoder_cache:
                (todo if self._is_cacheable(item.mm_hash) else refused).append(item)
        if refused:
            self._recompute(refused, metadata)
        if not todo:
            return
        start = time.perf_counter()
        try:
            records = list(self._store.get_many([self._record_key(it.mm_hash) for it in todo]))
        except Exception:
            logger.exception("tiercache EC: store read failed; re-encoding %d items", len(todo))
            records = [None] * len(todo)
        failed: list[LoadItem] = []
        nbytes = 0
        for item, rec in zip(todo, records, strict=True):
            tensor = rec.tensor if rec is not None else None
            if not self._valid(tensor, item):
                failed.append(item)
                continue
            assert tensor is not None
            # Same device: `.to` returns the tensor itself (a memory-tier hit is never copied).
            encoder_cache[item.mm_hash] = tensor.to(self._device, non_blocking=True)
            nbytes += tensor.numel() * tensor.element_size()
            self._track(item.mm_hash)  # a hit in a slower tier was promoted into memory
        self._count(
            loads=len(todo) - len(failed), load_failures=len(failed), bytes_loaded=nbytes,
            load_seconds=time.perf_counter() - start,
        )
        if failed:
            self._recompute(failed, metadata)

    def _recompute(self, failed: list[LoadItem], metadata: TieredECMetadata) -> None:
        """Have vLLM encode `failed` in this step: add them to the step's scheduled encoder inputs."""
        scheduled = metadata.scheduled_encoder_inputs
        if scheduled is None:
            logger.error(
                "tiercache EC: %d promised encoder outputs could not be loaded and the metadata carries no "
                "scheduled encoder inputs to re-encode them into; the step will fail", len(failed)
            )
            return
        for item in failed:
            # A new list under the request: the dict is the shared object, the lists may be vLLM's own.
            ids = list(scheduled.get(item.req_id, []))
            if item.input_id not in ids:
                ids.append(item.input_id)
            scheduled[item.req_id] = ids
        self._count(recomputed=len(failed))
        logger.warning("tiercache EC: %d stored encoder outputs were unusable; re-encoding them", len(failed))

    # ------------------------------------------------------------------------------------------- save

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        """Copy off the device and hand to the store; slower tiers are written by its background writer."""
        if not self._save_enabled or not self._is_cacheable(mm_hash):
            return
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            return
        start = time.perf_counter()
        cpu = tensor.detach()
        # A device output is copied to the host here, once, into a tensor only the store sees: handed over
        # (owned=True), no second copy. A CPU output is vLLM's own: the store copies it (the default).
        owned = cpu.device.type != "cpu"
        if owned:
            cpu = cpu.to("cpu")
        try:
            meta: dict[str, Any] = {"mm_hash": mm_hash, "shape": list(cpu.shape)}
            if tags := self._tags.get(mm_hash):
                meta[TAGS_KEY] = list(tags)
            self._store.put(self._record_key(mm_hash), cpu, meta, owned=owned)
        except Exception:
            logger.exception("tiercache EC: store write failed for %s", mm_hash)
            self._count(save_errors=1)
            return
        self._track(mm_hash)
        self._count(saves=1, bytes_saved=cpu.numel() * cpu.element_size(), save_seconds=time.perf_counter() - start)

    # ------------------------------------------------------------------------------ residency reports

    def _track(self, mm_hash: str) -> None:
        """Report `mm_hash` (its current generation's name) as resident if the memory tier holds it now (a
        put can be refused or evicted)."""
        name = generation_mm_name(mm_hash, self.generation)
        self._residency.stored(name, [self._key_of(name)])

    def worker_meta(self) -> TieredECWorkerMetadata | None:
        """This step's residency changes, counter increments and store numbers, or None when there are
        none (vLLM then sends nothing)."""
        stats: dict[str, float] = dict(self._unsent.take())
        take = getattr(self._store, "take_counter_deltas", None)
        moved = take() if take is not None else {}
        if moved.get("write_queue_hits"):
            stats["write_queue_hits"] = moved["write_queue_hits"]
        tiers = moved.get("tiers", {})
        gauges = self._gauges.take()
        changes = self._residency.take()
        if changes is None and not stats and not tiers and not gauges:
            return None
        return TieredECWorkerMetadata(added=changes.added if changes else set(),
                                      evicted=changes.evicted if changes else set(), stats=stats,
                                      tiers=tiers, gauges=gauges)
