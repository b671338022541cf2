"""TieredStore: ordered tiers (fastest first) behind the one `Store` interface connectors use.

Read path: ask tiers in order, each only for the keys still missing (one batched call per tier); a hit
in a slower tier is promoted into the faster ones. Write path: the fastest tier synchronously, slower
tiers through the bounded background writer, so a put costs one memory copy, never an fsync or a
network round trip.

Write-behind stays readable: a record queued for the slower tiers is kept in `_in_flight` until the
writer has written it, and reads consult it right after the fastest tier. Without this, the memory tier
can evict a record before its disk or Redis copy lands, and for that moment no tier has it: a load the
scheduler planned from a residency report fails. For the same reason an eviction from the fastest tier
reaches listeners (residency reports) only once the record's queued write is done: told earlier, the
scheduler looks in the shared tier, finds nothing yet and misses. The buffer costs no memory of its own:
the writer's queue holds the same tensors until then.

Why copy on put: the caller's tensor may be a view into vLLM's paged KV cache that is reused right
after; the store must own what it keeps (pass ``owned=True`` to skip the copy when the caller
guarantees the tensor is never mutated).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store.api import Record, StoreKey, Tier
from vllm_tiercache.shared.store.registry import make_tier
from vllm_tiercache.shared.store.writer import BackgroundWriter, Item

log = logging.getLogger(__name__)


def own_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """One contiguous CPU copy of ``tensor`` (a single copy kernel, whatever the source layout/device)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    out.copy_(tensor.detach())
    return out


