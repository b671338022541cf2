"""The results of `tiercache bench kv`: one case's measurements (`CaseResult`), where a hit's time goes
(`hit_breakdown`), and the human table of the report (`format_table`).

Why apart from `vllm_tiercache.tools.bench.kv.command`: that module runs the engines and builds the report; this one
only reads measurements and the report's dict, so the arithmetic and the table are read and tested
without engines.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CaseResult:
    """One row of the table: per-prompt TTFTs and cached-token counts, and whether it really hit."""

    name: str
    ttft_s: list[float] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    error: str | None = None
    #: vLLM's KV capacity in blocks in this case's engine, and whether its hybrid KV cache manager ran
    kv_blocks: int | None = None
    hma: bool | None = None
    #: vLLM's resident hit of the same prompts in the same engine, right after each hit (paired steps)
    resident_ttft_s: list[float] = field(default_factory=list)
    resident_cached_tokens: list[int] = field(default_factory=list)
    #: the connector's own account of each hit's load (`vllm_tiercache.kvcache.load.trace`; None: no load)
    loads: list[dict[str, Any] | None] = field(default_factory=list)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.ttft_s) if self.ttft_s else None

    @property
    def own_resident_s(self) -> float | None:
        return statistics.median(self.resident_ttft_s) if self.resident_ttft_s else None

    @property
    def min_s(self) -> float | None:
        return min(self.ttft_s) if self.ttft_s else None


def hit_breakdown(res: CaseResult) -> dict[str, Any] | None:
    """Where a hit's time over vLLM's resident hit of the same prompt (same engine) goes, medians over the
    paired hits whose load failed nowhere, in seconds: the connector's load (its store reads and checks,
    its copies into the KV cache, its other work) and, where the load ran before the forward (a CPU's
    default), the rest outside it: vLLM's own work for an external hit and the connector's plumbing. A
    layerwise load overlaps the forward, so there the rest is not the difference (None). None without
    paired hits and load traces."""
    if not res.resident_ttft_s or not len(res.ttft_s) == len(res.resident_ttft_s) == len(res.loads):
        return None
    pairs = [(hit, resident, load) for hit, resident, load
             in zip(res.ttft_s, res.resident_ttft_s, res.loads, strict=True) if load is not None and not load["failed"]]
    if not pairs:
        return None

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 6)

    before_forward = all(load["before_forward"] for _, _, load in pairs)
    return {
        "over_resident_s": median([hit - resident for hit, resident, _ in pairs]),
        "load_s": median([load["load_s"] for _, _, load in pairs]),
        "fetch_s": median([load["fetch_s"] for _, _, load in pairs]),
        "copy_s": median([load["copy_s"] for _, _, load in pairs]),
        "loader_other_s": median([load["load_s"] - load["fetch_s"] - load["copy_s"] for _, _, load in pairs]),
        "outside_load_s": (median([hit - resident - load["load_s"] for hit, resident, load in pairs])
                           if before_forward else None),
        "bytes": median([load["bytes"] for _, _, load in pairs]),
        "hits": len(pairs),
        "failed_hits": sum(1 for load in res.loads if load is not None and load["failed"]),
        "before_forward": before_forward,
    }


def format_table(report: dict[str, Any]) -> str:
    """The human table: one row per case, then the targets with ok/BELOW."""
    lines = [
        f"TTFT, {report['prompts']} prompts x {report['prompt_len']} tokens, {report.get('dtype', 'bfloat16')} "
        f"(hit cases: each sent "
        f"{report['hit_repeats']}x), model {report['model']}; "
        f"hits need num_cached_tokens >= {report['min_hit_tokens']}; case 8's disk admission: "
        f"{report.get('admission', 'always')}" + ("; disk and Redis records sealed (--encrypt)" if report.get("sealed")
                                                   else "")
        + (f"; lookup_budget_ms {report['lookup_budget_ms']:g}" if report.get("lookup_budget_ms") is not None else "")
        + (f"; store RTT +{report['store_rtt_ms']:g} ms (Redis and S3 behind a delaying proxy, raw references "
           "too: --store-rtt-ms)" if report.get("store_rtt_ms") else ""),
        f"{'case':44} {'TTFT med (s)':>12} {'min (s)':>8} {'x resident':>10} {'own res (s)':>11} {'x own res':>9} "
        f"{'x cold':>7} {'cached tokens':>14}  note",
    ]
    for row in report["rows"]:
        med = f"{row['ttft_median_s']:.4f}" if row["status"] == "ok" else "-"
        low = f"{row['ttft_min_s']:.4f}" if row["status"] == "ok" else "-"
        res = f"{row['ratio_to_resident']:.2f}" if row["ratio_to_resident"] is not None else "-"
        cold = f"{row['ratio_to_cold']:.3f}" if row["ratio_to_cold"] is not None else ""
        own_res = f"{row['own_resident_s']:.4f}" if row.get("own_resident_s") is not None else ""
        x_own = f"{row['ratio_to_own_resident']:.2f}" if row.get("ratio_to_own_resident") is not None else ""
        cached = "/".join(str(c) for c in row["num_cached_tokens"]) if row["num_cached_tokens"] else "-"
        if len(cached) > 14:
            cached = f"{min(row['num_cached_tokens'])}..{max(row['num_cached_tokens'])}"
        if row["status"] == "error":
            note = f"NOT MEASURED: {row['error']}"[:160]
        elif row["status"] == "miss":
            med_all = statistics.median(row["ttft_s"]) if row["ttft_s"] else float("nan")
            note = f"NO HIT (connector did not supply the prefix; TTFT {med_all:.4f}s is a prefill)"
        else:
            note = ""
        lines.append(f"{row['label']:44} {med:>12} {low:>8} {res:>10} {own_res:>11} {x_own:>9} {cold:>7} {cached:>14}"
                     f"  {note}".rstrip())
    capacity = [row for row in report["rows"] if row.get("kv_blocks") is not None]
    if capacity:
        lines.append("")
        lines.append("vLLM KV capacity (blocks) and hybrid KV cache manager per case: " + ", ".join(
            f"{row['case']} {row['kv_blocks']}{' HMA' if row.get('hma') else ' no-HMA'}" for row in capacity))
    media = report.get("media") or {}
    if media and report.get("hit_bytes"):
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.2f} ms"

        lines.append("")
        def hot(name: str) -> str:
            value = media.get(f"{name}_hot")
            return "" if value is None else f" (cache-hot {ms(value)})"

        lines.append(f"raw media for the {report['hit_bytes'] / 2**20:.1f} MiB a hit loads (1 MiB pieces, from DRAM): "
                     f"memory copy {ms(media.get('memory'))}{hot('memory')}, page-cache read "
                     f"{ms(media.get('page_cache'))}{hot('page_cache')}, O_DIRECT read {ms(media.get('o_direct'))}, "
                     f"redis-py GET {ms(media.get('redis'))}")
        if media.get("s3_get") is not None:  # the object case's own objects: one per layer and chunk
            lines.append(f"raw S3 GETs of the object case's objects ({media['s3_objects']} objects, "
                         f"{media['s3_bytes'] / 2**20:.1f} MiB, boto3 with the tier's concurrency in flight): "
                         f"{ms(media['s3_get'])}")
        for row in report["rows"]:
            if row.get("share_of_raw") is not None:
                where = " in the same engine" if row.get("own_resident_s") else ""
                lines.append(f"  {row['case']:14} share of the raw medium's speed (raw / (hit - resident{where})): "
                             f"{row['share_of_raw']:.2f}")
    broken_down = [row for row in report["rows"] if row.get("breakdown")]
    if broken_down:
        lines.append("")
        lines.append("where a hit's time over vLLM's resident hit (same engine) goes, medians per hit in ms "
                     "(the connector's load trace):")
        lines.append(f"  {'case':16} {'over resident':>13} {'load':>7} {'store reads':>11} {'copies':>7} "
                     f"{'loader other':>12} {'outside load':>12} {'MiB':>6}")
        for row in broken_down:
            b = row["breakdown"]
            outside = "overlapped" if b["outside_load_s"] is None else f"{b['outside_load_s'] * 1e3:.2f}"
            failed = f"  ({b['failed_hits']} hits with a failed load left out)" if b["failed_hits"] else ""
            lines.append(f"  {row['case']:16} {b['over_resident_s'] * 1e3:>13.2f} {b['load_s'] * 1e3:>7.2f} "
                         f"{b['fetch_s'] * 1e3:>11.2f} {b['copy_s'] * 1e3:>7.2f} {b['loader_other_s'] * 1e3:>12.2f} "
                         f"{outside:>12} {b['bytes'] / 2**20:>6.1f}{failed}")
    lines.append("")
    lines.append("targets:")
    for t in report["targets"]:
        verdict = "n/a" if t["ratio"] is None else ("ok" if t["ok"] else "BELOW")
        ratio = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
        formula = t.get("formula") or f"{t['case']:14} / {t['reference']:9}"
        lines.append(f"  {formula} = {ratio:>6}  (target <= {t['target']})  {verdict}")
    return "\n".join(lines)
