"""The demo's results: one table (printed) and the same numbers as a PNG.

Rows compare like with like: every tiercache row is set against the *same queries* of the no-cache run
(same trace, same order), so "vs no cache" is a ratio of medians over identical prompts. Which tier
served a RAG query is told by first touch: the consumer starts with an empty memory tier, so the first
query of a document reads its KV from disk (and promotes it); later ones read it from memory. The
per-tier store counters printed under the table check that attribution.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.stats_dump import read_stats
from vllm_tiercache.tools.demo.load import Result


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 1]); None for no values (the demo and `bench serve`)."""
    ordered = sorted(values)
    if not ordered:
        return None
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _pct(values: list[float], q: float) -> float:
    """`percentile`, NaN for no values (the demo's table prints and compares NaN)."""
    value = percentile(values, q)
    return float("nan") if value is None else value


def classify(results: list[Result]) -> dict[str, list[int]]:
    """Trace positions per serving path of the tiercache run (first touch of a document's KV = disk).

    Page-only queries: the first one on a page loads its encoder output through TieredECConnector;
    later ones find it in vLLM's own encoder cache, as the no-cache server does for any repeated page.
    """
    seen: set[int] = set()
    seen_images: set[int] = set()
    groups: dict[str, list[int]] = {"disk": [], "memory": [], "visual_new": [], "visual_seen": []}
    for i, r in enumerate(results):
        if r.query.visual:
            # RAG queries that hit the KV cache never run the encoder, so only an earlier page-only query
            # puts a page into vLLM's own (in-process) encoder cache.
            groups["visual_seen" if r.query.doc in seen_images else "visual_new"].append(i)
            seen_images.add(r.query.doc)
        elif r.query.doc in seen:
            groups["memory"].append(i)
        else:
            seen.add(r.query.doc)
            groups["disk"].append(i)
    return groups


def connector_stats(stats_dir: Path) -> dict[str, Any]:
    """Sum what the consumer's processes wrote to `$TIERCACHE_STATS_DIR` (KV worker, EC processes)."""
    out: dict[str, Any] = {"ec_hits": 0, "ec_misses": 0, "ec_loads": 0, "ec_saves": 0, "kv_loaded_blocks": 0,
                           "kv_load_errors": 0, "tier_hits": {}, "tier_bytes_read": {}}
    for entry in read_stats(str(stats_dir), "ec"):
        conn = entry.get("connector", {})
        out["ec_hits"] += int(conn.get("hits", 0))
        out["ec_misses"] += int(conn.get("misses", 0))
        out["ec_loads"] += int(conn.get("loads", 0))
        out["ec_saves"] += int(conn.get("saves", 0))
    for entry in read_stats(str(stats_dir), "kv-worker"):
        counters = entry.get("counters", {})
        out["kv_loaded_blocks"] += int(counters.get("loaded_blocks", 0))
        out["kv_load_errors"] += int(counters.get("load_errors", 0))
        # The worker's store is shared by both connectors there: these are all reads, KV and EC.
        for name, tier in entry.get("store", {}).get("tiers", {}).items():
            kind = tier.get("kind", name)
            out["tier_hits"][kind] = out["tier_hits"].get(kind, 0) + int(tier.get("hits", 0))
            out["tier_bytes_read"][kind] = out["tier_bytes_read"].get(kind, 0) + int(tier.get("bytes_read", 0))
    return out


