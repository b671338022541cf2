"""Per-tier counters, and how they reach vLLM's `/metrics` (`StoreSeries`).

Why a separate module: tiers count their own events (corrupt files, evictions, Redis being down) while
the tiered store counts hits, misses and timings; both write into the same object so `stats()` is a
single snapshot per tier with the same keys everywhere.

On `/metrics` both connectors export the store's numbers through `StoreSeries`: one set of
`vllm:tiercache_store_*` series per engine, labelled by tier, fed by whichever connector's stats carry
them (each process's store hands every increment out once, `TieredStore.take_counter_deltas`, so a store
the two connectors share is never counted twice). The series are created for every configured tier when
vLLM builds the connector's metrics, so a scrape shows zeros, not nothing, before the first request.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from vllm_tiercache.shared.counters import Counters
from vllm_tiercache.shared.metric_families import counter_families, gauge_family

log = logging.getLogger(__name__)

#: Every tier reports these keys (tiers that cannot have an event report 0).
COUNTER_NAMES = (
    "hits", "misses", "puts", "bytes_read", "bytes_written", "evictions", "corrupt", "other_format",
    "partial", "dropped_writes",
    "refused", "errors", "read_seconds", "write_seconds", "lookups_past_budget", "lookups_skipped",
    "writes_admitted", "writes_refused", "sealed_rejected", "throttled", "write_retries", "write_wait_seconds",
)

#: Counter -> help text of `vllm:tiercache_store_<name>_total{tier}` (`COUNTER_NAMES` plus the memory tier's
#: W-TinyLFU admission refusals).
STORE_COUNTER_HELP: dict[str, str] = {
    "hits": "Records this tier served (a read answered by a slower tier counts there, not in the faster ones).",
    "misses": "Records asked of this tier that it did not hold (the next tier was asked).",
    "puts": "Records written into this tier (saves, promotions, background writes).",
    "bytes_read": "Bytes of records this tier served.",
    "bytes_written": "Bytes of records written into this tier.",
    "evictions": "Records this tier evicted to stay within its capacity.",
    "corrupt": "Records found damaged (checksum, size, key digest) and deleted; read as misses.",
    "other_format": "Records of another record format version (another build's), read as misses.",
    "partial": "Records found with a piece gone (Redis evicted or expired one of a record's keys, not the whole "
               "record: the rest deleted), or missing from their chunk's pack on the object tier: read as "
               "misses; not damage.",
    "dropped_writes": "Records not written to this tier: background queue full, or the tier failed or was down.",
    "refused": "Records this tier refused (larger than its capacity, or refused on arrival by admission).",
    "admission_refused": "W-TinyLFU admission refusals (memory tier with policy wtinylfu).",
    "errors": "Backend errors of this tier (I/O errors, Redis unreachable or failing); served as misses.",
    "read_seconds": "Seconds spent reading from this tier.",
    "write_seconds": "Seconds spent writing into this tier.",
    "lookups_past_budget": "Scheduler lookups this network tier did not answer within lookup_budget_ms (misses).",
    "lookups_skipped": "Scheduler lookups that skipped this network tier: its previous call was still outstanding.",
    "writes_admitted": "Records the store's admission handed to this slower tier (puts, and write-downs of records "
                       "kept in memory until they were used again, or, with admission evicted, until memory "
                       "evicted them).",
    "sealed_rejected": "Sealed records that did not open (unknown or retired key id, bad tag, truncated or edited, "
                       "another tenant's, or plaintext in a sealing store); read as misses, the damaged ones deleted.",
    "throttled": "Answers that asked the writer to slow down (S3 503 SlowDown or 429, Redis OOM or LOADING): a "
                 "miss for a read; a patient writer backs off and puts again, others drop the write.",
    "write_retries": "Records a patient writer (write_patience_s: precompute jobs) put again after a failed, hung or "
                     "throttled try.",
    "write_wait_seconds": "Seconds a patient writer (write_patience_s) waited out this tier: backoffs between tries.",
    "writes_refused": "Records a put kept out of this slower tier by its admission (policy seen): in memory only "
                      "until used again.",
}


class TierCounters(Counters):
    """One tier's counters: every name of `COUNTER_NAMES` (tiers that cannot have an event report 0)."""

    def __init__(self) -> None:
        super().__init__(COUNTER_NAMES)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def counter_deltas(now: Mapping[str, Mapping[str, Any]], before: Mapping[str, Mapping[str, Any]],
                   names: Iterable[str] = COUNTER_NAMES) -> dict[str, dict[str, float]]:
    """Per tier, how much each monotonic counter of ``names`` grew since ``before`` (zeros included).

    Only the counters: a tier's `stats()` entry also carries usage gauges (`entries`, `bytes_used`) that are
    `None` while a Redis server is down and may shrink, so a difference of them once crashed the worker
    (`int - None` when Redis came back) and would feed negative increments to Prometheus counters.
    """
    names = tuple(names)
    deltas: dict[str, dict[str, float]] = {}
    for tier, numbers in now.items():
        previous = before.get(tier, {})
        out: dict[str, float] = {}
        for name in names:
            value = numbers.get(name)
            if not _number(value):
                continue
            last = previous.get(name)
            out[name] = value - (last if _number(last) else 0)
        deltas[tier] = out
    return deltas


