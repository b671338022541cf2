"""The store's numbers on `/metrics`, unit level: nothing lost, everything listed from the start, no
backend round trip per engine step. (The real server: tests/engine/test_metrics_server.py.)

- background writes that finish in a step where the connector itself counted nothing still reach the
  stats (they were dropped: the tier baseline moved on and the "empty" step was thrown away);
- the KV and the EC connector's metrics share one set of `vllm:tiercache_store_*` families in a registry,
  with a child for every configured tier at zero before anything happened;
- gauges from several processes: per-process tiers summed, shared tiers not, `tier_up` the lowest;
- a Redis tier gets no `INFO` per step (usage comes from the store's background refresh).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tests.kv.test_kv_worker import worker
from tests.support.waiting import wait_until
from vllm_tiercache.eccache.connector import TieredECConnector, TieredECStats
from vllm_tiercache.kvcache.connector import TieredKVConnector
from vllm_tiercache.kvcache.metrics import TieredKVStats
from vllm_tiercache.shared.stats_dump import read_stats
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.counters import GAUGE_CHECK_INTERVAL_S, STORE_COUNTER_HELP, GaugeChanges

LABELS = ["model_name", "engine"]
ENGINE = {"model_name": "m", "engine": "0"}
MiB = 1 << 20


def _metric_types(registry: CollectorRegistry) -> dict[Any, Any]:
    return {Gauge: partial(Gauge, registry=registry), Counter: partial(Counter, registry=registry),
            Histogram: partial(Histogram, registry=registry)}


def _tiers(tmp_path: Path, redis_url: str = "redis://127.0.0.1:1/0") -> list[dict[str, Any]]:
    return [{"kind": "memory", "capacity": "64MiB"},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"},
            {"kind": "redis", "url": redis_url}]


def _vllm_config(tmp_path: Path, world_size: int = 1) -> SimpleNamespace:
    extra = {"namespace": "m", "tiers": _tiers(tmp_path)}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={**extra, "chunk_size": 64}),
        ec_transfer_config=SimpleNamespace(ec_connector_extra_config=dict(extra)),
        parallel_config=SimpleNamespace(world_size=world_size),
    )


def _kv_connector(side: Any, store: Any) -> TieredKVConnector:
    """The worker-role shell around `side` (only what `get_kv_connector_stats` uses)."""
    conn = TieredKVConnector.__new__(TieredKVConnector)
    conn._worker, conn._store, conn._scheduler = side, store, None
    return conn


def _record(i: int) -> tuple[StoreKey, torch.Tensor, dict[str, Any]]:
    return StoreKey(f"m|kv|x|f|tp1r0|{i:04d}|L0"), torch.full((256,), float(i)), {}


def test_background_writes_in_an_otherwise_empty_step_are_reported(tmp_path: Path) -> None:
    store = build_store({"tiers": _tiers(tmp_path)[:2]})
    side = worker(store)
    try:
        conn = _kv_connector(side, store)
        first = conn.get_kv_connector_stats()  # nothing happened: nothing, or a gauge report only
        assert first is None or first.is_empty()
        # What the saver thread does: the memory tier is written now, the disk tier in the background.
        store.put_many([_record(i) for i in range(4)], owned=True)
        assert store.flush(10.0)
        stats = conn.get_kv_connector_stats()
        assert stats is not None and not stats.is_empty(), "the step's store counts were dropped"
        assert stats.data["loaded_blocks"] == 0 and stats.data["saved_chunks"] == 0  # the connector: nothing
        assert stats.data["tiers"]["memory"]["puts"] == 4
        assert stats.data["tiers"]["disk"]["puts"] == 4 and stats.data["tiers"]["disk"]["bytes_written"] > 0
        # Reported once: the next step has nothing new, and nothing is repeated.
        again = conn.get_kv_connector_stats()
        assert again is None or (again.is_empty() and not again.data["tiers"])
        # A disk write that lands only after the step that queued it is reported by a later step.
        store.put_many([_record(10)], owned=True)
        early = conn.get_kv_connector_stats()
        assert store.flush(10.0)
        late = conn.get_kv_connector_stats()
        total = sum(s.data["tiers"].get("disk", {}).get("puts", 0) for s in (early, late) if s is not None)
        assert total == 1
    finally:
        side.shutdown()
        store.close()


def test_idle_steps_report_nothing_and_the_next_increment_once(tmp_path: Path) -> None:
    """Every engine step asks for stats, decode steps included, and most count nothing: such a step must
    return None outright (it used to snapshot and difference every tier's counters: ~70 us a step), and
    skipping the snapshot must never lose or repeat an increment that comes later."""
    store = build_store({"tiers": _tiers(tmp_path)[:2]})
    try:
        side = worker(store)
        conn = _kv_connector(side, store)
        store.put_many([_record(i) for i in range(2)], owned=True)
        assert store.flush(10.0)
        conn.get_kv_connector_stats()  # the writes above, and the first gauge report
        # the usage refresh's first pass, which changes the gauges once (a pass landing among the idle steps
        # below would send a report there)
        wait_until("the usage refresh's first pass", lambda: store.usage_refresh.snapshot())
        time.sleep(GAUGE_CHECK_INTERVAL_S)
        conn.get_kv_connector_stats()  # the gauges as they stay
        assert [conn.get_kv_connector_stats() for _ in range(50)] == [None] * 50
        assert store.take_counter_deltas() == {}
        store.get_many([_record(0)[0]])  # a read in the memory tier, after many idle steps
        stats = conn.get_kv_connector_stats()
        assert stats is not None and stats.data["tiers"]["memory"]["hits"] == 1
        assert stats.data["block_size"] == side.block_size  # the worker's, though it counted nothing itself
        assert conn.get_kv_connector_stats() is None
        with side._counters_lock:
            side.counters.loaded_blocks += 3
        stats = conn.get_kv_connector_stats()
        assert stats is not None and stats.data["loaded_blocks"] == 3 and stats.data["tiers"] == {}
        assert side.totals["loaded_blocks"] == 3 and conn.get_kv_connector_stats() is None
    finally:
        side.shutdown()
        store.close()


def test_a_worker_that_counted_nothing_still_writes_every_counter(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The stats file of a worker that never loaded nor saved (a consumer that missed everything) lists
    every counter at 0: readers (tests, operators' scripts) look them up by name. Steps that count nothing
    return nothing to vLLM, which must not leave the totals without those names."""
    monkeypatch.setenv("TIERCACHE_STATS_DIR", str(tmp_path / "stats"))
    store = build_store({"tiers": _tiers(tmp_path)[:1]})
    try:
        side = worker(store)
        conn = _kv_connector(side, store)
        assert [conn.get_kv_connector_stats() for _ in range(3)] == [None] * 3
        side.shutdown()
    finally:
        store.close()
    (stats,) = read_stats(str(tmp_path / "stats"), "kv-worker")
    assert stats["counters"]["load_errors"] == 0 and stats["counters"]["loaded_blocks"] == 0, stats["counters"]
    assert stats["counters"]["saved_chunks"] == 0 and stats["counters"]["dropped_saves"] == 0, stats["counters"]


@pytest.mark.serial
@pytest.mark.redis
def test_a_hung_redis_reaches_the_gauges_with_the_step_that_met_it(tmp_path: Path, redis_url: str,
                                                                    redis_server: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis stops answering (SIGSTOP, a hang): the step whose read hung counted it, so that step looks at
    the gauges at once, whatever the interval, and reports the tier down; its return reaches them with
    the next step that does work. (An interval no step reaches here: only that rule can report.)"""
    from vllm_tiercache.shared.store import usage

    # The store's usage refresh asks Redis too (INFO), on its own thread: one pass here, over before Redis
    # hangs. An INFO that hung along with the read (the thread, started with the worker, first ran late on
    # a loaded machine, or its next pass came) marked the tier down on its own time: its error, counted
    # after the step that met the hang, made the "idle" step below one that counted something (it looks at
    # the gauges, and sent the tier's return), or it marked the tier down again after the prober's return.
    monkeypatch.setattr(usage, "USAGE_REFRESH_S", 3600.0)
    store = build_store({"tiers": [{"kind": "memory", "capacity": "64MiB"},
                                   {"kind": "redis", "url": redis_url, "timeout_s": 0.5, "retry_after_s": 0.2}]})
    try:
        side = worker(store)
        side._gauges = GaugeChanges(store, interval_s=3600.0)
        conn = _kv_connector(side, store)
        key, tensor, meta = _record(1)
        store.tiers[1].put_many([(key, tensor, meta)])  # in Redis only: a later read asks Redis
        conn.get_kv_connector_stats()  # the write, and the first look (the usage refresh started with the worker)
        # its one pass over (an INFO that ran into timeout_s on a loaded machine marked the tier down: the
        # prober brings it back)
        wait_until("a usage pass with Redis up",
                   lambda: "redis" in store.usage_refresh.snapshot() and not store.tiers[1].down)
        conn.get_kv_connector_stats()  # what that pass counted, if anything, is taken here

        def redis_up(stats: TieredKVStats | None) -> Any:
            assert stats is not None
            (report,) = stats.data["gauges"].values()
            return report["tiers"]["redis"]["up"]

        redis_server.pause()
        try:
            store.get_many([StoreKey("m|kv|x|f|tp1r0|9999|L0")])  # hangs for timeout_s: a miss, tier down
            assert redis_up(conn.get_kv_connector_stats()) == 0
        finally:
            redis_server.resume()
        # the prober brings it back (it PINGs every 0.2 s); no step counts that
        wait_until("the Redis tier back after SIGCONT", lambda: not store.tiers[1].down)
        # an idle step within the interval: the gauges are not looked at (a probe counts nothing, failed
        # or not; the one other thread that asks Redis, the usage refresh, is done)
        idle = conn.get_kv_connector_stats()
        assert idle is None or "gauges" not in idle.data, idle
        assert store.get_many([key])[0] is not None  # read from Redis
        assert redis_up(conn.get_kv_connector_stats()) == 1
    finally:
        side.shutdown()
        store.close()


def test_gauges_are_looked_at_once_per_interval_and_sent_when_changed() -> None:
    """Every step asks; the report is built and compared at most once per interval, and a change made
    meanwhile is sent at the first look after it (never lost, never sent twice).

    On a clock of the test's own: with the real one and a 0.2 s interval, "within the interval" needed two
    statements less than 0.2 s apart, which a loaded machine need not give."""
    used = [0]
    looks = [0]
    now = [1000.0]

    class Store:
        source = "w1"

        def gauge_report(self) -> dict[str, Any]:
            looks[0] += 1
            return {"tiers": {"memory": {"bytes_used": used[0], "up": 1, "shared": 0}}, "write_queue": 0}

    changes = GaugeChanges(Store(), interval_s=1.0, clock=lambda: now[0])
    assert changes.take() == {} and looks == [1]  # nothing held yet: what /metrics shows from registration on
    used[0] = 10
    now[0] += 0.75
    assert changes.take() == {} and looks == [1]  # within the interval: not looked at
    now[0] += 0.25
    assert changes.take()["w1"]["tiers"]["memory"]["bytes_used"] == 10 and looks == [2]
    now[0] += 1.5
    assert changes.take() == {} and looks == [3]  # looked at, unchanged
    used[0] = 20
    assert changes.take() == {} and looks == [3]  # within the interval again
    assert changes.take(force=True)["w1"]["tiers"]["memory"]["bytes_used"] == 20  # a step that counted something
    assert looks == [4]
    assert changes.take(force=True) == {}  # sent once


def test_aggregate_keeps_tier_counts_and_the_latest_gauges() -> None:
    a = TieredKVStats(data={"tiers": {"disk": {"bytes_written": 10}},
                            "gauges": {"p1": {"tiers": {"disk": {"bytes_used": 1}}}}})
    b = TieredKVStats(data={"tiers": {"disk": {"bytes_written": 5}, "redis": {"hits": 2}},
                            "gauges": {"p1": {"tiers": {"disk": {"bytes_used": 7}}}}, "write_queue_hits": 3})
    merged = a.aggregate(b)
    assert merged.data["tiers"] == {"disk": {"bytes_written": 15}, "redis": {"hits": 2}}
    assert merged.data["gauges"]["p1"]["tiers"]["disk"]["bytes_used"] == 7
    assert merged.data["write_queue_hits"] == 3 and not merged.is_empty()
    assert TieredKVStats(data={"gauges": {"p": {}}}).is_empty()  # levels alone are nothing to log
    assert not TieredKVStats(data={"tiers": {"disk": {"dropped_writes": 1}}}).is_empty()
    # vLLM's logger aggregates into the object it built first: the data it was built from stays as it was.
    data = {"tiers": {"disk": {"hits": 1}}}
    TieredKVConnector.build_kv_connector_stats(data).aggregate(TieredKVStats(data={"tiers": {"disk": {"hits": 1}}}))
    assert data == {"tiers": {"disk": {"hits": 1}}}
    ec = TieredECStats(data={"hits": 1, "tiers": {"disk": {"hits": 1}}}).aggregate(
        TieredECStats(data={"hits": 2, "tiers": {"disk": {"hits": 2}}, "gauges": {"p": {"write_queue": 1}}}))
    assert ec.data == {"hits": 3, "tiers": {"disk": {"hits": 3}}, "gauges": {"p": {"write_queue": 1}}}
    assert ec.reduce()["disk_hits"] == 3


def test_every_series_is_listed_at_zero_before_anything_happens(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    config = _vllm_config(tmp_path, world_size=2)
    kv = TieredKVConnector.build_prom_metrics(config, _metric_types(registry), LABELS, {0: ["m", "0"]})  # type: ignore[arg-type]
    ec = TieredECConnector.build_prom_metrics(config, _metric_types(registry), LABELS, {0: ["m", "0"]})  # type: ignore[arg-type]
    assert ec is not None and ec.store is kv.store  # one set of store families for both connectors
    value = registry.get_sample_value
    for tier in ("memory", "disk", "redis"):
        labels = {**ENGINE, "tier": tier}
        for name in STORE_COUNTER_HELP:
            assert value(f"vllm:tiercache_store_{name}_total", labels) == 0, (name, tier)
        assert value("vllm:tiercache_store_bytes_used", labels) == 0
        assert value("vllm:tiercache_store_tier_up", labels) == 1
    # Capacity from the config: the memory tier once per worker, the shared disk once; Redis has none.
    assert value("vllm:tiercache_store_capacity_bytes", {**ENGINE, "tier": "memory"}) == 2 * 64 * MiB
    assert value("vllm:tiercache_store_capacity_bytes", {**ENGINE, "tier": "disk"}) == 1 << 30
    assert value("vllm:tiercache_store_capacity_bytes", {**ENGINE, "tier": "redis"}) is None
    assert value("vllm:tiercache_store_write_queue_pending", ENGINE) == 0
    assert value("vllm:tiercache_store_write_queue_hits_total", ENGINE) == 0
    assert value("vllm:tiercache_kv_save_queue_records", ENGINE) == 0
    for name in ("hit_tokens", "loaded_blocks", "saved_bytes", "dropped_saves", "load_errors"):
        assert value(f"vllm:tiercache_kv_{name}_total", ENGINE) == 0, name
    assert value("vllm:tiercache_kv_load_seconds_count", ENGINE) == 0
    for name in ("hits", "misses", "loads", "saves", "bytes_saved", "load_failures"):
        assert value(f"vllm:tiercache_ec_{name}_total", ENGINE) == 0, name

    # Both connectors' data land in the same families.
    kv.observe({"tiers": {"redis": {"hits": 2, "bytes_read": 100}}, "write_queue_hits": 1}, 0)
    ec.observe({"hits": 1, "tiers": {"redis": {"hits": 1}, "disk": {"bytes_written": 50}}}, 0)
    assert value("vllm:tiercache_store_hits_total", {**ENGINE, "tier": "redis"}) == 3
    assert value("vllm:tiercache_store_bytes_written_total", {**ENGINE, "tier": "disk"}) == 50
    assert value("vllm:tiercache_store_write_queue_hits_total", ENGINE) == 1
    assert value("vllm:tiercache_ec_hits_total", ENGINE) == 1

    # Gauges: the latest report per process; memory summed over workers, disk not, tier_up the lowest.
    def report(memory: int, disk: int, redis_up: int, queue: int) -> dict[str, Any]:
        return {"tiers": {"memory": {"bytes_used": memory, "up": 1, "shared": 0},
                          "disk": {"bytes_used": disk, "up": 1, "shared": 1},
                          "redis": {"bytes_used": None, "up": redis_up, "shared": 1}}, "write_queue": queue}

    kv.observe({"gauges": {"w1": report(10, 500, 1, 2)}, "save_queue": {"w1": 4}}, 0)
    ec.observe({"gauges": {"w2": report(20, 400, 0, 3)}}, 0)
    kv.observe({"gauges": {"w1": report(15, 600, 1, 0)}}, 0)
    assert value("vllm:tiercache_store_bytes_used", {**ENGINE, "tier": "memory"}) == 35
    assert value("vllm:tiercache_store_bytes_used", {**ENGINE, "tier": "disk"}) == 600
    assert value("vllm:tiercache_store_tier_up", {**ENGINE, "tier": "redis"}) == 0
    assert value("vllm:tiercache_store_write_queue_pending", ENGINE) == 3
    assert value("vllm:tiercache_kv_save_queue_records", ENGINE) == 4

    # vLLM unregisters every `vllm:` family when it builds a new stat logger: the next build starts over.
    for collector in list(registry._collector_to_names):
        if getattr(collector, "_name", "").startswith("vllm:"):
            registry.unregister(collector)
    again = TieredKVConnector.build_prom_metrics(config, _metric_types(registry), LABELS, {0: ["m", "0"]})  # type: ignore[arg-type]
    assert again.store is not kv.store
    assert registry.get_sample_value("vllm:tiercache_store_hits_total", {**ENGINE, "tier": "redis"}) == 0


@pytest.mark.redis
def test_the_usage_refresh_starts_with_the_worker_not_on_its_first_step() -> None:
    """The first gauge report comes on the forward's thread; ``Thread.start`` there waited for the new thread
    to run (up to half a second on a loaded machine)."""
    store = build_store({"tiers": [{"kind": "memory", "capacity": "64MiB"}]})
    side = worker(store)
    try:
        refresh = store.usage_refresh.thread
        assert refresh is not None and refresh.is_alive()
        _kv_connector(side, store).get_kv_connector_stats()
        assert store.usage_refresh.thread is refresh
    finally:
        side.shutdown()
        store.close()


def test_a_step_costs_redis_no_info_round_trip(tmp_path: Path, redis_url: str, redis_server: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Usage (Redis `INFO`) comes from the store's background refresh, never from a step; with a stats
    directory too. The gauges still carry Redis' used memory and reachability."""
    from vllm_tiercache.shared.store import usage

    monkeypatch.setattr(usage, "USAGE_REFRESH_S", 3600.0)  # one refresh pass in this test
    monkeypatch.setenv("TIERCACHE_STATS_DIR", str(tmp_path / "stats"))
    store = build_store({"tiers": [{"kind": "memory", "capacity": "64MiB"}, {"kind": "redis", "url": redis_url}]})
    side = worker(store)
    try:
        with redis_server.client() as client:
            conn = _kv_connector(side, store)
            reports: list[dict[str, Any]] = []

            def look() -> None:
                stats = conn.get_kv_connector_stats()
                if stats is not None and stats.data.get("gauges"):
                    reports.append(stats.data["gauges"])

            # the first look: it sends Redis' usage if the refresh thread (started with the worker) has
            # answered by now, else a later look does, once the usage came
            look()
            # the refresh's INFO must land before the reset below; a pass whose INFO did not answer in its
            # budget (a loaded machine) leaves Redis' usage None, and with it the report looks as registered
            # and is never sent: ask again then (the background pass runs once an hour here)
            deadline = time.monotonic() + 60.0
            while not (store.usage_refresh.snapshot().get("redis") or {}).get("bytes_used"):
                assert time.monotonic() < deadline, f"Redis' usage never came: {store.usage_refresh.snapshot()}"
                if store.usage_refresh.snapshot():
                    store.usage_refresh.refresh()
                time.sleep(0.05)
            client.config_resetstat()
            for i in range(40):  # 40 engine steps, half of them with writes, over 4 gauge intervals
                if i % 2:
                    store.put_many([_record(i)], owned=True)
                time.sleep(GAUGE_CHECK_INTERVAL_S / 10)
                look()
            assert store.flush(10.0)
            info_calls = client.info("commandstats").get("cmdstat_info", {}).get("calls", 0)
        assert info_calls == 0, f"{info_calls} INFO round trips in 40 steps"
        assert reports, f"no gauge report in 41 steps; the store's report: {store.gauge_report()}"
        (source,) = reports[-1]
        redis = reports[-1][source]["tiers"]["redis"]
        assert redis["up"] == 1 and redis["bytes_used"] > 0 and redis["shared"] == 1
    finally:
        side.shutdown()
        store.close()
