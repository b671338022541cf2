"""TinyLFU's frequency sketch: approximate, aging access counts for keys in and out of a cache."""

from __future__ import annotations

import zlib
from collections.abc import Hashable

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
        self.add(key)

    def add(self, key: Hashable) -> int:
        """`increment`, then the key's frequency: one hashing for both (the slower tiers' admission asks both
        for every record it counts)."""
        added = False
        count = self.max_count
        for row, i in zip(self._rows, self._indexes(key), strict=True):
            if row[i] < self.max_count:
                row[i] += 1
                added = True
            count = min(count, row[i])
        if added:
            self._additions += 1
            if self._additions >= self.sample_size:
                self._halve()
                return self.frequency(key)
        return count

    def _halve(self) -> None:
        # rebuilt rows, not a loop of item assignments: about twice as fast, and the halving runs on the
        # thread that counted (a KV saver, a loader)
        self._rows = [[v >> 1 for v in row] for row in self._rows]
        self._additions //= 2