class TieredStore:
    """The process's store: thread-safe, never raises for a backend problem, see module docstring."""

    def __init__(self, config: StoreConfig, tiers: Sequence[Tier] | None = None) -> None:
        self.config = config
        if tiers is None:
            tiers = []
            seen: dict[str, int] = {}
            for tc in config.tiers:
                n = seen.get(tc.kind, 0)
                seen[tc.kind] = n + 1
                tiers.append(make_tier(tc, tc.kind if n == 0 else f"{tc.kind}{n}"))
        self.tiers: list[Tier] = list(tiers)
        if not self.tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self._writer = BackgroundWriter(config.write_queue_size)
        self._in_flight_lock = threading.Lock()
        #: digest -> (record, number of queued writes of it) for records on their way to slower tiers.
        self._in_flight: dict[bytes, tuple[Record, int]] = {}
        #: digest -> eviction notifications held back until the record's queued write is done.
        self._deferred_evictions: dict[bytes, list[tuple[Tier, Callable[[], None]]]] = {}
        self._write_behind_hits = 0
        self._closed = False
        self._close_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ reads
    def _tiers(self, shared_only: bool) -> list[tuple[int, Tier]]:
        return [(i, t) for i, t in enumerate(self.tiers) if t.shared_across_processes or not shared_only]

    def contains_many(self, keys: Sequence[StoreKey], shared_only: bool = False) -> list[bool]:
        """Which keys some tier holds; ``shared_only`` consults only tiers other processes also see.

        A record still on its way to the slower tiers counts as held, except for ``shared_only``: other
        processes can't read this process's write-behind buffer.
        """
        found = [False] * len(keys)
        missing = list(range(len(keys)))
        for ti, tier in self._tiers(shared_only):
            if not missing:
                break
            if ti == 1 and not shared_only:
                held, missing = self._split_in_flight(keys, missing)
                for i in held:
                    found[i] = True
                if not missing:
                    break
            try:
                res = tier.contains_many([keys[i] for i in missing])
            except Exception as exc:
                self._tier_error(tier, "contains_many", exc)
                continue
            still = []
            for i, hit in zip(missing, res, strict=True):
                if hit:
                    found[i] = True
                else:
                    still.append(i)
            missing = still
        return found

    def _split_in_flight(self, keys: Sequence[StoreKey], missing: list[int]) -> tuple[dict[int, Record], list[int]]:
        """Of the indexes in ``missing``: the records the write-behind buffer holds, and the rest."""
        held: dict[int, Record] = {}
        still: list[int] = []
        with self._in_flight_lock:
            for i in missing:
                entry = self._in_flight.get(keys[i].digest)
                if entry is None:
                    still.append(i)
                else:
                    held[i] = entry[0]
        return held, still

    def get(self, key: StoreKey) -> Record | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        """Records for ``keys`` (None for a miss): fastest tier, write-behind buffer, then slower tiers."""
        out: list[Record | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        found_in: list[tuple[int, list[Item]]] = []
        for ti, tier in enumerate(self.tiers):
            if not missing:
                break
            if ti == 1:
                held, missing = self._split_in_flight(keys, missing)
                for i, record in held.items():
                    out[i] = record
                if held:
                    with self._in_flight_lock:
                        self._write_behind_hits += len(held)
                if not missing:
                    break
            start = time.perf_counter()
            try:
                res = tier.get_many([keys[i] for i in missing])
            except Exception as exc:
                self._tier_error(tier, "get_many", exc)
                res = [None] * len(missing)
            elapsed = time.perf_counter() - start
            still, promoted, nbytes = [], [], 0
            for i, rec in zip(missing, res, strict=True):
                if rec is None:
                    still.append(i)
                    continue
                out[i] = rec
                nbytes += rec.nbytes
                if ti > 0:
                    promoted.append((keys[i], rec.tensor, rec.meta))
            tier.counters.add(hits=len(missing) - len(still), misses=len(still), bytes_read=nbytes,
                              read_seconds=elapsed)
            if promoted:
                found_in.append((ti, promoted))
            missing = still
        for ti, items in found_in:
            self._promote(ti, items)
        return out

    def _promote(self, found_tier: int, items: list[Item]) -> None:
        """Copy hits into faster tiers: the fastest synchronously, the ones in between in background."""
        self._put_sync(self.tiers[0], items)
        if found_tier > 1:
            self._writer.submit(self.tiers[1:found_tier], items)

    # ----------------------------------------------------------------------------------------- writes
    def put(self, key: StoreKey, tensor: torch.Tensor, meta: dict[str, Any] | None = None, *,
            owned: bool = False) -> None:
        self.put_many([(key, tensor, meta)], owned=owned)

    def put_many(self, items: Sequence[Item], *, owned: bool = False) -> None:
        """Store records: fastest tier now, slower tiers queued (dropped and counted when the queue is full).

        ``owned=True``: the caller promises never to mutate the tensors, so the store keeps them as-is
        instead of copying (CPU, contiguous tensors only; others are still copied).
        """
        if self._closed or not items:
            return
        mine: list[Item] = []
        for key, tensor, meta in items:
            if not (owned and tensor.device.type == "cpu" and tensor.is_contiguous()):
                tensor = own_tensor(tensor)
            mine.append((key, tensor.detach(), dict(meta) if meta else {}))
        if len(self.tiers) == 1:
            self._put_sync(self.tiers[0], mine)
            return
        self._hold_in_flight(mine)  # before the fastest tier, which may evict one of them right away
        self._put_sync(self.tiers[0], mine)
        if not self._writer.submit(self.tiers[1:], mine, on_done=self._release_in_flight):
            self._release_in_flight(mine)

    def _hold_in_flight(self, items: Sequence[Item]) -> None:
        with self._in_flight_lock:
            for key, tensor, meta in items:
                entry = self._in_flight.get(key.digest)
                self._in_flight[key.digest] = (Record(tensor, meta or {}), 1 + (entry[1] if entry else 0))

    def _release_in_flight(self, items: Sequence[Item]) -> None:
        """The writer is done with ``items``: drop them from the buffer, send the evictions held back."""
        held_back: list[tuple[StoreKey, Tier, Callable[[], None]]] = []
        with self._in_flight_lock:
            for key, _, _ in items:
                entry = self._in_flight.get(key.digest)
                if entry is None:
                    continue
                if entry[1] > 1:
                    self._in_flight[key.digest] = (entry[0], entry[1] - 1)
                    continue
                del self._in_flight[key.digest]
                held_back.extend((key, tier, notify) for tier, notify in self._deferred_evictions.pop(key.digest, ()))
        for key, tier, notify in held_back:
            if not tier.contains_many([key])[0]:  # put back meanwhile: that eviction no longer holds
                notify()

    def _on_tier_eviction(self, tier: Tier, digest: bytes, notify: Callable[[], None]) -> None:
        """Send an eviction now, or once the record's queued write is done (see the module docstring)."""
        with self._in_flight_lock:
            if digest in self._in_flight:
                self._deferred_evictions.setdefault(digest, []).append((tier, notify))
                return
        notify()

    def _put_sync(self, tier: Tier, items: list[Item]) -> None:
        start = time.perf_counter()
        try:
            tier.put_many(items)
        except Exception as exc:
            self._tier_error(tier, "put_many", exc)
            tier.counters.add(dropped_writes=len(items))
        tier.counters.add(write_seconds=time.perf_counter() - start)

    @staticmethod
    def _tier_error(tier: Tier, what: str, exc: BaseException) -> None:
        """A tier bug (tiers handle their own backend errors) becomes a miss plus a log line."""
        tier.counters.add(errors=1)
        log.exception("tiercache: %s tier %s failed: %s", tier.name, what, exc)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued slower-tier writes are done; False when ``timeout`` passed first."""
        return self._writer.flush(timeout)

    @property
    def pending_writes(self) -> int:
        return self._writer.pending

    # ------------------------------------------------------------------------------------------- misc
    @property
    def memory_tier(self) -> Tier | None:
        """The in-process memory tier, if any: the one tier other processes can't see (residency reports)."""
        return next((tier for tier in self.tiers if tier.kind == "memory"), None)

    def add_eviction_listener(self, listener: Callable[[str, bytes], None]) -> None:
        """Call `listener(tier_kind, digest)` whenever a tier that reports evictions drops a record.

        For a record whose write to the slower tiers is still queued, the call waits until that write is
        done: a listener (a residency report) may then tell other processes to look in a shared tier.
        """
        for tier in self.tiers:
            add = getattr(tier, "add_eviction_listener", None)
            if add is not None:
                add(lambda digest, t=tier: self._on_tier_eviction(t, digest, lambda: listener(t.kind, digest)))

    def stats(self) -> dict[str, Any]:
        """JSON-able snapshot: {"tiers": {name: counters + usage}, "write_queue": {...}}."""
        tiers: dict[str, Any] = {}
        for tier in self.tiers:
            entry: dict[str, Any] = {"kind": tier.kind,
                                     "shared_across_processes": tier.shared_across_processes}
            entry.update(tier.counters.snapshot())
            try:
                entry.update(tier.usage())
            except Exception as exc:
                entry.update({"entries": None, "bytes_used": None, "usage_error": str(exc)})
            tiers[tier.name] = entry
        return {
            "namespace": self.config.namespace,
            "tiers": tiers,
            "write_queue": {"pending": self._writer.pending, "capacity": self.config.write_queue_size,
                            "hits": self._write_behind_hits},
        }

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush queued writes (up to ``timeout`` s), stop the writer, release every tier."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if not self._writer.close(timeout):
            log.warning("tiercache: closing with %d slower-tier writes not flushed", self._writer.pending)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as exc:
                log.warning("tiercache: closing %s tier failed: %s", tier.name, exc)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
