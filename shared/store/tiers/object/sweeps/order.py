"""The object tier's eviction order for policy ``prefix``: the disk tier's LRFU key, computed afresh by each sweep.

Why: the memory and disk tiers evict by ``prefix`` (decayed access counts, newcomers discounted, parents at
least as high as their children: `vllm_tiercache.shared.store.tiers.disk.order` says why each part). The
object tier's sweeper sees the same facts in the usage ledgers (`ledger`): per record its last use, its
access count and its parent. It ranks every record it listed, so nothing is kept between sweeps and no key
needs to survive an older build or another process's clock: a pure function of one listing.

The key. A record with decayed access count C as of its last use v gets ``v + H x log2(C)`` (comparing keys
compares counts at any common later time), H the half-life in seconds. A record the ledgers know only by its
write counts `NEWCOMER` (0.1, the memory policy's): one-off prompts go before anything read again.

The half-life. ``half_life`` x the tier's **turnover**: the time the writers took to write the last
capacity's worth of records (`next_turnover`: the bytes listed beyond what the previous sweep left, over the
time between the two listings, smoothed over about one capacity of writes; ``sys/usage`` carries it from
sweep to sweep). That is the wall-time twin of the memory policy's "one capacity of traffic", and the time a
record takes to age out by recency. Why not the ages of what the tier holds (twice their median, or their
span): those are what the order itself kept, so they feed back. A stale majority (records read once, then a
workload that moved on) ages, the half-life grows with its age, and its keys stay above every newcomer's for
good: measured, a chain read once outlived any number of one-offs. The ages serve once, for a first sweep
with no previous one to measure against (`turnover`).

Parents. Each record's key is raised to the highest key among its listed descendants (a prefix lookup reads
the parent first, so it is worth at least its child), and equal keys go deepest first: in this order no
parent comes before any of its listed descendants, so a sweep never deletes a parent while keeping a child
(pins aside: `evictions.choose_victims` keeps a pinned child whose parent goes, as the disk tier does). A
record whose parent is not listed is a root here (its parent may be held by a faster tier in front).

Cost: O(n log n) per sweep in the records listed (two sorts, dict lookups, one pass up each chain).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

#: The weight of a record the ledgers know only by its write (the memory and disk policies' measured best).
NEWCOMER = 0.1
#: The shortest half-life, seconds: a tier with one record, or whose records share one use time.
MIN_HALF_LIFE_S = 1e-3


class Candidate(NamedTuple):
    """One listed record as the sweep knows it: its digest (hex), object name, bytes, last use (unix time),
    decayed access count as of that use (`NEWCOMER` for a write alone) and parent digest (None: a root)."""

    digest: str
    name: str
    size: int
    last: float
    count: float
    parent: str | None


def next_turnover(previous: float | None, written: int, elapsed: float, capacity: int) -> float | None:
    """The turnover after a sweep that found ``written`` bytes more than the previous one left, ``elapsed``
    seconds after it listed: the time one capacity of such writes takes, averaged with ``previous`` by the
    share of capacity written (an exponential average over about one capacity of writes; an idle night
    counts once, as the time that capacity took). None when nothing measures it (no previous sweep, nothing
    written, a clock that went back) and there is no previous one.

    Writes between two sweeps that listed at the same instant (``elapsed`` 0: a clock too coarse to tell
    them apart, or a replay on the trace's clock, where a request's puts share its time) count as written
    in no time: they shorten the average as written in a microsecond would. Ignoring them, as this did,
    dropped them from the measure while the next sweep counted from after them: on the Mooncake trace the
    simulated sweeps (`tiercache bench trace --object`), half of them inside a request at small capacities,
    ranked by twice the turnover a real bucket measured (``--object-bucket``)."""
    if written <= 0 or elapsed < 0 or capacity <= 0 or (elapsed == 0 and previous is None):
        return previous
    measured = capacity * elapsed / written
    if previous is None or not previous > 0:
        return measured
    return previous + min(1.0, written / capacity) * (measured - previous)


def turnover(lasts: Sequence[float], sizes: Sequence[int]) -> float:
    """Twice the byte-weighted median age of the records (age from the newest last use), in seconds: the
    turnover of a tier filled at a steady pace, for a sweep with nothing to measure it against."""
    if not lasts:
        return 0.0
    newest = max(lasts)
    order = sorted(range(len(lasts)), key=lasts.__getitem__, reverse=True)
    half = sum(sizes) / 2.0
    seen = 0
    for i in order:
        seen += sizes[i]
        if seen >= half:
            return 2.0 * (newest - lasts[i])
    return 0.0


def sweep_turnover(previous: Mapping[str, Any], total: int, listed_at: float, capacity: int,
                   candidates: Sequence[Candidate]) -> float:
    """This sweep's turnover, seconds: `next_turnover` from ``previous`` (``sys/usage`` as the previous sweep
    left it: its ``bytes`` after eviction, ``listed_at`` and ``turnover_s``) to ``total`` bytes listed at
    ``listed_at``; with nothing to measure by, the ages of the ``candidates`` (`turnover`)."""
    def number(key: str) -> float | None:
        value = previous.get(key)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    last, before, then = number("turnover_s"), number("bytes"), number("listed_at")
    if before is not None and then is not None:
        last = next_turnover(last, total - int(before), listed_at - then, capacity)
    return last if last is not None else turnover([c.last for c in candidates], [c.size for c in candidates])


def half_life_s(turnover_s: float, half_life: float) -> float:
    """The sweep's half-life in seconds: ``half_life`` turnovers (module docstring)."""
    return max(MIN_HALF_LIFE_S, half_life * turnover_s)


