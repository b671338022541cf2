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

import heapq
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

#: Every policy name the encoder cache managers accept (the memory tier: lru and wtinylfu).
POLICIES = ("lru", "lfu", "wtinylfu")
#: The best measured policy on the encoder-cache benchmark (`tiercache bench policy`).
DEFAULT_POLICY = "lfu"

_MASK64 = (1 << 64) - 1
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


def _stable_hash(key: Hashable) -> int:
    """A 64-bit hash that is the same in every process (Python's str/bytes hash is salted per process):
    benchmark figures and eviction decisions then reproduce run to run."""
    if isinstance(key, str):
        key = key.encode()
    if isinstance(key, (bytes, bytearray)):
        h = zlib.crc32(key) | (zlib.adler32(key) << 32)
    else:
        h = hash(key)
    h = ((h & _MASK64) * 0x9E3779B97F4A7C15) & _MASK64
    return h ^ (h >> 29)


class FrequencySketch:
    """A count-min sketch of 4 rows of 4-bit counters with periodic halving (TinyLFU's "reset").

    Why a sketch and not a dict: frequencies must be remembered for items *not* in the cache (that is what
    lets a returning popular item win admission), and a sketch bounds that memory whatever the key space.
    Halving every `sample_size` increments ages the counts, so yesterday's favourites fade.
    """

    def __init__(self, expected_entries: int = 16, width_factor: int = 2, sample_factor: int = 10,
                 max_count: int = 15) -> None:
        self.max_count = max_count
        self.width_factor = width_factor
        self.sample_factor = sample_factor
        self.expected_entries = 0
        self.ensure_capacity(expected_entries)

    def ensure_capacity(self, expected_entries: int) -> None:
        """Size the table for `expected_entries` (grows only; growing forgets the counts, as Caffeine does)."""
        if expected_entries <= self.expected_entries:
            return
        self.expected_entries = max(64, expected_entries)
        width = 1
        while width < self.width_factor * self.expected_entries:
            width <<= 1
        self._mask = width - 1
        self._rows = [[0] * width for _ in _SEEDS]
        self.sample_size = self.sample_factor * self.expected_entries
        self._additions = 0

    def _indexes(self, key: Hashable) -> list[int]:
        h = _stable_hash(key)
        return [(((h ^ seed) * 0xFF51AFD7ED558CCD) & _MASK64) >> 40 & self._mask for seed in _SEEDS]

    def frequency(self, key: Hashable) -> int:
        return min(row[i] for row, i in zip(self._rows, self._indexes(key), strict=True))

    def increment(self, key: Hashable) -> None:
        added = False
        for row, i in zip(self._rows, self._indexes(key), strict=True):
            if row[i] < self.max_count:
                row[i] += 1
                added = True
        if added:
            self._additions += 1
            if self._additions >= self.sample_size:
                self._halve()

    def _halve(self) -> None:
        for row in self._rows:
            for i, v in enumerate(row):
                if v:
                    row[i] = v >> 1
        self._additions //= 2


