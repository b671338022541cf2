"""W-TinyLFU (window LRU, frequency-sketch admission, segmented main LRU), size-aware; see the package docstring."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from vllm_tiercache.shared.eviction.base import EvictionPolicy
from vllm_tiercache.shared.eviction.sketch import FrequencySketch


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

    def insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
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
