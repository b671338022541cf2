"""Worker side of TieredKVConnector: the coordinator of its loader and its saver in a vLLM worker process.

`KVWorkerSide` learns the paged KV cache (`register_kv_caches`) and hands it to a `KVLoader`
(`vllm_tiercache.kvcache.load.loader`: a step's hits, layer by layer, and what failed) and a `KVSaver`
(`vllm_tiercache.kvcache.save.saver`: the per-layer gathers and the saver thread), routes each step's plan to
them, and reports for both: the counters and gauges vLLM's stats carry, the residency changes and failed
chunks the scheduler side hears of, the stats file, and the shutdown. The connector asks the loader
directly for what it calls on every layer or step without work for the coordinator (`wait_for_layer_load`,
the load results): a step should enter as few functions as it can.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

import torch

from vllm_tiercache.kvcache.blocks.layout import PagedLayout
from vllm_tiercache.kvcache.blocks.transfer import BlockMover, CudaBlockMover, make_mover
from vllm_tiercache.kvcache.load.loader import KVLoader
from vllm_tiercache.kvcache.load.prefetcher import Prefetcher
from vllm_tiercache.kvcache.load.staging import Staging
from vllm_tiercache.kvcache.naming import KVNaming
from vllm_tiercache.kvcache.options import DEFAULT_PREFETCH_BUFFER
from vllm_tiercache.kvcache.plan import TieredKVMetadata, TieredKVWorkerMetadata
from vllm_tiercache.kvcache.save.saver import KVSaver
from vllm_tiercache.kvcache.worker_counters import WorkerCounters
from vllm_tiercache.shared.stats_dump import ENV_VAR as STATS_DIR_ENV
from vllm_tiercache.shared.stats_dump import dump_stats
from vllm_tiercache.shared.store.api import Store, StoreKey
from vllm_tiercache.shared.store.counters import GaugeChanges

log = logging.getLogger(__name__)

#: Record keys `KVWorkerSide.key` remembers (~0.5 KiB each: 8 MiB; 4,096 chunks of a 4-layer model).
KEY_CACHE_SIZE = 16384


class KVWorkerSide:
    """Everything `TieredKVConnector` does in a vLLM worker process: registration, the step's routing to
    `loader` and `saver`, and their reports."""

    def __init__(
        self,
        *,
        store: Store,
        naming: KVNaming,
        rank: int,
        use_mla: bool,
        load_mode: str = "auto",
        prefetch_buffer_bytes: int = DEFAULT_PREFETCH_BUFFER,
    ) -> None:
        """`naming` names the records (the scheduler side's naming); `rank`: this worker's tensor-parallel
        rank, whose records it reads and writes; `load_mode`: `KVConnectorOptions.load_mode` ("auto" is
        resolved when the KV caches' device is known); `prefetch_buffer_bytes`: the host memory that far chunks
        fetched ahead may hold until their load (`vllm_tiercache.kvcache.load.staging`)."""
        self.store = store
        self.load_mode = load_mode
        #: a step's loads run in `start_load`, before the forward, instead of on the loader thread
        #: (`load_mode` resolved in `register_kv_caches`; no load runs before that)
        self.loads_before_forward = False
        self.naming = naming
        self.rank = rank
        self.identity = naming.identities[rank]
        self.groups = naming.groups
        self.tag_of_layer = self.groups.tag_of_layer()
        self.group_of_layer = self.groups.group_of_layer()
        self.block_size = naming.geometry.block_size
        self.use_mla = use_mla
        self.layout: PagedLayout | None = None
        self.layer_index: dict[str, int] = {}
        self.mover: BlockMover | None = None
        self.counters = WorkerCounters()
        #: cumulative counters for the stats file: every count of `WorkerCounters`, 0 until it moves
        self.totals: dict[str, Any] = {name: value for name, value in vars(WorkerCounters()).items()
                                       if isinstance(value, int)}
        self._counters_lock = threading.Lock()
        self._gauges = GaugeChanges(store)
        self._sent_save_queue = 0
        #: `$TIERCACHE_STATS_DIR` is set when the process starts (tests, precompute jobs): read once, not
        #: on every step
        self._dumps_totals = bool(os.environ.get(STATS_DIR_ENV))
        #: `key`, remembered: a chunk's keys are built when it is saved, and a hit needs them again, one per
        #: chunk and layer; building one (text, checks, blake2b) costs more than finding it here
        #: (docs/benchmarks-kv.md, "the loader's keys"). The loader and the saver share them.
        self.key = functools.lru_cache(maxsize=KEY_CACHE_SIZE)(self._build_key)
        #: far chunks fetched ahead, held for their load, and those this step's loads read for the last time
        self.staging = Staging(prefetch_buffer_bytes)
        self._release: list[bytes] = []
        self.loader = KVLoader(
            store=store,
            key=self.key,
            group_of_layer=self.group_of_layer,
            # loaded_blocks counts the prefix blocks a hit restored: those of a full-attention layer (the
            # sliding-window groups load only the window)
            counted_layer=(self.groups.full or self.groups.groups)[0].layers[0],
            rank=rank,
            counters=self.counters,
            counters_lock=self._counters_lock,
            staging=self.staging,
        )
        self.saver = KVSaver(store=store, key=self.key, counters=self.counters, counters_lock=self._counters_lock)
        #: far chunks fetched into host memory before their request's turn (the scheduler names them)
        self.prefetcher = Prefetcher(store=store, key=self.key, residency=self.saver.residency, staging=self.staging,
                                     counters=self.counters, counters_lock=self._counters_lock)

    # ------------------------------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None) -> PagedLayout | None:
        """Learn the paged layout (None, with loads and saves off, for a model whose KV cache groups the
        connector cannot load: `vllm_tiercache.kvcache.groups`)."""
        if not self.groups.supported:
            log.warning("TieredKVConnector: worker idle for this model: %s", self.groups.unsupported)
            return None
        layout = PagedLayout.learn(
            kv_caches,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.identity.num_kv_heads,
            head_size=self.identity.head_size,
            use_mla=self.use_mla,
        )
        if len(layout.layer_names) != self.identity.num_layers:
            log.warning(
                "TieredKVConnector: %d KV cache layers registered, config says %d",
                len(layout.layer_names),
                self.identity.num_layers,
            )
        strays = [name for i, name in enumerate(layout.layer_names) if i not in self.group_of_layer]
        if strays and (len(self.groups.groups) > 1 or self.groups.hybrid):
            # e.g. KV-sharing layers vLLM adds to the groups after it built this connector: their blocks
            # follow another group's block table, so no record of theirs could be placed safely
            log.warning("TieredKVConnector: worker idle for this model: KV cache layers %s belong to no KV "
                        "cache group the scheduler knows; their hits are failed loads (recomputed)", strays[:4])
            return None
        self.layout = layout
        self.layer_index = {name: i for i, name in enumerate(layout.layer_names)}
        self.mover = make_mover(layout.device)
        if isinstance(self.mover, CudaBlockMover):
            # records read from disk land in pinned memory: their load is one copy, and promoted to the
            # memory tier they stay pinned (a GDS tier reads into GPU memory itself and declines)
            self.store.set_payload_allocator(self.mover.host_bytes)
        # On a CPU the loader thread and the forward share the cores and the GIL: layerwise overlap bought
        # nothing there, and its hand-offs made a disk hit slower than loading before the forward
        # (docs/benchmarks-kv.md, "loads before the forward on a CPU"). A GPU copies on its own engines.
        self.loads_before_forward = self.load_mode == "before_forward" or (
            self.load_mode == "auto" and layout.device.type == "cpu")
        self.loader.attach(layout, kv_caches, self.layer_index, self.mover, before_forward=self.loads_before_forward)
        self.saver.attach(layout, self.mover)
        self.prefetcher.attach(list(self.layer_index.values()))
        log.info("TieredKVConnector: %d layers, layout %s", len(layout.layer_names), layout.describe())
        return layout

    def _build_key(self, chunk_hash: bytes, layer: int) -> StoreKey:
        """The store key of one layer's record of a chunk, for this worker's rank (`key` remembers them)."""
        return self.naming.record_key(chunk_hash, layer, self.rank, self.tag_of_layer.get(layer))

    # ------------------------------------------------------------------------------------ a step's plan
    def start_load(self, meta: TieredKVMetadata) -> None:
        """Hand this step's prefetches to the prefetcher and its loads to the loader (a step without
        either, most of them, goes no further)."""
        if meta.prefetches:
            self.prefetcher.submit(meta.prefetches)
        self._release = meta.release
        loads = [load for plan in meta.requests for load in plan.loads]
        if not loads:
            return
        owners = [plan.req_id for plan in meta.requests for _ in plan.loads]
        whole = {plan.req_id for plan in meta.requests if plan.whole_request and plan.loads}
        handoffs = {plan.req_id: plan.handoff_wait_s for plan in meta.requests
                    if plan.handoff_wait_s is not None and plan.loads}
        self.loader.start(loads, owners, whole, handoffs, near_only=meta.near_loads)

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: TieredKVMetadata) -> None:
        """Hand the saver this step's saves of the layer's KV cache group, right after the layer wrote its KV
        (nothing before the KV caches are registered, nor for a layer outside them)."""
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        group = self.group_of_layer.get(layer, 0)
        saves = [save for plan in meta.requests for save in plan.saves if save.group == group]
        if saves:
            self.saver.gather(layer, kv_layer, saves)

    def wait_for_save(self) -> None:
        """End of the step's forward: its loads are over, and its gathers go to the saver thread."""
        self.loader.finish_load()
        if self._release:  # staged chunks this step's loads read for the last time
            self.staging.release(self._release)
            self._release = []
        if self.saver.gathered:
            self.saver.hand_off()

    # ---------------------------------------------------------------------------------------- reports
    def worker_meta(self) -> TieredKVWorkerMetadata | None:
        """What the scheduler side must hear of: chunks that entered or left the memory tier, and chunks a
        whole-request load could not use."""
        news = self.prefetcher.take() if self.prefetcher.has_news else None
        changes = self.saver.residency.take()
        failed = self.loader.take_failed_chunks() if self.loader.failed_chunks else set()
        if news is not None:  # a chunk whose records were missing is claimed no more until saved anew
            failed |= news.missing
        if changes is None and not failed and (news is None or not (news.staged or news.failed or news.unstaged)):
            return None
        added, evicted = (changes.added, changes.evicted) if changes is not None else (set(), set())
        if news is None:
            return TieredKVWorkerMetadata(added=added, evicted=evicted, failed=failed)
        return TieredKVWorkerMetadata(added=added, evicted=evicted, failed=failed,
                                      prefetched=dict.fromkeys(news.staged, 1), prefetch_failed=news.failed,
                                      unstaged=news.unstaged)

    def take_counters(self) -> dict[str, Any]:
        """This worker's counters since the last call; ``{}`` when none moved."""
        with self._counters_lock:
            data = self.counters.take()
        for name, value in data.items():
            if isinstance(value, int):
                self.totals[name] = self.totals.get(name, 0) + value
        self.dump_totals()
        return data

    def gauge_reports(self, force: bool = False) -> dict[str, Any]:
        """The store's gauge report and this worker's save-queue depth, each only when it changed since
        the last call (a first report that shows only what `/metrics` shows from the start is not sent);
        in-process reads only (the store's usage comes from its background refresh). The report is looked
        at every `GAUGE_CHECK_INTERVAL_S`, or now with ``force``."""
        out: dict[str, Any] = {}
        if gauges := self._gauges.take(force=force):
            out["gauges"] = gauges
        depth = self.saver.queued
        if depth != self._sent_save_queue:
            self._sent_save_queue = depth
            out["save_queue"] = {str(os.getpid()): depth}
        return out

    def dump_totals(self, force: bool = False) -> None:
        """Cumulative counters and store stats for `$TIERCACHE_STATS_DIR` (tests, operators).

        Nothing is built without that directory; per step the store's usage is the cached one (no Redis
        round trip on the step), at shutdown (``force``) a fresh one."""
        if not self._dumps_totals:
            return
        stats = self.store.stats(cached_usage=not force) if hasattr(self.store, "gauge_report") else self.store.stats()
        dump_stats("kv-worker", {"counters": dict(self.totals), "store": stats, "groups": self.groups.to_json()},
                   force=force)

    def shutdown(self) -> None:
        """Store what was saved, write the last counters, and stop the loader and saver threads."""
        self.saver.flush()
        self.take_counters()
        self.dump_totals(force=True)
        self.prefetcher.shutdown()
        self.loader.shutdown()
        self.saver.shutdown()
