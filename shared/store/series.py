"""Which store series a connector's `/metrics` creates at start: its configured tiers, named as the store names them.

Why apart from the store: a connector's metrics object lives in vLLM's API server and logging processes,
which build no store; they read the connector's config and create each tier's series up front (so a
dashboard sees every tier from the first scrape), without opening any tier. The store names its tiers
with the same `tier_names`, so the series a worker fills are the ones created here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vllm_tiercache.shared.store.registry import tier_class

if TYPE_CHECKING:
    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.store.counters import TierSpec


def tier_names(tier_configs: Sequence[Any]) -> list[str]:
    """The name each configured tier gets in a store: its kind, then kind1, kind2... for repeats."""
    names, seen = [], {}
    for tc in tier_configs:
        n = seen.get(tc.kind, 0)
        seen[tc.kind] = n + 1
        names.append(tc.kind if n == 0 else f"{tc.kind}{n}")
    return names


def series_spec(config: StoreConfig, vllm_config: Any) -> tuple[list[tuple[str, int | None, bool]], str, int]:
    """(tier specs, store key, workers per engine): what a connector's metrics need to create every
    store series at start (`tier_specs`), to tell stores apart, and to sum per-worker gauges."""
    parallel = getattr(vllm_config, "parallel_config", None)
    workers = int(getattr(parallel, "world_size", 1) or 1)
    return tier_specs(config), config.cache_key(), workers


def tier_specs(config: StoreConfig) -> list[tuple[str, int | None, bool]]:
    """(name, capacity or None, shared across processes) of each configured tier, without opening any."""
    out = []
    for name, tc in zip(tier_names(config.tiers), config.tiers, strict=True):
        try:
            shared = bool(tier_class(tc.kind).shared_across_processes)
        except Exception:  # a tier whose module does not import here can't be built here either; counted
            # as shared: the memory tier's module needs nothing this store lacks, so only another kind can
            # fail to import, and every other built-in kind is shared
            shared = True
        capacity = getattr(tc, "capacity", None)
        out.append((name, capacity if isinstance(capacity, int) else None, shared))
    return out


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
    _, store_config = load_options(dict(getattr(transfer, extra_config_attr) or {}))
    return series_spec(store_config, vllm_config)
