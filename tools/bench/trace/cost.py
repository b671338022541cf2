"""What a policy costs per put: a micro-benchmark of the policy objects alone, against LRU's.

Why alone: the replay's time is mostly the tier's (keys, locks, counters); the policy's bookkeeping is
what differs between columns. Each put is an insert (naming its parent: chains of `CHAIN` blocks) and,
once full, an eviction of one entry; every other chain first reads the head of the previous one (hits
keep heads warm, as shared prefixes are).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from vllm_tiercache.shared.eviction import make_policy

CHAIN = 32


def seconds_per_put(policy: str, capacity: int = 20_000, puts: int = 100_000) -> float:
    """Mean seconds per put of ``policy`` (capacity in entries of size 1)."""
    p = make_policy(policy, capacity)
    held = 0
    started = time.perf_counter()
    for i in range(puts):
        chain, depth = divmod(i, CHAIN)
        if depth == 0 and chain % 2 and (chain - 1) * CHAIN in p:
            p.access((chain - 1) * CHAIN)
        p.insert(i, 1, i - 1 if depth else None)
        held += 1
        if held > capacity:
            held -= len(p.evict(held - capacity))
    return (time.perf_counter() - started) / puts


def cost_rows(policies: Sequence[str], puts: int = 100_000) -> list[dict[str, float | str]]:
    """One row per policy: microseconds per put (``puts`` of them) and the ratio to LRU's."""
    base = seconds_per_put("lru", puts=puts)
    rows: list[dict[str, float | str]] = []
    for name in policies:
        cost = base if name == "lru" else seconds_per_put(name, puts=puts)
        rows.append({"policy": name, "us_per_put": cost * 1e6, "x_lru": cost / base})
    return rows
