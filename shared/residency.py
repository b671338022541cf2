"""Residency reports: which records a worker's in-process memory tier holds, told to the scheduler.

Why: vLLM runs its scheduler and its workers in different processes, and the memory tier is the one tier
another process cannot look into. Without reports a scheduler would promise only what the shared tiers
(disk, Redis) hold, and a record only in the worker's memory would never be a hit. Both connectors use
this one mechanism: the worker side calls `ResidencyReporter.stored` after a put and sends `take()` with
its worker metadata; the scheduler side keeps a `ResidentSet` and applies every report.

Names are what a scheduler looks up: a KV chunk hash (bytes, one record per layer) or an encoder
`mm_hash` (str, one record). A name is resident when the memory tier holds every one of its records.
With several tensor-parallel workers a name is resident only when every rank holds it, so merged
reports take the intersection of additions and the union of evictions (`merge`).

The tiered store reports an eviction of a record still queued for a slower tier only once that write
is done (see `shared.store.tiered`), so a scheduler told "evicted" finds the record in a shared tier.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from vllm_tiercache.shared.store.api import Store, StoreKey

Name = TypeVar("Name", bound=Hashable)


@dataclass
class ResidencyChanges(Generic[Name]):
    """Names that entered (`added`) or left (`evicted`) a worker's memory tier since its last report."""

    added: set[Name] = field(default_factory=set)
    evicted: set[Name] = field(default_factory=set)

    def merge(self, other: ResidencyChanges[Name]) -> ResidencyChanges[Name]:
        """Two ranks' reports as one: resident only where both hold it."""
        return ResidencyChanges(self.added & other.added, self.evicted | other.evicted)


class ResidencyReporter(Generic[Name]):
    """Worker side: tracks names the memory tier holds and the changes not yet reported.

    Disabled (every call a no-op, `take()` None) when the store has no memory tier.
    """

    def __init__(self, store: Store) -> None:
        self._memory = store.memory_tier
        self._lock = threading.Lock()
        self._name_of_digest: dict[bytes, Name] = {}
        self._changes: ResidencyChanges[Name] = ResidencyChanges()
        if self._memory is not None:
            store.add_eviction_listener(self._on_evicted)

    @property
    def enabled(self) -> bool:
        return self._memory is not None

    def stored(self, name: Name, keys: Sequence[StoreKey]) -> bool:
        """Report `name` resident if the memory tier holds all its `keys` now (a put can be refused or
        evicted at once); whether it does. Checked under the lock the eviction listener takes, so an
        eviction racing with this (another connector's saves share the memory tier) is never lost."""
        if self._memory is None or not keys:
            return False
        with self._lock:
            if not all(self._memory.contains_many(keys)):
                return False
            for key in keys:
                self._name_of_digest[key.digest] = name
            self._changes.added.add(name)
            self._changes.evicted.discard(name)
        return True

    def _on_evicted(self, tier_kind: str, digest: bytes) -> None:
        """An eviction from a tier that reports them (`Store.add_eviction_listener`); residency reports
        are about `Store.memory_tier` alone."""
        if self._memory is None or tier_kind != self._memory.kind:
            return
        with self._lock:
            name = self._name_of_digest.pop(digest, None)
            if name is not None:
                self._changes.evicted.add(name)
                self._changes.added.discard(name)

    def take(self) -> ResidencyChanges[Name] | None:
        """The changes since the last call, or None when there are none."""
        if self._memory is None:
            return None
        with self._lock:
            changes, self._changes = self._changes, ResidencyChanges()
        return changes if changes.added or changes.evicted else None


class ResidentSet(Generic[Name]):
    """Scheduler side: the names the worker(s) reported resident and have not reported evicted since."""

    def __init__(self) -> None:
        self._names: set[Name] = set()

    def apply(self, added: Iterable[Name], evicted: Iterable[Name]) -> None:
        self._names.difference_update(evicted)
        self._names.update(added)

    def clear(self) -> None:
        """Forget every name (a generation reset: the names of the old generation are never asked again)."""
        self._names.clear()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[Name]:
        return iter(self._names)
