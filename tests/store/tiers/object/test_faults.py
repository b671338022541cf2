"""The object tier when its store fails as operators meet it: a hung server (SIGSTOP), a crash mid-write
(SIGKILL), a bucket deleted under a running store, an endpoint away at start; and preflight's one line for
a missing bucket or refused credentials. Each gives misses and skipped writes, never an exception to the
caller nor wrong data, and the tier comes back by itself."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
import torch

from tests.support.waiting import wait_until
from vllm_tiercache.shared.config import ConfigError, StoreConfig
from vllm_tiercache.shared.store import StoreKey
from vllm_tiercache.shared.store.tiered import TieredStore
from vllm_tiercache.shared.store.tiers.object.tier import ObjectTier
from vllm_tiercache.tools.s3_server import SECRET_KEY

pytestmark = [pytest.mark.s3, pytest.mark.serial]


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|faults|{i}")


def _t(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def tier_of(s3_bucket, **fields) -> ObjectTier:
    return ObjectTier(StoreConfig.load({"tiers": [s3_bucket.tier_config(**fields)]}).tiers[0])


class CountingGets:
    """Wraps the tier's GET (of a record's first range): how many requests reached the network."""

    def __init__(self, tier: ObjectTier) -> None:
        self.n, self._real = 0, tier._calls._first_range
        tier._calls._first_range = self

    def __call__(self, name: str, part: int) -> tuple[bytes, int]:
        self.n += 1
        return self._real(name, part)


def test_a_hung_server_marks_the_tier_down_and_the_prober_brings_it_back(s3_bucket, caplog):
    caplog.set_level(logging.WARNING)
    tier = tier_of(s3_bucket, timeout_s=2.0, concurrency=4)
    try:
        tier.put_many([(_k(i), _t(100, i), None) for i in range(8)])
        assert tier.counters.get("puts") == 8 and not tier.down
        gets = CountingGets(tier)
        s3_bucket.server.pause()
        try:
            assert tier.get_many([_k(i) for i in range(8)]) == [None] * 8  # misses, no exception, no hang
            assert tier.down and "unreachable" in caplog.text
            assert 1 <= gets.n <= 4  # one wave on the pool at most; the rest never sent once the tier was down
            sent = gets.n
            assert tier.get_many([_k(0)]) == [None] and tier.contains_many([_k(0)]) == [False]
            tier.put_many([(_k("x"), _t(10), None)])
            assert gets.n == sent and tier.counters.get("dropped_writes") == 1  # nothing sent while down
            # the prober is at work while the server hangs (it counts a probe as it sends it; this one hangs)
            wait_until("the prober's first probe", lambda: tier.probes >= 1)
        finally:
            s3_bucket.server.resume()
        # back by a probe, or by a request sent before the tier went down that the server answered on resuming
        wait_until("the tier to find the server back", lambda: not tier.down)
        assert "reachable again" in caplog.text
        got = tier.get_many([_k(i) for i in range(8)])
        assert all(rec is not None and torch.equal(rec.tensor, _t(100, i)) for i, rec in enumerate(got))
    finally:
        tier.close()  # its prober and pool, whatever failed (the module's thread guard)


def test_a_server_killed_mid_write_leaves_whole_records_or_nothing(s3_bucket):
    tier = tier_of(s3_bucket, timeout_s=10.0, concurrency=4)
    big = {i: _t(64 * 1024, i) for i in range(24)}  # 256 KiB each
    killed = threading.Event()

    def write() -> None:
        """Batches of 4 over the 24 records in turn until the server is killed, and one batch after: the kill
        lands while it writes however late the test sees the first batch land (on a loaded machine the test
        thread saw it a batch late; the 6 batches of a fixed run could all land before the kill, leaving the
        tier up)."""
        lo = 0
        while True:
            after_kill = killed.is_set()
            tier.put_many([(_k(i), big[i], {"i": i}) for i in range(lo, lo + 4)])
            if after_kill:
                return
            lo = (lo + 4) % 24

    writer = threading.Thread(target=write)
    writer.start()
    wait_until("some records written", lambda: tier.counters.get("puts") >= 4)
    s3_bucket.server.kill()
    killed.set()
    writer.join(60)
    assert not writer.is_alive()  # the writer was never stuck
    assert tier.down
    s3_bucket.server.start()  # the same data directory: what was committed is there again
    wait_until("the prober to find the server back", lambda: not tier.down)
    got = tier.get_many([_k(i) for i in range(24)])
    hits = [i for i, rec in enumerate(got) if rec is not None]
    assert len(hits) >= 4
    assert all(torch.equal(got[i].tensor, big[i]) and got[i].meta == {"i": i} for i in hits)  # never torn
    assert tier.counters.get("corrupt") == 0  # a PUT is whole or absent: nothing torn to delete
    tier.close()


def test_a_bucket_deleted_under_a_running_store(s3_bucket, caplog):
    caplog.set_level(logging.WARNING)
    cfg = StoreConfig.load({"tiers": [{"kind": "memory", "capacity": "1MiB"}, s3_bucket.tier_config()]})
    store = TieredStore(cfg)
    store.put_many([(_k(i), _t(100, i), None) for i in range(4)])
    assert store.flush(30)
    tier = store.tiers[1]
    s3_bucket.server.delete_bucket(s3_bucket.bucket)
    assert tier.get_many([_k(0)]) == [None]
    store.put_many([(_k("new"), _t(10), None)])
    assert store.flush(30)
    assert tier.down and "unreachable" in caplog.text
    assert store.get_many([_k(1)])[0] is not None  # memory still serves; nothing raised
    s3_bucket.server.create_bucket(s3_bucket.bucket)
    wait_until("the prober to find the bucket back", lambda: not tier.down)
    tier.put_many([(_k("again"), _t(10), None)])
    assert tier.contains_many([_k("again")]) == [True]
    store.close()


def test_an_endpoint_away_at_start_is_a_warning_and_requests_are_served(s3_bucket, caplog):
    caplog.set_level(logging.WARNING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    cfg = StoreConfig.load({"tiers": [{"kind": "memory", "capacity": "1MiB"},
                                      {**s3_bucket.tier_config(), "endpoint": f"http://127.0.0.1:{port}"}]})
    store = TieredStore(cfg)
    assert store.tiers[1].down and "unreachable" in caplog.text
    store.put_many([(_k(1), _t(10), None)])
    assert store.get_many([_k(1)])[0] is not None and store.get_many([_k(2)]) == [None]
    store.close()


def test_preflight_names_a_missing_bucket(s3_bucket):
    cfg = StoreConfig.load({"tiers": [{**s3_bucket.tier_config(), "bucket": "no-such-bucket-here"}]}).tiers[0]
    with pytest.raises(ConfigError) as exc:
        ObjectTier.preflight(cfg, "tiers[0]")
    assert str(exc.value).startswith("tiers[0].bucket: bucket 'no-such-bucket-here' does not exist")
    ObjectTier.preflight(StoreConfig.load({"tiers": [s3_bucket.tier_config()]}).tiers[0], "tiers[0]")  # fine


def test_preflight_names_refused_credentials_without_the_secret(s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY + "-wrong")
    cfg = StoreConfig.load({"tiers": [s3_bucket.tier_config()]}).tiers[0]
    with pytest.raises(ConfigError) as exc:
        ObjectTier.preflight(cfg, "tiers[0]")
    text = str(exc.value)
    assert text.startswith("tiers[0]: the AWS credentials of this process are refused")
    assert "credentials from env" in text
    assert SECRET_KEY not in text and "AWS_SECRET_ACCESS_KEY" in text


def test_preflight_warns_on_an_endpoint_that_does_not_answer(s3_bucket, caplog):
    caplog.set_level(logging.WARNING)
    s3_bucket.server.pause()
    try:
        cfg = StoreConfig.load({"tiers": [s3_bucket.tier_config(timeout_s=0.5)]}).tiers[0]
        ObjectTier.preflight(cfg, "tiers[0]")  # no exception: the engine starts without it
    finally:
        s3_bucket.server.resume()
    assert "does not answer" in caplog.text


def test_the_engines_preflight_asks_the_object_tier(s3_bucket):
    from vllm_tiercache.preflight import check_tier_backends

    store = StoreConfig.load({"tiers": [{"kind": "memory", "capacity": "1MiB"},
                                        {**s3_bucket.tier_config(), "bucket": "not-there-at-all"}]})
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.bucket: bucket 'not-there-at-all' does not exist"):
        check_tier_backends(store)


def test_everything_restarted_seaweedfs_included_hits_again(s3_bucket):
    tier = tier_of(s3_bucket)
    tier.put_many([(_k(i), _t(1000, i), {"i": i}) for i in range(10)])
    assert tier.counters.get("puts") == 10
    tier.close()
    s3_bucket.server.stop()
    s3_bucket.server.start()  # the same data directory, as a restarted deployment
    again = tier_of(s3_bucket)
    got = again.get_many([_k(i) for i in range(10)])
    assert all(rec is not None and torch.equal(rec.tensor, _t(1000, i)) and rec.meta == {"i": i}
               for i, rec in enumerate(got))
    again.close()
