"""The connector's own counters over one `bench serve` level, read from the server's `/metrics`.

Why: a row's KV hit says how much the connector loaded, not why the rest was not. The far-tier cases load
less than the memory case with the same trace; whether a far lookup came in late, a prefetch was still on
its way or was dropped before its request ran, or the store never held the chunk (a write dropped) is what
the scheduler's and the store's counters say (docs/operations.md, the metrics table). Those of the scheduler
side reach `/metrics` only, not the stats files the workers write, so the bench reads them there, before and
after each level.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

#: The counters a row shows (`vllm:tiercache_kv_<name>_total`), in the progress line's order.
KV_COUNTERS = ("lookups_late", "prefetches_late", "prefetches_evicted", "found_unused_chunks", "prefetched_chunks",
               "prefetch_failures", "load_errors", "dropped_saves")
#: The store's per-tier counters a row shows (`vllm:tiercache_store_<name>_total{tier=...}`).
STORE_COUNTERS = ("hits", "misses", "puts", "dropped_writes", "refused", "writes_refused", "errors", "evictions",
                  "partial", "corrupt")


def tiercache_counters(metrics_text: str) -> dict[str, float]:
    """Every `vllm:tiercache_*_total` counter in a `/metrics` text, summed over its labels but ``tier``:
    ``kv.<name>`` for the connector's, ``<tier>.<name>`` for the store's (e.g. ``object.dropped_writes``)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name
            if not name.startswith("vllm:tiercache_") or not name.endswith("_total"):
                continue
            base = name[len("vllm:tiercache_"):-len("_total")]
            if base.startswith("kv_"):
                key = f"kv.{base[3:]}"
            elif base.startswith("store_"):
                key = f"{sample.labels.get('tier', '?')}.{base[6:]}"
            else:
                key = base
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def level_counters(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """What moved over the level: ``after - before`` of the counters a row shows, those that moved only."""
    def shown(key: str) -> bool:
        kind, _, name = key.partition(".")
        return name in KV_COUNTERS if kind == "kv" else name in STORE_COUNTERS

    moved = {key: round(value - before.get(key, 0.0)) for key, value in after.items() if shown(key)}
    return {key: value for key, value in sorted(moved.items()) if value}


def counters_line(moved: dict[str, int]) -> str:
    """The progress line's tail: ``late 3 lookups / 12 chunks, ...`` ('' when nothing moved)."""
    return ", ".join(f"{key} {value}" for key, value in moved.items())
