"""TieredECConnector's numbers on vLLM's `/metrics`: `vllm:tiercache_ec_*` counters, one per engine.

The path is vLLM's own (0.32+): the scheduler-side connector's `get_ec_connector_stats` returns this
step's counter increments (its own hits/misses and the ones the workers sent back with their residency
reports, see `eccache.scheduler`), the scheduler puts their `data` into `SchedulerStats.ec_connector_stats`,
and the front end's Prometheus logger hands it to the `ECConnectorPromMetrics` that
`TieredECConnector.build_prom_metrics` built, whose `observe` increments these counters.

The same data carries the workers' store numbers (``tiers``, ``write_queue_hits``, ``gauges``), exported as
the `vllm:tiercache_store_*` series that the KV connector's metrics share
(`vllm_tiercache.shared.store.counters.StoreSeries`). Every series exists from registration on.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, PromMetric, PromMetricT

from vllm_tiercache.eccache.options import ECConnectorOptions
from vllm_tiercache.shared.metric_families import counter_families
from vllm_tiercache.shared.store.counters import store_series
from vllm_tiercache.shared.store.series import configured_tiers

#: Counter -> help text. Names match `vllm_tiercache.eccache.connector.COUNTER_NAMES` (the keys of the stats data).
EC_METRICS: dict[str, str] = {
    "hits": "Encoder inputs the store held when vLLM asked (a consumer loads them, a producer skips them).",
    "misses": "Encoder inputs vLLM asked about that the store did not hold (vLLM encodes them).",
    "lookup_errors": "Store lookups that failed (answered as misses).",
    "loads": "Encoder outputs loaded from the store instead of encoded.",
    "load_failures": "Promised encoder outputs that could not be loaded (missing, corrupt, wrong shape).",
    "recomputed": "Encoder outputs re-encoded in the same step after a failed load.",
    "bytes_loaded": "Bytes of encoder output loaded from the store.",
    "load_seconds": "Seconds spent loading encoder outputs.",
    "saves": "Encoder outputs handed to the store.",
    "save_errors": "Encoder outputs the store refused to take.",
    "bytes_saved": "Bytes of encoder output handed to the store.",
    "save_seconds": "Seconds spent handing encoder outputs to the store.",
    "generation_resets": "Weights generations started: vLLM reset its encoder cache (a weight update in place).",
}


class TieredECPromMetrics(ECConnectorPromMetrics):
    """`vllm:tiercache_ec_<name>_total` counters, labelled per engine like vLLM's own."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = counter_families(
            self._counter_cls, "vllm:tiercache_ec_",
            {name: f"TieredECConnector: {doc}" for name, doc in EC_METRICS.items()}, labelnames,
        )
        # Every series exists from the start (a scrape shows 0, not nothing, before the first image).
        self._bound = {
            idx: {name: counter.labels(*labels) for name, counter in self._counters.items()}
            for idx, labels in per_engine_labelvalues.items()
        }
        self.store = store_series(metric_types, labelnames, per_engine_labelvalues)
        self.store.add_configured_tiers(
            lambda: configured_tiers(vllm_config, "ec_transfer_config", "ec_connector_extra_config",
                                     ECConnectorOptions.load),
            "TieredECConnector",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        bound = self._bound.get(engine_idx)
        if bound is None:
            return
        for name, counter in bound.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter.inc(value)
        self.store.observe_counters(transfer_stats_data.get("tiers") or {}, engine_idx,
                                    transfer_stats_data.get("write_queue_hits", 0))
        if transfer_stats_data.get("gauges"):
            self.store.observe_gauges(transfer_stats_data["gauges"], engine_idx)


class PendingCounts:
    """Counter increments not yet handed on (worker -> scheduler report, scheduler -> vLLM's stats).

    Thread-safe: a worker counts from the forward pass and from the store's saver thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def add(self, deltas: Mapping[str, float]) -> None:
        with self._lock:
            for name, value in deltas.items():
                self._values[name] = self._values.get(name, 0) + value

    def take(self) -> dict[str, float]:
        """The non-zero increments since the last take; starts over."""
        with self._lock:
            values, self._values = self._values, {}
        return {name: value for name, value in values.items() if value}
