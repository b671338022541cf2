"""`tiercache bench lookups` end to end against a real S3 store (the session's SeaweedFS), its store put
``--store-rtt-ms`` away: the header says the delay, the JSON carries it, and the lookups really crossed the
proxy (each at least one round trip: asserted from below only, a loaded machine can only add)."""

from __future__ import annotations

import json

import pytest

from vllm_tiercache.tools.bench.lookups import format_table
from vllm_tiercache.tools.cli import main

pytestmark = pytest.mark.s3


def test_a_lookup_of_a_far_store_says_its_delay_and_pays_it(s3_bucket, capsys: pytest.CaptureFixture[str]) -> None:
    store = ["--s3-endpoint", s3_bucket.server.endpoint, "--s3-bucket", s3_bucket.bucket]
    assert main(["bench", "lookups", "--keys", "32", "--repeat", "1", "--store-rtt-ms", "20", *store]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "store RTT +20 ms: the object tier behind a proxy that delays every byte 10 ms each way " \
                       "(--store-rtt-ms)"
    assert lines[1].split()[:2] == ["keys", "in"]
    fields = lines[3].split()
    assert fields[:3] == ["32", "16", "|"]
    cold_ms, listed_ms, cached_ms = (float(v) for v in fields[3:6])
    assert min(cold_ms, listed_ms, cached_ms) >= 20.0  # each stage asks the store at least once
    # (how many keys the bounded lookups found within the budget depends on the machine's load: not asserted)

    assert main(["bench", "lookups", "--keys", "1", "--repeat", "1", "--store-rtt-ms", "20", "--json", *store]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["store_rtt_ms"] for row in rows] == [20.0] and rows[0]["cached_ms"] >= 20.0
    assert format_table([{**rows[0], "store_rtt_ms": 0.0}]).startswith("  keys in flight")  # no proxy: no line
