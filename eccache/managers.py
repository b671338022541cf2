"""Encoder cache managers for vLLM 0.32's `--ec-manager-config` extension point: one per eviction policy.

vLLM's own `EncoderCacheManager` evicts unreferenced entries in the order they *became* unreferenced, so
an image a short request just hit can be evicted before one a long request last touched much earlier;
on RAG traffic a popular image is also evicted as readily as a one-off. These subclasses keep vLLM's
bookkeeping (reference sets, `freeable`, `freed`, slot counts: the scheduler reads them directly) and
change only which unreferenced entry is evicted, through a `vllm_tiercache.shared.eviction` policy (the same code the
store's memory tier uses):

- `PolicyEncoderCacheManager`: the policy named by config (`manager_config["policy"]`, else the EC
  connector's `encoder_cache_policy`, else `vllm_tiercache.shared.eviction.DEFAULT_POLICY`).
- one class per registered policy (`vllm_tiercache.shared.eviction.registry`) that fixes it, named after the
  policy class (`manager_class_name`): `LRUEncoderCacheManager` (the least recently *accessed*; every hit
  and every allocation refreshes), `LFUEncoderCacheManager` (the least frequently accessed, ties broken by
  recency; counts survive eviction in a bounded history and are halved every `aging_period` accesses),
  `WTinyLFUEncoderCacheManager` (W-TinyLFU, Caffeine's policy, size-aware in embeddings). They are made
  from the registry when this module is imported, because vLLM names a manager by its class path
  (``encoder_cache_manager_cls``), so each must be an attribute of this module.

Every `manager_config` key is checked when the manager is built (`check_manager_options`): a key the
chosen policy does not take, a bad value, or a ``policy`` other than the one a fixed-policy class uses is
a `ConfigError` that names the key and what is allowed, never silently ignored.

Invariants kept from vLLM: capacity is never exceeded and referenced entries are never evicted (only
entries in `freeable` are candidates). Enable with::

    --ec-manager-config '{"encoder_cache_manager_cls": "vllm_tiercache.eccache.managers.PolicyEncoderCacheManager",
                          "manager_config": {"policy": "lfu"}}'
    LLM(..., ec_manager_config={"encoder_cache_manager_cls": "vllm_tiercache.eccache.managers.LFUEncoderCacheManager",
                                "manager_config": {"aging_period": 4096, "history_size": 65536}})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from vllm_tiercache.eccache.options import check_manager_option, manager_class_name
from vllm_tiercache.shared.config import ConfigError
from vllm_tiercache.shared.eviction import (
    DEFAULT_POLICY,
    make_policy,
    policy_class_path,
    policy_entry,
    policy_names,
    policy_options,
)
from vllm_tiercache.shared.store.tier_config import did_you_mean, invalid

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
        policy, options = cls._configured_policy(vllm_config)
        return cls(cache_size=cache_size, policy=policy, **options)

    @classmethod
    def check_config(cls, vllm_config: VllmConfig) -> str:
        """The policy a manager of this class would use for ``vllm_config``, every option checked, nothing
        built: what the plugin runs when vLLM builds its config, before any weights load."""
        policy, options = cls._configured_policy(vllm_config)
        return check_manager_options(cls, policy, options)

    @classmethod
    def _configured_policy(cls, vllm_config: VllmConfig) -> tuple[str | None, dict[str, Any]]:
        """(`manager_config["policy"]`, else the EC connector's `encoder_cache_policy` for a class without a
        fixed policy; the other `manager_config` options)."""
        options = dict(vllm_config.ec_manager_config.manager_config or {})
        policy = options.pop("policy", None)
        if policy is None and cls.policy_name is None:
            policy = _connector_policy(vllm_config)
        return policy, options

    def __init__(self, cache_size: int, policy: str | None = None, **policy_options: Any) -> None:
        super().__init__(cache_size)
        self.policy_name = check_manager_options(type(self), policy, policy_options)
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


def _fixed_policy_manager(policy: str) -> type[PolicyEncoderCacheManager]:
    """A `PolicyEncoderCacheManager` subclass that always uses ``policy`` (another ``manager_config["policy"]``
    is an error), as a named class of this module so that vLLM can load it by its path."""
    name = manager_class_name(policy)
    options = policy_options(policy)
    takes = f"Options: {', '.join(f'`{o}`' for o in options)}." if options else "Takes no options."
    doc = f"Evicts by the {policy_entry(policy).label} policy (`{policy}`, `{policy_class_path(policy)}`). {takes}"
    return type(name, (PolicyEncoderCacheManager,),
                {"policy_name": policy, "__doc__": doc, "__module__": __name__, "__qualname__": name})


#: policy name -> the manager class that fixes it, one per registered policy
FIXED_POLICY_MANAGERS: Mapping[str, type[PolicyEncoderCacheManager]] = {
    policy: _fixed_policy_manager(policy) for policy in policy_names()}
globals().update({cls.__name__: cls for cls in FIXED_POLICY_MANAGERS.values()})


def manager_class(policy: str) -> type[PolicyEncoderCacheManager]:
    """The manager class that fixes ``policy`` (e.g. `LFUEncoderCacheManager` for lfu)."""
    policy_entry(policy, "encoder_cache_policy")
    return FIXED_POLICY_MANAGERS[policy]


# ------------------------------------------------------------------------------------ manager_config

def check_manager_options(cls: type, policy: Any, options: Mapping[str, Any]) -> str:
    """The policy name a manager of class ``cls`` uses, after checking ``policy`` and every option.

    ``policy`` is `manager_config["policy"]` (or the EC connector's `encoder_cache_policy`, or None); a
    class with a fixed `policy_name` refuses another. Each option must be one the policy takes, with a
    value it accepts. Errors are `ConfigError`s naming ``manager_config.<key>`` and what is allowed.
    """
    fixed = getattr(cls, "policy_name", None)
    if fixed is not None and policy is not None and policy != fixed:
        raise invalid("manager_config.policy", policy,
                      f"{fixed!r} or no policy: {cls.__name__} always uses {fixed!r}; to choose the policy, set "
                      "encoder_cache_manager_cls to vllm_tiercache.eccache.managers.PolicyEncoderCacheManager")
    name = fixed or policy or DEFAULT_POLICY
    if not isinstance(name, str) or name not in policy_names():  # the message make_policy gives too
        raise invalid("encoder_cache_policy", name, ", ".join(policy_names()))
    allowed = policy_options(name)
    for key, value in options.items():
        if key not in allowed:
            takes = ", ".join(["policy", *allowed]) if allowed else f"policy only ({name} takes no other option)"
            which = f"{cls.__name__}" + ("" if policy or fixed else ", the default policy")
            raise ConfigError(f"manager_config.{key}: unknown option for policy {name!r} ({which}); "
                              f"{did_you_mean(key, allowed)}allowed: {takes}")
        check_manager_option(key, value)  # its type and bounds: `vllm_tiercache.eccache.options.ManagerOptions`
    return name