def _depths(parent: list[int]) -> list[int]:
    """Each record's depth among the listed (a root 0); a cycle of parent links (a damaged ledger) is cut
    where it is found (that record becomes a root). O(n): each record's chain is walked once."""
    n = len(parent)
    depth = [-1] * n
    walking = -2
    for start in range(n):
        path = []
        j = start
        while j >= 0 and depth[j] == -1:
            depth[j] = walking
            path.append(j)
            j = parent[j]
        if j >= 0 and depth[j] == walking:  # came back to this walk: cut the link into it
            parent[path[-1]] = -1
            j = -1
        base = depth[j] if j >= 0 else -1
        for k in reversed(path):
            base += 1
            depth[k] = base
    return depth


def prefix_order(candidates: Sequence[Candidate], half_life_seconds: float) -> list[tuple[float, str, int]]:
    """(key, name, bytes) of every candidate, in eviction order (first goes first): LRFU keys with the given
    half-life, each raised to its highest listed descendant's, deepest first among equal keys."""
    index = {c.digest: i for i, c in enumerate(candidates)}
    parent = [index.get(c.parent, -1) if c.parent is not None else -1 for c in candidates]
    parent = [-1 if p == i else p for i, p in enumerate(parent)]
    depth = _depths(parent)
    h = max(MIN_HALF_LIFE_S, half_life_seconds)
    key = [c.last + h * math.log2(c.count) if c.count > 0 else -math.inf for c in candidates]
    for i in sorted(range(len(candidates)), key=depth.__getitem__, reverse=True):  # children before parents
        p = parent[i]
        if p >= 0 and key[i] > key[p]:
            key[p] = key[i]
    ranked = sorted(range(len(candidates)), key=lambda i: (key[i], -depth[i], candidates[i].name))
    return [(key[i], candidates[i].name, candidates[i].size) for i in ranked]


def lru_order(candidates: Sequence[Candidate]) -> list[tuple[float, str, int]]:
    """(last use, name, bytes) in last-use order: policy ``lru``, the order sweeps had before ``prefix``."""
    return sorted((c.last, c.name, c.size) for c in candidates)
