"""Redis tier against a real redis-server: pipelining, split values, TTL, password, TLS, outages."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis
import torch

from tests.support.redis_wire import RedisWire
from tests.support.waiting import wait_until
from vllm_tiercache.shared.config import RedisTierConfig, StoreConfig
from vllm_tiercache.shared.store import RedisTier, StoreKey

pytestmark = pytest.mark.redis


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|redis|{i}")


def _t(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _tier(url: str, **kw) -> RedisTier:
    cfg = StoreConfig.load({"tiers": [{"kind": "redis", "url": url, **kw}]}).tiers[0]
    return RedisTier(cfg)


def test_put_get_contains(redis_url):
    tier = _tier(redis_url)
    items = [(_k(i), _t(100, i), {"i": i}) for i in range(5)]
    tier.put_many(items)
    assert tier.contains_many([_k(i) for i in range(7)]) == [True] * 5 + [False] * 2
    recs = tier.get_many([_k(i) for i in range(7)])
    for i in range(5):
        assert torch.equal(recs[i].tensor, items[i][1]) and recs[i].meta == {"i": i}
    assert recs[5:] == [None, None]
    assert tier.counters.get("puts") == 5
    assert tier.usage()["down"] is False
    tier.close()


def test_large_values_are_split(redis_url, redis_server):
    tier = _tier(redis_url, part_size="64KiB")
    big = _t(100_000)  # 400 kB -> 7 parts
    tier.put_many([(_k("big"), big, None), (_k("small"), _t(10), None)])
    with redis_server.client() as c:
        parts = sorted(k.decode() for k in c.keys(f"tiercache:{{{_k('big').hex}}}:*"))
        assert len(parts) == 7
        assert max(c.strlen(p) for p in parts) == 64 << 10
    got = tier.get_many([_k("big"), _k("small")])
    assert torch.equal(got[0].tensor, big) and got[1] is not None
    tier.close()


def test_corrupt_and_missing_parts_are_misses(redis_url, redis_server):
    """Damage is ``corrupt``; a part gone (what Redis's eviction or expiry does) is ``partial``: both misses,
    both deleted (tests/store/tiers/redis/test_evicted_pieces.py has the eviction cases)."""
    tier = _tier(redis_url, part_size="64KiB")
    tier.put_many([(_k("a"), _t(50_000), None), (_k("b"), _t(100), None), (_k("c"), _t(100), None)])
    with redis_server.client() as c:
        c.delete(f"tiercache:{{{_k('a').hex}}}:2")
        val = bytearray(c.get(f"tiercache:{{{_k('b').hex}}}:0"))
        val[5] ^= 1
        c.set(f"tiercache:{{{_k('b').hex}}}:0", bytes(val))
        # a swapped record: c's head and parts now hold b's record
        for suffix in ("", ":0"):
            c.set(f"tiercache:{{{_k('c').hex}}}{suffix}", c.get(f"tiercache:{{{_k('b').hex}}}{suffix}"))
    assert tier.get_many([_k("a"), _k("b"), _k("c")]) == [None, None, None]
    assert tier.counters.get("corrupt") == 2 and tier.counters.get("partial") == 1
    assert tier.contains_many([_k("a"), _k("b"), _k("c")]) == [False, False, False]  # heads dropped
    tier.close()


def test_ttl(redis_url, redis_server):
    tier = _tier(redis_url, ttl_s=0.3)
    tier.put_many([(_k(1), _t(10), None)])
    with redis_server.client() as c:
        assert 0 < c.pttl(f"tiercache:{{{_k(1).hex}}}") <= 300
    assert tier.contains_many([_k(1)]) == [True]
    time.sleep(0.5)
    assert tier.contains_many([_k(1)]) == [False] and tier.get_many([_k(1)]) == [None]
    tier.close()


def test_one_round_trip_per_batch(redis_url, redis_server):
    tier = _tier(redis_url)
    keys = [_k(i) for i in range(50)]
    tier.put_many([(k, _t(10), None) for k in keys])
    with redis_server.client() as c:
        before = c.info("stats")["total_commands_processed"]
        tier.contains_many(keys)
        tier.get_many(keys)
        after = c.info("stats")["total_commands_processed"]
    assert after - before == 50 + 1 + 1  # EXISTS x50 (pipelined), one MGET, INFO
    tier.close()


def test_server_killed_and_restarted(redis_url, redis_server, caplog):
    tier = _tier(redis_url, retry_after_s=0.2, timeout_s=0.5)
    tier.put_many([(_k(1), _t(10), None)])
    redis_server.kill()
    with caplog.at_level(logging.WARNING):
        assert tier.get_many([_k(1)]) == [None]
        assert tier.contains_many([_k(1)]) == [False]
        tier.put_many([(_k(2), _t(10), None)])
    assert tier.down and tier.usage()["down"] is True
    assert tier.counters.get("dropped_writes") == 1
    down_logs = [r for r in caplog.records if "unreachable" in r.message]
    assert len(down_logs) == 1 and f"127.0.0.1:{redis_server.port}" in down_logs[0].message
    redis_server.restart()
    # the prober (every retry_after_s, off this thread) brings the tier back; on a loaded machine that can
    # take longer than a probe period, so wait for it, bounded, instead of a fixed sleep
    wait_until("the tier to come back after Redis did", lambda: not tier.down, limit_s=15.0)
    tier.put_many([(_k(3), _t(10), None)])
    assert not tier.down
    assert tier.contains_many([_k(3)]) == [True]
    tier.close()


def test_redis_py_accepts_our_client_options(redis_url):
    # guards against redis-py renaming the options make_client passes
    from vllm_tiercache.shared.store.tiers.redis.tier import make_client

    client = make_client(RedisTierConfig(url=redis_url))
    assert isinstance(client, redis.Redis) and client.ping()
    client.close()


def test_one_failed_command_is_one_miss(redis_url, redis_server, caplog):
    # a server error on one record's command (WRONGTYPE on a part) costs that record, not the batch
    tier = _tier(redis_url, part_size="4KiB")
    keys = [_k(f"wt{i}") for i in range(3)]
    tier.put_many([(k, _t(3000, i), None) for i, k in enumerate(keys)])  # 12 kB: 3 parts each
    with redis_server.client() as c:
        c.delete(f"tiercache:{{{keys[1].hex}}}:2")
        c.rpush(f"tiercache:{{{keys[1].hex}}}:2", b"x")
    with caplog.at_level(logging.WARNING):
        assert [r is not None for r in tier.get_many(keys)] == [True, False, True]
        assert [r is not None for r in tier.get_many(keys)] == [True, False, True]
    assert not tier.down and tier.counters.get("corrupt") == 0
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    tier.close()


def test_down_tier_is_probed_off_the_callers_thread(redis_url, redis_server, caplog, monkeypatch):
    """While down every call returns at once (it touches no socket) and never probes; the prober alone
    brings the tier back."""
    tier = _tier(redis_url, retry_after_s=0.1, timeout_s=0.5)
    tier.put_many([(_k("p"), _t(10), None)])
    probe_threads = []
    real_probe = tier._probe

    def probe():
        probe_threads.append(threading.get_ident())
        return real_probe()

    tier._probe = probe
    caller = threading.get_ident()
    wire = RedisWire.install(monkeypatch)
    redis_server.kill()
    with caplog.at_level(logging.INFO, logger="vllm_tiercache.shared.store.tiers.redis.tier"):
        assert tier.contains_many([_k("p")]) == [False]
        assert tier.down
        wire.clear()
        for _ in range(200):
            assert tier.contains_many([_k("p")]) == [False]
            assert tier.get_many([_k("p")]) == [None]
        # at once: none of the 400 calls connected, sent or read (was: all within 1 s, which a loaded
        # machine misses and a refused connection, instant too, passes)
        assert wire.on(caller) == []
        wait_until("a probe while down", lambda: probe_threads)
        assert tier.down
        redis_server.restart()
        # no call on this thread: only the prober can bring it back
        wait_until("the prober to bring the tier back", lambda: not tier.down, poll_s=0.02)
    assert caller not in probe_threads
    assert tier.contains_many([_k("p")]) == [False]  # the restarted server is empty
    tier.put_many([(_k("q"), _t(10), None)])
    assert tier.contains_many([_k("q")]) == [True]
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "unreachable" in m]) == 1
    assert len([m for m in messages if "reachable again" in m]) == 1
    tier.close()
