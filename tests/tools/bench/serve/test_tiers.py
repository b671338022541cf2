"""`tiercache bench serve`'s tiered text cases without a server: the object cases are known, build the tiers
they are named after, get a private SeaweedFS bucket, and a missing ``weed`` is one line before any server;
``--store-rtt-ms`` puts the private Redis and bucket behind a delaying proxy."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import pytest
import redis

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.tools.bench.serve import tiers
from vllm_tiercache.tools.bench.serve.command import TEXT_CASES, BenchServeError, _settings, add_arguments, run
from vllm_tiercache.tools.bench.serve.report import format_table


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_object_cases_are_text_cases_in_table_order() -> None:
    assert TEXT_CASES[-2:] == ("memory-object", "memory-disk-object")
    settings = _settings(_args("--cases", "memory-disk-object,vllm,memory-object"))
    assert settings["cases"] == ["vllm", "memory-object", "memory-disk-object"]


@pytest.mark.parametrize(("case", "kinds"), [("memory-object", ["memory", "object"]),
                                             ("memory-disk-object", ["memory", "disk", "object"]),
                                             ("memory-disk-redis", ["memory", "disk", "redis"])])
def test_each_case_builds_the_tiers_it_is_named_after(case: str, kinds: list[str], tmp_path: Path) -> None:
    stores = {"redis_url": "redis://127.0.0.1:1/0",
              "object": {"kind": "object", "endpoint": "http://127.0.0.1:9", "bucket": "tiercache-bench",
                         "path_style": True}}
    config = tiers.kv_transfer(case, "bench-serve-x", 64, 64 << 20, 16 << 20, tmp_path, stores)
    extra = config["kv_connector_extra_config"]
    store = StoreConfig.from_dict({"tiers": extra["tiers"]})
    assert [tier.kind for tier in store.tiers] == kinds
    assert store.tiers[0].capacity == 16 << 20  # the small memory tier: the lower tiers serve the spill
    if "object" in kinds:
        assert store.tiers[-1].prefix == f"bench-serve-x/{case}/"  # each case its own records and capacity
    if "disk" in kinds:
        assert store.tiers[1].path == str(tmp_path / "tiers" / case)
    assert "lookup_budget_ms" not in extra  # the store's own unless the bench was given one


def test_the_lookup_budget_reaches_the_store_and_is_checked_at_parse_time(tmp_path: Path) -> None:
    assert _settings(_args("--cases", "vllm,memory-object"))["lookup_budget_ms"] is None
    assert _settings(_args("--cases", "vllm,memory-object", "--lookup-budget-ms", "1000"))["lookup_budget_ms"] == 1000
    stores = {"redis_url": None, "object": {"kind": "object", "bucket": "tiercache-bench"}}
    extra = tiers.kv_transfer("memory-object", "n", 64, 1 << 26, 1 << 24, tmp_path, stores,
                              lookup_budget_ms=1000.0)["kv_connector_extra_config"]
    assert StoreConfig.from_dict(extra).lookup_budget_ms == 1000.0
    with pytest.raises(SystemExit):
        _args("--lookup-budget-ms", "0.5")


def test_a_missing_weed_is_one_line_before_any_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TIERCACHE_WEED", str(tmp_path / "no-weed"))
    with pytest.raises(BenchServeError, match="--cases memory-object,memory-disk-object need SeaweedFS: "
                                              "TIERCACHE_WEED="):
        _settings(_args("--cases", "vllm,memory-object,memory-disk-object"))
    assert run(_args("--cases", "memory-object", "--work-dir", str(tmp_path / "work"))) == 1
    assert "tiercache bench serve: error: --cases memory-object need SeaweedFS" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()
    assert tiers.weed_missing(["vllm", "memory-disk"]) is None  # no object case: weed is not needed


@pytest.mark.s3
def test_the_object_cases_get_a_private_bucket_and_its_credentials_only_while_the_bench_runs(
        s3_server, monkeypatch: pytest.MonkeyPatch) -> None:
    # the session's SeaweedFS stands in for the private one the bench would start (its start and stop are
    # the fixture's, tested there): this checks the bucket, the environment and its restoring
    monkeypatch.setattr("vllm_tiercache.tools.s3_server.SeaweedFSServer", lambda: contextlib.nullcontext(s3_server))
    before = os.environ.get("AWS_SECRET_ACCESS_KEY")
    with tiers.private_stores(["vllm", "memory-object"]) as stores:
        item = stores["object"]
        assert stores["redis_url"] is None and item["kind"] == "object" and item["bucket"]
        assert os.environ["AWS_SECRET_ACCESS_KEY"]  # the servers inherit it: the AWS chain
        assert "secret" not in repr(item).lower()
        store = StoreConfig.from_dict({"tiers": [{**item, "prefix": "probe/"}]})
        from vllm_tiercache.shared.store.tiers.object.client import make_client

        client = make_client(store.tiers[0])
        client.put_object(Bucket=item["bucket"], Key="probe/x", Body=b"x")
        assert client.get_object(Bucket=item["bucket"], Key="probe/x")["Body"].read() == b"x"
    assert os.environ.get("AWS_SECRET_ACCESS_KEY") == before
    with tiers.private_stores(["vllm", "memory-disk"]) as stores:
        assert stores == {"redis_url": None, "object": None}


@pytest.mark.s3
@pytest.mark.redis
def test_the_store_rtt_puts_redis_and_the_bucket_behind_a_delaying_proxy_while_the_bench_runs(
        s3_server, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_tiercache.shared.store.tiers.object.client import make_client

    assert _settings(_args("--cases", "vllm,memory-redis"))["store_rtt_ms"] == 0.0
    assert _settings(_args("--cases", "vllm,memory-redis", "--store-rtt-ms", "20"))["store_rtt_ms"] == 20.0
    monkeypatch.setattr("vllm_tiercache.tools.s3_server.SeaweedFSServer", lambda: contextlib.nullcontext(s3_server))
    with tiers.private_stores(["vllm", "memory-redis", "memory-object"], 20.0) as stores:
        item = stores["object"]
        assert item["endpoint"] != s3_server.endpoint  # the proxy's, in front of it
        client = make_client(StoreConfig.from_dict({"tiers": [{**item, "prefix": "probe/"}]}).tiers[0])
        client.put_object(Bucket=item["bucket"], Key="probe/x", Body=b"x")
        started = time.perf_counter()
        assert client.get_object(Bucket=item["bucket"], Key="probe/x")["Body"].read() == b"x"
        assert time.perf_counter() - started >= 0.020
        with redis.Redis.from_url(stores["redis_url"]) as r:
            assert r.ping()
            started = time.perf_counter()
            assert r.ping()
            assert time.perf_counter() - started >= 0.020
    assert format_table([], 20.0).splitlines()[0].startswith("store RTT +20 ms: the Redis and object tiers behind")
    assert format_table([]).startswith("case ")  # no proxy: no line
