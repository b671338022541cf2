"""The write-behind buffer: records queued for the slower tiers stay readable until they are written.

Why: a record queued for the slower tiers is kept here until the writer has written it, and the store's
reads consult it right after the fastest tier. Without it, the memory tier can evict a record before its
disk or Redis copy lands, and for that moment no tier has it: a load the scheduler planned from a residency
report fails. For the same reason an eviction from the fastest tier reaches listeners (residency reports)
only once the record's queued write is done: told earlier, the scheduler looks in the shared tier, finds
nothing yet and misses. The buffer costs no memory of its own: the writer's queue holds the same tensors
until then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from vllm_tiercache.shared.store.api import Record, StoreKey, Tier
from vllm_tiercache.shared.store.writes.background import Item


class WriteBehindBuffer:
    """Records on their way to the slower tiers, by digest, and the evictions held back for them (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: digest -> (record, number of queued writes of it)
        self._records: dict[bytes, tuple[Record, int]] = {}
        #: digest -> eviction notifications held back until the record's queued write is done
        self._deferred_evictions: dict[bytes, list[tuple[Tier, Callable[[], None]]]] = {}
        self._hits = 0

    @property
    def hits(self) -> int:
        """Records `split` handed to reads (``count_hits``) so far."""
        with self._lock:
            return self._hits

    def hold(self, items: Sequence[Item]) -> None:
        """Keep ``items`` readable: call before the fastest tier gets them (it may evict one right away)."""
        with self._lock:
            for key, tensor, meta in items:
                entry = self._records.get(key.digest)
                self._records[key.digest] = (Record(tensor, meta or {}), 1 + (entry[1] if entry else 0))

    def release(self, items: Sequence[Item]) -> None:
        """The writer is done with ``items``: drop them from the buffer, send the evictions held back."""
        held_back: list[tuple[StoreKey, Tier, Callable[[], None]]] = []
        with self._lock:
            for key, _, _ in items:
                entry = self._records.get(key.digest)
                if entry is None:
                    continue
                if entry[1] > 1:
                    self._records[key.digest] = (entry[0], entry[1] - 1)
                    continue
                del self._records[key.digest]
                held_back.extend((key, tier, notify) for tier, notify in self._deferred_evictions.pop(key.digest, ()))
        for key, tier, notify in held_back:
            if not tier.contains_many([key])[0]:  # put back meanwhile: that eviction no longer holds
                notify()

    def on_eviction(self, tier: Tier, digest: bytes, notify: Callable[[], None]) -> None:
        """Send an eviction now, or once the record's queued write is done (see the module docstring)."""
        with self._lock:
            if digest in self._records:
                self._deferred_evictions.setdefault(digest, []).append((tier, notify))
                return
        notify()

    def split(self, keys: Sequence[StoreKey], missing: list[int], *,
              count_hits: bool = False) -> tuple[dict[int, Record], list[int]]:
        """Of the indexes in ``missing``: the records the buffer holds, and the rest. ``count_hits``: a read
        takes those records (`hits`)."""
        held: dict[int, Record] = {}
        still: list[int] = []
        with self._lock:
            for i in missing:
                entry = self._records.get(keys[i].digest)
                if entry is None:
                    still.append(i)
                else:
                    held[i] = entry[0]
            if count_hits:
                self._hits += len(held)
        return held, still
