"""The KV worker's saver: a step's completed chunks copied out of vLLM's paged KV cache and into the store.

`gather` copies this step's chunk blocks of one layer right after the layer wrote them (a private copy,
so vLLM may reuse the blocks at once); `hand_off`, at the step's end, gives the copies to one saver
thread that puts them in the store. Nothing in the forward pass waits for a disk, GDS or Redis write, and
a backlog past `MAX_PENDING_SAVES` drops new saves (counted) rather than block a step, except in a batch
job's patient store (``write_patience_s``), where the step waits for room: nothing is dropped there. Once a chunk's
last layer is stored, the saver reports it resident when the worker's memory tier holds every layer of
it (`vllm_tiercache.shared.residency`).

`KVWorkerSide` builds the saver, hands it the registered KV caches' layout (`attach`) and each layer's
saves.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vllm_tiercache.kvcache.blocks.layout import PagedLayout
from vllm_tiercache.kvcache.blocks.transfer import BlockMover
from vllm_tiercache.kvcache.plan import ChunkSave
from vllm_tiercache.kvcache.worker_counters import WorkerCounters
from vllm_tiercache.shared.eviction.lineage import PARENT_KEY
from vllm_tiercache.shared.residency import ResidencyReporter
from vllm_tiercache.shared.store.api import Store, StoreKey
from vllm_tiercache.shared.store.tags import TAGS_KEY
from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)

#: Gathered chunks waiting for the saver thread; past this, new saves are dropped (counted), never blocked.
MAX_PENDING_SAVES = 4096


class GatheredRecord(NamedTuple):
    """One layer's record of one chunk, copied out of the KV cache and waiting to be stored."""

    key: StoreKey
    blocks: torch.Tensor
    chunk_hash: bytes
    #: the record of the chunk's last layer: once it is stored, the chunk is saved whole
    last_layer: bool
    #: the first block of the chunk the record holds (its ``start``: `ChunkSave.first`)
    first_block: int
    #: a prefill/decode hand-off's record (`ChunkSave.urgent`): the store writes it ahead of the queue
    urgent: bool = False
    #: the request's tags (`ChunkSave.tags`), written into the record's meta
    tags: tuple[str, ...] = ()
    #: the share of its prompt the request reused (`ChunkSave.reused_share`), for the store's admission
    reused_share: float | None = None
    #: the key digest of the same layer's record of the chunk before (`ChunkSave.parent_hash`): its parent
    parent: bytes | None = None


