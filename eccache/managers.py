"""Encoder cache managers for vLLM 0.32's `--ec-manager-config` extension point: LRU and LFU-with-aging.

vLLM's own `EncoderCacheManager` evicts unreferenced entries in the order they *became* unreferenced, so
an image a short request just hit can be evicted before one a long request last touched much earlier;
on RAG traffic a popular image is also evicted as readily as a one-off. These subclasses keep vLLM's
bookkeeping (reference sets, `freeable`, `freed`, slot counts: the scheduler reads them directly) and
change only which unreferenced entry is evicted:

- `LRUEncoderCacheManager`: the least recently *accessed* (every hit and every allocation refreshes).
- `LFUEncoderCacheManager`: the least frequently accessed, ties broken by recency; counts survive
  eviction in a bounded history (so a popular image comes back with its count) and are halved every
  `aging_period` accesses so yesterday's favourites fade.

Invariants kept from vLLM: capacity is never exceeded and referenced entries are never evicted (only
entries in `freeable` are candidates). Enable with::

    --ec-manager-config '{"encoder_cache_manager_cls": "eccache.managers.LRUEncoderCacheManager"}'
    LLM(..., ec_manager_config={"encoder_cache_manager_cls": "eccache.managers.LFUEncoderCacheManager",
                                "manager_config": {"aging_period": 4096, "history_size": 65536}})
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


class _PolicyEncoderCacheManager(EncoderCacheManager):
    """vLLM's manager with the victim choice made by a policy (`_victim`) fed by `_touch` on every access."""

    @classmethod
    def create_manager(cls, *, cache_size: int, vllm_config: VllmConfig) -> EncoderCacheManager:
        options = dict(vllm_config.ec_manager_config.manager_config or {})
        return cls(cache_size=cache_size, **options)

    def __init__(self, cache_size: int) -> None:
        super().__init__(cache_size)
        self.evictions = 0

    # ------------------------------------------------------------------------------------ policy hooks

    def _touch(self, mm_hash: str) -> None:
        raise NotImplementedError

    def _victim(self) -> str:
        """An unreferenced entry (a key of `freeable`) to evict."""
        raise NotImplementedError

    def _forget(self, mm_hash: str) -> None:
        """`mm_hash` was evicted."""

    # ------------------------------------------------------------------------------- vLLM's interface

    def reset(self) -> None:
        super().reset()
        self._reset_policy()

    def _reset_policy(self) -> None:
        raise NotImplementedError

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        hit = super().check_and_update_cache(request, input_id)
        if hit:
            self._touch(request.mm_features[input_id].identifier)
        return hit

    def allocate(self, request: Request, input_id: int) -> None:
        super().allocate(request, input_id)
        self._touch(request.mm_features[input_id].identifier)

    def can_allocate(
        self, request: Request, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int
    ) -> bool:
        """vLLM's `can_allocate` (same budget and capacity checks) with the policy picking victims."""
        num_embeds = request.get_num_encoder_embeds(input_id)
        if num_embeds > encoder_compute_budget:
            return False
        num_embeds += num_embeds_to_schedule
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        while num_embeds > self.num_free_slots:
            mm_hash = self._victim()
            num_free_embeds = self.freeable.pop(mm_hash)
            del self.cached[mm_hash]
            del self.num_embeds_by_hash[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += num_free_embeds
            self.evictions += 1
            self._forget(mm_hash)
        return True


class LRUEncoderCacheManager(_PolicyEncoderCacheManager):
    """Evicts the unreferenced entry whose last hit or allocation is oldest."""

    def __init__(self, cache_size: int, **_: Any) -> None:
        super().__init__(cache_size)
        self._reset_policy()

    def _reset_policy(self) -> None:
        #: every cached hash, least recently accessed first
        self._recency: OrderedDict[str, None] = OrderedDict()

    def _touch(self, mm_hash: str) -> None:
        self._recency[mm_hash] = None
        self._recency.move_to_end(mm_hash)

    def _victim(self) -> str:
        # Referenced entries sit among the old ones only while in use: few, so the scan stays short.
        for mm_hash in self._recency:
            if mm_hash in self.freeable:
                return mm_hash
        raise AssertionError("can_allocate found freeable slots but no unreferenced entry")

    def _forget(self, mm_hash: str) -> None:
        self._recency.pop(mm_hash, None)


class LFUEncoderCacheManager(_PolicyEncoderCacheManager):
    """Evicts the unreferenced entry with the lowest aged access count (then the least recent).

    Args:
        aging_period: accesses between two halvings of every count (0 disables aging).
        history_size: how many evicted hashes keep their count (a bounded "ghost" table).
    """

    def __init__(
        self, cache_size: int, aging_period: int = 4096, history_size: int = 65536, **_: Any
    ) -> None:
        super().__init__(cache_size)
        self.aging_period = int(aging_period)
        self.history_size = int(history_size)
        self._reset_policy()

    def _reset_policy(self) -> None:
        self._freq: dict[str, float] = {}
        self._last: dict[str, int] = {}
        self._ghost: OrderedDict[str, float] = OrderedDict()
        self._clock = 0

    def _touch(self, mm_hash: str) -> None:
        self._clock += 1
        base = self._freq.get(mm_hash)
        if base is None:
            base = self._ghost.pop(mm_hash, 0.0)
        self._freq[mm_hash] = base + 1.0
        self._last[mm_hash] = self._clock
        if self.aging_period and self._clock % self.aging_period == 0:
            for table in (self._freq, self._ghost):
                for k in table:
                    table[k] /= 2.0

    def _victim(self) -> str:
        return min(self.freeable, key=lambda h: (self._freq.get(h, 0.0), self._last.get(h, 0)))

    def _forget(self, mm_hash: str) -> None:
        count = self._freq.pop(mm_hash, 0.0)
        self._last.pop(mm_hash, None)
        if self.history_size > 0:
            self._ghost[mm_hash] = count
            self._ghost.move_to_end(mm_hash)
            while len(self._ghost) > self.history_size:
                self._ghost.popitem(last=False)
