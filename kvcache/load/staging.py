"""Prefetched records held in host memory for their request's load, outside every tier's eviction.

Why not the memory tier alone: its capacity serves every request by recency and reuse, and an operator may
size it small (or a prompt's prefix may be larger than it); a prefetch into it could be evicted by the
next one before its own request ran, and the fetch would have been for nothing. Here what the prefetcher
read stays until the loader has read it, within its own budget (``prefetch_buffer``): the scheduler names
the chunks a step's loads read for the last time (`release`, after the step's loads), so the staging is a
way in and never a cache of its own (one `tiercache evict` or a tier's eviction could not reach); chunks
unused for `STAGED_TTL_S` (an aborted request's) go too, and when room is needed, chunks already loaded
first; a chunk that still does not fit is not staged (the prefetch fails, counted, and its request
computes it).

The scheduler hears of every chunk dropped (`take_dropped`) and claims it no more from here.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from vllm_tiercache.shared.store.api import Record, StoreKey

#: A staged chunk nobody loaded for this long is dropped (its request was aborted, or answered without it).
STAGED_TTL_S = 60.0


class Staging:
    """Chunks' records by key, with their bytes counted against a budget (thread-safe)."""

    def __init__(self, budget_bytes: int, ttl_s: float = STAGED_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        #: chunk -> (its records by key digest, bytes, staged at, loaded); oldest first
        self._chunks: OrderedDict[bytes, tuple[dict[bytes, Record], int, float, bool]] = OrderedDict()
        self._by_key: dict[bytes, Record] = {}
        self._held = 0
        self._dropped: set[bytes] = set()
        self._swept = clock()

    @property
    def held_bytes(self) -> int:
        return self._held

    def admit(self, chunk: bytes, records: Sequence[tuple[StoreKey, Record]]) -> bool:
        """Stage ``chunk``'s records; False when they do not fit even after dropping what may go."""
        nbytes = sum(record.nbytes for _, record in records)
        with self._lock:
            self._drop(chunk, dropped=False)
            if nbytes > self.budget_bytes - self._held:
                self._make_room(nbytes)
            if nbytes > self.budget_bytes - self._held:
                return False
            by_key = {key.digest: record for key, record in records}
            self._chunks[chunk] = (by_key, nbytes, self._clock(), False)
            self._by_key.update(by_key)
            self._held += nbytes
            return True

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        """The staged records of ``keys`` (None: not staged)."""
        if not self._by_key:
            return [None] * len(keys)
        with self._lock:
            return [self._by_key.get(key.digest) for key in keys]

    def loaded(self, chunks: Sequence[bytes]) -> None:
        """The loader read these chunks: they are the first to go when room is needed."""
        with self._lock:
            for chunk in chunks:
                entry = self._chunks.get(chunk)
                if entry is not None:
                    self._chunks[chunk] = (entry[0], entry[1], entry[2], True)

    def release(self, chunks: Sequence[bytes]) -> None:
        """Drop these chunks: their last load is over (the scheduler already counts them gone)."""
        with self._lock:
            for chunk in chunks:
                self._drop(chunk, dropped=False)

    def take_dropped(self) -> set[bytes]:
        """Chunks dropped since the last call (the scheduler claims them no more, unless the memory tier holds
        them); drops the staged chunks past their time first."""
        with self._lock:
            now = self._clock()
            if now - self._swept >= 1.0:  # once a second at most: this is asked on every step
                self._swept = now
                for chunk in [c for c, (_, _, at, _) in self._chunks.items() if at < now - self.ttl_s]:
                    self._drop(chunk)
            dropped, self._dropped = self._dropped, set()
        return dropped

    def _make_room(self, nbytes: int) -> None:
        """Drop loaded chunks, then stale ones, oldest first, until ``nbytes`` fit (under the lock)."""
        stale = self._clock() - self.ttl_s
        for wanted in (lambda loaded, at: loaded, lambda loaded, at: at < stale):
            for chunk in [c for c, (_, _, at, done) in self._chunks.items() if wanted(done, at)]:
                if nbytes <= self.budget_bytes - self._held:
                    return
                self._drop(chunk)

    def _drop(self, chunk: bytes, dropped: bool = True) -> None:
        entry = self._chunks.pop(chunk, None)
        if entry is None:
            return
        by_key, nbytes, _, _ = entry
        for digest in by_key:
            self._by_key.pop(digest, None)
        self._held -= nbytes
        if dropped:
            self._dropped.add(chunk)
