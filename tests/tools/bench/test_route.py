"""`tiercache bench route`: two instances on one Redis behind NVIDIA Dynamo's indexer.

The end-to-end run is the real command line in a process of its own (as `bench serve`'s, see
tests/tools/bench/serve/run.py): two servers, a redis-server and Dynamo's indexer. Only counts are checked,
never timings: the router's pick is each document's home (the instance whose memory tier holds it, which
the connector's `CPU` events told the indexer), and every request reused the whole document (the pick from
its memory tier, the other instance from Redis).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.zygote_client import run_tiercache
from vllm_tiercache.tools.bench.route import pick_worker


def test_the_pick_is_the_longest_host_match_then_the_longest_lower_tier_match() -> None:
    host_on_2 = {1: {"gpu": 0, "cpu": 0, "disk": 512}, 2: {"gpu": 0, "cpu": 256, "disk": 256}}
    assert pick_worker(host_on_2) == 2  # host memory beats a longer disk / Redis match
    assert pick_worker({1: {"gpu": 0, "cpu": 0, "disk": 0}, 2: {"gpu": 0, "cpu": 0, "disk": 64}}) == 2
    assert pick_worker({}) == 1  # nothing anywhere: the lowest id


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_bench_route_quick_picks_each_documents_home(tmp_path: Path) -> None:
    out_json = tmp_path / "route.json"
    proc = run_tiercache(["bench", "route", "--quick", "--work-dir", str(tmp_path / "work"), "--json", str(out_json)],
                         timeout=840)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "TTFT medians" in proc.stdout
    report = json.loads(out_json.read_text())
    assert report["docs"] == 4 and report["picked_home"] == 4, report["rows"]
    for row in report["rows"]:
        home, other = str(row["home"]), str(3 - row["home"])
        assert row["matches"][home]["cpu"] == 512, row  # the whole document, on the home's host tier
        assert other not in row["matches"] or row["matches"][other]["cpu"] == 0, row
        assert row["picked"]["cached_tokens"] == 512 and row["other"]["cached_tokens"] == 512, row
        assert row["cold"]["cached_tokens"] == 0, row
