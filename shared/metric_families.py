"""How the connectors' `/metrics` modules create their Prometheus families, written once.

Why one module: the KV connector's series (`kvcache/metrics.py`), the EC connector's (`eccache/metrics.py`)
and the store's (`StoreSeries` in `shared/store/counters.py`) are all built from the metric classes vLLM
hands to `build_prom_metrics`, and both connectors pre-register the store tiers their config declares.
Doing each of these one way keeps the series of the three alike (names, help texts, gauge merge mode).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def counter_families(counter_cls: Any, prefix: str, help_by_name: Mapping[str, str],
                     labelnames: list[str]) -> dict[str, Any]:
    """One counter `{prefix}{name}_total` per name of ``help_by_name`` (its help text), in that order."""
    return {
        name: counter_cls(name=f"{prefix}{name}_total", documentation=documentation, labelnames=labelnames)
        for name, documentation in help_by_name.items()
    }


def gauge_family(gauge_cls: Any, name: str, documentation: str, labelnames: list[str]) -> Any:
    """A gauge whose values from vLLM's API server processes merge as the most recent one.

    vLLM's gauge class takes that multiprocess mode; a class that does not (prometheus_client's plain
    `Gauge` in a test registry) makes a plain gauge.
    """
    try:
        return gauge_cls(name=name, documentation=documentation, labelnames=labelnames, multiprocess_mode="mostrecent")
    except TypeError:
        return gauge_cls(name=name, documentation=documentation, labelnames=labelnames)
