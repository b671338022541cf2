"""The KV worker's loader: a step's hits read from the store into vLLM's paged KV cache, layer by layer.

A step's loads walk the layers in order, reading every chunk of layer i in one batched store call and
copying it into its blocks. Where that runs is `load_mode`: layerwise (a GPU's default) hands the step to
one loader thread, and the forward pass waits in `wait_for_layer` only for the layer it is about to run,
so layer i+1 is read while layer i computes; before_forward (a CPU's default) runs it in `start`, on the
forward's thread, before the forward starts. A record that is missing, corrupt or of another layout marks
its destination blocks invalid; vLLM then recomputes them (with `kv_load_failure_policy=recompute`, the
connector's default) or fails the request (`fail`, when the user set it). A whole-request load (a model
with several KV cache groups) is reported finished, or failed, receiving instead.

`KVWorkerSide` builds the loader, hands it the registered KV caches (`attach`) and each step's loads; the
connector asks it per layer (`wait_for_layer`) and per step for the results.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from vllm_tiercache.kvcache.blocks.layout import PagedLayout
from vllm_tiercache.kvcache.blocks.transfer import BlockMover, block_spans
from vllm_tiercache.kvcache.handoff.wait import HandoffLoads
from vllm_tiercache.kvcache.load.job import LoadJob
from vllm_tiercache.kvcache.load.staging import Staging
from vllm_tiercache.kvcache.load.trace import LoadTrace
from vllm_tiercache.kvcache.plan import ChunkLoad
from vllm_tiercache.kvcache.worker_counters import WorkerCounters
from vllm_tiercache.shared.store.api import Reach, Record, Store, StoreKey
from vllm_tiercache.shared.store.records import byte_view
from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)

#: A hand-off job's records read in one batch before its first layer up to this many bytes (`_read_ahead`).
READ_AHEAD_BYTES = 1 << 30


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


class KVLoader:
    """Loads, their thread, the forward's per-layer waits and what failed (for vLLM's load-error calls)."""

    def __init__(
        self,
        *,
        store: Store,
        key: Callable[[bytes, int], StoreKey],
        group_of_layer: dict[int, int],
        counted_layer: int,
        rank: int = 0,
        counters: WorkerCounters | None = None,
        counters_lock: threading.Lock | None = None,
        staging: Staging | None = None,
    ) -> None:
        """`key`: the store key of a chunk's record of one layer (the worker's remembered keys);
        `group_of_layer`: the KV cache group of each layer index; `counted_layer`: the layer whose
        blocks count as `loaded_blocks` (a full-attention layer: the prefix a hit restored); `rank`: for
        the load trace. The counters and their lock are the worker's (its own ones when the loader runs alone)."""
        self.store = store
        self.key = key
        self.group_of_layer = group_of_layer
        self._counted_layer = counted_layer
        self.rank = rank
        self.counters = counters if counters is not None else WorkerCounters()
        #: far chunks fetched ahead (`vllm_tiercache.kvcache.load.staging`), read first by near-only loads
        self.staging = staging
        self._counters_lock = counters_lock if counters_lock is not None else threading.Lock()
        #: a step's loads run in `start`, before the forward, instead of on the loader thread (`attach`)
        self.before_forward = False
        #: the registered KV caches (`attach`); None: an idle worker, whose planned loads all fail
        self.layout: PagedLayout | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layer_index: dict[str, int] = {}
        self.mover: BlockMover | None = None
        #: some tier can land records in the (host) KV cache itself (`landing_place`), and the byte views
        #: of the layers it lands them in
        self._reads_into = False
        self._layer_bytes: dict[str, memoryview] = {}
        self._block_bytes = 0
        self._job: LoadJob | None = None
        self._load_errors: set[int] = set()
        #: whole-request loads that finished (failed ones too, as vLLM wants), those that failed, and the
        #: chunks they could not use (the scheduler claims them no more: `KVWorkerSide.worker_meta`)
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self.failed_chunks: set[bytes] = set()
        self._queue: queue.Queue[LoadJob | None] = queue.Queue()
        #: one line per load when $TIERCACHE_LOAD_TRACE names a file (`vllm_tiercache.kvcache.load.trace`)
        self.trace = LoadTrace.from_env()
        self._thread = background_thread(self._load_loop, "tiercache-kv-loader")
        self._thread.start()
        #: prefill/decode hand-off loads: on their own thread, after a bounded wait for their records
        self.handoffs = HandoffLoads(store=store, key=key, run_job=self._do_load, counters=self.counters,
                                     counters_lock=self._counters_lock)

    def attach(self, layout: PagedLayout, kv_caches: dict[str, torch.Tensor], layer_index: dict[str, int],
               mover: BlockMover, *, before_forward: bool) -> None:
        """Load into these KV caches from now on; ``before_forward``: each step's loads run in `start`, on
        the forward's thread, instead of on the loader thread (`load_mode`, resolved for their device)."""
        self.layout = layout
        self.kv_caches = dict(kv_caches)
        self.layer_index = layer_index
        self.mover = mover
        self.before_forward = before_forward
        self.handoffs.attach(self.group_of_layer, list(layer_index.values()), load_on_caller=before_forward)
        self._reads_into = layout.device.type == "cpu" and self.store.reads_into
        if self._reads_into:  # the byte view of each (contiguous) layer that in-place reads slice
            first = next(iter(kv_caches.values()))
            self._block_bytes = first[0].numel() * first.element_size()
            self._layer_bytes = {name: byte_view(tensor) for name, tensor in kv_caches.items()
                                 if tensor.is_contiguous()}

    # ------------------------------------------------------------------------------------------ a step
    def start(self, loads: list[ChunkLoad], owners: list[str], whole_requests: set[str],
              handoffs: dict[str, float] | None = None, *, near_only: bool = False) -> None:
        """Start one step's loads (``owners``: the request of each load; ``whole_requests``: those whose
        loads vLLM waits for as a whole, failing as a whole; ``handoffs``: requests whose loads are
        prefill/decode hand-offs, with their longest wait for records in flight; ``near_only``: the step's
        loads read the near tiers only, `TieredKVMetadata.near_loads`); before_forward: run them now. A
        hand-off goes to its own thread (`vllm_tiercache.kvcache.handoff.wait`), never this step's."""
        if handoffs and self.layout is not None:
            for req_id, wait_s in handoffs.items():
                mine = [load for load, owner in zip(loads, owners, strict=True) if owner == req_id]
                self.handoffs.submit(LoadJob(self.layout.layer_names, mine, [req_id] * len(mine),
                                             whole_requests & {req_id}), req_id, wait_s)
            kept = [(load, owner) for load, owner in zip(loads, owners, strict=True) if owner not in handoffs]
            loads, owners = [load for load, _ in kept], [owner for _, owner in kept]
            if not loads:
                return
        elif handoffs:  # an idle worker: the hand-off fails as a whole, and vLLM recomputes the request
            whole_requests = whole_requests | set(handoffs)
        if self.layout is None:  # an idle worker: a planned load is a failed one, never unloaded blocks
            self._finished_recving |= whole_requests
            self._failed_recving |= whole_requests
            self._load_errors.update(block for load, owner in zip(loads, owners, strict=True)
                                     if owner not in whole_requests for block in load.block_ids)
            return
        job = LoadJob(self.layout.layer_names, loads, owners, whole_requests, near_only=near_only)
        self._job = job
        assert self.mover is not None
        # before this step's forward is queued: the loads land after everything already queued (with
        # async scheduling, the previous step may still write KV into blocks vLLM has handed on since)
        self.mover.order_after_queued_work()
        if self.before_forward:
            self._do_load(job)
        else:
            self._queue.put(job)

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once this step's loads of ``layer_name`` have landed (for the forward: issued in order)."""
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
        self._note_failures(job)

    def _note_failures(self, job: LoadJob) -> None:
        """A finished job's failed loads: a whole-request load fails its request (vLLM recomputes from the
        first failed block); a per-layer load reports its blocks as load errors."""
        for i in job.failed:
            if job.owners[i] in job.whole_requests:
                self._failed_recving.add(job.owners[i])
                self.failed_chunks.add(job.loads[i].chunk_hash)
            else:
                self._load_errors.update(job.loads[i].block_ids)

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) whole-request loads since the last call; every failed one is finished too."""
        self.finish_load()
        done = self.handoffs.take_done()
        if done and self.mover is not None:
            self.mover.finish_scatters()
        for job in done:  # finished, and what failed: reported in this same step (vLLM reads both at once)
            self._finished_recving.update(job.owners)
            self._note_failures(job)
        finished, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return finished, failed

    def take_load_errors(self) -> set[int]:
        """The blocks of failed loads since the last call (vLLM recomputes them or fails their requests)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_chunks(self) -> set[bytes]:
        """The chunks whole-request loads could not use since the last call."""
        failed, self.failed_chunks = self.failed_chunks, set()
        return failed

    # -------------------------------------------------------------------------------------- the load
    def _load_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            self._do_load(job)

    def _do_load(self, job: LoadJob) -> None:
        """Run one step's loads (on the loader thread, or in `start`); a failure fails its loads."""
        assert self.mover is not None  # a job exists only once the KV caches are attached
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
                                  before_forward=self.before_forward, chunks=len(job.loads),
                                  failed=len(job.failed), bytes=job.loaded_bytes, load_s=elapsed,
                                  fetch_s=job.fetch_seconds, copy_s=job.copy_seconds)
            for event in job.ready.values():
                event.set()
            job.done.set()
        with self._counters_lock:
            self.counters.load_seconds.append(elapsed)

    def _run_load(self, job: LoadJob) -> None:
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
            self.store.prefetch(self._every_record(job, layers, loads_of_group))  # type: ignore[attr-defined]
        ahead = self._read_ahead(job, layers, loads_of_group)
        for layer_name, layer, group in layers:
            todo = [i for i in loads_of_group.get(group, ()) if i not in job.failed]
            keys = [self._record_key(job.loads[i], layer) for i in todo]
            kv_layer = self.kv_caches[layer_name]
            layer_bytes = self._layer_bytes.get(layer_name)
            fetch_started = time.perf_counter()
            if ahead is not None:
                records = [ahead.get(key.digest) for key in keys]
            else:
                records = self._read(job, todo, keys, spans, in_place, layer_bytes)
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
        if job.near_only and self.staging is not None:
            self.staging.loaded([load.chunk_hash for load in job.loads])

    def _read_ahead(self, job: LoadJob, layers: list[tuple[str, int, int]],
                    loads_of_group: dict[int, list[int]]) -> dict[bytes, Record | None] | None:
        """Every layer's records of a job that may read a far tier (a prefill/decode hand-off: the other loads
        of a store with a far tier read host memory and the near tiers only, ``near_only``), in one batched
        read before the first layer, by key digest; None for any other job (read layer by layer). Why: a
        far tier answers a batch in about one round trip, and the object tier keeps a chunk's layers in one
        object (a read per layer would fetch it once per layer). A job past `READ_AHEAD_BYTES` is read layer
        by layer still: its records would all sit in host memory at once."""
        if job.near_only or not getattr(self.store, "far_tiers", None):
            return None
        blocks = sum(len(job.loads[i].block_ids) for _, _, group in layers for i in loads_of_group.get(group, ()))
        if blocks * self._block_bytes > READ_AHEAD_BYTES:
            return None
        keys = self._every_record(job, layers, loads_of_group)
        started = time.perf_counter()
        found = self.store.get_many(keys)
        job.fetch_seconds += time.perf_counter() - started
        return {key.digest: record for key, record in zip(keys, found, strict=True)}

    def _record_key(self, load: ChunkLoad, layer: int) -> StoreKey:
        """A load's record of one layer, for its request's tenant (a sealing store opens each record with its
        request's tenant subkey, `ChunkLoad.tenant`)."""
        return self.key(load.chunk_hash, layer).for_tenant(load.tenant)

    def _every_record(self, job: LoadJob, layers: list[tuple[str, int, int]],
                      loads_of_group: dict[int, list[int]]) -> list[StoreKey]:
        """Every layer's record of the job's loads, layer after layer (what a step reads ahead)."""
        return [self._record_key(job.loads[i], layer) for _, layer, group in layers
                for i in loads_of_group.get(group, ())]

    def _read(self, job: LoadJob, todo: list[int], keys: list[StoreKey], spans: list[list[tuple[int, int, int, int]]],
              in_place: list[bool], layer_bytes: memoryview | None) -> list[Record | None]:
        """One layer's records of the loads ``todo``: a near-only load takes what was fetched ahead from the
        staging first, then asks the near tiers; any other asks every tier. A file tier lands a record in
        its blocks where it can (`landing_place`)."""
        reach: Reach = "near" if job.near_only else "all"
        staged = self.staging.get_many(keys) if job.near_only and self.staging is not None else [None] * len(keys)
        need = [j for j, record in enumerate(staged) if record is None]
        if not need:
            return staged
        asked = [keys[j] for j in need]
        if layer_bytes is not None and any(in_place[todo[j]] for j in need):
            into = [landing_place(layer_bytes, self._block_bytes, job.loads[todo[j]], spans[todo[j]])
                    if in_place[todo[j]] else None for j in need]
            found = self.store.get_many(asked, into=into, reach=reach)
        else:
            found = self.store.get_many(asked, reach=reach)
        records = list(staged)
        for j, record in zip(need, found, strict=True):
            records[j] = record
        return records

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

    def shutdown(self) -> None:
        """Stop the loader thread (after the step's job, if any) and close the trace."""
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.handoffs.shutdown()
        if self.trace is not None:
            self.trace.close()
