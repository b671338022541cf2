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
    client = s3_bucket.server.client()
    assert client.list_objects_v2(Bucket=s3_bucket.bucket, Prefix="bench-").get("KeyCount", 0) == 0  # cleaned


def test_an_endpoint_needs_its_bucket():
    with pytest.raises(UsageError, match="--s3-endpoint: needs --s3-bucket"):
        run_bench(_args("--tiers", "object", "--s3-endpoint", "http://127.0.0.1:1"))