class CounterBaseline:
    """What a store's `take_counter_deltas` handed out so far: per tier, and the write-behind hits.

    One baseline per store: a store two connectors share hands each increment to one of them. Every engine
    step asks, and most steps count nothing: the tiers' counter versions, read before the snapshot (an add in
    between is in it, and moves the version again), say so without a snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reported: dict[str, dict[str, Any]] = {}
        self._write_behind = 0
        #: every tier's `Counters.version` when `_reported` was taken (None: not known, take a snapshot)
        self._versions: tuple[int, ...] | None = None

    def take(self, tiers: Sequence[Any], write_behind_hits: int) -> dict[str, Any]:
        """What moved since the last call: {"tiers": {tier: {name: increment}}, "write_queue_hits": n}."""
        with self._lock:  # the snapshot too: two callers must not swap baselines
            versions = tuple(tier.counters.version for tier in tiers)
            if versions == self._versions and write_behind_hits == self._write_behind:
                return {}
            now = {tier.name: tier.counters.snapshot() for tier in tiers}
            names = {name for numbers in now.values() for name in numbers}
            deltas = counter_deltas(now, self._reported, sorted(names))
            self._reported, self._versions = now, versions
            hits, self._write_behind = write_behind_hits - self._write_behind, write_behind_hits
        out: dict[str, Any] = {}
        moved = {tier: {k: v for k, v in numbers.items() if v > 0} for tier, numbers in deltas.items()}
        moved = {tier: numbers for tier, numbers in moved.items() if numbers}
        if moved:
            out["tiers"] = moved
        if hits > 0:
            out["write_queue_hits"] = hits
        return out


def add_nested(into: dict[str, dict[str, float]], more: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Sum ``more`` ({tier: {counter: increment}}) into ``into``; returns ``into``."""
    for tier, numbers in more.items():
        mine = into.setdefault(tier, {})
        for name, value in numbers.items():
            if _number(value):
                mine[name] = mine.get(name, 0) + value
    return into


# ------------------------------------------------------------------------------------------ /metrics

#: A tier as `StoreSeries` pre-registers it: (name, capacity in bytes or None, shared across processes).
TierSpec = tuple[str, int | None, bool]


