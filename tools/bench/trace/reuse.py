"""`tiercache bench trace --reuse`: which features of a block, seen by an online policy, separate blocks
used again soon from blocks never used again.

For every block the store is asked for (after vLLM's prefix cache, `replay.store_traffic`), the features a
memory tier could know at that moment: whether the block was seen before, how often, how many requests
ago it was last asked for (log2 buckets), its place from the prompt's tail, whether it is a first-time
block after a prefix seen before (a new turn's suffix). Per feature value: how many occurrences, and the
share asked for again within each horizon (in requests) and ever. A feature is worth a policy's
attention where these shares differ by value; on the Mooncake trace they barely do (docs/benchmarks-kv.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from vllm_tiercache.tools.bench.trace.replay import Asked

#: one occurrence's features: (uses before, requests since the last use or None, from tail, suffix after a seen prefix)
_Features = tuple[int, int | None, int, bool]

FEATURES: dict[str, Callable[[_Features], Any]] = {
    "uses before": lambda f: min(f[0], 8),
    "log2 requests since last use": lambda f: "never used" if f[1] is None else f[1].bit_length(),
    "place from the tail": lambda f: min(f[2], 4),
    "first-time block after a seen prefix": lambda f: f[0] == 0 and f[3],
}


def reuse_tables(traffic: Sequence[Asked],
                 horizons: Sequence[int] = (65, 300, 1000)) -> dict[str, list[dict[str, Any]]]:
    """Per feature, per value: ``count``, ``within`` (share asked again within each horizon, in requests)
    and ``ever`` (share asked again at all)."""
    occurrences: list[tuple[int, int, _Features]] = []  # (request, block, features)
    uses: dict[int, int] = defaultdict(int)
    last: dict[int, int] = {}
    for index, request in enumerate(traffic):
        blocks = request.blocks
        seen_prefix = request.parent is not None
        for place, block in enumerate(blocks):
            since = index - last[block] if block in last else None
            occurrences.append((index, block, (uses[block], since, len(blocks) - 1 - place, seen_prefix)))
            seen_prefix = seen_prefix or uses[block] > 0
        for block in blocks:
            uses[block] += 1
            last[block] = index
    following: dict[int, int] = {}
    gaps: list[int | None] = [None] * len(occurrences)
    for at in range(len(occurrences) - 1, -1, -1):
        index, block, _ = occurrences[at]
        later = following.get(block)
        gaps[at] = None if later is None else later - index
        following[block] = index
    tables: dict[str, list[dict[str, Any]]] = {}
    for name, feature in FEATURES.items():
        cells: dict[Any, list[int]] = defaultdict(lambda: [0] * (len(horizons) + 2))
        for (_, _, features), gap in zip(occurrences, gaps, strict=True):
            cell = cells[feature(features)]
            cell[0] += 1
            if gap is not None:
                cell[-1] += 1
                for i, horizon in enumerate(horizons):
                    cell[1 + i] += gap <= horizon
        tables[name] = [{"value": value, "count": cell[0],
                         "within": {h: cell[1 + i] / cell[0] for i, h in enumerate(horizons)},
                         "ever": cell[-1] / cell[0]} for value, cell in sorted(cells.items(), key=_order)]
    return tables


def _order(item: tuple[Any, list[int]]) -> tuple[bool, float, str]:
    """Numbers in order, then words ("never used")."""
    value = item[0]
    return (isinstance(value, str), 0.0 if isinstance(value, str) else float(value), str(value))


def format_reuse(tables: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for name, rows in tables.items():
        horizons = list(rows[0]["within"]) if rows else []
        lines.append(f"-- {name}: count, share asked again within {', '.join(map(str, horizons))} requests, ever")
        for row in rows:
            shares = "  ".join(f"{row['within'][h]:.3f}" for h in horizons)
            lines.append(f"  {row['value']!s:12s} {row['count']:8d}  {shares}  {row['ever']:.3f}")
    return "\n".join(lines)
