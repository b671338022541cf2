"""Encoder cache managers for vLLM 0.32's `--ec-manager-config` extension point: LRU, LFU, W-TinyLFU.

vLLM's own `EncoderCacheManager` evicts unreferenced entries in the order they *became* unreferenced, so
an image a short request just hit can be evicted before one a long request last touched much earlier;
on RAG traffic a popular image is also evicted as readily as a one-off. These subclasses keep vLLM's
bookkeeping (reference sets, `freeable`, `freed`, slot counts: the scheduler reads them directly) and
change only which unreferenced entry is evicted, through a `vllm_tiercache.shared.eviction` policy (the same code the
store's memory tier uses):

- `PolicyEncoderCacheManager`: the policy named by config (`manager_config["policy"]`, else the EC
  connector's `encoder_cache_policy`, else `vllm_tiercache.shared.eviction.DEFAULT_POLICY`).
- `LRUEncoderCacheManager`: the least recently *accessed* (every hit and every allocation refreshes).
- `LFUEncoderCacheManager`: the least frequently accessed, ties broken by recency; counts survive
  eviction in a bounded history and are halved every `aging_period` accesses.
- `WTinyLFUEncoderCacheManager`: W-TinyLFU (Caffeine's policy), size-aware in embeddings.

Invariants kept from vLLM: capacity is never exceeded and referenced entries are never evicted (only
entries in `freeable` are candidates). Enable with::

    --ec-manager-config '{"encoder_cache_manager_cls": "vllm_tiercache.eccache.managers.PolicyEncoderCacheManager",
                          "manager_config": {"policy": "lfu"}}'
    LLM(..., ec_manager_config={"encoder_cache_manager_cls": "vllm_tiercache.eccache.managers.LFUEncoderCacheManager",
                                "manager_config": {"aging_period": 4096, "history_size": 65536}})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from vllm_tiercache.shared.eviction import DEFAULT_POLICY, make_policy

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


class PolicyEncoderCacheManager(EncoderCacheManager):
    """vLLM's manager with victims chosen by a `shared.eviction` policy (the same code as the memory tier).

    The policy is picked, first match wins, by `manager_config["policy"]`, by `encoder_cache_policy` in
    the EC connector's extra config, or else `vllm_tiercache.shared.eviction.DEFAULT_POLICY` (the best measured one).
    Other `manager_config` keys go to the policy (lfu: `aging_period`, `history_size`, `size_aware`;
    wtinylfu: `window_fraction`, `protected_fraction`, `victim_sample`, `size_aware`).

    vLLM's contract kept: `can_allocate` answers exactly as vLLM's would (True whenever the free plus
    freeable slots suffice), so no request is starved; only entries in `freeable` (unreferenced) are
    offered to the policy; capacity is never exceeded. W-TinyLFU's admission refusal therefore never
    refuses the allocation itself (the running request needs the encoder output): a refused entry is
    kept while referenced and is the first to go once unreferenced.
    """

    policy_name: str | None = None  #: fixed by subclasses; None: chosen by config

    @classmethod
    def create_manager(cls, *, cache_size: int, vllm_config: VllmConfig) -> EncoderCacheManager:
        options = dict(vllm_config.ec_manager_config.manager_config or {})
        policy = options.pop("policy", None) or cls.policy_name or _connector_policy(vllm_config)
        return cls(cache_size=cache_size, policy=policy, **options)

    def __init__(self, cache_size: int, policy: str | None = None, **policy_options: Any) -> None:
        super().__init__(cache_size)
        self.policy_name = policy or self.policy_name or DEFAULT_POLICY
        self._policy_options = policy_options
        self.policy = make_policy(self.policy_name, cache_size, "encoder_cache_policy", **policy_options)
        self.evictions = 0

    def reset(self) -> None:
        super().reset()
        self.policy = make_policy(self.policy_name, self.cache_size, "encoder_cache_policy",  # type: ignore[arg-type]
                                  **self._policy_options)

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        hit = super().check_and_update_cache(request, input_id)
        if hit:
            self.policy.access(request.mm_features[input_id].identifier)
        return hit

    def allocate(self, request: Request, input_id: int) -> None:
        super().allocate(request, input_id)
        mm_hash = request.mm_features[input_id].identifier
        if mm_hash in self.policy:
            self.policy.access(mm_hash)
        else:
            self.policy.insert(mm_hash, self.num_embeds_by_hash[mm_hash])

    def can_allocate(
        self, request: Request, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int
    ) -> bool:
        """vLLM's `can_allocate` (same budget and capacity checks, same answer) with the policy picking victims."""
        incoming = request.get_num_encoder_embeds(input_id)
        if incoming > encoder_compute_budget:
            return False
        num_embeds = incoming + num_embeds_to_schedule
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        victims = self.policy.evict(num_embeds - self.num_free_slots, self.freeable.__contains__, incoming)
        for mm_hash in victims:
            self._evict(mm_hash)
        while num_embeds > self.num_free_slots:  # never reached with a correct policy; vLLM's order then
            mm_hash = next(iter(self.freeable))
            self.policy.remove(mm_hash)
            self._evict(mm_hash)
        return True

    def _evict(self, mm_hash: str) -> None:
        self.num_free_slots += self.freeable.pop(mm_hash)
        del self.cached[mm_hash]
        del self.num_embeds_by_hash[mm_hash]
        self.freed.append(mm_hash)
        self.evictions += 1


def _connector_policy(vllm_config: Any) -> str | None:
    """`encoder_cache_policy` of the EC connector's options (read as the connector reads them, so a
    `config_file` or `$TIERCACHE_CONFIG` works too), or None without an EC connector."""
    ec = getattr(vllm_config, "ec_transfer_config", None)
    if ec is None:
        return None
    from vllm_tiercache.eccache.options import ECConnectorOptions

    options, _ = ECConnectorOptions.load(dict(getattr(ec, "ec_connector_extra_config", None) or {}))
    return options.encoder_cache_policy


class LRUEncoderCacheManager(PolicyEncoderCacheManager):
    """Evicts the unreferenced entry whose last hit or allocation is oldest."""

    policy_name = "lru"

    def __init__(self, cache_size: int, policy: str | None = None, **_: Any) -> None:
        super().__init__(cache_size, policy="lru")


class WTinyLFUEncoderCacheManager(PolicyEncoderCacheManager):
    """W-TinyLFU (window LRU, frequency-sketch admission, segmented LRU), size-aware in embeddings."""

    policy_name = "wtinylfu"

    def __init__(self, cache_size: int, policy: str | None = None, **options: Any) -> None:
        super().__init__(cache_size, policy="wtinylfu", **options)


class LFUEncoderCacheManager(PolicyEncoderCacheManager):
    """Evicts the unreferenced entry with the lowest aged access count (then the least recent).

    Args:
        aging_period: accesses between two halvings of every count (0 disables aging).
        history_size: how many evicted hashes keep their count (a bounded "ghost" table).
    """

    policy_name = "lfu"

    def __init__(self, cache_size: int, policy: str | None = None, **options: Any) -> None:
        super().__init__(cache_size, policy="lfu", **options)