class StoreSeries:
    """The `vllm:tiercache_store_*` families of one Prometheus registry, shared by both connectors' metrics.

    Counters: `observe_counters({tier: {name: increment}})`. Gauges: `observe_gauges({source: report})`,
    where a source is one process's store (`TieredStore.gauge_report`): the latest report of each source is
    kept, and a tier's gauge is the sum over sources for a per-process tier (memory: one per worker) and
    the largest for a shared one (disk, GDS, Redis: every worker sees the same); `tier_up` is the lowest
    (0 as soon as one process finds the tier down). Capacity comes from the configuration (per-process
    tiers times the engine's worker count); tiers with no capacity (Redis) have no capacity series.
    """

    def __init__(self, counter_cls: Any, gauge_cls: Any, labelnames: list[str],
                 per_engine_labelvalues: Mapping[int, list[object]], first: Any = None) -> None:
        tier_labels = [*labelnames, "tier"]
        self._engines = dict(per_engine_labelvalues)
        self._lock = threading.Lock()
        self.counters = counter_families(
            counter_cls, "vllm:tiercache_store_",
            {name: f"Tiered store: {doc}" for name, doc in STORE_COUNTER_HELP.items()
             if first is None or name != "hits"},
            tier_labels)
        if first is not None:  # the hits family `store_series` registered: first, as in STORE_COUNTER_HELP
            self.counters = {"hits": first, **self.counters}
        self.write_queue_hits = counter_cls(
            name="vllm:tiercache_store_write_queue_hits_total",
            documentation="Tiered store: reads served from records still queued for the slower tiers.",
            labelnames=labelnames)
        self.bytes_used = gauge_family(
            gauge_cls, "vllm:tiercache_store_bytes_used", "Tiered store: bytes a tier holds (memory: "
            "summed over the engine's workers; Redis: the server's used_memory).", tier_labels)
        self.capacity = gauge_family(
            gauge_cls, "vllm:tiercache_store_capacity_bytes", "Tiered store: configured capacity of a "
            "tier (memory: summed over the engine's workers).", tier_labels)
        self.tier_up = gauge_family(
            gauge_cls, "vllm:tiercache_store_tier_up", "Tiered store: 1 while the tier is reachable, 0 "
            "while a process of the engine finds it down (Redis); on a Redis Cluster with "
            "shards down, the share of its shards that answer.", tier_labels)
        self.write_queue = gauge_family(
            gauge_cls, "vllm:tiercache_store_write_queue_pending", "Tiered store: background writes "
            "(batches of records) queued for the slower tiers, summed over processes.", labelnames)
        #: engine -> tier -> (shared, capacity) of the tiers pre-registered for it
        self._tiers: dict[int, dict[str, tuple[bool, int]]] = {idx: {} for idx in self._engines}
        self._configs: set[str] = set()
        #: engine -> source -> its latest gauge report
        self._reports: dict[int, dict[str, dict[str, Any]]] = {idx: {} for idx in self._engines}
        for labels in self._engines.values():
            self.write_queue_hits.labels(*labels)
            self.write_queue.labels(*labels).set(0)

    def add_configured_tiers(self, read_spec: Callable[[], tuple[list[TierSpec], str, int]], connector: str) -> None:
        """`add_tiers` for a connector's configured store (``read_spec`` returns `series_spec`'s answer).

        Metrics must never stop a server: a config that cannot be read here is one warning, and that
        store's series then appear when they first move.
        """
        try:
            tiers, config_key, workers = read_spec()
        except Exception as exc:
            log.warning("%s: cannot read the store config for /metrics: %s", connector, exc)
            return
        if tiers:
            self.add_tiers(tiers, config_key=config_key, workers=workers)

    def add_tiers(self, tiers: Iterable[TierSpec], *, config_key: str, workers: int) -> None:
        """Create every series of ``tiers`` for every engine (zeros; capacity from the config).

        ``config_key`` names the store config: two connectors of one engine with the same config share one
        store per process, whose capacity is counted once.
        """
        with self._lock:
            first = config_key not in self._configs
            self._configs.add(config_key)
            for idx, labels in self._engines.items():
                known = self._tiers[idx]
                for name, capacity, shared in tiers:
                    for counter in self.counters.values():
                        counter.labels(*labels, name)
                    if name not in known:
                        known[name] = (shared, 0)
                        self.bytes_used.labels(*labels, name).set(0)
                        self.tier_up.labels(*labels, name).set(1)
                    if first and capacity is not None:
                        was_shared, total = known[name]
                        more = capacity if was_shared else capacity * max(1, workers)
                        total = max(total, more) if was_shared else total + more
                        known[name] = (was_shared, total)
                        self.capacity.labels(*labels, name).set(total)

    def observe_counters(self, tiers: Mapping[str, Mapping[str, Any]], engine_idx: int,
                         write_queue_hits: float = 0) -> None:
        labels = self._engines.get(engine_idx)
        if labels is None:
            return
        for tier, numbers in tiers.items():
            for name, value in numbers.items():
                counter = self.counters.get(name)
                if counter is not None and _number(value) and value > 0:
                    counter.labels(*labels, tier).inc(value)
        if _number(write_queue_hits) and write_queue_hits > 0:
            self.write_queue_hits.labels(*labels).inc(write_queue_hits)

    def observe_gauges(self, reports: Mapping[str, Mapping[str, Any]], engine_idx: int) -> None:
        """Keep each source's latest report, then set every store gauge of the engine from all of them."""
        labels = self._engines.get(engine_idx)
        if labels is None or not reports:
            return
        with self._lock:
            mine = self._reports[engine_idx]
            for source, report in reports.items():
                if isinstance(report, Mapping):
                    mine[source] = dict(report)
            used: dict[str, float] = {}
            up: dict[str, float] = {}
            shared_of: dict[str, bool] = {}
            pending = 0.0
            for report in mine.values():
                if _number(report.get("write_queue")):
                    pending += report["write_queue"]
                for tier, numbers in (report.get("tiers") or {}).items():
                    shared = bool(numbers.get("shared"))
                    shared_of[tier] = shared
                    value = numbers.get("bytes_used")
                    if _number(value):
                        used[tier] = max(used.get(tier, 0), value) if shared else used.get(tier, 0) + value
                    if _number(numbers.get("up")):
                        up[tier] = min(up.get(tier, 1), numbers["up"])
        for tier, value in used.items():
            self.bytes_used.labels(*labels, tier).set(value)
        for tier, value in up.items():
            self.tier_up.labels(*labels, tier).set(value)
        self.write_queue.labels(*labels).set(pending)


