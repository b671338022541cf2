"""How the connectors' `/metrics` modules create their Prometheus families, written once.

Why one module: the KV connector's series (`kvcache/metrics.py`), the EC connector's (`eccache/metrics.py`)
and the store's (`StoreSeries` in `shared/store/counters.py`) are all built from the metric classes vLLM
hands to `build_prom_metrics`, and both connectors pre-register the store tiers their config declares.
Doing each of these one way keeps the series of the three alike (names, help texts, gauge merge mode).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.store.counters import TierSpec


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


def configured_tiers(vllm_config: Any, transfer_attr: str, extra_config_attr: str,
                     load_options: Callable[[dict[str, Any]], tuple[Any, StoreConfig]],
                     ) -> tuple[list[TierSpec], str, int]:
    """(tier specs, store config key, workers per engine) of the store a connector's config declares
    (`series_spec`), for `StoreSeries.add_configured_tiers`; no tiers when vLLM's config has no transfer
    config at ``transfer_attr`` (``kv_transfer_config`` or ``ec_transfer_config``).

    ``load_options`` is the connector's options loader (`KVConnectorOptions.load`, `ECConnectorOptions.load`),
    which splits the connector's extra config into its options and the store config.
    """
    transfer = getattr(vllm_config, transfer_attr, None)
    if transfer is None:
        return [], "", 1
    # Imported here: the tiered store imports the store counters, which build their gauges with this module.
    from vllm_tiercache.shared.store.tiered import series_spec

    _, store_config = load_options(dict(getattr(transfer, extra_config_attr) or {}))
    return series_spec(store_config, vllm_config)
