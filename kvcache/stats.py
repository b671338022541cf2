"""TieredKVConnector's numbers in vLLM's stats pipeline: logged by the engine, exported on `/metrics`.

Workers return a plain dict each step (`get_kv_connector_stats`); vLLM aggregates it across workers and
steps with `TieredKVStats.aggregate`, logs `reduce()`, and hands it to `TieredKVPromMetrics.observe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

_COUNTERS = (
    "loaded_blocks",
    "loaded_bytes",
    "load_errors",
    "saved_chunks",
    "saved_bytes",
    "dropped_saves",
)
_SERIES = ("load_seconds", "save_seconds")


@dataclass
class TieredKVStats(KVConnectorStats):
    """Counters (summed) and latency series (concatenated) for one logging interval."""

    def __post_init__(self) -> None:
        for name in _COUNTERS:
            self.data.setdefault(name, 0)
        for name in _SERIES:
            self.data.setdefault(name, [])
        self.data.setdefault("block_size", 0)
        self.data.setdefault("tiers", {})

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in _COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for name in _SERIES:
            self.data[name] = list(self.data[name]) + list(other.data.get(name, []))
        self.data["block_size"] = self.data["block_size"] or other.data.get("block_size", 0)
        tiers = self.data["tiers"]
        for tier, numbers in other.data.get("tiers", {}).items():
            mine = tiers.setdefault(tier, {})
            for key, value in numbers.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    mine[key] = mine.get(key, 0) + value
        return self

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in _COUNTERS) and not any(self.data[n] for n in _SERIES)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in _COUNTERS}
        out["hit_tokens"] = self.data["loaded_blocks"] * self.data["block_size"]
        for name in _SERIES:
            series = self.data[name]
            out[f"avg_{name}"] = round(sum(series) / len(series), 6) if series else 0.0
        return out


class TieredKVPromMetrics(KVConnectorPromMetrics):
    """`vllm:tiercache_kv_*` series, labelled per engine (and per tier for store counters)."""

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
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:tiercache_kv_{name}_total",
                documentation=f"TieredKVConnector {name.replace('_', ' ')}.",
                labelnames=labelnames,
            )
            for name in _COUNTERS
        }
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
        tier_labels = [*labelnames, "tier"]
        self._tier_counters = {
            name: self._counter_cls(
                name=f"vllm:tiercache_store_{name}_total",
                documentation=f"Tiered store {name.replace('_', ' ')} per tier.",
                labelnames=tier_labels,
            )
            for name in ("hits", "misses", "bytes_read", "bytes_written", "corrupt", "read_seconds", "write_seconds")
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        data = transfer_stats_data
        self._hit_tokens.labels(*labels).inc(data.get("loaded_blocks", 0) * data.get("block_size", 0))
        for name, counter in self._counters.items():
            counter.labels(*labels).inc(data.get(name, 0))
        for name, histogram in self._latency.items():
            for value in data.get(name, []):
                histogram.labels(*labels).observe(value)
        for tier, numbers in data.get("tiers", {}).items():
            for name, counter in self._tier_counters.items():
                value = numbers.get(name, 0)
                if value:
                    counter.labels(*labels, tier).inc(value)