def gauges_as_registered(report: Mapping[str, Any]) -> bool:
    """True when a store's gauge report (`TieredStore.gauge_report`) says nothing the series do not show
    from registration on (nothing held, every tier up, no queued write): no need to send it."""
    if report.get("write_queue"):
        return False
    return all(not numbers.get("bytes_used") and numbers.get("up", 1) == 1
               for numbers in (report.get("tiers") or {}).values())


#: Seconds between two looks at a store's gauges by one sender (`GaugeChanges`).
GAUGE_CHECK_INTERVAL_S = 0.25


class GaugeChanges:
    """A store's gauge report (`TieredStore.gauge_report`), handed on by one sender only when it changed.

    Why per sender: both connectors of a process may report the same store, each through its own stats
    path, and each must send a change once. A first report that shows only what the series show from
    registration on is not sent. In-process reads only: the store's usage comes from its background
    refresh. A store without gauge reports (a test stand-in) gives nothing.

    Looked at no more than every `GAUGE_CHECK_INTERVAL_S`: vLLM asks on every engine step, decode steps
    included, and building and comparing the report cost ~20 us of a step in an engine (its caches cold
    after the forward), for gauges that Prometheus scrapes every few seconds and whose usage part is
    refreshed every `vllm_tiercache.shared.store.usage.USAGE_REFRESH_S` anyway.
    """

    def __init__(self, store: Any, interval_s: float = GAUGE_CHECK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._sent: dict[str, Any] | None = None
        self._interval_s = interval_s
        #: Seconds, for the interval (a test drives its own).
        self._clock = clock
        self._checked = -math.inf
        # the store's usage refresh starts now, not on the first `take` (a step's, on the forward's thread)
        if (refresh := getattr(store, "usage_refresh", None)) is not None:
            refresh.start()

    def take(self, force: bool = False) -> dict[str, Any]:
        """``{store source: report}`` when the report changed since the last look, else ``{}``; ``force``:
        look now, whenever the last look was (a step that counted something: the last step before the
        engine goes idle must not leave a change behind)."""
        now = self._clock()
        if not force and now - self._checked < self._interval_s:
            return {}
        self._checked = now
        report = getattr(self._store, "gauge_report", None)
        if report is None:
            return {}
        current = report()
        if current == self._sent or (self._sent is None and gauges_as_registered(current)):
            return {}
        self._sent = current
        return {getattr(self._store, "source", str(os.getpid())): current}


_SHARED_LOCK = threading.Lock()
#: (registry, label names) -> the `StoreSeries` registered there
_SHARED: dict[tuple[int, tuple[str, ...]], StoreSeries] = {}


def _registry_of(metric_cls: Any) -> Any:
    """The registry a metric class registers into: a ``partial(Counter, registry=...)`` names it, the plain
    classes (what vLLM passes) use prometheus_client's default one."""
    from prometheus_client import REGISTRY

    keywords = getattr(metric_cls, "keywords", None)
    return keywords.get("registry", REGISTRY) if isinstance(keywords, dict) else REGISTRY


def store_series(metric_types: Mapping[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: Mapping[int, list[object]]) -> StoreSeries:
    """The `StoreSeries` of the registry behind ``metric_types`` (vLLM's `build_prom_metrics` argument).

    The KV and the EC connector's metrics are built one after the other into one registry and must share
    the families (a second registration of a name is an error). vLLM unregisters every `vllm:` family
    when it builds a new stat logger, so the remembered one is reused only while it is still registered:
    registering its first family again fails exactly then.
    """
    from prometheus_client import Counter, Gauge

    counter_cls, gauge_cls = metric_types[Counter], metric_types[Gauge]
    key = (id(_registry_of(counter_cls)), tuple(labelnames))
    with _SHARED_LOCK:
        try:
            first = counter_cls(name="vllm:tiercache_store_hits_total",
                                documentation=f"Tiered store: {STORE_COUNTER_HELP['hits']}",
                                labelnames=[*labelnames, "tier"])
        except ValueError:  # still registered: the other connector's metrics built it
            existing = _SHARED.get(key)
            if existing is None:
                raise
            return existing
        series = StoreSeries(counter_cls, gauge_cls, labelnames, per_engine_labelvalues, first=first)
        _SHARED[key] = series
        return series
