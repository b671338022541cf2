"""Worker side of TieredKVConnector: layerwise loads into, and saves out of, vLLM's paged KV cache.

Loads: the step's load plan walks the layers in order, reading every chunk of layer i in one batched
store call and copying it into its blocks. With `load_mode` layerwise (a GPU's default) `start_load` hands
the plan to one loader thread and the forward pass waits in `wait_for_layer` only for the layer it is about
to run, so layer i+1 is read while layer i computes; before_forward (a CPU's default) runs it in
`start_load`, on the forward's thread, before the forward starts. A record that is missing, corrupt or
of another layout marks its destination blocks invalid; vLLM then recomputes them (with
`kv_load_failure_policy=recompute`, the connector's default) or fails the request (`fail`, when the user
set it).

Saves: `save_layer` gathers this step's chunk blocks of one layer right after the layer wrote them (a
private copy, so vLLM may reuse the blocks at once); `wait_for_save` hands the copies to one saver thread
that puts them in the store. Nothing in the forward pass waits for a disk, GDS or Redis write.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_tiercache.kvcache.layout import PagedLayout
from vllm_tiercache.kvcache.load_trace import LoadTrace
from vllm_tiercache.kvcache.naming import KVNaming
from vllm_tiercache.kvcache.plan import ChunkLoad, TieredKVMetadata, TieredKVWorkerMetadata
from vllm_tiercache.kvcache.transfer import BlockMover, CudaBlockMover, block_spans, make_mover
from vllm_tiercache.shared.residency import ResidencyReporter
from vllm_tiercache.shared.stats_dump import ENV_VAR as STATS_DIR_ENV
from vllm_tiercache.shared.stats_dump import dump_stats
from vllm_tiercache.shared.store.api import Record, Store, StoreKey
from vllm_tiercache.shared.store.counters import GaugeChanges
from vllm_tiercache.shared.store.records import byte_view
from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)

#: Record keys `KVWorkerSide.key` remembers (~0.5 KiB each: 8 MiB; 4,096 chunks of a 4-layer model).
KEY_CACHE_SIZE = 16384
#: Gathered chunks waiting for the saver thread; past this, new saves are dropped (counted), never blocked.
MAX_PENDING_SAVES = 4096


@dataclass
class WorkerCounters:
    """Per-interval numbers `get_kv_connector_stats` reports (reset after each report)."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_errors: int = 0
    load_seconds: list[float] = field(default_factory=list)
    saved_chunks: int = 0
    saved_bytes: int = 0
    dropped_saves: int = 0
    save_seconds: list[float] = field(default_factory=list)

    def take(self) -> dict[str, Any]:
        """The numbers since the last call, then zero; ``{}`` when none moved (most decode steps)."""
        if not any(self.__dict__.values()):
            return {}
        data = dict(self.__dict__)
        self.__init__()  # type: ignore[misc]
        return data


class _LoadJob:
    """One step's layerwise load, shared by the loader thread and the forward pass."""

    def __init__(self, layer_names: tuple[str, ...], loads: list[ChunkLoad],
                 owners: list[str] | None = None, whole_requests: set[str] | None = None) -> None:
        self.loads = loads
        #: the request of every load, and the requests whose loads are whole-request loads
        self.owners = owners or [""] * len(loads)
        self.whole_requests = whole_requests or set()
        self.ready = {name: threading.Event() for name in layer_names}
        self.handles: dict[str, object | None] = {}
        self.failed: set[int] = set()  # indices into `loads`
        self.done = threading.Event()
        #: where the load's time went (`LoadTrace`): the store's reads and the copies into the KV cache
        self.fetch_seconds = 0.0
        self.copy_seconds = 0.0
        self.loaded_bytes = 0


