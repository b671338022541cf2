"""The worker's prefetcher: chunks a far tier holds, fetched into host memory before their request's turn.

Why: a far store (S3 at 10-30 ms to the first byte, a Redis in another zone) must never be waited for
inside a forward pass, which also carries every other user's decode. The scheduler side finds a waiting
request's chunks on a far tier (`vllm_tiercache.kvcache.lookup`) and names them in the next step's plan
(`ChunkPrefetch`); here a few threads read each chunk's records of this worker's rank with one batched
store read and hold them in host memory for the load (`vllm_tiercache.kvcache.load.staging`), and the
worker reports the chunk staged. The scheduler lets the request run once its chunks are staged (or its
deadline passed); its load then reads host memory and the near tiers only (``near_loads``).

Several threads: each chunk's read waits mostly on the network, and sealed records are opened on the
thread that read them, so chunks are fetched and opened side by side. A chunk asked twice while queued
or in flight is fetched once. A chunk whose records are not all there, or that does not fit the staging
budget (host memory too tight), is reported failed: the scheduler counts it and its request computes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_tiercache.kvcache.load.staging import Staging
from vllm_tiercache.kvcache.plan import ChunkPrefetch
from vllm_tiercache.kvcache.worker_counters import WorkerCounters
from vllm_tiercache.shared.residency import ResidencyReporter
from vllm_tiercache.shared.store.api import Store, StoreKey
from vllm_tiercache.shared.threads import WorkerThreads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefetchNews:
    """The prefetcher's news for the worker's report: chunks staged, chunks whose prefetch failed (and, of
    those, the ones a record was missing or unreadable for), chunks dropped from staging."""

    staged: set[bytes]
    failed: set[bytes]
    missing: set[bytes]
    unstaged: set[bytes]

#: Chunks fetched at once: enough to overlap a far tier's round trips (a thread mostly waits on a socket), as
#: many as the object tier's requests in flight by default (`concurrency`): it reads a chunk in one GET of its
#: pack, so each thread is one request. With 4, `bench serve --store-rtt-ms 20` (memory-object, 16 users) had
#: 17 prefetches late, each a chunk recomputed; with 16, none (docs/benchmarks.md).
PREFETCH_THREADS = 16


class Prefetcher:
    """Background reads of whole chunks (every layer of this rank) into the staging."""

    def __init__(self, *, store: Store, key: Callable[[bytes, int], StoreKey], residency: ResidencyReporter[bytes],
                 staging: Staging, counters: WorkerCounters, counters_lock: threading.Lock,
                 threads: int = PREFETCH_THREADS) -> None:
        """`key`: the store key of a chunk's record of one layer (the worker's); `residency`: the saver's
        reporter, which tells the scheduler what the memory tier holds; `staging`: where fetched chunks wait
        for their load."""
        self.store = store
        self.staging = staging
        self.key = key
        self.residency = residency
        self.counters = counters
        self._counters_lock = counters_lock
        self._threads: WorkerThreads[ChunkPrefetch] = WorkerThreads(self._run, "tiercache-kv-prefetch", threads)
        #: layer indices whose records a chunk has on this rank (`attach`); empty: nothing can be fetched
        self.layers: list[int] = []
        self._lock = threading.Condition()
        self._pending: set[bytes] = set()
        #: of ``_pending``, the chunks a thread is fetching now (a second entry of one, put urgent, is skipped)
        self._running: set[bytes] = set()
        #: of ``_pending``, those put again urgent (once: a chunk's entries are at most two)
        self._hurried: set[bytes] = set()
        self._done: set[bytes] = set()
        self._failed: set[bytes] = set()
        #: failed because a record was missing or unreadable (not for want of room): not claimed until saved anew
        self._missing: set[bytes] = set()

    def attach(self, layers: list[int]) -> None:
        """Fetch these layers' records from now on. With a far tier (the only one the scheduler names chunks
        for) the threads start here, at registration: the first `submit` comes on the forward's thread."""
        self.layers = list(layers)
        if self.layers and getattr(self.store, "far_tiers", None):
            self._threads.start()

    def submit(self, prefetches: list[ChunkPrefetch]) -> None:
        """Fetch these chunks in the background, the urgent ones (their request's turn came) ahead of those
        queued. A chunk already in flight is not asked again; one still queued is put again ahead when it comes
        urgent now (its first entry is skipped when it comes up)."""
        with self._lock:
            fresh = [p for p in prefetches if p.chunk_hash not in self._pending]
            hurried = [p for p in prefetches if p.urgent and p.chunk_hash in self._pending
                       and p.chunk_hash not in self._running and p.chunk_hash not in self._hurried]
            self._pending.update(p.chunk_hash for p in fresh)
            self._hurried.update(p.chunk_hash for p in hurried)
        for prefetch in [*fresh, *hurried]:
            self._threads.put(prefetch, urgent=prefetch.urgent)

    def take(self) -> PrefetchNews:
        """What happened since the last call."""
        with self._lock:
            news = PrefetchNews(self._done - self._failed, self._failed, self._missing, self.staging.take_dropped())
            self._done, self._failed, self._missing = set(), set(), set()
        return news

    def drain(self, timeout: float) -> bool:
        """Wait until no prefetch is queued or in flight (tests, benchmarks); False when the time passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout)

    @property
    def has_news(self) -> bool:
        """Prefetches over, or staged chunks that may have to be reported dropped (cheap: most steps)."""
        return bool(self._done) or bool(self.staging.held_bytes)

    def _run(self, prefetch: ChunkPrefetch) -> None:
        """One chunk's fetch, on a prefetch thread; what came of it, for `take`."""
        with self._lock:
            if prefetch.chunk_hash in self._running or prefetch.chunk_hash not in self._pending:
                return  # the chunk's other entry (put again urgent) is fetching it, or fetched it
            self._running.add(prefetch.chunk_hash)
        started = time.perf_counter()
        missing = False
        try:
            fetched = self._fetch(prefetch)
            ok, missing = bool(fetched), fetched is None
        except Exception:  # a store or tier bug: the chunk is a miss, never a dead thread
            log.exception("TieredKVConnector: prefetch of chunk %s failed", prefetch.chunk_hash.hex())
            ok = False
        with self._lock:
            self._pending.discard(prefetch.chunk_hash)
            self._running.discard(prefetch.chunk_hash)
            self._hurried.discard(prefetch.chunk_hash)
            self._done.add(prefetch.chunk_hash)
            if not ok:
                self._failed.add(prefetch.chunk_hash)
            if missing:
                self._missing.add(prefetch.chunk_hash)
            self._lock.notify_all()
        with self._counters_lock:
            self.counters.prefetched_chunks += ok
            self.counters.prefetch_failures += not ok
            self.counters.prefetch_seconds.append(time.perf_counter() - started)

    def _fetch(self, prefetch: ChunkPrefetch) -> bool | None:
        """Read the chunk's records (the store also promotes them into its memory tier) and stage them for
        the load; whether they fit the staging budget, None when a record was missing or unreadable (absent,
        corrupt, a tier that failed: `Store.get_many` tells these apart no further)."""
        if not self.layers:
            return False
        keys = [self.key(prefetch.chunk_hash, layer).for_tenant(prefetch.tenant) for layer in self.layers]
        records = self.store.get_many(keys)
        if any(record is None for record in records):
            return None
        self.residency.stored(prefetch.chunk_hash, keys)
        return self.staging.admit(prefetch.chunk_hash, [(k, r) for k, r in zip(keys, records, strict=True) if r])

    def shutdown(self) -> None:
        self._threads.close(timeout=10)