class KVSaver:
    """Saves: the per-layer gathers, the hand-off at the step's end, the saver thread, resident reports."""

    def __init__(
        self,
        *,
        store: Store,
        key: Callable[[bytes, int], StoreKey],
        counters: WorkerCounters | None = None,
        counters_lock: threading.Lock | None = None,
    ) -> None:
        """`key`: the store key of a chunk's record of one layer (the worker's remembered keys). The
        counters and their lock are the worker's (its own ones when the saver runs alone)."""
        self.store = store
        self.key = key
        self.counters = counters if counters is not None else WorkerCounters()
        self._counters_lock = counters_lock if counters_lock is not None else threading.Lock()
        #: the chunks whose every layer the worker's memory tier holds (reported to the scheduler)
        self.residency: ResidencyReporter[bytes] = ResidencyReporter(store)
        #: what the records' metadata says of their layout, and how many layers a chunk has (`attach`)
        self._layout_text = ""
        self._num_layers = 0
        self.mover: BlockMover | None = None
        #: this step's gathers, handed to the saver thread at its end
        self.gathered: list[GatheredRecord] = []
        self._queue: queue.Queue[list[GatheredRecord] | None] = queue.Queue()
        #: records handed off and not yet stored (the save-queue gauge reads it without the lock)
        self.queued = 0
        self._queued_lock = threading.Lock()
        self._thread = background_thread(self._save_loop, "tiercache-kv-saver", beside_forward=True)
        self._thread.start()

    def attach(self, layout: PagedLayout, mover: BlockMover) -> None:
        """Gather from KV caches of this layout from now on."""
        self._layout_text = layout.describe()
        self._num_layers = len(layout.layer_names)
        self.mover = mover

    def gather(self, layer: int, kv_layer: torch.Tensor, saves: list[ChunkSave]) -> None:
        """Copy the blocks of ``saves`` out of layer index ``layer`` (``kv_layer``), for this step's
        hand-off; the saves of other KV cache groups are the caller's to leave out."""
        assert self.mover is not None
        last_layer = layer == self._num_layers - 1
        gathered = self.mover.gather_many(kv_layer, [save.block_ids for save in saves])
        for save, blocks in zip(saves, gathered, strict=True):
            key = self.key(save.chunk_hash, layer).for_tenant(save.tenant)  # sealed for the request's tenant
            parent = (None if save.parent_hash is None
                      else self.key(save.parent_hash, layer).for_tenant(save.tenant).digest)
            self.gathered.append(GatheredRecord(key, blocks, save.chunk_hash, last_layer, save.first, save.urgent,
                                                save.tags, save.reused_share, parent))

    def hand_off(self) -> None:
        """Hand this step's gathered records to the saver thread (the copies are ours: no waiting)."""
        if not self.gathered:
            return
        assert self.mover is not None
        self.mover.finish_gathers()
        batch, self.gathered = self.gathered, []
        if self.store.write_patience_s > 0:  # a batch job: wait for room, the store waits the tiers out
            while self.queued and self.queued + len(batch) > MAX_PENDING_SAVES:
                time.sleep(0.01)
        with self._queued_lock:
            if self.queued + len(batch) > MAX_PENDING_SAVES:
                with self._counters_lock:
                    self.counters.dropped_saves += len(batch)
                return
            self.queued += len(batch)
        self._queue.put(batch)

    def _meta(self, record: GatheredRecord) -> dict[str, Any]:
        """A record's meta: its layout, block count and first block, its tags when it has some, and its
        parent (the record of the chunk before) unless it is a prompt's first."""
        meta: dict[str, Any] = {"layout": self._layout_text, "blocks": int(record.blocks.shape[0]),
                                "start": record.first_block}
        if record.tags:
            meta[TAGS_KEY] = list(record.tags)
        if record.parent is not None:
            meta[PARENT_KEY] = record.parent
        return meta

    def _save_loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            started = time.perf_counter()
            try:
                for urgent in (True, False):  # a hand-off's records first, ahead of the store's queue
                    records = [record for record in batch if record.urgent == urgent]
                    if records:
                        self.store.put_many([(record.key, record.blocks, self._meta(record)) for record in records],
                                            owned=True, urgent=urgent,
                                            reused_shares=[record.reused_share for record in records])
                done = {record.chunk_hash for record in batch if record.last_layer}
                self._report_resident(batch, done)
                with self._counters_lock:
                    self.counters.saved_chunks += len(done)
                    self.counters.saved_bytes += sum(record.blocks.numel() * record.blocks.element_size()
                                                     for record in batch)
                    self.counters.save_seconds.append(time.perf_counter() - started)
            except Exception:
                log.exception("TieredKVConnector: saving %d records failed; they stay uncached", len(batch))
            finally:
                with self._queued_lock:
                    self.queued -= len(batch)

    def _report_resident(self, batch: list[GatheredRecord], done: set[bytes]) -> None:
        """Report the chunks saved whole in this batch whose every layer the memory tier holds now."""
        if not self.residency.enabled or not done:
            return
        keys_of: dict[bytes, list[StoreKey]] = {}
        for record in batch:
            if record.chunk_hash in done:
                keys_of.setdefault(record.chunk_hash, []).append(record.key)
        for chunk_hash, keys in keys_of.items():
            self.residency.stored(chunk_hash, keys)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the saver thread has handed everything to the store, and the store its writes
        (tests, shutdown, `TieredKVConnector.wait_saves_stored`); a patient store's (``write_patience_s``) that much
        longer. False when the time passed first."""
        deadline = time.monotonic() + timeout
        while self.queued and time.monotonic() < deadline + self.store.write_patience_s:
            time.sleep(0.005)
        # the store adds its own patience to what is left: counted once, not twice
        return self.store.flush(max(0.0, deadline - time.monotonic())) and not self.queued

    def shutdown(self) -> None:
        """Stop the saver thread once it has stored what it was handed."""
        self._queue.put(None)
        self._thread.join(timeout=10)
