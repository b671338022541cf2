"""`tiercache bench kv`'s object-tier case (``tiered-object``) without engines: the case is known, the tier
it builds is an object tier the store accepts, a missing ``weed`` is one line before anything runs, the raw
GET reference really GETs (the session's SeaweedFS) and the table carries its targets; with ``--store-rtt-ms``
the Redis and object cases' engines and raw references reach their stores through a delaying proxy."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.tools.bench.kv import object_case
from vllm_tiercache.tools.bench.kv.command import CASE_LABELS, HIT_CASES, MEDIUM_OF, TARGETS, Bench, add_arguments
from vllm_tiercache.tools.bench.kv.medium import object_get_s
from vllm_tiercache.tools.bench.kv.report import format_table
from vllm_tiercache.tools.cli import main


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_object_case_is_a_hit_case_with_its_medium_and_targets(tmp_path: Path) -> None:
    assert "tiered-object" in CASE_LABELS and "tiered-object" in HIT_CASES
    assert MEDIUM_OF["tiered-object"] == "s3_get"
    assert ("tiered-object", "cold", 0.2) in TARGETS
    bench = Bench(_args("--cases", "cold,resident,tiered-object"), tmp_path)
    assert bench.cases == ["cold", "resident", "tiered-object"]
    target = {"kind": "object", "endpoint": "http://127.0.0.1:9", "bucket": "tiercache-bench", "path_style": True}
    item = object_case.tier_item(target, bench.namespace)
    for role in ("kv_both", "kv_consumer"):  # the producer's and the consumer's: the object tier alone
        extra = bench.tiered(role, [item])["kv_connector_extra_config"]
        config = StoreConfig.from_dict({"tiers": extra["tiers"]})
        assert [tier.kind for tier in config.tiers] == ["object"]
        assert config.tiers[0].prefix == f"{bench.namespace}/" and config.tiers[0].concurrency == 16
        assert "secret" not in repr(extra).lower() and "AWS" not in repr(extra)  # credentials: the AWS chain
        assert "lookup_budget_ms" not in extra  # the store's own unless asked


def test_the_lookup_budget_goes_to_every_tiered_case_and_is_checked_at_parse_time(tmp_path: Path) -> None:
    bench = Bench(_args("--cases", "tiered-object", "--lookup-budget-ms", "2000"), tmp_path)
    extra = bench.tiered("kv_consumer", [{"kind": "memory", "capacity": "1GiB"}])["kv_connector_extra_config"]
    assert StoreConfig.from_dict(extra).lookup_budget_ms == 2000.0
    for bad in ("0", "60001", "x"):
        with pytest.raises(SystemExit):
            _args("--lookup-budget-ms", bad)


def test_a_missing_weed_is_one_line_before_any_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERCACHE_WEED", str(tmp_path / "no-weed"))
    work = tmp_path / "work"
    assert main(["bench", "kv", "--cases", "cold,tiered-object", "--work-dir", str(work)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiercache: error: --cases tiered-object needs SeaweedFS: TIERCACHE_WEED=")
    assert "make setup" in err
    assert not work.exists()  # refused before the work dir, the model or any engine
    object_case.require_weed("cold,resident")  # no object case: weed is not needed


def test_object_sizes_are_the_packs_a_hit_reads() -> None:
    # BENCH_SPEC in bf16: 12 layers, 4 KV heads of 64: 1 KiB per layer and token; chunks of 256 tokens
    sizes = object_case.object_sizes(12, 1024, 2048, 2016, 256)
    assert sizes == [12 * (256 << 10)] * 8  # 8 whole chunks, a pack of 12 layers each (the last one partly used)
    assert len(object_case.object_sizes(12, 1024, 8192, 8160, 256)) == 32
    assert object_case.object_sizes(2, 1, 600, 576, 256) == [512, 512, 176]  # the prompt's partial last chunk


@pytest.mark.s3
def test_the_raw_get_reference_gets_every_object_and_leaves_nothing(s3_bucket) -> None:
    item = s3_bucket.tier_config(prefix="bench-raw/")
    seconds = object_get_s([64 << 10] * 8 + [1000], item, 4)
    assert seconds is not None and 0 < seconds < 10
    client = s3_bucket.server.client()
    assert client.list_objects_v2(Bucket=s3_bucket.bucket, Prefix="bench-raw/").get("KeyCount", 0) == 0


def test_the_table_says_the_raw_get_and_its_target() -> None:
    row = {"case": "tiered-object", "label": object_case.LABEL, "status": "ok", "error": None,
           "ttft_median_s": 0.05, "ttft_min_s": 0.04, "ttft_s": [0.05], "num_cached_tokens": [2016],
           "ratio_to_resident": None, "ratio_to_cold": None, "own_resident_s": 0.02,
           "ratio_to_own_resident": 2.5, "raw_medium_s": 0.025, "share_of_raw": 0.833}
    target = object_case.raw_get_target({"tiered-object": row}, resident=0.03)
    assert target is not None and target["ratio"] == 1.2 and target["ok"]  # (0.05 - 0.02) / 0.025, own resident
    slow = object_case.raw_get_target({"tiered-object": {**row, "raw_medium_s": 0.01}}, resident=0.03)
    assert slow is not None and slow["ratio"] == 3.0 and not slow["ok"]
    assert object_case.raw_get_target({}, resident=0.03) is None
    report = {"media": {"memory": 0.003, "s3_get": 0.025, "s3_objects": 96, "s3_bytes": 24 << 20},
              "hit_bytes": 24 << 20, "prompt_len": 2048, "prompts": 1, "hit_repeats": 1, "model": "m",
              "min_hit_tokens": 2016, "rows": [row], "targets": [target]}
    table = format_table(report)
    assert "raw S3 GETs of the object case's objects (96 objects, 24.0 MiB" in table and "25.00 ms" in table
    assert "(tiered-object - resident (same engine)) / raw S3 GET =  1.200  (target <= 1.5)  ok" in table


@pytest.mark.s3
@pytest.mark.redis
def test_the_store_rtt_puts_the_redis_and_object_cases_behind_a_delaying_proxy(
        s3_bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_tiercache.shared.store.tiers.object.client import make_client

    bench = Bench(_args("--cases", "tiered-redis,tiered-object", "--store-rtt-ms", "20"), tmp_path)
    assert bench.store_rtt_ms == 20.0 and Bench(_args(), tmp_path).store_rtt_ms == 0.0
    reached: list[str] = []

    def check(name: str, producer: dict[str, Any], consumer: dict[str, Any]) -> None:
        """Stands in for the engines: their tier reaches the store through the proxy, a round trip away."""
        tier = consumer["kv_connector_extra_config"]["tiers"][0]
        assert producer["kv_connector_extra_config"]["tiers"][0] == tier
        started = time.perf_counter()
        if tier["kind"] == "redis":
            with redis.Redis.from_url(tier["url"]) as client:
                assert client.ping()
        else:
            assert tier["endpoint"] != s3_bucket.server.endpoint
            client = make_client(StoreConfig.from_dict({"tiers": [tier]}).tiers[0])
            client.put_object(Bucket=tier["bucket"], Key=f"{tier['prefix']}x", Body=b"x")
        assert time.perf_counter() - started >= 0.020
        reached.append(tier["kind"])

    @contextlib.contextmanager
    def session_bucket(*_: object) -> Iterator[dict[str, Any]]:
        yield {"kind": "object", "endpoint": s3_bucket.server.endpoint, "bucket": s3_bucket.bucket,
               "path_style": True}

    monkeypatch.setattr(bench, "_produce_then_consume", check)
    monkeypatch.setattr("vllm_tiercache.tools.bench.object_row.s3_target", session_bucket)
    bench.case_tiered_redis()
    object_case.run_case(bench)
    assert reached == ["redis", "object"]
    report = {"media": {}, "hit_bytes": None, "prompt_len": 512, "prompts": 1, "hit_repeats": 1, "model": "m",
              "min_hit_tokens": 480, "rows": [], "targets": [], "store_rtt_ms": 20.0}
    assert "; store RTT +20 ms (Redis and S3 behind a delaying proxy" in format_table(report).splitlines()[0]
    assert "store RTT" not in format_table({**report, "store_rtt_ms": 0.0})
