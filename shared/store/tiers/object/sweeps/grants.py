"""How much each writer may write between sweeps, and what a sweep leaves: grants, the low-water mark, the
sweep's result (the design: this package's docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_tiercache.shared.store.tiers.object.config import ObjectTierConfig

#: All grants together take at most this share of capacity: with many writers each grant is smaller (and
#: each writer sweeps sooner), so that the low-water mark never falls below half of capacity.
MAX_RESERVE = 0.5
#: A grant holds at least this many of the largest records listed (a record larger than its writer's grant
#: can never be admitted), within `MAX_RESERVE`.
GRANT_RECORDS = 2
#: How many ``timeout_s`` a writer with no room left in its grant waits for a sweep before it falls back to
#: its `FALLBACK_SHARES` allowance.
ADMIT_WAIT_TIMEOUTS = 4
#: When no sweep came within that wait (a sweeper that died holding the lock until `LOCK_STALE_S`, a store
#: that was away or is too slow to list), a writer may write this many ``sweep_share`` of capacity since the
#: last sweep it knows of instead of dropping everything: the looser bound this tier had before grants
#: (writers x 2 x ``sweep_share`` past capacity at most), for as long as sweeps do not come. Why: a writer
#: that drops every write until a sweep comes loses a whole corpus (a precompute job, a server after an
#: outage) to a janitor it cannot hurry; a bound that slips by a few percent meanwhile costs far less.
FALLBACK_SHARES = 2.0
#: A ledger rewritten within this many ``sweep_every_s`` (and at least `MIN_ACTIVE_S`) names an active
#: writer (`active_seconds`); its owner admits only while it rewrote it within half of that.
ACTIVE_SWEEPS = 4
MIN_ACTIVE_S = 60.0


def leading_fit(sizes: Sequence[int], room: int) -> tuple[int, int]:
    """How many of the leading ``sizes`` fit in ``room`` bytes together, and their bytes."""
    n, total = 0, 0
    while n < len(sizes) and total + sizes[n] <= room:
        total += sizes[n]
        n += 1
    return n, total


def active_seconds(config: ObjectTierConfig) -> float:
    """How recently a writer's ledger must have been rewritten for a sweep to give it a grant."""
    return max(MIN_ACTIVE_S, ACTIVE_SWEEPS * config.sweep_every_s)


def grant_size(capacity: int, share: float, writers: int, largest: int) -> int:
    """Each active writer's grant: ``share`` of capacity, at least `GRANT_RECORDS` of the largest record,
    all of them together at most `MAX_RESERVE` of capacity."""
    if writers <= 0:
        return 0
    want = max(int(share * capacity), GRANT_RECORDS * largest)
    return min(want, int(MAX_RESERVE * capacity) // writers)


@dataclass
class SweepResult:
    """What one sweep found and did (and what it left in ``sys/usage``)."""

    entries: int
    bytes_used: int
    evicted: int
    evicted_bytes: int
    #: usage the sweep evicted down to: capacity less the grants it reserved
    low_water: int = 0
    #: writer -> bytes it may write after ``listed_at``
    grants: dict[str, int] = field(default_factory=dict)
    #: when the records were listed (the sweeper's clock): writes before it are counted in ``bytes_used``
    listed_at: float = 0.0
    #: changes whenever an eviction deleted records (`existence`: cached lookups hold while it stays)
    generation: str = ""
    #: the half-life the sweep ranked by (policy ``prefix``: `order.half_life_s`), seconds; writers decay
    #: their ledgers' counts by it (`ledger`); None under ``lru``
    half_life_s: float | None = None
    #: the time one capacity of writes took, seconds (`order.sweep_turnover`): the next sweep's starting point
    turnover_s: float | None = None


def low_water_mark(capacity: int, share: int, active: set[str], previous_usage: dict[str, Any]) -> int:
    """Usage a sweep evicts down to: ``capacity`` less room for each active writer's grant. A writer may still
    write within its previous grant (``previous_usage``'s, which it may not have replaced yet): room for the
    larger of the two, within `MAX_RESERVE` of capacity (grants shrinking by more, e.g. many writers arriving
    at once, pass it for one sweep)."""
    try:
        previous = {str(w): int(g) for w, g in (previous_usage.get("grants") or {}).items()}
    except (TypeError, ValueError, AttributeError):
        previous = {}
    reserve = min(sum(max(previous.get(w, 0), share) for w in active),
                  max(share * len(active), int(MAX_RESERVE * capacity)))
    return max(0, capacity - reserve)


def positive(value: Any) -> float | None:
    """``value`` as a float when it is a positive number (a field of ``sys/usage``), else None."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else None
