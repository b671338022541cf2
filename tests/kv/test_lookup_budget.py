"""The schedulers' lookup never waits on the network (`lookup_budget_ms`, `TieredStore.contains_many`).

Against a real redis-server that stops answering (SIGSTOP: its sockets stay open, nothing is answered, as
with a hung server or a partition that drops packets), every bounded lookup answers misses for what only
Redis holds, never raises, and never waits for the hung server. After SIGCONT the tier comes back by itself:
the prober thread finds it, and no lookup ever ran a probe.

How "never waits" is shown without a stopwatch (a bound tight enough to tell a 30 ms budget from a wait is
one a loaded 2-core CI machine misses): the caller's thread never sends to or reads from Redis
(`tests.support.redis_wire.RedisWire`), the first lookup returns while the tier's call it handed to the
lookup thread still hangs (that call ends only at the socket timeout, seconds later), and the store's own
counters say the lookup gave up at its budget (``past_budget``) or did not ask (``busy``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support.redis_wire import RedisWire
from tests.support.waiting import wait_until
from vllm_tiercache.shared.config import ConfigError, StoreConfig
from vllm_tiercache.shared.store import RedisTier, StoreKey, TieredStore

pytestmark = [pytest.mark.redis, pytest.mark.serial]

BUDGET_MS = 30.0
#: The budget of the test that a healthy Redis's answers are hits: one a loaded 2-core machine meets. At
#: 30 ms about 3% of healthy lookups missed there (the answer came late, or the next lookup found the late
#: one still outstanding), and the test needs 20 in a row.
HEALTHY_BUDGET_MS = 2000.0
#: The Redis client's socket timeout in the tests where a call hangs on a paused server: the hung call on
#: the lookup thread gives up after twice this (one retry). The first lookup must return before that; a
#: loaded machine would have to stall the caller's 30 ms wait by seconds to miss it.
HUNG_TIMEOUT_S = 1.0
#: How long the fake slow tier holds its call: far past anything a loaded machine takes to answer a
#: lookup, so a lookup that returned while it is held did not wait for it.
HELD_S = 60.0


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|budget|{i}")


def _t(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _store(url: str, budget_ms: float = BUDGET_MS, **redis_kw: Any) -> TieredStore:
    cfg = StoreConfig.from_dict({
        "lookup_budget_ms": budget_ms,
        "tiers": [{"kind": "memory", "capacity": "64MiB"},
                  {"kind": "redis", "url": url, "timeout_s": 0.5, "retry_after_s": 0.2, **redis_kw}],
    })
    return TieredStore(cfg)


class _ProbeSpy:
    """Wraps a tier's `_probe`: records the thread of every call."""

    def __init__(self, tier: RedisTier) -> None:
        self.threads: list[int] = []
        real = tier._probe

        def probe() -> bool:
            self.threads.append(threading.get_ident())
            return real()

        tier._probe = probe  # type: ignore[method-assign]


class _OffThreadCalls:
    """Wraps a tier's `contains_many`: counts the calls of threads other than ``caller`` (the lookup
    thread's) that started and that returned, so a test sees whether one is still in flight."""

    def __init__(self, tier: Any, caller: int) -> None:
        self.started = 0
        self.ended = 0
        real = tier.contains_many

        def contains_many(keys: Any) -> list[bool]:
            if threading.get_ident() == caller:  # the store asks a tier that is down inline: at once
                return real(keys)
            self.started += 1
            try:
                return real(keys)
            finally:
                self.ended += 1

        tier.contains_many = contains_many


@pytest.fixture
def store(redis_url: str, redis_server: Any) -> Iterator[TieredStore]:
    s = _store(redis_url)
    try:
        yield s
    finally:
        redis_server.resume()  # a failed test must not leave the session's server stopped
        s.close()


@pytest.fixture
def hung_store(redis_url: str, redis_server: Any) -> Iterator[TieredStore]:
    """`store` with `HUNG_TIMEOUT_S`: a call to the paused server hangs seconds, not 30 ms."""
    s = _store(redis_url, timeout_s=HUNG_TIMEOUT_S)
    try:
        yield s
    finally:
        redis_server.resume()
        s.close()


# ------------------------------------------------------------------------------------------ healthy
def test_healthy_redis_hit_within_budget(redis_url: str) -> None:
    store = _store(redis_url, budget_ms=HEALTHY_BUDGET_MS)
    try:
        redis_tier = store.tiers[1]
        keys = [_k(i) for i in range(8)]
        redis_tier.put_many([(k, _t(64, i), None) for i, k in enumerate(keys[:4])])
        for _ in range(20):
            # a hit is an answer that came within the budget (a late one is a miss): no stopwatch needed
            assert store.contains_many(keys, shared_only=True) == [True] * 4 + [False] * 4
        assert store.stats()["lookup"] == {"budget_ms": HEALTHY_BUDGET_MS, "past_budget": 0, "busy": 0}
        # unbounded callers (offline checks) and the full lookup see the same
        assert store.contains_many(keys, shared_only=True, bounded=False) == [True] * 4 + [False] * 4
        assert store.contains_many(keys) == [True] * 4 + [False] * 4
    finally:
        store.close()


