"""`tiercache bench kv --quick`, the CI smoke run: real engines, every hit a real hit, and each tiered hit
paired with vLLM's own resident hit of the same prompt in the same engine. No timings are asserted."""

from __future__ import annotations

import json
import subprocess
import sys


def test_quick_run_pairs_each_tiered_hit_with_a_resident_hit_in_its_own_engine(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "kv", "--quick", "--cases",
         "tiered-memory,tiered-disk", "--prompts", "1", "--hit-repeats", "1", "--json",
         "--work-dir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600)
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
        assert 0 < parts["fetch_s"] and 0 <= parts["copy_s"] and parts["fetch_s"] + parts["copy_s"] <= parts["load_s"]
        # one hit: its medians are its own figures, so the load and the rest add up to the hit's extra time
        assert abs(parts["load_s"] + parts["outside_load_s"] - parts["over_resident_s"]) < 1e-5, parts
    # a memory hit copies its records into the blocks; a disk hit on a CPU reads them there in place
    assert rows["tiered-memory"]["breakdown"]["copy_s"] > 0
    targets = {t["case"]: t for t in report["targets"] if t["reference"].startswith("resident")}
    assert targets["tiered-memory"]["reference"] == "resident (same engine)"
    assert "vLLM's resident hit right after each" in done.stderr  # progress names the pairs
