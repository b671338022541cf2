"""Runs `tiercache bench serve --quick` through its real command line and checks what every case must show.

Why a process of its own: the benchmark starts and kills whole process groups of vLLM servers; run from the test
it proves the command line, the exit status and the clean-up, not only the functions. Only counts are
checked (every case ran, nothing failed, answers identical to vLLM alone, the connector hit), never
timings: this machine's cores are shared with whatever else runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.zygote_client import run_tiercache

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: A bound against a hung run, not a speed target: a loaded CI machine has taken 114 s per server start.
TIMEOUT_S = 1200


def run_quick(tmp_path: Path, cases: tuple[str, ...], extra_args: tuple[str, ...] = ()) -> tuple[str, dict[str, Any]]:
    """Run `--quick` on `cases` (and `extra_args`); assert it succeeded, printed its table and plot; return
    stdout and the JSON."""
    out_json, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    proc = run_tiercache(
        ["bench", "serve", "--quick", "--cases", ",".join(cases), "--work-dir", str(tmp_path / "work"),
         "--json", str(out_json), "--plot", str(plot), *extra_args], timeout=TIMEOUT_S)
    out = proc.stdout
    assert proc.returncode == 0, f"bench serve failed ({proc.returncode}):\n{out[-4000:]}\n{proc.stderr[-4000:]}"
    # progress while it ran, then the table
    assert "TTFT p50" in out and "tok/s" in out and "working set / budget" in out
    report = json.loads(out_json.read_text())
    assert report["working_set_ratio"] >= 4.0
    assert report["case_errors"] == {}
    for row in report["rows"]:
        assert row["requests"] == 16 and row["failed"] == 0, (row["case"], row["users"], row["errors"])
        assert row["ttft_p50_s"] is not None and row["out_tok_per_s"] > 0
        assert row["peak_rss_bytes"] > 0
    assert plot.read_bytes().startswith(PNG_MAGIC)
    return out, report


def rows_checked(report: dict[str, Any], family: str, cases: tuple[str, ...],
                 baseline: str) -> dict[tuple[str, int], dict[str, Any]]:
    """The rows by (case, users), every case at users 1 and 4, checked: the family's working set at least 4x
    vLLM's KV budget; the baseline (vLLM alone) shows no connector; every tiercache case's answers were all
    compared with vLLM alone's on the same model, and identical (greedy), with no load error and later
    turns cached."""
    assert set(report["families"]) == {family} and report["families"][family]["working_set_ratio"] >= 4.0
    rows = {(r["case"], r["users"]): r for r in report["rows"]}
    assert set(rows) == {(case, users) for case in cases for users in (1, 4)}
    for label, row in rows.items():
        if label[0] == baseline:
            assert row["kv_hit"] is None and row["ec_hit"] is None, label
            continue
        assert row["compared"] == 16 and row["mismatches"] == 0, label
        assert row["kv_load_errors"] == 0, label
        assert row["cached_share_later_turns"] > 0, label
        assert row["ttft_p50_ratio"] is not None and row["throughput_ratio"] is not None, label
    return rows
