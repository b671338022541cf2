"""Memory tier: a byte-bounded cache of tensor objects inside this process, evicting by `shared.eviction`.

Why it stores the tensor object itself: a hit is then free (no copy, no decode). The tiered store hands
it a tensor it owns (copied on put), and callers never mutate what a read returns, so sharing is safe.

The eviction order comes from the tier's `policy` ("prefix" by default, "lru" or "wtinylfu"): the same
code as the encoder cache managers. A record's meta may name its parent (`shared.eviction.lineage`: a KV
record names the record of the block before it); the tier hands it to the policy, and `prefix` evicts
leaves first, so the tier never keeps a KV block whose prefix it lost (a record whose parent is not held
goes first, and one refused on arrival counts as `refused`). With W-TinyLFU a record can be refused by
admission: the new record, or one leaving the admission window, was asked for less often than what it
would displace. Every such refusal counts as `admission_refused`; a put refused on arrival also counts as
`refused`. The record simply stays in the slower tiers.

Tags and pins (`vllm_tiercache.shared.store.tags`, `vllm_tiercache.shared.store.control`): a record's tags
are in its meta; the tier indexes tagged records by tag and remembers when each was written, so that
`drop_tagged` (an invalidation the store's control poller saw) drops exactly the records of a tag written
before the invalidation, and eviction skips the records of pinned tags (`set_pinned_tags`), up to
``pin_budget`` of the capacity, while unpinned records remain.

Records let go of for room (evicted, or refused on arrival) are handed whole to the eviction sink, when
the store set one (`HandsOverEvictions`): an exclusive slower tier is written them (admission
``evicted``, `vllm_tiercache.shared.store.writes.demotion`). Invalidated records are not: they are gone
everywhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from vllm_tiercache.shared.eviction import make_policy
from vllm_tiercache.shared.eviction.lineage import parent_of
from vllm_tiercache.shared.store.api import (
    DropsTagged,
    HandsOverEvictions,
    HonorsPins,
    InProcessTier,
    Record,
    StoredRecord,
    StoreKey,
    TierAdminUnsupported,
)
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tags import tags_of
from vllm_tiercache.shared.store.tiers.memory.config import MemoryTierConfig

#: Why the admin operations cannot serve a memory tier: another process would see only its own copy.
_PER_PROCESS = "a memory tier lives inside each serving process; another process cannot list or delete its records"


class MemoryTier(InProcessTier, DropsTagged, HonorsPins, HandsOverEvictions):
    """Bounded in bytes; a record larger than the capacity is refused (counted as `refused`)."""

    kind = "memory"
    shared_across_processes = False

    def __init__(self, config: MemoryTierConfig, name: str = "memory") -> None:
        self.config = config
        self.name = name
        self.capacity = config.capacity
        self.counters = TierCounters()
        self._lock = threading.Lock()
        #: digest -> (record, bytes counted, its key: what the eviction sink is handed)
        self._items: dict[bytes, tuple[Record, int, StoreKey]] = {}
        #: tag -> digests of the records carrying it; digest -> when it was written (tagged records only)
        self._tagged: dict[str, set[bytes]] = {}
        self._written: dict[bytes, float] = {}
        self._pins: frozenset[str] = frozenset()
        self._protected_cache: set[bytes] | None = None
        self._pin_budget = int(config.pin_budget * config.capacity)
        self.policy = make_policy(config.policy, self.capacity, "memory.policy")
        self._bytes = 0
        self._evict_listeners: list[Callable[[bytes], None]] = []
        self._sink: Callable[[list[tuple[StoreKey, torch.Tensor, dict[str, Any]]]], None] | None = None

    def add_eviction_listener(self, listener: Callable[[bytes], None]) -> None:
        """Call `listener(digest)` after a record leaves this tier (the KV connector's residency reports)."""
        self._evict_listeners.append(listener)

    def set_eviction_sink(self, sink: Callable[[list[tuple[StoreKey, torch.Tensor, dict[str, Any]]]], None] | None
                          ) -> None:
        """Hand the records a put lets go of for room to ``sink`` (module docstring)."""
        self._sink = sink

    def held_items(self) -> list[tuple[StoreKey, torch.Tensor, dict[str, Any]]]:
        with self._lock:
            return [(key, record.tensor, record.meta) for record, _, key in self._items.values()]

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
        let_go: list[tuple[StoreKey, torch.Tensor, dict[str, Any]]] = []  # for the sink: evicted or refused
        with self._lock:
            for key, tensor, meta in items:
                size = tensor.numel() * tensor.element_size()
                if size > self.capacity:
                    refused += 1
                    if self._sink is not None:
                        let_go.append((key, tensor, dict(meta or {})))
                    continue
                old = self._items.pop(key.digest, None)
                if old is not None:  # rewritten: the policy updates it in place (a prefix keeps its children)
                    self._bytes -= old[1]
                    self._untag(key.digest, old[0])
                record = Record(tensor, dict(meta or {}))
                self._items[key.digest] = (record, size, key)
                self._tag(key.digest, record)
                self.policy.insert(key.digest, size, parent_of(meta))
                self._bytes += size
                puts += 1
                written += size
                rejected_before = self.policy.rejections
                for digest in self._victims(self._bytes - self.capacity):
                    gone = self._items.pop(digest)
                    self._bytes -= gone[1]
                    self._untag(digest, gone[0])
                    if self._sink is not None:
                        let_go.append((gone[2], gone[0].tensor, gone[0].meta))
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
        if let_go and self._sink is not None:  # before the listeners: the store holds them back until written
            self._sink(let_go)
        for digest in evicted_digests:
            for listener in self._evict_listeners:
                listener(digest)

    # ------------------------------------------------------------------------------------- tags, pins
    def _tag(self, digest: bytes, record: Record) -> None:
        tags = tags_of(record.meta)
        if tags:
            if not self._pins.isdisjoint(tags):
                self._protected_cache = None
            self._written[digest] = time.time()
            for tag in tags:
                self._tagged.setdefault(tag, set()).add(digest)

    def _untag(self, digest: bytes, record: Record) -> None:
        if self._written.pop(digest, None) is None:
            return
        tags = tags_of(record.meta)
        if not self._pins.isdisjoint(tags):
            self._protected_cache = None
        for tag in tags:
            holders = self._tagged.get(tag)
            if holders is not None:
                holders.discard(digest)
                if not holders:
                    del self._tagged[tag]

    def _protected(self) -> set[bytes]:
        """The records of pinned tags eviction must skip: up to ``pin_budget`` of the capacity. Kept until
        a tagged record comes or goes or the pins change (puts of untagged records reuse it)."""
        if self._protected_cache is not None:
            return self._protected_cache
        protected: set[bytes] = set()
        room = self._pin_budget
        for tag in sorted(self._pins):
            for digest in self._tagged.get(tag, ()):
                entry = self._items.get(digest)
                if entry is None or digest in protected or entry[1] > room:
                    continue
                protected.add(digest)
                room -= entry[1]
        self._protected_cache = protected
        return protected

    def _victims(self, need: int) -> list[bytes]:
        """The policy's victims for ``need`` bytes: unpinned records first; pinned ones only when no
        unpinned record is left to free the rest. Pinned records the policy walked past are moved to its
        recent end, so the next eviction does not walk past the pinned corpus again."""
        protected = self._protected() if self._pins and self._pin_budget > 0 else set()
        if not protected:
            return self.policy.evict(need)
        passed: list[bytes] = []

        def evictable(digest: bytes) -> bool:
            if digest in protected:
                passed.append(digest)
                return False
            return True

        victims = self.policy.evict(need, can_evict=evictable)
        freed = sum(self._items[d][1] for d in victims if d in self._items)
        if freed < need:
            victims += self.policy.evict(need - freed)
        for digest in passed:
            if digest not in victims:
                self.policy.access(digest)
        return victims

    def set_pinned_tags(self, tags: frozenset[str]) -> None:
        """The tags pinned now (the store's control poller): eviction skips their records, within budget."""
        with self._lock:
            if tags != self._pins:
                self._pins, self._protected_cache = frozenset(tags), None

    def drop_tagged(self, invalidations: dict[str, float]) -> int:
        """Drop the records carrying a tag of ``invalidations`` (tag -> unix time) written before that
        time; returns how many. Listeners hear of each, as of an eviction."""
        dropped: list[bytes] = []
        with self._lock:
            for tag, before in invalidations.items():
                for digest in list(self._tagged.get(tag, ())):
                    if self._written.get(digest, before) >= before:
                        continue
                    record, size, _ = self._items.pop(digest)
                    self._bytes -= size
                    self.policy.remove(digest)
                    self._untag(digest, record)
                    dropped.append(digest)
        if dropped:
            self.counters.add(invalidated=len(dropped))
        for digest in dropped:
            for listener in self._evict_listeners:
                listener(digest)
        return len(dropped)

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
            self._tagged.clear()
            self._written.clear()
            self._bytes = 0
            self.policy = make_policy(self.config.policy, self.capacity, "memory.policy")

    def close(self) -> None:
        self.clear()
