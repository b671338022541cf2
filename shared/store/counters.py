"""Per-tier counters: one small lock-protected object per tier, read by `TieredStore.stats()`.

Why a separate module: tiers count their own events (corrupt files, evictions, Redis being down) while
the tiered store counts hits, misses and timings; both write into the same object so `stats()` is a
single snapshot per tier with the same keys everywhere.
"""

from __future__ import annotations

import threading
from typing import Any

#: Every tier reports these keys (tiers that cannot have an event report 0).
COUNTER_NAMES = (
    "hits", "misses", "puts", "bytes_read", "bytes_written", "evictions", "corrupt", "other_format",
    "dropped_writes",
    "refused", "errors", "read_seconds", "write_seconds",
)


class TierCounters:
    """Thread-safe monotonically increasing counters (ints, seconds as floats)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(COUNTER_NAMES, 0)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] = self._values.get(name, 0) + delta

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self._values.items()}
