"""A record Redis evicted part of, against a real redis-server: a miss counted ``partial``, never damage.

Why: a record is several keys (head, parts, key text, tags) and a server with ``maxmemory-policy
allkeys-lru`` (or volatile-*, or expiring keys) evicts keys, not records. `tiercache bench trace
--shared-share` measured 47-92 records per replay whose payload part went while the head stayed: the
lookup said "held" (a planned hit that then failed to load), and the read counted the record ``corrupt``
with a damage line in the log, for a normal eviction. Deleting a part by hand is what the eviction does.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import RedisTier, StoreKey
from vllm_tiercache.tools.redis_server import RedisServer

pytestmark = pytest.mark.redis


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|evicted|{i}")


def _t(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _tier(url: str, **kw: object) -> RedisTier:
    return RedisTier(StoreConfig.load({"tiers": [{"kind": "redis", "url": url, **kw}]}).tiers[0])


def _pieces(server: RedisServer, key: StoreKey) -> list[bytes]:
    """Every stored key of ``key``'s record (head, parts, key text, tags)."""
    with server.client() as c:
        return list(c.keys(f"tiercache:{{{key.hex}}}*"))


def _loud(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_head_without_its_first_part_is_not_held_and_reads_as_partial(redis_url, redis_server, caplog):
    tier = _tier(redis_url)
    keys = [_k(i) for i in range(3)]
    tier.put_many([(k, _t(100, i), {"tags": ["doc"]} if i == 1 else None) for i, k in enumerate(keys)])
    with redis_server.client() as c:
        assert c.delete(tier._part(keys[1], 0)) == 1  # what allkeys-lru does to one key of a record
    with caplog.at_level(logging.WARNING):
        assert tier.contains_many(keys) == [True, False, True]  # the lookup no longer promises it
        got = tier.get_many(keys)
    assert [r is not None for r in got] == [True, False, True]
    assert tier.counters.get("partial") == 1 and tier.counters.get("corrupt") == 0
    assert _pieces(redis_server, keys[1]) == []  # head, key text and tags freed: `tiercache stats` lists it no more
    assert not _loud(caplog)  # a server's eviction is not damage: no log line
    assert tier.get_many(keys[1:2]) == [None] and tier.counters.get("partial") == 1  # now a plain miss
    tier.close()


def test_a_multi_part_record_missing_a_later_part_reads_as_partial(redis_url, redis_server, caplog):
    tier = _tier(redis_url, part_size="4KiB")
    keys = [_k(f"big{i}") for i in range(2)]
    tensors = [_t(3000, i) for i in range(2)]  # 12 kB: 3 parts each
    tier.put_many([(k, t, None) for k, t in zip(keys, tensors, strict=True)])
    with redis_server.client() as c:
        assert c.delete(tier._part(keys[0], 2)) == 1
    # the lookup asks for the head and part 0 only (one command per record): only the read finds this one
    assert tier.contains_many(keys) == [True, True]
    with caplog.at_level(logging.WARNING):
        got = tier.get_many(keys)
    assert got[0] is None and torch.equal(got[1].tensor, tensors[1])
    assert tier.counters.get("partial") == 1 and tier.counters.get("corrupt") == 0
    assert _pieces(redis_server, keys[0]) == [] and len(_pieces(redis_server, keys[1])) == 3 + 2
    assert not _loud(caplog)
    assert tier.contains_many(keys) == [False, True]
    tier.close()


def test_damage_is_still_corrupt_and_told_apart_from_an_eviction(redis_url, redis_server, caplog):
    """Damage in the same batch as an evicted part: three ``corrupt``, one ``partial``."""
    tier = _tier(redis_url, part_size="4KiB")
    keys = [_k("flipped"), _k("short"), _k("multi-short"), _k("evicted")]
    tier.put_many([(keys[0], _t(100), None), (keys[1], _t(100), None), (keys[2], _t(3000), None),
                   (keys[3], _t(100), None)])
    with redis_server.client() as c:
        c.delete(tier._part(keys[3], 0))
        part = bytearray(c.get(tier._part(keys[0], 0)))
        part[5] ^= 1  # a bad checksum
        c.set(tier._part(keys[0], 0), bytes(part))
        c.set(tier._head(keys[1]), c.get(tier._head(keys[1]))[:2])  # a head too short for its part count
        c.set(tier._part(keys[2], 1), c.get(tier._part(keys[2], 1))[:-1])  # parts that do not add up
    with caplog.at_level(logging.WARNING):
        assert tier.get_many(keys) == [None] * 4
    assert tier.counters.get("corrupt") == 3 and tier.counters.get("partial") == 1
    assert all(_pieces(redis_server, k) == [] for k in keys)
    assert _loud(caplog)  # damage is still told (once per kind)
    tier.close()


def test_an_allkeys_lru_server_never_has_a_held_record_that_does_not_read():
    """A tiny ``maxmemory`` under ``allkeys-lru``, written far past it: the server evicts single keys of
    records. Then its limit is lifted (so no read evicts more between the lookup and the read) and every
    record the lookup says is held must read."""
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lru"]) as server:
        with server.client() as c:
            empty = int(c.info("memory")["used_memory"])
        tier = _tier(server.url)
        keys = [_k(f"lru{i}") for i in range(3000)]
        with server.client() as c:
            c.config_set("maxmemory", str(empty + (2 << 20)))  # about 2 MiB of records, 6 MiB written
        for lo in range(0, len(keys), 100):
            tier.put_many([(k, _t(512, lo + i), None) for i, k in enumerate(keys[lo:lo + 100])])
        with server.client() as c:
            c.config_set("maxmemory", "0")
            assert int(c.info("stats")["evicted_keys"]) > 0
            heads = c.mget([tier._head(k) for k in keys])
            parts = c.mget([tier._part(k, 0) for k in keys])
        # the case this test is about is there: records whose head outlived their payload
        assert any(h is not None and p is None for h, p in zip(heads, parts, strict=True))
        held = [k for k, h in zip(keys, tier.contains_many(keys), strict=True) if h]
        assert held
        assert all(r is not None for r in tier.get_many(held))
        assert tier.counters.get("partial") == 0 and tier.counters.get("corrupt") == 0
        # the records left partial by the eviction are misses counted partial, and freed
        rest = [k for k in keys if k not in set(held)]
        assert tier.get_many(rest) == [None] * len(rest)
        partial = sum(h is not None and p is None for h, p in zip(heads, parts, strict=True))
        assert tier.counters.get("partial") == partial and tier.counters.get("corrupt") == 0
        tier.close()
