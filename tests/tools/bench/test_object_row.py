"""`tiercache bench tiers` object row: measured against a real S3 store (the session's SeaweedFS)."""

from __future__ import annotations

import argparse

import pytest

from vllm_tiercache.tools.bench.tiers import add_arguments, format_table, run_bench
from vllm_tiercache.tools.cli import UsageError

pytestmark = pytest.mark.s3


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_object_row_against_raw_and_one_at_a_time(s3_bucket):
    args = _args("--tiers", "object", "--sizes", "64KiB", "--repeat", "1",
                 "--s3-endpoint", s3_bucket.server.endpoint, "--s3-bucket", s3_bucket.bucket)
    rows = run_bench(args)
    assert [r["tier"] for r in rows] == ["object"] and rows[0]["batch"] == 32
    row = rows[0]
    assert all(row[k] > 0 for k in ("put_gib_s", "put_ref_gib_s", "get_gib_s", "get_ref_gib_s", "get_serial_gib_s"))
    assert "get vs boto3 one at a time" in format_table(rows)
    # the CPU per record, the client's always; a store of the user's (here: --s3-endpoint) has no server figure
    cpu = row["cpu_ms_per_record"]
    assert set(cpu) == {"put", "put boto3", "get", "get boto3"}
    assert all(c["client"] > 0 and c["server"] is None for c in cpu.values())
    assert "CPU ms per record, client / server: put " in format_table(rows)
    client = s3_bucket.server.client()
    assert client.list_objects_v2(Bucket=s3_bucket.bucket, Prefix="bench-").get("KeyCount", 0) == 0  # cleaned


def test_an_endpoint_needs_its_bucket():
    with pytest.raises(UsageError, match="--s3-endpoint: needs --s3-bucket"):
        run_bench(_args("--tiers", "object", "--s3-endpoint", "http://127.0.0.1:1"))


def test_a_private_seaweedfs_reports_its_cpu_per_record(s3_bucket, monkeypatch):
    """A SeaweedFS the bench started itself (`object_row.s3_target` notes its process) has its CPU read too;
    the session's server stands in for it."""
    from vllm_tiercache.tools.bench import object_row

    endpoint = s3_bucket.server.endpoint
    monkeypatch.setitem(object_row._PRIVATE_SERVERS, endpoint, s3_bucket.server.proc.pid)
    rows = run_bench(_args("--tiers", "object", "--sizes", "64KiB", "--repeat", "1",
                           "--s3-endpoint", endpoint, "--s3-bucket", s3_bucket.bucket))
    cpu = rows[0]["cpu_ms_per_record"]
    # (the server's in clock ticks of 10 ms: a fast machine's small batch may read 0)
    assert all(c["client"] > 0 and c["server"] is not None and c["server"] >= 0 for c in cpu.values())
