"""`bench trace --shared-share R`: memory + disk + a shared Redis tier, one real store per policy and
arrangement, and its table.

Why apart from `command`: the sweep of the three tiers has its own split (R of each capacity in Redis, the
rest between memory and disk as ``--disk-share`` says), its own server (`shared_tier`), and its own
columns (hits per tier, and the records Redis's eviction left half there).
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_tiercache.shared.eviction import policy_entry
from vllm_tiercache.tools.bench.trace.mooncake import format_tokens
from vllm_tiercache.tools.bench.trace.replay import Asked
from vllm_tiercache.tools.bench.trace.shared_tier import MAXMEMORY_POLICY, SharedTier
from vllm_tiercache.tools.bench.trace.tiers import ARRANGEMENTS, TierSplit, replay_memory_disk


def memory_disk_redis(traffic: list[Asked], args: argparse.Namespace, blocks: int, progress: Any,
                      shared: SharedTier) -> dict[str, Any]:
    """Each policy in memory, the disk tier behind it in each arrangement, Redis behind both: the split and,
    per arrangement and policy, each tier's share of the hits, the total served, what the lookups found
    (``found``), and the blocks found and not served (``lost``: Redis evicted them, or part of them, between
    the lookup and the read; a client's replies count in Redis's used memory, so even a read can make it
    evict); ``partial``: the records the Redis tier's reads found with a piece evicted (its ``partial``
    counter; a lookup asks for the head and the first part, so mostly a record's reads before any lookup
    found it, or a part evicted since), ``corrupt``: damaged ones (none expected)."""
    split = TierSplit.of_three(blocks, args.disk_share, args.shared_share)
    out: dict[str, Any] = {"memory_blocks": split.memory_blocks, "disk_blocks": split.disk_blocks,
                           "redis_blocks": split.shared_blocks, "redis_record_cost": shared.record_cost,
                           "arrangements": {}}
    for arrangement in ARRANGEMENTS:
        cells = out["arrangements"][arrangement] = {}
        for policy in args.policies:
            r = replay_memory_disk(traffic, policy, split, args.record_bytes, progress, arrangement, shared,
                                   args.disk_policy)
            cells[policy] = {"memory": r.ratio(r.memory), "disk": r.ratio(r.disk), "redis": r.ratio(r.redis),
                             "total": r.ratio(r.memory + r.disk + r.redis), "found": r.ratio(r.found),
                             "lost": r.found - r.memory - r.disk - r.redis, "partial": r.partial,
                             "corrupt": r.corrupt,
                             "redis_misses": r.redis_misses,
                             **(r.redis_stats or {}), "seconds": round(r.seconds, 2)}
    return out


def format_memory_disk_redis(result: dict[str, Any], policies: list[str], disk_share: float,
                             shared_share: float) -> str:
    """Per capacity and memory policy and arrangement: memory + disk + Redis hits = total served."""
    header = ["capacity", "memory/disk/redis blocks", "LRU (plain)",
              *(f"{policy_entry(p).label} ({p}) {a}: mem + disk + redis = total"
                for p in policies for a in ARRANGEMENTS), "optimum"]
    lines, partial = [], []
    for row in result["rows"]:
        three = row["memory_disk_redis"]
        cells = [format_tokens(row["capacity_tokens"]),
                 f"{three['memory_blocks']}/{three['disk_blocks']}/{three['redis_blocks']}",
                 f"{row['lru_reference']:.3f}"]
        for p in policies:
            for arrangement in ARRANGEMENTS:
                r = three["arrangements"][arrangement][p]
                cells.append(f"{r['memory']:.3f} + {r['disk']:.3f} + {r['redis']:.3f} = {r['total']:.3f}")
                partial.append(f"{format_tokens(row['capacity_tokens'])} {p} {arrangement}: {r['lost']} lost, "
                               f"{r['partial']} partial, {r.get('corrupt', 0)} corrupt, "
                               f"{r['evicted_keys']} keys evicted")
        lines.append([*cells, f"{row['optimum']:.3f}"])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    text = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in [header, *lines]]
    rest = 1 - shared_share
    text.append(f"(memory {rest * (1 - disk_share):.3g}, disk {rest * disk_share:.3g} and Redis {shared_share:g} of "
                f"each capacity; Redis written through in both arrangements, evicting by its own {MAXMEMORY_POLICY} "
                "under a maxmemory measured per record; a Redis hit is promoted into memory and disk; LRU (plain) "
                "and optimum at the combined capacity)")
    text.append("Blocks the lookup found and the read did not (lost: all Redis's, evicted in between), records "
                "Redis's reads found with a piece evicted (partial: misses, not damage), damaged ones (corrupt), "
                "and the keys Redis evicted: "
                + "; ".join(partial))
    return "\n".join(text)
