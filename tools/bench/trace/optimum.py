"""The offline optimum of a KV block cache: Belady with bypass, under the prefix rule.

Why this is the bound: with unit-size blocks, evicting the block used furthest in the future is optimal
(Belady, 1966), and never storing a block that will not be used again (bypass) only helps. The prefix
rule (a lookup stops at the first miss) keeps it optimal: a child's next use is never before its
parent's, so the optimum never prefers a child to its parent (ties go to the deeper block), and when a
block is bypassed the rest of its request is too (they are used no sooner).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

_NEVER = 1 << 62


def next_uses(asked: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each request's asked blocks, the index of the next request asking for each (`_NEVER` if none)."""
    later: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in asked]
    for index in range(len(asked) - 1, -1, -1):
        out[index] = [later.get(block, _NEVER) for block in asked[index]]
        for block in asked[index]:
            later[block] = index
    return out


def belady_hits(asked: Sequence[Sequence[int]], capacity: int) -> int:
    """Blocks found by the optimal cache of ``capacity`` blocks replaying ``asked`` (per request, the
    blocks the store is asked for, in prompt order: a hit is the leading run it holds)."""
    if capacity <= 0:
        return 0
    nexts = next_uses(asked)
    held: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block): furthest first, deeper first
    hits = 0
    for index, blocks in enumerate(asked):
        found = 0
        while found < len(blocks) and blocks[found] in held:
            found += 1
        hits += found
        for depth, (block, use) in enumerate(zip(blocks, nexts[index], strict=True)):
            if depth < found:
                held[block] = use
                heapq.heappush(heap, (-use, -depth, block))
                continue
            if use == _NEVER or not _make_room(held, heap, capacity, use):
                break  # bypassed: so is the rest of the request (used no sooner)
            held[block] = use
            heapq.heappush(heap, (-use, -depth, block))
    return hits


def _make_room(held: dict[int, int], heap: list[tuple[int, int, int]], capacity: int, use: int) -> bool:
    """Evict blocks used later than ``use`` until one more fits; False when none is (bypass instead)."""
    while len(held) >= capacity:
        while heap and held.get(heap[0][2]) != -heap[0][0]:
            heapq.heappop(heap)  # stale: re-used since (a newer entry stands for it) or gone
        if not heap or -heap[0][0] <= use:
            return False
        del held[heapq.heappop(heap)[2]]
    return True
