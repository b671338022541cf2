"""Eviction policies shared by the encoder cache managers (`eccache.managers`) and the store's memory tier.

Why one module: both caches face the same traffic shape (a few hot items asked again and again, a long
tail of one-offs, the odd sweep over a whole corpus), and on such traffic recency alone (LRU) is close to
vLLM's release order while frequency is what pays (see docs/benchmarks.md). Keeping one implementation
means one set of invariant tests and one benchmark covers both users.

A policy only *orders* entries. The owner keeps the data and the accounting (bytes or embeddings) and
asks the policy for victims with `evict(need, can_evict, incoming)`. `can_evict` lets the owner pin
entries: vLLM's encoder cache must never evict an entry a running request references, so the policy
skips those and never returns them.

Policies:

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
"""

from __future__ import annotations

from typing import Any

from vllm_tiercache.shared.eviction.base import EvictionPolicy
from vllm_tiercache.shared.eviction.lfu import LFUPolicy
from vllm_tiercache.shared.eviction.lru import LRUPolicy
from vllm_tiercache.shared.eviction.sketch import FrequencySketch
from vllm_tiercache.shared.eviction.wtinylfu import WTinyLFUPolicy

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "EvictionPolicy",
    "FrequencySketch",
    "LFUPolicy",
    "LRUPolicy",
    "WTinyLFUPolicy",
    "make_policy",
]

#: Every policy name the encoder cache managers accept (the memory tier: lru and wtinylfu).
POLICIES = ("lru", "lfu", "wtinylfu")
#: The best measured policy on the encoder-cache benchmark (`tiercache bench policy`).
DEFAULT_POLICY = "lfu"


def make_policy(name: str, capacity: int, field: str = "policy", **options: Any) -> EvictionPolicy:
    """Build policy `name`; an unknown name is a `ValueError` naming `field`, the value and the choices."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "wtinylfu":
        return WTinyLFUPolicy(capacity, **options)
    if name == "lfu":
        return LFUPolicy(capacity, **options)
    raise ValueError(f"{field}: invalid value {name!r}; allowed: {', '.join(POLICIES)}")
