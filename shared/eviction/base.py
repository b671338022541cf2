"""The interface every eviction policy offers its owner (the encoder cache manager, the memory tier)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


class EvictionPolicy:
    """What every policy offers. Keys are hashable (an mm_hash, a 16-byte digest); sizes are the owner's units.

    The owner calls `insert` when an entry becomes resident, `access` on every hit, `remove` when it drops
    an entry itself, and `evict` to make room; entries `evict` returns are already forgotten by the policy.

    `insert`'s ``parent`` is the key of the entry this one extends (a KV block's record names the record
    of the block before it): a prefix-aware policy (`prefix`) never keeps a child whose parent is gone;
    the others ignore it.
    """

    name = "base"

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        #: candidates refused by admission (the owner may count them as refused puts)
        self.rejections = 0

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        raise NotImplementedError

    def access(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def evict(self, need: int, can_evict: Callable[[Any], bool] | None = None, incoming: int = 0) -> list[Any]:
        """Forget and return entries whose sizes add up to at least `need` (fewer only if too few are evictable).

        `incoming` is the size of an entry the owner is about to `insert` (the encoder cache makes room
        before allocating); a policy with a window keeps room for it there.
        """
        raise NotImplementedError
