"""LRU: least recently accessed first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from vllm_tiercache.shared.eviction.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently accessed first; every insert and every hit refresh an entry."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Any, int] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self._order[key] = int(size)
        self._order.move_to_end(key)

    def access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def evict(self, need: int, can_evict: Callable[[Any], bool] | None = None, incoming: int = 0) -> list[Any]:
        victims: list[Any] = []
        freed = 0
        # Pinned entries are few (the running batch), so skipping them keeps the scan short.
        for key, size in self._order.items():
            if freed >= need:
                break
            if can_evict is None or can_evict(key):
                victims.append(key)
                freed += size
        for key in victims:
            del self._order[key]
        return victims
