"""`bench serve`'s per-level counters, read from a `/metrics` text as prometheus_client writes it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from vllm_tiercache.tools.bench.serve.counters import counters_line, level_counters, tiercache_counters


def _metrics(late: float, object_hits: float, disk_hits: float) -> str:
    registry = CollectorRegistry()
    kv = Counter("vllm:tiercache_kv_prefetches_late", "late", ["engine"], registry=registry)
    kv.labels(engine="0").inc(late)
    kv.labels(engine="1").inc(1)  # summed over every label but the tier
    store = Counter("vllm:tiercache_store_hits", "hits", ["engine", "tier"], registry=registry)
    store.labels(engine="0", tier="object").inc(object_hits)
    store.labels(engine="0", tier="disk").inc(disk_hits)
    Counter("vllm:tiercache_kv_saved_bytes", "not shown", registry=registry).inc(5)
    Counter("vllm:num_requests", "not ours", registry=registry).inc(7)
    return generate_latest(registry).decode()


def test_a_levels_counters_are_what_moved_per_tier_and_only_those_a_row_shows() -> None:
    before = tiercache_counters(_metrics(late=2, object_hits=10, disk_hits=4))
    assert before["kv.prefetches_late"] == 3 and before["object.hits"] == 10 and before["disk.hits"] == 4
    assert not any(key.startswith("vllm:") or "num_requests" in key for key in before)
    after = tiercache_counters(_metrics(late=5, object_hits=25, disk_hits=4))
    moved = level_counters(before, after)
    assert moved == {"kv.prefetches_late": 3, "object.hits": 15}  # saved_bytes is not shown; disk did not move
    assert counters_line(moved) == "kv.prefetches_late 3, object.hits 15"
    assert level_counters(after, after) == {} and counters_line({}) == ""
