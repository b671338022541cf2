"""Per-tier counters: one small lock-protected object per tier, read by `TieredStore.stats()`.

Why a separate module: tiers count their own events (corrupt files, evictions, Redis being down) while
the tiered store counts hits, misses and timings; both write into the same object so `stats()` is a
single snapshot per tier with the same keys everywhere.
"""

from __future__ import annotations

from vllm_tiercache.shared.counters import Counters

#: Every tier reports these keys (tiers that cannot have an event report 0).
COUNTER_NAMES = (
    "hits", "misses", "puts", "bytes_read", "bytes_written", "evictions", "corrupt", "other_format",
    "dropped_writes",
    "refused", "errors", "read_seconds", "write_seconds",
)


class TierCounters(Counters):
    """One tier's counters: every name of `COUNTER_NAMES` (tiers that cannot have an event report 0)."""

    def __init__(self) -> None:
        super().__init__(COUNTER_NAMES)
