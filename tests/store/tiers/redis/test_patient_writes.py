"""A patient store (``write_patience_s``: a precompute job's) against a real redis-server that answers OOM
(``maxmemory`` reached under ``noeviction``) for a while: the writer backs off and puts again, and every
record is stored once memory is given back; the OOM answers are counted as throttling, the tier never went
down for them. A serving store (no patience) drops the same writes at once, counted."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support.waiting import wait_until
from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import StoreKey
from vllm_tiercache.shared.store.tiered import TieredStore

pytestmark = [pytest.mark.redis]

#: only ends a test that would hang; the waits below are for states
HANG_BOUND_S = 300.0


def _items(first: int, n: int) -> list[tuple[StoreKey, torch.Tensor, None]]:
    return [(StoreKey(f"ns|patience|{i}"), torch.randn(4096, generator=torch.Generator().manual_seed(i)), None)
            for i in range(first, first + n)]


def _store(url: str, patience_s: float) -> TieredStore:
    return TieredStore(StoreConfig.from_dict({"namespace": "patience", "write_patience_s": patience_s, "tiers": [
        {"kind": "memory", "capacity": "64MiB"}, {"kind": "redis", "url": url, "timeout_s": 5.0}]}))


@contextlib.contextmanager
def _out_of_memory(redis_server, redis_url: str, patience_s: float) -> Iterator[tuple[TieredStore, Any]]:
    """A store with the given patience, and the server's ``maxmemory`` just under what it uses now with no
    eviction: every write is refused with OOM until the test sets ``maxmemory`` back to 0 (done at the end)."""
    with redis_server.client() as client:
        store = _store(redis_url, patience_s)
        try:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", str(max(1, used - 1024 * 1024)))
            yield store, client
        finally:
            client.config_set("maxmemory", "0")
            store.close()


def test_a_patient_store_waits_out_an_out_of_memory_redis(redis_server, redis_url) -> None:
    with _out_of_memory(redis_server, redis_url, patience_s=600.0) as (store, client):
        store.put_many(_items(0, 8))
        # refused, and refused again after a backoff
        wait_until("two OOM answers to reach the writer",
                   lambda: store.stats()["tiers"]["redis"]["throttled"] >= 2, limit_s=HANG_BOUND_S)
        assert not store.tiers[1].down
        client.config_set("maxmemory", "0")  # memory given back: the next try lands
        assert store.flush(HANG_BOUND_S)
        counters = store.stats()["tiers"]["redis"]
    assert counters["dropped_writes"] == 0 and counters["puts"] == 8 and counters["write_retries"] >= 8
    fresh = TieredStore(StoreConfig.from_dict({"namespace": "patience", "tiers": [{"kind": "redis",
                                                                                   "url": redis_url}]}))
    try:
        got = fresh.get_many([key for key, _, _ in _items(0, 8)])
    finally:
        fresh.close()
    assert all(rec is not None and torch.equal(rec.tensor, t) for rec, (_, t, _) in zip(got, _items(0, 8),
                                                                                        strict=True))


def test_a_serving_store_drops_writes_an_out_of_memory_redis_refuses(redis_server, redis_url) -> None:
    with _out_of_memory(redis_server, redis_url, patience_s=0.0) as (store, _):
        store.put_many(_items(0, 3))
        assert store.flush(HANG_BOUND_S)
        counters = store.stats()["tiers"]["redis"]
    assert counters["dropped_writes"] == 3 and counters["throttled"] >= 1 and counters["write_retries"] == 0