def subtract_stats(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """`after - before` for every counter (nested per-tier dicts too): the trace's share, without warm-up."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = subtract_stats(value, before.get(key, {}))
        elif isinstance(value, int | float):
            out[key] = value - before.get(key, 0)
        else:
            out[key] = value
    return out


def build_rows(baseline: list[Result], cached: list[Result]) -> list[dict[str, Any]]:
    """Table rows as dicts (label, n, failed, kv_hit, p50, p90, ratio)."""
    groups = classify(cached)
    everything = list(range(len(cached)))
    # Context for the page-only rows: what a page-only query costs the no-cache server when its page is new
    # to that server (the encoder runs), as opposed to a repeat (vLLM's in-process encoder cache).
    seen_base: set[int] = set()
    base_new_pages = []
    for i, r in enumerate(baseline):
        if r.query.visual and r.query.doc not in seen_base:
            base_new_pages.append(i)
        seen_base.add(r.query.doc)
    specs = [
        ("no cache (vLLM alone)", "baseline", everything),
        ("tiercache, all queries", "tiercache", everything),
        ("  RAG, KV from disk tier", "tiercache", groups["disk"]),
        ("  RAG, KV from memory tier", "tiercache", groups["memory"]),
        ("  page-only, EC load (new page)", "tiercache", groups["visual_new"]),
        ("  page-only, vLLM's enc. cache", "tiercache", groups["visual_seen"]),
        ("no cache, page-only, new page", "baseline", base_new_pages),
    ]
    rows = []
    for label, run, idx in specs:
        if not idx:
            continue
        results = [(baseline if run == "baseline" else cached)[i] for i in idx]
        ok = [r for r in results if r.error is None and r.ttft_s is not None]
        base_ok = [baseline[i].ttft_s for i in idx if baseline[i].error is None and baseline[i].ttft_s is not None]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in ok)
        p50 = statistics.median(ttfts) if ttfts else float("nan")
        base_p50 = statistics.median(base_ok) if base_ok else float("nan")
        rows.append({
            "label": label, "run": run, "n": len(results), "failed": len(results) - len(ok),
            "kv_hit": (sum(r.cached_tokens for r in ok) / prompt) if prompt else 0.0,
            "p50": p50, "p90": _pct(ttfts, 0.9), "ratio": p50 / base_p50 if base_p50 == base_p50 else float("nan"),
            "ttfts": ttfts,
        })
    return rows


def format_table(rows: list[dict[str, Any]], stats: dict[str, Any]) -> str:
    head = f"{'run / served by':<30} {'queries':>7} {'failed':>6} {'KV hit':>7} {'TTFT p50':>9} {'TTFT p90':>9} " \
           f"{'vs no cache':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['label']:<30} {r['n']:>7} {r['failed']:>6} {r['kv_hit']:>6.1%} {r['p50'] * 1e3:>7.0f}ms "
            f"{r['p90'] * 1e3:>7.0f}ms {r['ratio']:>10.2f}x"
        )
    lookups = stats["ec_hits"] + stats["ec_misses"]
    ec_rate = f"{stats['ec_hits'] / lookups:.1%}" if lookups else "n/a"
    lines.append("")
    lines.append("KV hit = prompt tokens whose KV tiercache loaded (usage.prompt_tokens_details.cached_tokens) "
                 "/ prompt tokens")
    lines.append(f"encoder cache (TieredECConnector): {stats['ec_hits']} hits / {lookups} lookups ({ec_rate}), "
                 f"{stats['ec_loads']} loads")
    tiers = ", ".join(f"{kind} {hits} hits ({stats['tier_bytes_read'].get(kind, 0) / 2**20:.1f} MiB)"
                      for kind, hits in stats["tier_hits"].items()) or "no stats file"
    lines.append(f"store reads in the worker (KV + EC): {tiers}; KV blocks loaded {stats['kv_loaded_blocks']}, "
                 f"load errors {stats['kv_load_errors']}")
    return "\n".join(lines)


def write_plot(rows: list[dict[str, Any]], baseline: list[Result], cached: list[Result], path: Path) -> Path:
    """Two panels: TTFT median/p90 per row, and every query's TTFT in trace order for both runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [r["label"].strip() for r in rows]
    colors = ["#9e9e9e" if r["run"] == "baseline" else "#1f77b4" for r in rows]
    y = list(range(len(rows)))
    ax1.barh(y, [r["p50"] * 1e3 for r in rows], color=colors, label="median")
    ax1.scatter([r["p90"] * 1e3 for r in rows], y, marker="|", s=300, color="black", label="p90")
    for yi, r in zip(y, rows, strict=True):
        ax1.text(r["p50"] * 1e3, yi, f" {r['ratio']:.2f}x", va="center", fontsize=8)
    ax1.set_yticks(y, labels, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("time to first token (ms)")
    ax1.set_title("TTFT per serving path (ratio: median vs same queries without cache)", fontsize=9)
    ax1.legend(fontsize=8)

    def series(results: list[Result]) -> tuple[list[int], list[float]]:
        pts = [(i, r.ttft_s * 1e3) for i, r in enumerate(results) if r.ttft_s is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    for results, label, color in ((baseline, "no cache", "#9e9e9e"), (cached, "tiercache", "#1f77b4")):
        xs, ys = series(results)
        ax2.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=label, color=color)
    ax2.set_yscale("log")
    ax2.set_xlabel("query (trace order; Zipf over documents)")
    ax2.set_ylabel("TTFT (ms, log)")
    ax2.set_title("every query", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