def test_late_answer_is_a_miss_and_nothing_queues_behind_it(store: TieredStore) -> None:
    """A tier slower than the budget: its answer is a miss, and a second lookup meanwhile is not queued.

    The slow tier holds its call until the test lets it go (`HELD_S` at most): a lookup that returned while
    it is held did not wait for its answer, whatever the machine's load."""
    redis_tier = store.tiers[1]
    key = _k("slow")
    redis_tier.put_many([(key, _t(8), None)])
    real = redis_tier.contains_many
    release = threading.Event()
    calls: list[int] = []
    answered: list[int] = []

    def slow(keys: Any) -> list[bool]:
        calls.append(len(keys))
        release.wait(HELD_S)
        answered.append(len(keys))
        return real(keys)

    redis_tier.contains_many = slow  # type: ignore[method-assign]
    try:
        assert store.contains_many([key], shared_only=True) == [False]
        assert not answered  # returned with the tier's call still held: it did not wait for the answer
        assert store.stats()["lookup"]["past_budget"] == 1  # it waited its budget, then took a miss
        assert store.contains_many([key], shared_only=True) == [False]
        assert not answered
        # the lookup thread may run late on a loaded machine
        wait_until("the first lookup to reach the tier", lambda: calls, limit_s=30.0, poll_s=0.01)
        assert calls == [1]  # the second lookup never reached the tier ...
        lookup = store.stats()["lookup"]
        assert lookup["past_budget"] == 1 and lookup["busy"] == 1  # ... nor waited a budget: not asked
    finally:
        release.set()
        redis_tier.contains_many = real  # type: ignore[method-assign]
    wait_until("the lookup thread to be free again",  # it is: a lookup is answered (a hit) again
               lambda: store.contains_many([key], shared_only=True) == [True], poll_s=0.01)


