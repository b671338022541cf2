"""`tiercache bench kv --quick`, the CI smoke run: real engines, every hit a real hit, and each tiered hit
paired with vLLM's own resident hit of the same prompt in the same engine. No timings are asserted."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.zygote_client import run_job


@pytest.mark.engine
@pytest.mark.timeout(1260)
def test_quick_run_pairs_each_tiered_hit_with_a_resident_hit_in_its_own_engine(tmp_path) -> None:
    done = run_job(
        [sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "kv", "--quick", "--cases",
         "tiered-memory,tiered-disk", "--prompts", "1", "--hit-repeats", "1", "--json",
         "--work-dir", str(tmp_path / "work")],
        env=dict(os.environ), cwd=os.getcwd(), timeout=1200)  # a hang bound: 484 s seen on a loaded 2-core VM
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    rows = {row["case"]: row for row in report["rows"]}
    assert set(rows) == {"tiered-memory", "tiered-disk"}  # no baseline engine: the pairs need none
    for case in ("tiered-memory", "tiered-disk"):
        row = rows[case]
        # a real hit from the connector (vLLM's cache was emptied before it), then vLLM's own hit
        assert row["status"] == "ok" and min(row["num_cached_tokens"]) >= report["min_hit_tokens"], row
        assert row["own_resident_s"] is not None and row["ratio_to_own_resident"] is not None, row
        # the connector's own account of the hit's load: all of the hit's bytes, parts within the whole
        parts = row["breakdown"]
        assert parts["hits"] == 1 and parts["bytes"] == report["hit_bytes"], parts
        assert parts["before_forward"] and parts["failed_hits"] == 0  # a CPU loads before the forward
        # medians rounded to the microsecond each: the parts fit in the whole within that rounding
        assert 0 < parts["fetch_s"] and 0 <= parts["copy_s"]
        assert parts["fetch_s"] + parts["copy_s"] <= parts["load_s"] + 2e-6, parts
        # one hit: its medians are its own figures, so the load and the rest add up to the hit's extra time
        assert abs(parts["load_s"] + parts["outside_load_s"] - parts["over_resident_s"]) < 1e-5, parts
    # a memory hit copies its records into the blocks; a disk hit on a CPU reads them there in place
    assert rows["tiered-memory"]["breakdown"]["copy_s"] > 0
    targets = {t["case"]: t for t in report["targets"] if t["reference"].startswith("resident")}
    assert targets["tiered-memory"]["reference"] == "resident (same engine)"
    assert "vLLM's resident hit right after each" in done.stderr  # progress names the pairs


def test_breakdown_takes_the_slowest_worker_and_leaves_out_what_it_cannot_split() -> None:
    """Tensor-parallel workers load their shares of a step at once (the slowest one's time, everyone's
    bytes); a hit whose load failed somewhere is left out; a layerwise load overlaps the forward, so the
    time outside it is not reported."""
    from vllm_tiercache.tools.bench.kv.engine import _load_of
    from vllm_tiercache.tools.bench.kv.report import CaseResult, hit_breakdown

    def line(rank: int, load_s: float, failed: int = 0, before_forward: bool = True) -> dict:
        return {"pid": 100 + rank, "rank": rank, "load_s": load_s, "fetch_s": load_s / 4, "copy_s": load_s / 2,
                "bytes": 1000, "failed": failed, "before_forward": before_forward}

    two_ranks = _load_of([line(0, 0.002), line(1, 0.003)])
    assert two_ranks == {"load_s": 0.003, "fetch_s": 0.00075, "copy_s": 0.0015, "bytes": 2000, "failed": 0,
                         "before_forward": True}
    assert _load_of([]) is None
    loads = [two_ranks, _load_of([line(0, 0.002), line(1, 0.009, failed=1)]), None]
    res = CaseResult("tiered-memory", ttft_s=[0.010, 0.020, 0.006], resident_ttft_s=[0.006, 0.006, 0.006],
                     loads=loads)
    parts = hit_breakdown(res)
    assert parts is not None and parts["hits"] == 1 and parts["failed_hits"] == 1
    assert parts["over_resident_s"] == 0.004 and parts["load_s"] == 0.003 and parts["outside_load_s"] == 0.001
    layerwise = CaseResult("tiered-memory", ttft_s=[0.010], resident_ttft_s=[0.006],
                           loads=[_load_of([line(0, 0.003, before_forward=False)])])
    assert hit_breakdown(layerwise)["outside_load_s"] is None  # type: ignore[index]
    assert hit_breakdown(CaseResult("tiered-memory", ttft_s=[0.010], loads=[two_ranks])) is None  # unpaired
