"""The worker side of a prefill/decode hand-off: wait a bounded time for promised records, then load them.

A consumer's hand-off load (`vllm_tiercache.kvcache.handoff.promise`) is one asynchronous load vLLM waits for
(the request sits in ``WAITING_FOR_REMOTE_KVS``), so it never runs on the forward's thread, whatever
``load_mode`` says: the producer may still be writing the records (its response leaves when its step ends,
its writes to the shared tier follow), and waiting for them there would hold up every request in the batch.
Here one thread per worker takes those loads in order. For each it asks the store, with short polls, for
every record the promise names, until all are there or ``handoff_wait_ms`` has passed since the load was
handed over; then the loader's own load (`KVLoader._do_load`) reads what is there: on this thread on a
GPU, on the forward's thread at the next step on a CPU (``load_on_caller``: the loads before the
forward, as every CPU load; beside vLLM's engine steps, which go on every millisecond while a request
waits, a reading thread took turns with them for the GIL and read several times slower). A chunk with a record
still missing is not read, nor is any chunk after it (vLLM recomputes from the first block it lacks): its
blocks are reported as failed loads, the request as finished receiving, both in the same step
(`KVLoader.take_transfer_results`), and the fallback is counted and logged with the request id.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_tiercache.kvcache.worker_counters import WorkerCounters
from vllm_tiercache.shared.store.api import Store, StoreKey
from vllm_tiercache.shared.threads import background_thread

if TYPE_CHECKING:
    from vllm_tiercache.kvcache.load.job import LoadJob

log = logging.getLogger(__name__)

#: The first poll for missing records, and the longest pause between two (the wait doubles up to it):
#: a record written a few ms after the request arrived is seen within ~2 ms, and a long wait costs the
#: shared tier at most 50 existence checks a second.
FIRST_POLL_S = 0.002
MAX_POLL_S = 0.02


def wait_for_records(store: Store, keys: list[list[StoreKey]], deadline: float,
                     sleep: Callable[[float], None] = time.sleep) -> tuple[list[bool], int]:
    """(per group of ``keys``: every record there, how many records were missing at first and came later),
    polling the store until all are there or ``deadline`` (`time.monotonic`) passes."""
    flat = [(g, key) for g, group in enumerate(keys) for key in group]
    missing = flat
    first_missing = None
    pause = FIRST_POLL_S
    while True:
        found = store.contains_many([key for _, key in missing], bounded=False) if missing else []
        missing = [item for item, hit in zip(missing, found, strict=True) if not hit]
        if first_missing is None:
            first_missing = len(missing)
        left = deadline - time.monotonic()
        if not missing or left <= 0:
            break
        sleep(min(pause, left))
        pause = min(pause * 2, MAX_POLL_S)
    lacking = {g for g, _ in missing}
    return [g not in lacking for g in range(len(keys))], first_missing - len(missing)


@dataclass(frozen=True)
class _Waited:
    """What a hand-off's wait found: for its counters and its log line."""

    req_id: str
    #: records missing at the first look that came within the wait
    records: int
    seconds: float
    missing_chunks: int
    missing_records: int


