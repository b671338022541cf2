"""TieredKVConnector's numbers in vLLM's stats pipeline: logged by the engine, exported on `/metrics`.

Workers return a plain dict each step (`get_kv_connector_stats`); vLLM aggregates it across workers and
steps with `TieredKVStats.aggregate`, logs `reduce()`, and hands it to `TieredKVPromMetrics.observe`.

What a step's data holds:

- the connector's counters (`_COUNTERS`: the workers', and the scheduler's ``generation_resets`` and
  hand-off promises) and latency series (`_SERIES`), and `block_size`;
- ``tiers``: {tier: {counter: increment}}, what the process's store counted this step (loads, saves,
  promotions and the background writes that finished meanwhile; `TieredStore.take_counter_deltas`), and
  ``write_queue_hits``; these make a step non-empty like the connector's own counters;
- ``gauges``: {source: report} (`TieredStore.gauge_report`: bytes used, reachability, write queue), only
  when a report changed; ``save_queue``: {source: records waiting for the worker's saver thread}. Gauges
  are levels, not increments: a later report of a source replaces the earlier one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from vllm_tiercache.kvcache.options import KVConnectorOptions
from vllm_tiercache.shared.metric_families import counter_families, gauge_family
from vllm_tiercache.shared.store.counters import add_nested, store_series
from vllm_tiercache.shared.store.series import configured_tiers

_COUNTERS = (
    "loaded_blocks",
    "loaded_bytes",
    "load_errors",
    "saved_chunks",
    "saved_bytes",
    "dropped_saves",
    "generation_resets",
    # requests kept out of the store for want of a cache_salt (require_cache_salt)
    "unsalted_requests",
    # prefill/decode hand-offs (vllm_tiercache.kvcache.handoff.promise): the scheduler's promises ...
    "handoffs_offered",
    "handoffs_received",
    "handoffs_rejected",
    # ... and the workers' loads of them (vllm_tiercache.kvcache.handoff.wait)
    "handoff_loads",
    "handoff_records_waited",
    "handoff_fallbacks",
    "handoff_missing_records",
    # far tiers (vllm_tiercache.kvcache.lookup): the scheduler's lookups answered past their deadline, chunks
    # still on their way to host memory at it, and prefetched chunks evicted before their request ran ...
    "lookups_late",
    "prefetches_late",
    "prefetches_evicted",
    # chunks a far lookup found stored past the prefix its answer could load (any of the three above, or a fetch
    # that failed): the far tiers' hits that went missing
    "found_unused_chunks",
    # ... and the workers' prefetches (vllm_tiercache.kvcache.load.prefetcher)
    "prefetched_chunks",
    "prefetch_failures",
)
_SERIES = ("load_seconds", "save_seconds", "handoff_wait_seconds", "prefetch_seconds")
#: Keys whose value is {source: latest level}, merged by replacement.
_LEVELS = ("gauges", "save_queue")


@dataclass
class TieredKVStats(KVConnectorStats):
    """Counters (summed), latency series (concatenated), store increments (summed per tier) and gauge
    reports (latest per source) for one step or logging interval."""

    def __post_init__(self) -> None:
        for name in _COUNTERS:
            self.data.setdefault(name, 0)
        for name in _SERIES:
            self.data.setdefault(name, [])
        self.data.setdefault("block_size", 0)
        self.data.setdefault("tiers", {})
        self.data.setdefault("write_queue_hits", 0)

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in _COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for name in _SERIES:
            self.data[name] = list(self.data[name]) + list(other.data.get(name, []))
        self.data["block_size"] = self.data["block_size"] or other.data.get("block_size", 0)
        add_nested(self.data["tiers"], other.data.get("tiers", {}))
        self.data["write_queue_hits"] += other.data.get("write_queue_hits", 0)
        for name in _LEVELS:
            if other.data.get(name):
                self.data[name] = {**self.data.get(name, {}), **other.data[name]}
        return self

    def is_empty(self) -> bool:
        """No counter moved (gauge reports alone do not make a step worth logging)."""
        return (
            not any(self.data[name] for name in _COUNTERS)
            and not any(self.data[n] for n in _SERIES)
            and not self.data.get("write_queue_hits")
            and not any(v for numbers in self.data.get("tiers", {}).values() for v in numbers.values())
        )

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in _COUNTERS}
        out["hit_tokens"] = self.data["loaded_blocks"] * self.data["block_size"]
        for name in _SERIES:
            series = self.data[name]
            out[f"avg_{name}"] = round(sum(series) / len(series), 6) if series else 0.0
        for tier, numbers in sorted(self.data.get("tiers", {}).items()):
            for name in ("hits", "bytes_written", "dropped_writes", "errors"):
                if numbers.get(name):
                    out[f"{tier}_{name}"] = numbers[name]
        return out


class TieredKVPromMetrics(KVConnectorPromMetrics):
    """`vllm:tiercache_kv_*` series, labelled per engine, and the store's `vllm:tiercache_store_*` series
    (per tier; shared with the EC connector's metrics, see `vllm_tiercache.shared.store.counters`).
    Every series is created here, so a scrape before the first request lists them all at zero."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._hit_tokens = self._counter_cls(
            name="vllm:tiercache_kv_hit_tokens_total",
            documentation="Prompt tokens whose KV TieredKVConnector loaded instead of computing.",
            labelnames=labelnames,
        )
        self._counters = counter_families(
            self._counter_cls, "vllm:tiercache_kv_",
            {name: f"TieredKVConnector {name.replace('_', ' ')}." for name in _COUNTERS}, labelnames,
        )
        buckets = [1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
        self._latency = {
            name: self._histogram_cls(
                name=f"vllm:tiercache_kv_{name}",
                documentation=f"TieredKVConnector {name.replace('_', ' ')} per step.",
                buckets=buckets,
                labelnames=labelnames,
            )
            for name in _SERIES
        }
        self._save_queue = gauge_family(
            self._gauge_cls, "vllm:tiercache_kv_save_queue_records",
            "TieredKVConnector: gathered KV records waiting for the workers' saver threads.", labelnames,
        )
        self._save_queue_by_source: dict[int, dict[str, float]] = {idx: {} for idx in per_engine_labelvalues}
        for labels in per_engine_labelvalues.values():
            self._hit_tokens.labels(*labels)
            for counter in self._counters.values():
                counter.labels(*labels)
            for histogram in self._latency.values():
                histogram.labels(*labels)
            self._save_queue.labels(*labels).set(0)
        self.store = store_series(metric_types, labelnames, per_engine_labelvalues)
        self.store.add_configured_tiers(
            lambda: configured_tiers(vllm_config, "kv_transfer_config", "kv_connector_extra_config",
                                     KVConnectorOptions.load),
            "TieredKVConnector",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx)
        if labels is None:
            return
        data = transfer_stats_data
        self._hit_tokens.labels(*labels).inc(data.get("loaded_blocks", 0) * data.get("block_size", 0))
        for name, counter in self._counters.items():
            counter.labels(*labels).inc(data.get(name, 0))
        for name, histogram in self._latency.items():
            for value in data.get(name, []):
                histogram.labels(*labels).observe(value)
        self.store.observe_counters(data.get("tiers", {}), engine_idx, data.get("write_queue_hits", 0))
        if data.get("gauges"):
            self.store.observe_gauges(data["gauges"], engine_idx)
        if data.get("save_queue"):
            mine = self._save_queue_by_source.setdefault(engine_idx, {})
            mine.update(data["save_queue"])
            self._save_queue.labels(*labels).set(sum(mine.values()))


def copy_stats_data(data: dict[str, Any] | None) -> dict[str, Any]:
    """A deep copy: vLLM's logger aggregates into the first step's object, whose nested dicts must not be
    the ones its Prometheus logger reads."""
    return copy.deepcopy(data) if data else {}
