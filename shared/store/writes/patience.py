"""Patient writes: a batch writer waits out a slow, hung, down or throttling tier instead of dropping records.

Why: the serving path must never wait for a store (a dropped cache write costs a later miss, a blocked
write costs every user's forward pass), so a serving store drops what a slower tier does not take at once.
A precompute job is the opposite: it writes a corpus for hours, has no latency budget, and one slow second
of S3 or Redis must not cost it documents. A store built with ``write_patience_s`` > 0
(`vllm_tiercache.shared.config.StoreConfig`; the jobs' ``--store-patience``) therefore puts again, after a
backoff, every record a tier left unwritten (`vllm_tiercache.shared.store.api.ReportsUnwritten`): a
throttling answer (S3 503 SlowDown, Redis OOM) and a tier that is down alike. It gives a record up only
after ``write_patience_s`` in which that tier wrote nothing at all, and says so in one line naming the
tier, the last error and how long it waited.

Counted per tier: ``write_retries`` (records put again), ``write_wait_seconds`` (time backing off),
``throttled`` (by the tier itself), and the records finally given up as ``dropped_writes``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_tiercache.shared.store.api import Item, ReportsUnwritten, Tier, Unwritten

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter (AWS's advice for S3 503s: callers spread out instead of
    retrying in step): the n-th pause is uniform in [0, min(cap_s, first_s * 2**n)], at least ``floor_s``."""

    first_s: float = 0.1
    cap_s: float = 5.0
    floor_s: float = 0.02

    def delays(self) -> Iterator[float]:
        n = 0
        while True:
            yield max(self.floor_s, random.uniform(0, min(self.cap_s, self.first_s * 2 ** n)))
            n += 1


#: The pauses of a patient put: from 0.1 s, doubling up to 5 s, with full jitter.
WRITE_BACKOFF = Backoff()


def put_patiently(tier: Tier, items: Sequence[Item], patience_s: float, *, backoff: Backoff = WRITE_BACKOFF,
                  stop: threading.Event | None = None,
                  sleep: Callable[[float], Any] | None = None) -> Unwritten | None:
    """Put ``items`` into ``tier``, putting again what it left unwritten, until all are written or the tier
    wrote nothing for ``patience_s`` (then those records are dropped, counted, and logged in one line).

    Returns what was given up (None: everything written). A tier that cannot say what it left unwritten
    (`ReportsUnwritten` not declared: memory, disk) gets one plain `put_many`, as without patience. ``stop``:
    set when the store closes; a pending wait ends at once and the rest is given up. ``sleep`` is for tests.
    """
    if patience_s <= 0 or not isinstance(tier, ReportsUnwritten):
        tier.put_many(items)
        return None
    pause = sleep or (stop.wait if stop is not None else time.sleep)
    left = list(items)
    delays = backoff.delays()
    last_progress = time.monotonic()
    while True:
        unwritten = tier.try_put_many(left)
        if unwritten is None:
            return None
        now = time.monotonic()
        if len(unwritten.positions) < len(left):  # some landed: the tier works, the patience starts again
            last_progress, delays = now, backoff.delays()
        left = [left[i] for i in unwritten.positions]
        waited = now - last_progress
        if waited >= patience_s or (stop is not None and stop.is_set()):
            tier.counters.add(dropped_writes=len(left))
            log.error("tiercache store: %s tier wrote nothing for %.1fs (last: %s); %d records given up "
                      "(write_patience_s=%g)", tier.name, waited, unwritten.reason, len(left), patience_s)
            return Unwritten(tuple(range(len(left))), f"{unwritten.reason}, after waiting {waited:.1f}s",
                             unwritten.throttled)
        delay = min(next(delays), max(0.0, patience_s - waited))
        started = time.monotonic()
        pause(delay)
        tier.counters.add(write_retries=len(left), write_wait_seconds=time.monotonic() - started)
