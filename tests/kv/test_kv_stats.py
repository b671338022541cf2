"""TieredKVConnector's stats: aggregation across workers and steps, and the Prometheus series they feed."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from vllm_tiercache.kvcache.connector import TieredKVConnector
from vllm_tiercache.kvcache.metrics import TieredKVStats


def test_aggregate_sums_counters_and_concatenates_latencies() -> None:
    a = TieredKVStats(
        data={
            "loaded_blocks": 3,
            "block_size": 32,
            "load_seconds": [0.1],
            "tiers": {"disk": {"hits": 2, "read_seconds": 0.5}},
        }
    )
    b = TieredKVStats(
        data={
            "loaded_blocks": 5,
            "saved_bytes": 10,
            "load_seconds": [0.3],
            "tiers": {"disk": {"hits": 1}, "memory": {"hits": 4}},
        }
    )
    merged = a.aggregate(b)
    reduced = merged.reduce()
    assert reduced["loaded_blocks"] == 8 and reduced["hit_tokens"] == 8 * 32
    assert reduced["saved_bytes"] == 10 and abs(reduced["avg_load_seconds"] - 0.2) < 1e-9
    assert merged.data["tiers"] == {"disk": {"hits": 3, "read_seconds": 0.5}, "memory": {"hits": 4}}
    assert not merged.is_empty() and TieredKVStats().is_empty()


def test_prometheus_series_are_registered_and_observed() -> None:
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = TieredKVConnector.build_prom_metrics(
        config,  # type: ignore[arg-type]
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )
    metrics.observe(
        {
            "loaded_blocks": 4,
            "block_size": 32,
            "load_errors": 1,
            "load_seconds": [0.02],
            "tiers": {"disk": {"hits": 7, "bytes_read": 4096}},
        },
        engine_idx=0,
    )
    value = REGISTRY.get_sample_value
    assert value("vllm:tiercache_kv_hit_tokens_total", {"engine": "0"}) == 128
    assert value("vllm:tiercache_kv_load_errors_total", {"engine": "0"}) == 1
    assert value("vllm:tiercache_kv_load_seconds_count", {"engine": "0"}) == 1
    assert value("vllm:tiercache_store_hits_total", {"engine": "0", "tier": "disk"}) == 7