class EvictionPolicy:
    """What every policy offers. Keys are hashable (an mm_hash, a 16-byte digest); sizes are the owner's units.

    The owner calls `insert` when an entry becomes resident, `access` on every hit, `remove` when it drops
    an entry itself, and `evict` to make room; entries `evict` returns are already forgotten by the policy.
    """

    name = "base"

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        #: candidates refused by admission (the owner may count them as refused puts)
        self.rejections = 0

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def insert(self, key: Hashable, size: int) -> None:
        raise NotImplementedError

    def access(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def evict(self, need: int, can_evict: Callable[[Any], bool] | None = None, incoming: int = 0) -> list[Any]:
        """Forget and return entries whose sizes add up to at least `need` (fewer only if too few are evictable).

        `incoming` is the size of an entry the owner is about to `insert` (the encoder cache makes room
        before allocating); a policy with a window keeps room for it there.
        """
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently accessed first; every insert and every hit refresh an entry."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Any, int] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, key: Hashable, size: int) -> None:
        self._order[key] = int(size)
        self._order.move_to_end(key)

    def access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def evict(self, need: int, can_evict: Callable[[Any], bool] | None = None, incoming: int = 0) -> list[Any]:
        victims: list[Any] = []
        freed = 0
        # Pinned entries are few (the running batch), so skipping them keeps the scan short.
        for key, size in self._order.items():
            if freed >= need:
                break
            if can_evict is None or can_evict(key):
                victims.append(key)
                freed += size
        for key in victims:
            del self._order[key]
        return victims


class WTinyLFUPolicy(EvictionPolicy):
    """W-TinyLFU: LRU window, TinyLFU admission, segmented-LRU main area; size-aware (see module docstring).

    Args:
        capacity: total capacity in the owner's units (embeddings, bytes).
        window_fraction: share of the capacity for the admission window (Caffeine's default 1%).
        protected_fraction: share of the main area for entries hit at least twice (Caffeine: 80%).
        size_aware: compare frequencies per unit of size (False: raw frequencies, as Caffeine).
        victim_sample: how many of the oldest probation entries the victim is chosen from (Caffeine: 1).
    """

    name = "wtinylfu"

    def __init__(self, capacity: int, window_fraction: float = 0.01, protected_fraction: float = 0.8,
                 size_aware: bool = True, victim_sample: int = 16) -> None:
        super().__init__(capacity)
        self.size_aware = bool(size_aware)
        if not 0.0 < window_fraction < 1.0 or not 0.0 < protected_fraction < 1.0:
            raise ValueError("window_fraction and protected_fraction must lie strictly between 0 and 1")
        self.victim_sample = max(1, int(victim_sample))
        self.window_max = max(1, int(self.capacity * window_fraction))
        self.protected_max = int((self.capacity - self.window_max) * protected_fraction)
        self._window: OrderedDict[Any, int] = OrderedDict()
        self._probation: OrderedDict[Any, int] = OrderedDict()
        self._protected: OrderedDict[Any, int] = OrderedDict()
        self._window_size = 0
        self._protected_size = 0
        self.sketch = FrequencySketch()

    def __contains__(self, key: object) -> bool:
        return key in self._window or key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def segment_of(self, key: Hashable) -> str | None:
        """'window', 'probation', 'protected' or None (for tests and debugging)."""
        for name, seg in (("window", self._window), ("probation", self._probation),
                          ("protected", self._protected)):
            if key in seg:
                return name
        return None

    def insert(self, key: Hashable, size: int) -> None:
        if key in self:
            self.remove(key)
        self.sketch.increment(key)
        self._window[key] = int(size)
        self._window_size += int(size)
        if len(self) > self.sketch.expected_entries:
            self.sketch.ensure_capacity(2 * len(self))

    def access(self, key: Hashable) -> None:
        self.sketch.increment(key)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._probation:
            size = self._probation.pop(key)
            self._protected[key] = size
            self._protected_size += size
            while self._protected_size > self.protected_max and len(self._protected) > 1:
                old, old_size = self._protected.popitem(last=False)
                self._protected_size -= old_size
                self._probation[old] = old_size
        elif key in self._protected:
            self._protected.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        if key in self._window:
            self._window_size -= self._window.pop(key)
        elif key in self._probation:
            del self._probation[key]
        elif key in self._protected:
            self._protected_size -= self._protected.pop(key)

    def _size(self, key: Any) -> int:
        for seg in (self._window, self._probation, self._protected):
            if key in seg:
                return seg[key]
        raise KeyError(key)

    def _first(self, seg: OrderedDict[Any, int], ok: Callable[[Any], bool], skip: set[Any]) -> Any | None:
        for key in seg:
            if key not in skip and ok(key):
                return key
        return None

    def evict(self, need: int, can_evict: Callable[[Any], bool] | None = None, incoming: int = 0) -> list[Any]:
        ok = can_evict or (lambda _k: True)
        # 1. The window overflows into probation: those entries are the admission candidates (oldest first).
        candidates: list[Any] = []
        while self._window and self._window_size + incoming > self.window_max:
            key, size = self._window.popitem(last=False)
            self._window_size -= size
            self._probation[key] = size
            candidates.append(key)
        pending = set(candidates)
        victims: list[Any] = []
        freed = 0
        ci = 0
        # 2. Make room in main: each step the oldest candidate meets the oldest non-candidate of probation
        # (then protected, then window); the less frequent of the two goes.
        while freed < need:
            victim = self._victim(ok, pending)
            cand = None
            while ci < len(candidates):
                key = candidates[ci]
                if key in pending and ok(key):
                    cand = key
                    break
                if key in pending:
                    # Pinned: it cannot go now. Judge it anyway; a loser waits at the head of probation,
                    # first in line once unpinned, a winner stays at the tail (admitted).
                    pending.discard(key)
                    if victim is not None and not self._admit(key, victim):
                        self.rejections += 1
                        self._probation.move_to_end(key, last=False)
                ci += 1
            if cand is None and victim is None:
                break
            if cand is not None and (victim is None or not self._admit(cand, victim)):
                if victim is not None:
                    self.rejections += 1
                out = cand
                pending.discard(cand)
                ci += 1
            else:
                out = victim
            freed += self._size(out)
            self.remove(out)
            victims.append(out)
        return victims

    def _victim(self, ok: Callable[[Any], bool], skip: set[Any]) -> Any | None:
        """Evictable non-candidate: probation, then protected, then window (as Caffeine).

        Within probation, the least frequent (per size) of its `victim_sample` oldest entries (with 1 this
        is Caffeine's choice).
        """
        best, best_freq, seen = None, 0, 0
        for key in self._probation:
            if key in skip or not ok(key):
                continue
            freq = self._density(key)
            if best is None or freq < best_freq:
                best, best_freq = key, freq
            seen += 1
            if seen >= self.victim_sample:
                break
        if best is not None:
            return best
        for seg in (self._protected, self._window):
            key = self._first(seg, ok, skip)
            if key is not None:
                return key
        return None

    def _density(self, key: Any) -> float:
        freq = self.sketch.frequency(key)
        return freq / max(1, self._size(key)) if self.size_aware else freq

    def _admit(self, candidate: Any, victim: Any) -> bool:
        """TinyLFU: a candidate displaces a victim only if it was asked for more often, recently (per unit
        of size when size-aware: one big entry must earn the space of the several small ones it displaces)."""
        return self._density(candidate) > self._density(victim)


class LFUPolicy(EvictionPolicy):
    """Least frequently used, ties broken by recency; counts are aged and outlive eviction; size-aware.

    Why the history: a popular entry that was evicted comes back with its count, so it is not judged as a
    newcomer. Why aging: every `aging_period` accesses all counts are halved, so yesterday's favourites
    fade. Exact counts (not a sketch), so the victim search is a scan over the resident entries: fine for
    the encoder cache (tens to hundreds of entries), too slow for a memory tier of many thousand records,
    which therefore offers only lru and wtinylfu.

    Args:
        aging_period: accesses between two halvings of every count (0 disables aging).
        history_size: how many evicted keys keep their count (a bounded "ghost" table).
        size_aware: rank by count per unit of size (an entry of 576 embeddings must be asked for 36 times
            as often as one of 16 to stay); with equal sizes this is plain LFU.
    """

    name = "lfu"

    def __init__(self, capacity: int, aging_period: int = 4096, history_size: int = 65536,
                 size_aware: bool = True) -> None:
        super().__init__(capacity)
        self.size_aware = bool(size_aware)
        self.aging_period = int(aging_period)
        self.history_size = int(history_size)
        self._size: dict[Any, int] = {}
        self._freq: dict[Any, float] = {}
        self._last: dict[Any, int] = {}
        self._ghost: OrderedDict[Any, float] = OrderedDict()
        self._clock = 0

    def __contains__(self, key: object) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    def frequency(self, key: Hashable) -> float:
        return self._freq.get(key, self._ghost.get(key, 0.0))

    def _count(self, key: Hashable) -> None:
        self._clock += 1
        base = self._freq.get(key)
        if base is None:
            base = self._ghost.pop(key, 0.0)
        self._freq[key] = base + 1.0
        self._last[key] = self._clock
        if self.aging_period and self._clock % self.aging_period == 0:
            for table in (self._freq, self._ghost):
                for k in table:
                    table[k] /= 2.0

    def insert(self, key: Hashable, size: int) -> None:
        self._size[key] = int(size)
        self._count(key)

    def access(self, key: Hashable) -> None:
        if key in self._size:
            self._count(key)

    def remove(self, key: Hashable) -> None:
        if self._size.pop(key, None) is None:
            return
        count = self._freq.pop(key, 0.0)
        self._last.pop(key, None)
        if self.history_size > 0:
            self._ghost[key] = count
            self._ghost.move_to_end(key)
            while len(self._ghost) > self.history_size:
                self._ghost.popitem(last=False)

    def evict(self, need: int, can_evict: Callable[[Any], bool] | None = None, incoming: int = 0) -> list[Any]:
        ok = can_evict or (lambda _k: True)
        if self.size_aware:  # least hits per unit of space first: what maximizes the hit rate
            heap = [(self._freq[k] / max(1, self._size[k]), self._last[k], i, k)
                    for i, k in enumerate(self._size) if ok(k)]
        else:
            heap = [(self._freq[k], self._last[k], i, k) for i, k in enumerate(self._size) if ok(k)]
        heapq.heapify(heap)  # O(n), then O(log n) per victim: an eviction usually needs one or two
        victims: list[Any] = []
        freed = 0
        while heap and freed < need:
            key = heapq.heappop(heap)[3]
            victims.append(key)
            freed += self._size[key]
        for key in victims:
            self.remove(key)
        return victims


def make_policy(name: str, capacity: int, field: str = "policy", **options: Any) -> EvictionPolicy:
    """Build policy `name`; an unknown name is a `ValueError` naming `field`, the value and the choices."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "wtinylfu":
        return WTinyLFUPolicy(capacity, **options)
    if name == "lfu":
        return LFUPolicy(capacity, **options)
    raise ValueError(f"{field}: invalid value {name!r}; allowed: {', '.join(POLICIES)}")