def landing_place(layer_bytes: memoryview, block_bytes: int, load: ChunkLoad, spans: list[tuple[int, int, int, int]]
                  ) -> list[memoryview] | None:
    """Where a load's whole record can be read as it is stored: the bytes of its blocks in the layer's
    paged cache (``layer_bytes``, contiguous), in the record's order: one piece per ascending span of
    block ids, one per block of a descending one (`block_spans`); None when the load does not take the
    record from its first block (its bytes then are not exactly those blocks' bytes). A tier reading
    from a file lands the payload there and verifies it in place, instead of filling a buffer that is
    copied again (`Store.get_many`'s ``into``). A record that fails verification leaves garbage there,
    in blocks reported as failed loads, which vLLM recomputes before any attention reads them."""
    if load.first != load.chunk_start:
        return None
    pieces = []
    for _, first, length, step in spans:
        if step == 1:
            pieces.append(layer_bytes[first * block_bytes : (first + length) * block_bytes])
        else:
            pieces.extend(layer_bytes[(first - k) * block_bytes : (first - k + 1) * block_bytes]
                          for k in range(length))
    return pieces


class KVWorkerSide:
    """Everything `TieredKVConnector` does in a vLLM worker process."""

    def __init__(
        self,
        *,
        store: Store,
        naming: KVNaming,
        rank: int,
        use_mla: bool,
        load_mode: str = "auto",
    ) -> None:
        """`naming` names the records (the scheduler side's naming); `rank`: this worker's tensor-parallel
        rank, whose records it reads and writes; `load_mode`: `KVConnectorOptions.load_mode` ("auto" is
        resolved when the KV caches' device is known)."""
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
        #: loaded_blocks counts the prefix blocks a hit restored: those of a full-attention layer (the
        #: sliding-window groups load only the window)
        self._counted_layer = (self.groups.full or self.groups.groups)[0].layers[0]
        self.block_size = naming.geometry.block_size
        self.use_mla = use_mla
        self.layout: PagedLayout | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layer_index: dict[str, int] = {}
        self.mover: BlockMover | None = None
        #: some tier can land records in the (host) KV cache itself (`landing_place`), and the byte views
        #: of the layers it lands them in
        self._reads_into = False
        self._layer_bytes: dict[str, memoryview] = {}
        self._block_bytes = 0
        self.counters = WorkerCounters()
        #: cumulative counters for the stats file: every count of `WorkerCounters`, 0 until it moves
        self.totals: dict[str, Any] = {name: value for name, value in vars(WorkerCounters()).items()
                                       if isinstance(value, int)}
        self._counters_lock = threading.Lock()
        self._job: _LoadJob | None = None
        self._load_errors: set[int] = set()
        #: whole-request loads that finished (failed ones too, as vLLM wants), those that failed, and the
        #: chunks they could not use
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._failed_chunks: set[bytes] = set()
        self._pending_saves: list[tuple[StoreKey, torch.Tensor, bytes, bool, int]] = []
        self._save_queue: queue.Queue[list[tuple[StoreKey, torch.Tensor, bytes, bool, int]] | None] = queue.Queue()
        self._queued_saves = 0
        self._queued_lock = threading.Lock()
        self._gauges = GaugeChanges(store)
        self._sent_save_queue = 0
        #: `$TIERCACHE_STATS_DIR` is set when the process starts (tests, precompute jobs): read once, not
        #: on every step
        self._dumps_totals = bool(os.environ.get(STATS_DIR_ENV))
        self.residency: ResidencyReporter[bytes] = ResidencyReporter(store)
        self._load_queue: queue.Queue[_LoadJob | None] = queue.Queue()
        #: one line per load when $TIERCACHE_LOAD_TRACE names a file (`vllm_tiercache.kvcache.load_trace`)
        self.trace = LoadTrace.from_env()
        #: `key`, remembered: a chunk's keys are built when it is saved and were built again on every hit
        #: (text, checks, blake2b: 1.5 us each alone, several in a busy engine), one per chunk and layer
        #: (a 2K-token hit of a 4-layer model: 32; at 8K: 128)
        self.key = functools.lru_cache(maxsize=KEY_CACHE_SIZE)(self._build_key)
        self._threads = [
            background_thread(self._load_loop, "tiercache-kv-loader"),
            background_thread(self._save_loop, "tiercache-kv-saver", beside_forward=True),
        ]
        for thread in self._threads:
            thread.start()

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
        self.kv_caches = dict(kv_caches)
        self.layer_index = {name: i for i, name in enumerate(layout.layer_names)}
        self.mover = make_mover(layout.device)
        if isinstance(self.mover, CudaBlockMover):
            # records read from disk land in pinned memory: their load is one copy, and promoted to the
            # memory tier they stay pinned (a GDS tier reads into GPU memory itself and declines)
            self.store.set_payload_allocator(self.mover.host_bytes)
        # On a CPU the loader thread and the forward share the cores and the GIL: layerwise overlap bought
        # nothing there, and the handoffs cost a page-cache disk hit of 2049 tokens 0.1-0.26x of vLLM's
        # resident hit (docs/benchmarks-kv.md, "2026-11-25, fifth"). A GPU copies on its own engines.
        self.loads_before_forward = self.load_mode == "before_forward" or (
            self.load_mode == "auto" and layout.device.type == "cpu")
        self._reads_into = layout.device.type == "cpu" and self.store.reads_into
        if self._reads_into:  # the byte view of each (contiguous) layer that in-place reads slice
            first = next(iter(kv_caches.values()))
            self._block_bytes = first[0].numel() * first.element_size()
            self._layer_bytes = {name: byte_view(tensor) for name, tensor in kv_caches.items()
                                 if tensor.is_contiguous()}
        log.info("TieredKVConnector: %d layers, layout %s", len(layout.layer_names), layout.describe())
        return layout

    def _build_key(self, chunk_hash: bytes, layer: int) -> StoreKey:
        """The store key of one layer's record of a chunk, for this worker's rank (`key` remembers them)."""
        return self.naming.record_key(chunk_hash, layer, self.rank, self.tag_of_layer.get(layer))

    # ------------------------------------------------------------------------------------------ loads
    def start_load(self, meta: TieredKVMetadata) -> None:
        loads = [load for plan in meta.requests for load in plan.loads]
        whole = {plan.req_id for plan in meta.requests if plan.whole_request and plan.loads}
        if not loads:
            self._finished_recving |= whole  # nothing to load here: the request may go on
            return
        if self.layout is None:  # an idle worker: a planned load is a failed one, never unloaded blocks
            self._finished_recving |= whole
            self._failed_recving |= whole
            self._load_errors.update(b for plan in meta.requests if plan.req_id not in whole
                                     for load in plan.loads for b in load.block_ids)
            return
        owners = [plan.req_id for plan in meta.requests for _ in plan.loads]
        job = _LoadJob(self.layout.layer_names, loads, owners, whole)
        self._job = job
        assert self.mover is not None
        # before this step's forward is queued: the loads land after everything already queued (with
        # async scheduling, the previous step may still write KV into blocks vLLM has handed on since)
        self.mover.order_after_queued_work()
        if self.loads_before_forward:
            self._do_load(job)
        else:
            self._load_queue.put(job)

    def wait_for_layer(self, layer_name: str) -> None:
        job = self._job
        if job is None or layer_name not in job.ready:
            return
        job.ready[layer_name].wait()
        assert self.mover is not None
        self.mover.wait(job.handles.get(layer_name))

    def finish_load(self) -> None:
        """End of step: the job must be over before vLLM reuses any block it writes."""
        job, self._job = self._job, None
        if job is None:
            return
        job.done.wait()
        if self.mover is not None:
            # the copies were only issued (CUDA: on the mover's stream); vLLM may schedule, or free and
            # reuse, a whole-request load's blocks as soon as it is reported finished
            self.mover.finish_scatters()
        self._finished_recving |= job.whole_requests
        for i in job.failed:
            if job.owners[i] in job.whole_requests:
                self._failed_recving.add(job.owners[i])
                self._failed_chunks.add(job.loads[i].chunk_hash)
            else:
                self._load_errors.update(job.loads[i].block_ids)

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) whole-request loads since the last call; every failed one is finished too."""
        self.finish_load()
        finished, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return finished, failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _load_loop(self) -> None:
        while (job := self._load_queue.get()) is not None:
            self._do_load(job)

    def _do_load(self, job: _LoadJob) -> None:
        """Run one step's loads (on the loader thread, or in `start_load`); a failure fails its loads."""
        assert self.mover is not None  # a job exists only once the KV caches are registered
        started = time.perf_counter()
        try:
            with self.mover.loading():
                self._run_load(job)
        except Exception:  # never let a store or copy problem kill the worker: recompute instead
            log.exception("TieredKVConnector: load failed; the blocks will be recomputed")
            job.failed.update(range(len(job.loads)))
        finally:
            elapsed = time.perf_counter() - started
            if self.trace is not None:  # before the job is done: a reader that saw the step end sees its line
                self.trace.record(rank=self.rank, device=self.mover.device.type,
                                  before_forward=self.loads_before_forward, chunks=len(job.loads),
                                  failed=len(job.failed), bytes=job.loaded_bytes, load_s=elapsed,
                                  fetch_s=job.fetch_seconds, copy_s=job.copy_seconds)
            for event in job.ready.values():
                event.set()
            job.done.set()
        with self._counters_lock:
            self.counters.load_seconds.append(elapsed)

    def _run_load(self, job: _LoadJob) -> None:
        """Every layer in order: one batched store read of its chunks, then one batched copy of the
        records that did not land in place. Per-load work that is the same for every layer (block runs,
        whether a record can land in place) is done once: a hit reads one record per chunk and layer, and
        per-record Python cost, not bytes, was what made a memory hit slow."""
        assert self.layout is not None and self.mover is not None
        expected_meta = self.layout.describe()
        spans = [block_spans(load.block_ids) for load in job.loads]
        # a tier that reads from a file can land a whole record in its blocks (CPU caches only)
        in_place = [self._reads_into and load.first == load.chunk_start for load in job.loads]
        loads_of_group: dict[int, list[int]] = {}
        for i, load in enumerate(job.loads):
            loads_of_group.setdefault(load.group, []).append(i)
        layers = [(name, self.layer_index[name], self.group_of_layer.get(self.layer_index[name], 0))
                  for name in self.layout.layer_names]
        if self._reads_into:  # the whole step's files read ahead while the first layer loads (cold disks)
            self.store.prefetch([self.key(job.loads[i].chunk_hash, layer)  # type: ignore[attr-defined]
                                 for _, layer, group in layers for i in loads_of_group.get(group, ())])
        for layer_name, layer, group in layers:
            todo = [i for i in loads_of_group.get(group, ()) if i not in job.failed]
            keys = [self.key(job.loads[i].chunk_hash, layer) for i in todo]
            kv_layer = self.kv_caches[layer_name]
            layer_bytes = self._layer_bytes.get(layer_name)
            fetch_started = time.perf_counter()
            if layer_bytes is not None and any(in_place[i] for i in todo):
                into = [landing_place(layer_bytes, self._block_bytes, job.loads[i], spans[i]) if in_place[i]
                        else None for i in todo]
                records = self.store.get_many(keys, into=into)
            else:
                records = self.store.get_many(keys)
            job.fetch_seconds += time.perf_counter() - fetch_started
            copies: list[tuple[list[tuple[int, int, int, int]], torch.Tensor]] = []
            loaded_bytes = loaded_blocks = 0
            for i, record in zip(todo, records, strict=True):
                load = job.loads[i]
                blocks = self._usable_blocks(record, load, expected_meta)
                if blocks is None:
                    job.failed.add(i)
                    continue
                if not record.in_place:  # type: ignore[union-attr]
                    copies.append((spans[i], blocks))
                loaded_blocks += len(load.block_ids)
                loaded_bytes += blocks.numel() * blocks.element_size()
            copy_started = time.perf_counter()
            self.mover.scatter_spans(kv_layer, copies)
            job.copy_seconds += time.perf_counter() - copy_started
            job.loaded_bytes += loaded_bytes
            job.handles[layer_name] = self.mover.layer_ready()
            job.ready[layer_name].set()
            with self._counters_lock:
                self.counters.loaded_bytes += loaded_bytes
                if layer == self._counted_layer:
                    self.counters.loaded_blocks += loaded_blocks
        with self._counters_lock:
            self.counters.load_errors += len(job.failed)

    def _usable_blocks(self, record: Record | None, load: ChunkLoad, expected_meta: str) -> torch.Tensor | None:
        """The record's blocks for this load, or None when it must not reach attention."""
        if record is None:
            return None
        assert self.layout is not None
        tensor = record.tensor
        shape = tensor.shape
        if (
            record.meta.get("layout") != expected_meta
            or record.meta.get("start", load.chunk_start) != load.chunk_start
            or tensor.dtype != self.layout.dtype
            or shape[1:] != self.layout.block_shape
            or shape[0] != record.meta.get("blocks")
            or shape[0] < load.end - load.chunk_start
        ):
            log.warning("TieredKVConnector: chunk %s has another layout; recomputing", load.chunk_hash.hex())
            return None
        if load.first == load.chunk_start and load.end - load.chunk_start == shape[0]:
            return tensor  # the whole record (most loads): no view to build
        return tensor[load.source_slice]

    # ------------------------------------------------------------------------------------------ saves
    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: TieredKVMetadata) -> None:
        if self.layout is None or layer_name not in self.layer_index:
            return
        assert self.mover is not None
        layer = self.layer_index[layer_name]
        last_layer = layer == len(self.layout.layer_names) - 1
        group = self.group_of_layer.get(layer, 0)
        saves = [save for plan in meta.requests for save in plan.saves if save.group == group]
        if not saves:
            return
        gathered = self.mover.gather_many(kv_layer, [save.block_ids for save in saves])
        for save, blocks in zip(saves, gathered, strict=True):
            self._pending_saves.append(
                (self.key(save.chunk_hash, layer), blocks, save.chunk_hash, last_layer, save.first)
            )

    def wait_for_save(self) -> None:
        """Hand this step's gathered chunks to the saver thread (the copies are ours: no waiting)."""
        self.finish_load()
        if not self._pending_saves:
            return
        assert self.mover is not None
        self.mover.finish_gathers()
        batch, self._pending_saves = self._pending_saves, []
        with self._queued_lock:
            if self._queued_saves + len(batch) > MAX_PENDING_SAVES:
                with self._counters_lock:
                    self.counters.dropped_saves += len(batch)
                return
            self._queued_saves += len(batch)
        self._save_queue.put(batch)

    def _save_loop(self) -> None:
        assert self.store is not None
        while (batch := self._save_queue.get()) is not None:
            started = time.perf_counter()
            try:
                meta = {"layout": self.layout.describe() if self.layout else "", "blocks": 0}
                items = [
                    (key, blocks, {**meta, "blocks": int(blocks.shape[0]), "start": first})
                    for key, blocks, _, _, first in batch
                ]
                self.store.put_many(items, owned=True)
                done = {chunk_hash for _, _, chunk_hash, last, _ in batch if last}
                self._report_resident(batch, done)
                with self._counters_lock:
                    self.counters.saved_chunks += len(done)
                    self.counters.saved_bytes += sum(b.numel() * b.element_size() for _, b, _, _, _ in batch)
                    self.counters.save_seconds.append(time.perf_counter() - started)
            except Exception:
                log.exception("TieredKVConnector: saving %d records failed; they stay uncached", len(batch))
            finally:
                with self._queued_lock:
                    self._queued_saves -= len(batch)

    def flush_saves(self, timeout: float = 60.0) -> None:
        """Wait until the saver thread has handed everything to the store (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queued_saves and time.monotonic() < deadline:
            time.sleep(0.005)
        self.store.flush(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------------------ residency reports
    def _report_resident(self, batch: list[tuple[StoreKey, torch.Tensor, bytes, bool, int]], done: set[bytes]
                         ) -> None:
        """Report the chunks saved whole in this batch whose every layer the memory tier holds now."""
        if not self.residency.enabled or not done:
            return
        keys_of: dict[bytes, list[StoreKey]] = {}
        for key, _, chunk_hash, _, _ in batch:
            if chunk_hash in done:
                keys_of.setdefault(chunk_hash, []).append(key)
        for chunk_hash, keys in keys_of.items():
            self.residency.stored(chunk_hash, keys)

    def worker_meta(self) -> TieredKVWorkerMetadata | None:
        changes = self.residency.take()
        failed, self._failed_chunks = self._failed_chunks, set()
        if changes is None and not failed:
            return None
        added, evicted = (changes.added, changes.evicted) if changes is not None else (set(), set())
        return TieredKVWorkerMetadata(added=added, evicted=evicted, failed=failed)

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
        depth = self._queued_saves
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
        self.flush_saves()
        self.take_counters()
        self.dump_totals(force=True)
        self._load_queue.put(None)
        self._save_queue.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        if self.trace is not None:
            self.trace.close()
