"""Memory tier: a byte-bounded cache of tensor objects inside this process, evicting by `shared.eviction`.

Why it stores the tensor object itself: a hit is then free (no copy, no decode). The tiered store hands
it a tensor it owns (copied on put), and callers never mutate what a read returns, so sharing is safe.

The eviction order comes from the tier's `policy` ("lru" by default, or "wtinylfu"): the same code
as the encoder cache managers. With W-TinyLFU a record can be refused by admission: the new record, or
one leaving the admission window, was asked for less often than what it would displace. Every such
refusal counts as `admission_refused`; a put refused on arrival also counts as `refused`. The record
simply stays in the slower tiers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from vllm_tiercache.shared.eviction import make_policy
from vllm_tiercache.shared.store.api import InProcessTier, Record, StoredRecord, StoreKey, TierAdminUnsupported
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.memory_config import MemoryTierConfig

#: Why the admin operations cannot serve a memory tier: another process would see only its own copy.
_PER_PROCESS = "a memory tier lives inside each serving process; another process cannot list or delete its records"


class MemoryTier(InProcessTier):
    """Bounded in bytes; a record larger than the capacity is refused (counted as `refused`)."""

    kind = "memory"
    shared_across_processes = False

    def __init__(self, config: MemoryTierConfig, name: str = "memory") -> None:
        self.config = config
        self.name = name
        self.capacity = config.capacity
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._items: dict[bytes, tuple[Record, int]] = {}
        self.policy = make_policy(config.policy, self.capacity, "memory.policy")
        self._bytes = 0
        self._evict_listeners: list[Callable[[bytes], None]] = []

    def add_eviction_listener(self, listener: Callable[[bytes], None]) -> None:
        """Call `listener(digest)` after a record leaves this tier (the KV connector's residency reports)."""
        self._evict_listeners.append(listener)

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            return [k.digest in self._items for k in keys]

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        out: list[Record | None] = []
        with self._lock:
            for k in keys:
                entry = self._items.get(k.digest)
                if entry is not None:
                    self.policy.access(k.digest)
                    out.append(entry[0])
                else:
                    out.append(None)
        return out

    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None:
        evicted = refused = admission_refused = puts = written = 0
        evicted_digests: list[bytes] = []
        with self._lock:
            for key, tensor, meta in items:
                size = tensor.numel() * tensor.element_size()
                if size > self.capacity:
                    refused += 1
                    continue
                old = self._items.pop(key.digest, None)
                if old is not None:
                    self._bytes -= old[1]
                    self.policy.remove(key.digest)
                self._items[key.digest] = (Record(tensor, dict(meta or {})), size)
                self.policy.insert(key.digest, size)
                self._bytes += size
                puts += 1
                written += size
                rejected_before = self.policy.rejections
                for digest in self.policy.evict(self._bytes - self.capacity):
                    self._bytes -= self._items.pop(digest)[1]
                    if digest == key.digest and old is None:
                        # Refused on arrival: never resident, nobody to tell, and not a put either.
                        refused += 1
                        puts -= 1
                        written -= size
                        continue
                    evicted += 1
                    evicted_digests.append(digest)
                admission_refused += self.policy.rejections - rejected_before
        self.counters.add(puts=puts, bytes_written=written, evictions=evicted, refused=refused)
        if admission_refused:  # only W-TinyLFU refuses by admission; LRU tiers keep the common key set
            self.counters.add(admission_refused=admission_refused)
        for digest in evicted_digests:
            for listener in self._evict_listeners:
                listener(digest)

    def usage(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._items), "bytes_used": self._bytes, "capacity": self.capacity}

    def sizes_many(self, keys: Sequence[StoreKey]) -> list[int | None]:
        """Bytes each record counts against this tier's capacity (tensor bytes); None when not held."""
        with self._lock:
            return [entry[1] if (entry := self._items.get(k.digest)) is not None else None for k in keys]

    def iter_stored(self) -> Iterator[StoredRecord]:
        """Never: records live in each serving process (and keep no key text), so raises (admin contract)."""
        raise TierAdminUnsupported(_PER_PROCESS)

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """Never, for the reason `iter_stored` gives: serving processes drop their copies by eviction."""
        raise TierAdminUnsupported(_PER_PROCESS)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
            self.policy = make_policy(self.config.policy, self.capacity, "memory.policy")

    def close(self) -> None:
        self.clear()
