"""Eviction policies shared by the encoder cache managers (`eccache.managers`) and the store's memory tier.

Why one module: both caches face the same traffic shape (a few hot items asked again and again, a long
tail of one-offs, the odd sweep over a whole corpus), and on such traffic recency alone (LRU) is close to
vLLM's release order while frequency is what pays (see docs/benchmarks.md). Keeping one implementation
means one set of invariant tests and one benchmark covers both users.

A policy only *orders* entries. The owner keeps the data and the accounting (bytes or embeddings) and
asks the policy for victims with `evict(need, can_evict, incoming)`. `can_evict` lets the owner pin
entries: vLLM's encoder cache must never evict an entry a running request references, so the policy
skips those and never returns them.

Which policies exist is `registry` (one entry per policy: its class by dotted path, its label, whether the
memory tier may use it); every list of policy names elsewhere is derived from it. The built-in policies:

- `lru`: least recently accessed first.
- `wtinylfu`: W-TinyLFU as in Caffeine (Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient Cache
  Admission Policy", 2017). A small LRU *window* (1% of the capacity) takes every new entry; what
  overflows the window is a *candidate* for the main area, a segmented LRU (probation, then protected,
  80% of main). A candidate is admitted only if a count-min sketch of recent access frequencies (4-bit
  counters, halved every 10 x entries accesses so old popularity fades) rates it above the victim it
  would displace; otherwise the candidate itself is evicted. Size-aware: capacity is counted in the
  owner's units, frequencies are compared per unit of size, and a large candidate keeps being compared
  against victim after victim until enough room is made, so it has to beat every entry it displaces
  (Caffeine's weighted mode compares raw frequencies; per size is what maximizes the hit rate when
  entries differ in size). The victim is the least frequent (per size) of the 16 oldest probation entries
  (Caffeine takes the oldest alone). A candidate that loses but is pinned cannot be evicted now; it is
  moved to the head of probation, first in line once the owner unpins it.
- `lfu`: least frequently used with aging and a bounded history of evicted keys' counts, per unit of
  size. No admission filter (in the encoder cache a newcomer must be allocated anyway; a cold one is
  simply the next to go). The default for the encoder cache: best measured on every trace of
  `tiercache bench policy` but the shifting one, where W-TinyLFU adapts faster (docs/benchmarks.md).
- `prefix`: for KV records, which form prefix chains (a block is worth something only while every block
  before it is held): leaves-only eviction (never a child whose parent is gone), decayed access counts
  (LRFU), first-time keys behind returning ones. The memory tier's default (`tiercache bench trace`,
  docs/benchmarks-kv.md); see `prefix`.
"""

from __future__ import annotations

from typing import Any

from vllm_tiercache.shared.eviction.base import EvictionPolicy
from vllm_tiercache.shared.eviction.registry import (
    DEFAULT_POLICY,
    make_policy,
    memory_tier_policies,
    policy_class,
    policy_class_name,
    policy_class_path,
    policy_entry,
    policy_names,
    policy_options,
)
from vllm_tiercache.shared.eviction.sketch import FrequencySketch

__all__ = [  # the policy classes at the end come from `__getattr__`
    "DEFAULT_POLICY",
    "POLICIES",
    "EvictionPolicy",
    "FrequencySketch",
    "make_policy",
    "memory_tier_policies",
    "policy_class",
    "policy_class_name",
    "policy_class_path",
    "policy_entry",
    "policy_names",
    "policy_options",
    *(policy_class_name(name) for name in policy_names()),
]

#: Every policy name the encoder cache managers accept (the memory tier: `memory_tier_policies()`).
POLICIES = policy_names()


def __getattr__(attr: str) -> Any:
    """Each registered policy's class by its name (``from vllm_tiercache.shared.eviction import LFUPolicy``),
    imported on first use as the registry imports it."""
    for name in policy_names():
        if policy_class_name(name) == attr:
            return policy_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
