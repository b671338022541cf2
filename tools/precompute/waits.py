"""How a precompute job rides out a slow, hung, down or throttling store instead of failing its documents.

A job is a batch writer with no latency budget: its store is built patient (``write_patience_s`` =
``--store-patience``, `vllm_tiercache.shared.store.writes.patience`), so the producer engine's writes back off and
are put again until the tier takes them, and the job's own checks of what is stored ask again once a tier
that went down is back, instead of reading its silence as "not stored". A document fails only after the
store wrote nothing for the whole patience; the report then names the tier, its last error and the wait,
and a job that waited says how long and what it put again (`store_waits`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_tiercache.shared.config import MAX_WRITE_PATIENCE_S, read_sources
from vllm_tiercache.shared.stats_dump import read_stats
from vllm_tiercache.shared.store.api import ReportsHealth, StoreKey
from vllm_tiercache.shared.store.tiered import TieredStore
from vllm_tiercache.shared.store.writes.patience import WRITE_BACKOFF
from vllm_tiercache.tools.cli import float_in

#: ``--store-patience``: ten minutes in which a tier writes nothing, far beyond any request timeout (a
#: throttling burst, a failover, an endpoint restarted) and short enough that a store that is really gone
#: fails the job the same hour.
DEFAULT_STORE_PATIENCE_S = 600.0
#: The counters a job's report sums over the producer's tiers (`store_waits`).
WAIT_COUNTERS = ("write_retries", "write_wait_seconds", "throttled", "dropped_writes")


def add_patience_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store-patience", type=float_in(0, MAX_WRITE_PATIENCE_S, low_open=True),
                        default=DEFAULT_STORE_PATIENCE_S, metavar="SECONDS",
                        help="how long a write may wait out a store tier that is down, hangs or throttles (S3 "
                             "503 SlowDown, Redis OOM), backing off and putting again, before the documents it "
                             f"belongs to fail (default {DEFAULT_STORE_PATIENCE_S:g}: seconds in which the tier "
                             "wrote nothing)")


def patient_config(store_config: Mapping[str, Any] | None, patience_s: float) -> dict[str, Any]:
    """The job's store config with ``write_patience_s`` set (its sources read first: ``config_file``,
    $TIERCACHE_CONFIG), for the job's own store and its producer engine's alike."""
    raw = read_sources(dict(store_config) if store_config else None)
    raw["write_patience_s"] = float(patience_s)
    return raw


def _shared_tiers_down(store: TieredStore) -> list[str]:
    return [tier.name for tier in store.tiers
            if tier.shared_across_processes and isinstance(tier, ReportsHealth) and tier.down]


def lookup_patiently(store: TieredStore, keys: Sequence[StoreKey], patience_s: float) -> tuple[list[bool], str]:
    """Which ``keys`` the shared tiers hold, asked again (after a backoff) while a shared tier is down, up to
    ``patience_s``: a tier that is away answers "not stored" for what it holds. Returns the answer and, when
    a tier was still down at the end, a few words naming it for the report ("" when none)."""
    deadline = time.monotonic() + patience_s
    delays = WRITE_BACKOFF.delays()
    while True:
        present = store.contains_many(keys, shared_only=True, bounded=False)
        down = _shared_tiers_down(store)
        if not down or all(present):
            return present, ""
        if time.monotonic() >= deadline:
            return present, f"the {', '.join(down)} tier was still unreachable after {patience_s:g}s (--store-patience)"
        time.sleep(next(delays))


def store_waits(stats_dir: str, role: str) -> dict[str, dict[str, float]]:
    """Per tier of the producer's store, what waiting it out cost (`WAIT_COUNTERS`), summed over its worker
    processes' last stats files; tiers that never waited are left out."""
    totals: dict[str, dict[str, float]] = {}
    for payload in read_stats(stats_dir, role):
        for name, tier in ((payload.get("store") or {}).get("tiers") or {}).items():
            entry = totals.setdefault(name, dict.fromkeys(WAIT_COUNTERS, 0.0))
            for counter in WAIT_COUNTERS:
                entry[counter] += float(tier.get(counter) or 0)
    return {name: entry for name, entry in totals.items() if entry["write_retries"] or entry["throttled"]}


def describe_waits(waits: Mapping[str, Mapping[str, float]]) -> str:
    """One line for the report: ``object: waited 8.3 s, 40 records put again, 5 throttled answers, 0 given up``."""
    return "; ".join(f"{name}: waited {w['write_wait_seconds']:.1f} s, {int(w['write_retries'])} records put again, "
                     f"{int(w['throttled'])} throttled answers, {int(w['dropped_writes'])} given up"
                     for name, w in waits.items())
