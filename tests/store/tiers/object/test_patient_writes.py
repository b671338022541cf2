"""A patient store (``write_patience_s``: a precompute job's) against a real S3 store (SeaweedFS) that has its
bad days, behind `tests.support.faulty_proxy`: it hangs, then refuses connections, then answers 503 SlowDown,
then serves again. Every record is stored in the end; the throttling is counted as such (the tier never went
down for it), and the waits and retries are counted. A serving store (no patience) facing the same 503s drops
the writes at once, counted, and stays up."""

from __future__ import annotations

import pytest
import torch

from tests.support.faulty_proxy import FaultyProxy
from tests.support.waiting import wait_until
from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import StoreKey
from vllm_tiercache.shared.store.tiered import TieredStore

pytestmark = [pytest.mark.s3]

#: only ends a test that would hang; every wait below is for a state, not a guessed time
HANG_BOUND_S = 300.0


def _k(i: int) -> StoreKey:
    return StoreKey(f"ns|patience|{i}")


def _t(i: int) -> torch.Tensor:
    return torch.randn(2048, generator=torch.Generator().manual_seed(i))


def _until(what: str, predicate) -> None:
    wait_until(what, predicate, limit_s=HANG_BOUND_S)


def _store(s3_bucket, proxy: FaultyProxy, patience_s: float) -> TieredStore:
    bucket = s3_bucket.tier_config(endpoint=proxy.endpoint, timeout_s=1.0, retry_after_s=0.2, concurrency=4)
    return TieredStore(StoreConfig.from_dict({"namespace": "patience", "write_patience_s": patience_s,
                                              "tiers": [{"kind": "memory", "capacity": "64MiB"}, bucket]}))


def _object(store: TieredStore) -> dict:
    return store.stats()["tiers"]["object"]


def test_a_patient_store_writes_every_record_through_a_hung_refusing_and_throttling_store(s3_bucket) -> None:
    with FaultyProxy(s3_bucket.server.ports["s3"]) as proxy:
        store = _store(s3_bucket, proxy, patience_s=600.0)
        try:
            store.put_many([(_k(i), _t(i), None) for i in range(4)])
            assert store.flush(HANG_BOUND_S)
            proxy.set_mode("hang")  # the writes in flight and the next ones run into the tier's timeout
            store.put_many([(_k(i), _t(i), None) for i in range(4, 12)])
            _until("the tier to go down on the hung store", lambda: store.tiers[1].down)
            proxy.set_mode("refuse")
            store.put_many([(_k(i), _t(i), None) for i in range(12, 16)])
            retries = _object(store)["write_retries"]
            _until("the writer to put again while the store refuses", lambda: _object(store)["write_retries"] > retries)
            proxy.set_mode("throttle")  # the prober's HEAD gets 503: the store is up, and slows the writes down
            _until("503 SlowDown answers to the writer's PUTs", lambda: _object(store)["throttled"] >= 3)
            proxy.set_mode("forward")
            assert store.flush(HANG_BOUND_S)
            counters = _object(store)
        finally:
            store.close()
    assert counters["dropped_writes"] == 0, counters
    assert counters["throttled"] >= 3 and counters["write_retries"] >= 12 and counters["write_wait_seconds"] > 0
    assert len(proxy.throttled) >= 3
    check = s3_bucket.server.client()
    names = [obj["Key"] for page in check.get_paginator("list_objects_v2").paginate(
        Bucket=s3_bucket.bucket, Prefix="tiercache/r/") for obj in page.get("Contents", ())]
    assert len(names) == 16
    # and they read back whole, through a fresh store straight to the bucket
    direct = TieredStore(StoreConfig.from_dict({"namespace": "patience", "tiers": [s3_bucket.tier_config()]}))
    try:
        got = direct.get_many([_k(i) for i in range(16)])
    finally:
        direct.close()
    assert all(rec is not None and torch.equal(rec.tensor, _t(i)) for i, rec in enumerate(got))


def test_a_serving_store_drops_throttled_writes_at_once_counted_and_stays_up(s3_bucket) -> None:
    with FaultyProxy(s3_bucket.server.ports["s3"]) as proxy:
        store = _store(s3_bucket, proxy, patience_s=0.0)
        try:
            proxy.set_mode("throttle")
            store.put_many([(_k(i), _t(i), None) for i in range(3)])
            assert store.flush(HANG_BOUND_S)
            counters = _object(store)
            assert not store.tiers[1].down  # a store that asks to slow down is no store that is away
        finally:
            store.close()
    assert counters["dropped_writes"] == 3 and counters["throttled"] >= 1 and counters["write_retries"] == 0