# ------------------------------------------------------------------------------------------- paused
def test_paused_server_lookups_never_wait_for_it_and_tier_comes_back(
        hung_store: TieredStore, redis_server: Any, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = hung_store
    memory, redis_tier = store.tiers
    assert isinstance(redis_tier, RedisTier)
    spy = _ProbeSpy(redis_tier)
    in_redis = [_k(f"r{i}") for i in range(6)]
    in_memory = [_k(f"m{i}") for i in range(3)]
    redis_tier.put_many([(k, _t(32, i), None) for i, k in enumerate(in_redis)])
    memory.put_many([(k, _t(32, i), None) for i, k in enumerate(in_memory)])
    keys = in_redis + in_memory
    # stored (unbounded: a loaded machine may answer a healthy lookup past 30 ms)
    assert store.contains_many(keys, shared_only=True, bounded=False) == [True] * 6 + [False] * 3

    caller = threading.get_ident()
    hung = _OffThreadCalls(redis_tier, caller)
    wire = RedisWire.install(monkeypatch)

    def lookups() -> None:
        assert store.contains_many(keys, shared_only=True) == [False] * 9
        assert store.contains_many(keys, bounded=True) == [False] * 6 + [True] * 3  # memory still answers

    with caplog.at_level(logging.INFO, logger="vllm_tiercache.shared.store.tiers.redis.tier"):
        redis_server.pause()
        try:
            lookups()
            # the lookup thread's call hangs until its socket timeouts (2 x HUNG_TIMEOUT_S) end it: both
            # lookups returned before, so neither waited for it
            assert hung.started <= 1 and hung.ended == 0, (hung.started, hung.ended)
            # the first waited its budget; the second found the call outstanding and did not ask (the
            # tier's counters: `TieredStore.stats` would ask the paused server for its usage)
            assert redis_tier.counters.get("lookups_past_budget") == 1
            assert redis_tier.counters.get("lookups_skipped") == 1

            def looked_up_and_probed(probes: int) -> bool:  # lookups, then whether `probes` probes started
                lookups()
                return len(spy.threads) >= probes

            # the hung call, on the lookup thread, marks the tier down
            wait_until("the hung call to mark the tier down", lambda: looked_up_and_probed(0) and redis_tier.down)
            # the prober's next probe starts once the one under way failed against the paused server
            probes_at_down = len(spy.threads)
            wait_until("a probe to fail while the server is paused", lambda: looked_up_and_probed(probes_at_down + 2))
            assert hung.ended == 1  # one call reached the paused server; every later lookup took a miss
        finally:
            redis_server.resume()

        # back by itself: only lookups run here, none of them probes
        wait_until("the redis tier to come back after SIGCONT",
                   lambda: store.contains_many(keys, shared_only=True) == [True] * 6 + [False] * 3, poll_s=0.02)
    assert wire.on(caller) == []  # no lookup sent to or read from Redis on the caller's thread
    assert not redis_tier.down
    assert spy.threads and caller not in spy.threads  # probes ran, none on the caller's thread
    down = [r for r in caplog.records if "unreachable" in r.getMessage()]
    back = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(down) == 1 and len(back) == 1, [r.getMessage() for r in caplog.records]


def test_paused_server_writes_and_reads_return_once_down(store: TieredStore, redis_server: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker-side calls keep their own timeout (the first one pays it); once down, every call is at once:
    it touches no socket, so it cannot wait for the paused server."""
    redis_tier = store.tiers[1]
    key = _k("w")
    redis_tier.put_many([(key, _t(8), None)])
    caller = threading.get_ident()
    wire = RedisWire.install(monkeypatch)
    redis_server.pause()
    try:
        assert redis_tier.get_many([key]) == [None]  # pays timeout_s (x2 with the retry), marks it down
        assert redis_tier.down
        assert wire.on(caller)  # that one did go to the server
        wire.clear()
        for _ in range(50):
            assert redis_tier.get_many([key]) == [None]
            redis_tier.put_many([(key, _t(8), None)])
        assert wire.on(caller) == []  # none of the 100 calls since did
        assert redis_tier.down
    finally:
        redis_server.resume()
    # nothing calls the tier: the prober alone brings it back
    wait_until("the prober to bring the tier back", lambda: not redis_tier.down, poll_s=0.02)
    assert redis_tier.get_many([key])[0] is not None


def test_paused_cluster_lookups_never_wait_for_it(redis_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a Redis Cluster client, every node paused (no failover can happen)."""
    store = TieredStore(StoreConfig.from_dict({
        "lookup_budget_ms": BUDGET_MS,
        "tiers": [{"kind": "memory", "capacity": "64MiB"},
                  # a cluster batch takes no retry: twice the timeout keeps the standalone test's margin
                  {"kind": "redis", "url": redis_cluster.url, "timeout_s": 2 * HUNG_TIMEOUT_S,
                   "retry_after_s": 0.2}],
    }))
    redis_tier = store.tiers[1]
    spy = _ProbeSpy(redis_tier)
    keys = [_k(f"c{i}") for i in range(12)]
    redis_tier.put_many([(k, _t(16, i), None) for i, k in enumerate(keys)])
    assert store.contains_many(keys, shared_only=True, bounded=False) == [True] * 12  # stored
    caller = threading.get_ident()
    hung = _OffThreadCalls(redis_tier, caller)
    wire = RedisWire.install(monkeypatch)
    nodes = range(len(redis_cluster.nodes))
    try:
        for n in nodes:
            redis_cluster.pause(n)
        assert store.contains_many(keys, shared_only=True) == [False] * 12
        # the lookup thread's call waits at least one socket timeout (2 x HUNG_TIMEOUT_S) for a paused node
        assert hung.ended == 0 and redis_tier.counters.get("lookups_past_budget") == 1, hung.ended
        for _ in range(100):  # while its call hangs (skipped: busy), then inline once the tier is down
            assert store.contains_many(keys, shared_only=True) == [False] * 12
    finally:
        for n in nodes:
            redis_cluster.resume(n)
    wait_until("the cluster tier to come back",
               lambda: store.contains_many(keys, shared_only=True) == [True] * 12, poll_s=0.02)
    assert wire.on(caller) == []  # no lookup sent to or read from a node on the caller's thread
    assert caller not in spy.threads
    store.close()


# ------------------------------------------------------------------------------------------- config
def test_lookup_budget_config() -> None:
    assert StoreConfig.from_dict({}).lookup_budget_ms == 100.0
    assert StoreConfig.from_dict({"lookup_budget_ms": 5}).lookup_budget_ms == 5.0
    assert StoreConfig.from_dict({"lookup_budget_ms": 1}).cache_key() != StoreConfig.from_dict({}).cache_key()
    for bad in (0, 0.5, 60001, -1, float("nan"), float("inf"), "20ms", True, None):
        with pytest.raises(ConfigError, match=r"^lookup_budget_ms: invalid value .*allowed: a number of "
                                              r"milliseconds, at least 1, at most 60000"):
            StoreConfig.from_dict({"lookup_budget_ms": bad})
