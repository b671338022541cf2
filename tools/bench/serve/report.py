"""The results of `tiercache bench serve`: one row per case and concurrency level, ratios to vLLM alone.

Why ratios in the same run: absolute latencies on a shared 2-core machine move by tens of percent
between runs; each case is set against vLLM alone at the same concurrency, on the same trace, measured
minutes apart on the same cores. Greedy answers are compared request by request with vLLM alone's: a
cache must not change what the model says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_tiercache.tools.bench.serve.load import RequestResult
from vllm_tiercache.tools.demo.report import percentile

BASELINE = "vllm"


def summarize(results: list[RequestResult], wall_s: float, stats: dict[str, Any] | None, block_size: int,
              peak_rss: int) -> dict[str, Any]:
    """One row's figures from a level's results, the connector's counters (None: no connector) and RSS."""
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    prompt = sum(r.prompt_tokens for r in ok)
    later = [r for r in ok if r.turn > 0]
    later_prompt = sum(r.prompt_tokens for r in later)
    row: dict[str, Any] = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "wall_s": wall_s,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_s": percentile(itls, 0.5),
        "req_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "out_tok_per_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s > 0 else None,
        "prompt_tokens": prompt,
        # usage.prompt_tokens_details.cached_tokens: vLLM's own prefix cache and the connector together
        "cached_share": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "cached_share_later_turns": sum(r.cached_tokens for r in later) / later_prompt if later_prompt else 0.0,
        "peak_rss_bytes": peak_rss,
    }
    if stats is not None:
        loaded = int(stats.get("kv_loaded_blocks", 0)) * block_size
        row["kv_loaded_tokens"] = loaded
        row["kv_hit"] = loaded / prompt if prompt else 0.0
        row["kv_load_errors"] = int(stats.get("kv_load_errors", 0))
        row["tier_hits"] = dict(stats.get("tier_hits", {}))
        # the encoder connector's lookups (vLLM asks it about an image whose encoder output it needs)
        lookups = int(stats.get("ec_hits", 0)) + int(stats.get("ec_misses", 0))
        row["ec_lookups"] = lookups
        row["ec_saves"] = int(stats.get("ec_saves", 0))
        row["ec_hit"] = int(stats.get("ec_hits", 0)) / lookups if lookups else None
    else:
        row["kv_loaded_tokens"] = None
        row["kv_hit"] = None
        row["ec_hit"] = None
    return row


def mismatches(results: list[RequestResult], reference: dict[tuple[int, int, int], str]) -> int:
    """Requests that both runs answered whose answer text differs from the reference's (vLLM alone's)."""
    return sum(1 for r in results if r.error is None and r.key in reference and reference[r.key] != r.text)


def add_ratios(rows: list[dict[str, Any]], baselines: dict[str, str] | None = None) -> None:
    """Per row: TTFT p50/p90 and throughput divided by vLLM alone's at the same concurrency.

    `baselines` maps a case to the case it is compared with (vLLM alone on the same model and trace);
    cases it does not name are compared with `BASELINE`.
    """
    baselines = baselines or {}
    base = {(r["case"], r["users"]): r for r in rows}
    for row in rows:
        ref = base.get((baselines.get(row["case"], BASELINE), row["users"]))

        def ratio(key: str, row: dict[str, Any] = row, ref: dict[str, Any] | None = ref) -> float | None:
            if ref is None or row.get(key) is None or not ref.get(key):
                return None
            return row[key] / ref[key]

        row["ttft_p50_ratio"] = ratio("ttft_p50_s")
        row["ttft_p90_ratio"] = ratio("ttft_p90_s")
        row["throughput_ratio"] = ratio("out_tok_per_s")


def _ms(value: float | None) -> str:
    return f"{value * 1e3:.0f}" if value is not None else "-"


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def format_table(rows: list[dict[str, Any]], store_rtt_ms: float = 0.0) -> str:
    """The stdout table: one line per case and concurrency (first, the delay of Redis and S3 where they were
    behind `--store-rtt-ms`'s proxy)."""
    from vllm_tiercache.tools.bench.rtt_proxy import store_rtt_header

    rtt = store_rtt_header(store_rtt_ms, "the Redis and object tiers")
    head = (f"{'case':<18} {'users':>5} {'reqs':>5} {'fail':>4} {'mism':>4} {'TTFT p50':>8} {'p90':>7} {'p99':>7} "
            f"{'ITL p50':>7} {'req/s':>6} {'tok/s':>6} {'cached':>6} {'KV hit':>6} {'EC hit':>6} {'RSS GiB':>7} "
            f"{'TTFT50 x':>8} {'tput x':>6}")
    lines = [*([rtt] if rtt else []), head, "-" * len(head)]
    for r in rows:
        kv = f"{r['kv_hit']:.0%}" if r.get("kv_hit") is not None else "-"
        ec = f"{r['ec_hit']:.0%}" if r.get("ec_hit") is not None else "-"
        lines.append(
            f"{r['case']:<18} {r['users']:>5} {r['requests']:>5} {r['failed']:>4} {r.get('mismatches', 0):>4} "
            f"{_ms(r['ttft_p50_s']):>6}ms {_ms(r['ttft_p90_s']):>5}ms {_ms(r['ttft_p99_s']):>5}ms "
            f"{_ms(r['itl_p50_s']):>5}ms {r['req_per_s'] or 0:>6.2f} {r['out_tok_per_s'] or 0:>6.1f} "
            f"{r['cached_share']:>6.0%} {kv:>6} {ec:>6} {r['peak_rss_bytes'] / 2**30:>7.2f} "
            f"{_x(r.get('ttft_p50_ratio')):>8} {_x(r.get('throughput_ratio')):>6}")
    lines.append("")
    lines.append("mism = greedy answers that differ from vLLM alone's (same request); cached = prompt tokens served "
                 "from any cache (usage.cached_tokens: vLLM's prefix cache + the connector); KV hit = prompt tokens "
                 "the connector loaded (its stats) / prompt tokens; EC hit = the encoder connector's lookups that "
                 "found the image's encoder output; RSS = peak sum over the server's process group; "
                 "x = ratio to vLLM alone (mm- cases: to mm-vllm) at the same users (TTFT p50: lower is better; "
                 "tput = output tokens/s)")
    return "\n".join(lines)


def write_plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """TTFT p50/p90/p99 and output-token throughput against concurrency, one line per case; None without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    for case in cases:
        mine = sorted((r for r in rows if r["case"] == case), key=lambda r: r["users"])
        users = [r["users"] for r in mine]
        for ax, key in zip(axes[:3], ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"), strict=True):
            ax.plot(users, [(r[key] or 0) * 1e3 for r in mine], marker="o", label=case)
        axes[3].plot(users, [r["out_tok_per_s"] or 0 for r in mine], marker="o", label=case)
    for ax, title in zip(axes, ("TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT p99 (ms)", "output tokens / s"), strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("concurrent users")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    for ax in axes[:3]:
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
