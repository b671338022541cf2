"""LFU with aging and a bounded history of evicted keys' counts, per unit of size."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from vllm_tiercache.shared.eviction.base import EvictionPolicy


class LFUPolicy(EvictionPolicy):
    """Least frequently used, ties broken by recency; counts are aged and outlive eviction; size-aware.

    Why the history: a popular entry that was evicted comes back with its count, so it is not judged as a
    newcomer. Why aging: every `aging_period` accesses all counts are halved, so yesterday's favourites
    fade. Exact counts (not a sketch), so the victim search is a scan over the resident entries: fine for
    the encoder cache (tens to hundreds of entries), too slow for a memory tier of many thousand records,
    which therefore offers only lru and wtinylfu.

    Args:
        aging_period: accesses between two halvings of every count (0 disables aging).
        history_size: how many evicted keys keep their count (a bounded "ghost" table).
        size_aware: rank by count per unit of size (an entry of 576 embeddings must be asked for 36 times
            as often as one of 16 to stay); with equal sizes this is plain LFU.
    """

    name = "lfu"

    def __init__(self, capacity: int, aging_period: int = 4096, history_size: int = 65536,
                 size_aware: bool = True) -> None:
        super().__init__(capacity)
        self.size_aware = bool(size_aware)
        self.aging_period = int(aging_period)
        self.history_size = int(history_size)
        self._size: dict[Any, int] = {}
        self._freq: dict[Any, float] = {}
        self._last: dict[Any, int] = {}
        self._ghost: OrderedDict[Any, float] = OrderedDict()
        self._clock = 0

    def __contains__(self, key: object) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    def frequency(self, key: Hashable) -> float:
        return self._freq.get(key, self._ghost.get(key, 0.0))

    def _count(self, key: Hashable) -> None:
        self._clock += 1
        base = self._freq.get(key)
        if base is None:
            base = self._ghost.pop(key, 0.0)
        self._freq[key] = base + 1.0
        self._last[key] = self._clock
        if self.aging_period and self._clock % self.aging_period == 0:
            for table in (self._freq, self._ghost):
                for k in table:
                    table[k] /= 2.0

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self._size[key] = int(size)
        self._count(key)

    def access(self, key: Hashable) -> None:
        if key in self._size:
            self._count(key)

    def remove(self, key: Hashable) -> None:
        if self._size.pop(key, None) is None:
            return
        count = self._freq.pop(key, 0.0)
        self._last.pop(key, None)
        if self.history_size > 0:
            self._ghost[key] = count
            self._ghost.move_to_end(key)
            while len(self._ghost) > self.history_size:
                self._ghost.popitem(last=False)

    def evict(self, need: int, can_evict: Callable[[Any], bool] | None = None, incoming: int = 0) -> list[Any]:
        ok = can_evict or (lambda _k: True)
        if self.size_aware:  # least hits per unit of space first: what maximizes the hit rate
            heap = [(self._freq[k] / max(1, self._size[k]), self._last[k], i, k)
                    for i, k in enumerate(self._size) if ok(k)]
        else:
            heap = [(self._freq[k], self._last[k], i, k) for i, k in enumerate(self._size) if ok(k)]
        heapq.heapify(heap)  # O(n), then O(log n) per victim: an eviction usually needs one or two
        victims: list[Any] = []
        freed = 0
        while heap and freed < need:
            key = heapq.heappop(heap)[3]
            victims.append(key)
            freed += self._size[key]
        for key in victims:
            self.remove(key)
        return victims