class HandoffLoads:
    """The worker's hand-off loads: their thread, the bounded wait, and the loads that are over."""

    def __init__(self, *, store: Store, key: Callable[[bytes, int], StoreKey], run_job: Callable[[LoadJob], None],
                 counters: WorkerCounters, counters_lock: threading.Lock) -> None:
        """``run_job``: the loader's load of a `LoadJob` (it skips the loads already in ``job.failed``)."""
        self.store = store
        self.key = key
        self.run_job = run_job
        self.counters = counters
        self._counters_lock = counters_lock
        #: layer indices of each KV cache group (`attach`)
        self.layers_of_group: dict[int, list[int]] = {}
        self._queue: queue.Queue[tuple[LoadJob, str, float, float] | None] = queue.Queue()
        self._done: list[LoadJob] = []
        #: waits that are over, whose load runs on the caller of `take_done` (`load_on_caller`)
        self._ready: list[tuple[LoadJob, _Waited]] = []
        self._done_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: the loads run on the thread that asks for the results (the forward's), not on this one
        self.load_on_caller = False

    def attach(self, group_of_layer: dict[int, int], layer_indices: list[int], *, load_on_caller: bool) -> None:
        """``load_on_caller``: after the wait, the load runs in `take_done`, on the forward's thread (a CPU:
        there the hand-off thread reading beside vLLM's engine steps, which go on every millisecond while a
        request waits, took turns with them for the GIL and made the reads several times slower)."""
        self.load_on_caller = load_on_caller
        self.layers_of_group = {}
        for layer in layer_indices:
            self.layers_of_group.setdefault(group_of_layer.get(layer, 0), []).append(layer)
        self._start()  # at registration: the first `submit` comes on the forward's thread

    def submit(self, job: LoadJob, req_id: str, wait_s: float) -> None:
        """Load ``job`` (one request's hand-off) on the hand-off thread, waiting at most ``wait_s`` from now."""
        self._start()
        self._queue.put((job, req_id, wait_s, time.monotonic()))

    def _start(self) -> None:
        """Start the hand-off thread once (``Thread.start`` returns only once it has run: up to half a second on
        a loaded machine, which a forward must not wait)."""
        if self._thread is None:
            self._thread = background_thread(self._loop, "tiercache-kv-handoff")
            self._thread.start()

    def take_done(self) -> list[LoadJob]:
        """The hand-off loads that are over since the last call (with `load_on_caller`, the loads whose wait
        is over are run first, here)."""
        with self._done_lock:
            done, self._done = self._done, []
            ready, self._ready = self._ready, []
        for job, waited in ready:
            self._guarded(job, waited.req_id, functools.partial(self._load, job, waited))
        return done + [job for job, _ in ready]

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            job, req_id, wait_s, submitted = item
            waited = self._guarded(job, req_id, functools.partial(self._wait, job, req_id, submitted + wait_s))
            if waited is not None and self.load_on_caller:
                with self._done_lock:
                    self._ready.append((job, waited))
                continue
            if waited is not None:
                self._guarded(job, req_id, functools.partial(self._load, job, waited))
            with self._done_lock:
                self._done.append(job)

    @staticmethod
    def _guarded(job: LoadJob, req_id: str, step: Callable[[], _Waited | None]) -> _Waited | None:
        try:
            return step()
        except Exception:  # never leave vLLM waiting for a request: fail its loads, it is recomputed
            log.exception("TieredKVConnector: hand-off load of request %s failed; it is recomputed", req_id)
            job.failed.update(range(len(job.loads)))
            return None

    def _wait(self, job: LoadJob, req_id: str, deadline: float) -> _Waited:
        """Wait for the job's records; the loads of chunks still missing (and after them) fail unread."""
        loads = job.loads
        keys = [[self.key(load.chunk_hash, layer) for layer in self.layers_of_group.get(load.group, ())]
                for load in loads]
        started = time.monotonic()
        present, waited = wait_for_records(self.store, keys, deadline)
        waited_s = time.monotonic() - started
        missing = [i for i, ok in enumerate(present) if not ok]
        if missing:  # from the first block a missing chunk holds, vLLM recomputes: nothing there is read
            cut = min(loads[i].first for i in missing)
            job.failed.update(i for i, load in enumerate(loads) if load.end > cut)
        return _Waited(req_id, waited, waited_s, len(missing), sum(len(keys[i]) for i in missing))

    def _load(self, job: LoadJob, waited: _Waited) -> None:  # returns None: `_guarded`'s step
        """Load what came, then count the hand-off (and log a fallback)."""
        self.run_job(job)
        failed = job.failed
        with self._counters_lock:
            self.counters.handoff_loads += 1
            self.counters.handoff_records_waited += waited.records
            self.counters.handoff_wait_seconds.append(waited.seconds)
            if failed:
                self.counters.handoff_fallbacks += 1
                self.counters.handoff_missing_records += waited.missing_records
        if failed:
            log.warning("TieredKVConnector: hand-off of request %s fell back to recompute: %d of %d chunk loads "
                        "not taken (%d with records still missing after %.0f ms)", waited.req_id, len(failed),
                        len(job.loads), waited.missing_chunks, waited.seconds * 1000)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
