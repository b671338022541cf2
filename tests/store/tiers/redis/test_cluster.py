"""Redis tier on a real Redis Cluster (3 masters + 3 replicas, `tiers/redis/cluster.py` fixture).

What only a cluster shows: records spread over masters by hash slot, pipelines split per node, a damaged
record that must cost one miss and not the batch (redis-py's cluster pipeline refuses commands a
standalone pipeline takes), a cluster away at start or while running (the cluster client raises its
own exception types), memory spread over masters, and one master failing (killed and failed over, paused,
or replaced by a manual failover) while the other shards keep serving.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis
import torch

from tests.support.redis_wire import RedisWire
from tests.support.waiting import wait_until
from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import RedisTier, StoreKey
from vllm_tiercache.shared.store.tiered import TieredStore
from vllm_tiercache.shared.store.tiers.redis.errors import BUG, DOWN, ERROR, THROTTLED, classify
from vllm_tiercache.tools.redis_server import LocalRedisCluster

pytestmark = pytest.mark.serial

KiB, MiB = 1 << 10, 1 << 20


def _config(url: str, **kw) -> StoreConfig:
    return StoreConfig.load({"tiers": [{"kind": "redis", "url": url, **kw}]})


def _tier(url: str, **kw) -> RedisTier:
    return RedisTier(_config(url, **kw).tiers[0])


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _spread(cluster: LocalRedisCluster, tier: RedisTier, n: int) -> tuple[list[StoreKey], list[int]]:
    """``n`` keys whose records land on the masters in turn (key i on master i % masters), and their
    masters' node indexes."""
    masters = cluster.master_nodes()
    by_port = {cluster.nodes[i].port: i for i in masters}
    client = cluster.client()
    keys: list[StoreKey] = []
    owners: list[int] = []
    i = 0
    while len(keys) < n:
        key = StoreKey(f"ns|cluster|{i}")
        i += 1
        owner = by_port[client.get_node_from_key(tier._head(key)).port]
        if owner == masters[len(keys) % len(masters)]:
            keys.append(key)
            owners.append(owner)
    client.close()
    return keys, owners


def _pieces(cluster: LocalRedisCluster, key: StoreKey) -> list[str]:
    """Every stored name (head, parts, key text) of ``key``'s record, on any master."""
    found: list[str] = []
    for i in cluster.master_nodes():
        with cluster.node_client(i) as c:
            found += [k.decode() for k in c.keys(f"*{{{key.hex}}}*")]
    return found


def _loud(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


# -------------------------------------------------------------------------------------- classify
@pytest.mark.parametrize(("exc", "kind"), [
    (redis.ConnectionError("refused"), DOWN),
    (redis.TimeoutError("timed out"), DOWN),
    (redis.exceptions.BusyLoadingError("loading"), DOWN),
    (redis.exceptions.ClusterDownError("CLUSTERDOWN"), DOWN),
    (redis.exceptions.MasterDownError("MASTERDOWN"), DOWN),
    (redis.exceptions.SlotNotCoveredError("slot 7 not covered"), DOWN),
    (OSError("network unreachable"), DOWN),
    (redis.exceptions.RedisClusterException(
        "Redis Cluster cannot be connected. Please provide at least one reachable node: Timeout"), DOWN),
    (redis.exceptions.RedisClusterException("All slots are not covered after query all startup_nodes."), DOWN),
    (redis.exceptions.OutOfMemoryError("OOM command not allowed"), THROTTLED),  # back off: a patient writer's
    (redis.exceptions.ReadOnlyError("READONLY"), ERROR),
    (redis.ResponseError("WRONGTYPE"), ERROR),
    (redis.exceptions.RedisClusterException("deleting multiple keys is not implemented in pipeline command"), BUG),
    (redis.exceptions.ClusterCrossSlotError("CROSSSLOT"), BUG),
    (TypeError("not a redis error"), BUG),
])
def test_classify(exc: BaseException, kind: str) -> None:
    assert classify(exc) == kind


def test_classify_cluster_exception_by_cause() -> None:
    try:
        try:
            raise redis.ConnectionError("Error 111 connecting")
        except redis.ConnectionError as cause:
            raise redis.exceptions.RedisClusterException("no node answered") from cause
    except redis.exceptions.RedisClusterException as exc:
        assert classify(exc) == DOWN


# ----------------------------------------------------------------------------------- real cluster
@pytest.mark.redis
def test_round_trip_sizes_over_all_masters(redis_cluster):
    tier = _tier(redis_cluster.url)
    sizes = [1 * KiB, 64 * KiB, 1 * MiB, 8 * MiB + 1, 20 * MiB, 3 * KiB]  # 8 MiB parts: 1, 2 and 3 parts
    keys, owners = _spread(redis_cluster, tier, len(sizes))
    assert set(owners) == set(redis_cluster.master_nodes()) and len(set(owners)) == 3
    tensors = [_bytes(n, seed) for seed, n in enumerate(sizes)]
    tier.put_many([(k, t, {"n": t.numel()}) for k, t in zip(keys, tensors, strict=True)])
    assert tier.counters.get("puts") == len(sizes) and tier.counters.get("dropped_writes") == 0
    got = tier.get_many(keys)
    for key, tensor, rec, owner in zip(keys, tensors, got, owners, strict=True):
        assert rec is not None and rec.meta == {"n": tensor.numel()}
        assert rec.tensor.dtype == torch.uint8 and torch.equal(rec.tensor, tensor)  # byte-exact
        assert all(redis_cluster.node_of(name) == owner for name in _pieces(redis_cluster, key))
    assert len([n for n in _pieces(redis_cluster, keys[4]) if ":" in n.rsplit("}", 1)[1]]) == 3
    assert tier.contains_many(keys) == [True] * len(keys)
    assert tier.sizes_many(keys[:1])[0] >= sizes[0]
    assert not tier.down
    tier.close()


@pytest.mark.redis
@pytest.mark.parametrize("lost_part", [0, 2])  # first round trip (part 0) or the second (parts 1..n-1)
def test_one_damaged_record_is_one_miss(redis_cluster, lost_part, caplog):
    """allkeys-lru may evict one part of a record: that record misses (counted ``partial``, not damage, no
    log line) and is removed, the batch is served; without its first part the lookup (one EXISTS of head and
    part 0, both in one slot) no longer promises it."""
    store = TieredStore(_config(redis_cluster.url, part_size="4KiB"))
    tier = store.tiers[0]
    keys, owners = _spread(redis_cluster, tier, 4)
    assert len(set(owners)) == 3
    tensors = [_bytes(20 * KiB, seed) for seed in range(4)]  # 5 parts each
    tier.put_many([(k, t, None) for k, t in zip(keys, tensors, strict=True)])
    damaged = 1
    client = redis_cluster.client()
    assert client.delete(tier._part(keys[damaged], lost_part)) == 1
    client.close()
    expected = [i != damaged for i in range(4)]
    assert tier.contains_many(keys) == [lost_part != 0 or i != damaged for i in range(4)]

    with caplog.at_level(logging.WARNING):
        got = store.get_many(keys)
    assert [r is not None for r in got] == expected
    for i in range(4):
        if expected[i]:
            assert torch.equal(got[i].tensor, tensors[i])
    assert _pieces(redis_cluster, keys[damaged]) == []  # head, key text and every part gone
    assert all(len(_pieces(redis_cluster, keys[i])) == 5 + 2 for i in range(4) if expected[i])
    # no longer promised (unbounded: a hit within the 100 ms lookup budget is no promise a loaded machine keeps)
    assert store.contains_many(keys, shared_only=True, bounded=False) == expected
    assert tier.counters.get("partial") == 1 and tier.counters.get("corrupt") == 0
    assert not tier.down
    assert not _loud(caplog)  # an eviction is no damage: nothing logged
    # the next batch is a plain miss: nothing left to find partial
    assert [r is not None for r in store.get_many(keys)] == expected
    assert tier.counters.get("partial") == 1
    store.close()


@pytest.mark.redis
def test_one_failed_command_is_one_miss(redis_cluster, caplog):
    """A server error on one record's command (here WRONGTYPE on a part) costs that record, not the batch."""
    tier = _tier(redis_cluster.url, part_size="4KiB")
    keys, _ = _spread(redis_cluster, tier, 3)
    tier.put_many([(k, _bytes(10 * KiB, i), None) for i, k in enumerate(keys)])
    client = redis_cluster.client()
    client.delete(tier._part(keys[2], 1))
    client.rpush(tier._part(keys[2], 1), b"x")  # GET of a list: WRONGTYPE for that command only
    client.close()
    with caplog.at_level(logging.WARNING):
        assert [r is not None for r in tier.get_many(keys)] == [True, True, False]
        assert [r is not None for r in tier.get_many(keys)] == [True, True, False]
    assert not tier.down and tier.counters.get("corrupt") == 0
    loud = _loud(caplog)
    assert len(loud) == 1 and "WRONGTYPE" in loud[0].message
    tier.close()


@pytest.mark.redis
def test_cluster_down_at_start(redis_cluster, caplog):
    """A cluster that is away when the store is built gives a store whose Redis tier is down and retried."""
    redis_cluster.stop()
    with caplog.at_level(logging.WARNING):
        store = TieredStore(_config(redis_cluster.url, retry_after_s=0.2, timeout_s=0.5))
        tier = store.tiers[0]
        keys = [StoreKey(f"ns|down|{i}") for i in range(4)]
        assert tier.down and tier.usage()["down"] is True
        for _ in range(20):
            assert store.get_many(keys) == [None] * 4
            assert store.contains_many(keys, shared_only=True) == [False] * 4
            store.put(keys[0], _bytes(KiB, 0))
    loud = _loud(caplog)
    assert len(loud) == 1 and loud[0].levelno == logging.WARNING and "unreachable" in loud[0].message
    assert f"127.0.0.1:{redis_cluster.nodes[0].port}" in loud[0].message

    redis_cluster.start()  # back: the prober connects on its next try (a call while down touches no network)
    wait_until("the prober to find the cluster back", lambda: not tier.down)
    tensor = _bytes(3 * KiB, 1)
    tier.put_many([(keys[1], tensor, None)])
    assert not tier.down
    assert torch.equal(tier.get_many([keys[1]])[0].tensor, tensor)
    store.close()


@pytest.mark.redis
def test_cluster_stopped_while_running(redis_cluster, caplog, monkeypatch):
    """Down while running: misses, skipped writes, a few log lines (not one per call), then back; once
    the tier is down, a call touches no socket (the prober alone tries the cluster)."""
    store = TieredStore(_config(redis_cluster.url, retry_after_s=0.05, timeout_s=0.5))
    tier = store.tiers[0]
    keys, _ = _spread(redis_cluster, tier, 3)
    tier.put_many([(k, _bytes(KiB, i), None) for i, k in enumerate(keys)])
    assert all(r is not None for r in store.get_many(keys))
    caller = threading.get_ident()
    wire = RedisWire.install(monkeypatch)
    redis_cluster.stop()
    calls_while_down = 0
    with caplog.at_level(logging.WARNING):
        for i in range(200):  # long enough for many retries (every 0.05 s)
            was_down, sent = tier.down, len(wire.on(caller))
            if i % 3 == 0:
                assert store.get_many(keys) == [None] * 3
            elif i % 3 == 1:
                assert store.contains_many(keys, shared_only=True) == [False] * 3
            else:
                tier.put_many([(keys[0], _bytes(KiB, 9), None)])
            if was_down:  # answered without the network: it cannot have waited for it
                assert len(wire.on(caller)) == sent, wire.on(caller)[sent:]
                calls_while_down += 1
            time.sleep(0.003)
    assert calls_while_down >= 190  # the first call or two found it down
    assert tier.down and tier.usage()["down"] is True
    assert tier.counters.get("dropped_writes") >= 60
    loud = _loud(caplog)
    assert len(loud) <= 3, [r.message for r in loud]
    assert not [r for r in loud if r.levelno >= logging.ERROR]

    redis_cluster.start()
    wait_until("the prober to find the cluster back", lambda: not tier.down)
    tier.put_many([(keys[1], _bytes(KiB, 5), None)])
    assert not tier.down and tier.get_many(keys[1:2])[0] is not None
    store.close()


@pytest.mark.redis
def test_usage_sums_masters(redis_cluster):
    tier = _tier(redis_cluster.url)
    keys, _ = _spread(redis_cluster, tier, 3)
    tier.put_many([(k, _bytes(2 * MiB, i), None) for i, k in enumerate(keys)])  # 2 MiB on each master
    masters = redis_cluster.master_nodes()

    def per_master() -> list[int]:
        out = []
        for i in masters:
            with redis_cluster.node_client(i) as c:
                out.append(c.info("memory")["used_memory"])
        return out

    figures: list[tuple[list[int], int, list[int]]] = []

    def summed() -> bool:  # the tier's figure between two reads of the masters' own
        before = per_master()
        used = tier.usage()["bytes_used"]
        after = per_master()
        figures.append((before, used, after))
        return sum(before) - 256 * KiB <= used <= sum(after) + 256 * KiB

    # a loaded machine's masters may still be moving memory (a replica's resync after an earlier test's
    # restart grew one by 2.5 MiB between two reads): read again until the figures hold still around it
    wait_until("the tier's figure to be the masters' sum", summed, limit_s=30.0, poll_s=0.2)
    _, used, after = figures[-1]
    assert used > max(after) + 4 * MiB - 256 * KiB  # not one node's figure: the other two masters' records
    assert tier.usage()["capacity"] is None  # no maxmemory: no bound to count a pin budget against
    with redis_cluster.node_client(masters[0]) as c:
        saved = {name: c.config_get(name)[name] for name in ("maxmemory", "maxmemory-policy")}
    redis_cluster.config_set("maxmemory", str(64 * MiB))
    redis_cluster.config_set("maxmemory-policy", "volatile-lru")
    try:  # `tiercache pin` counts Redis's budget against this: the masters' maxmemory, summed
        usage = tier.usage()
        assert usage["capacity"] == len(masters) * 64 * MiB and usage["eviction_policy"] == "volatile-lru"
    finally:
        for name, value in saved.items():
            redis_cluster.config_set(name, value)
    tier.close()


# ------------------------------------------------------------------------------- one shard's failure
def _shard_lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.mark.redis
def test_master_killed_under_load(redis_cluster, caplog):
    """One master SIGKILLed while a thread gets and puts over every master: the other shards keep serving
    (no miss on them), the failed shard's keys are misses and its puts dropped until its replica is
    promoted, then served again with no restart; every hit is byte-exact; records replicated before the
    kill are all readable after the failover.

    The servers run with ``cluster-require-full-coverage no`` (docs/operations.md): with the default
    ``yes`` every node refuses every key (CLUSTERDOWN) from the moment the master is marked failed until
    the promotion, about a second here, which no client can help.
    """
    cluster = redis_cluster
    cluster.config_set("cluster-require-full-coverage", "no")
    # the killed master refuses at once; a timeout only ends a call to a healthy master that a loaded
    # machine stalled, and at 0.5 s one did (14 misses on a healthy shard, marked unreachable for a moment)
    tier = _tier(cluster.url, timeout_s=5.0, retry_after_s=0.5)
    try:
        keys, owners = _spread(cluster, tier, 30)
        tensors = [_bytes(2 * KiB + i, i) for i in range(len(keys))]
        tier.put_many([(k, t, None) for k, t in zip(keys, tensors, strict=True)])
        cluster.wait_replicated()  # acknowledged and on the replicas: a failover must keep them
        victim = owners[0]
        replica = cluster.replica_of(victim)

        events: list[tuple[float, int, bool, float]] = []  # call start, key index, hit, call seconds
        wrong: list[int] = []
        stop = threading.Event()
        puts = [0]

        def load() -> None:
            j = 0
            while not stop.is_set():
                batch = [(3 * j + n) % len(keys) for n in range(6)]  # two keys of every master
                start = time.monotonic()
                got = tier.get_many([keys[i] for i in batch])
                took = time.monotonic() - start
                for i, rec in zip(batch, got, strict=True):
                    if rec is not None and not torch.equal(rec.tensor, tensors[i]):
                        wrong.append(i)
                    events.append((start, i, rec is not None, took))
                tier.put_many([(StoreKey(f"ns|load|{j}|{n}"), _bytes(KiB, n), None) for n in range(3)])
                puts[0] += 3
                j += 1
                time.sleep(0.002)

        thread = threading.Thread(target=load, daemon=True)
        dropped_before = tier.counters.get("dropped_writes")
        with caplog.at_level(logging.WARNING):
            thread.start()
            time.sleep(0.5)
            t_kill = time.monotonic()
            cluster.kill(victim)
            cluster.wait_promoted(replica)
            t_promo = time.monotonic()
            wait_until("the failed shard's keys to be served after the promotion",
                       lambda: any(t > t_promo and owners[i] == victim and hit for t, i, hit, _ in list(events)),
                       limit_s=30.0, poll_s=0.02)
            time.sleep(0.2)
            stop.set()
            thread.join(10)
        assert not thread.is_alive()

        healthy = [(t, hit, took) for t, i, hit, took in events if owners[i] != victim and t_kill < t < t_promo]
        failed = [(t, hit) for t, i, hit, _ in events if owners[i] == victim and t > t_kill]
        back_at = min(t for t, hit in failed if hit)
        down_s = back_at - t_kill
        failed_misses = sum(1 for t, hit in failed if not hit)
        dropped = tier.counters.get("dropped_writes") - dropped_before
        print(f"\nkill test: failover {t_promo - t_kill:.2f}s after the kill; failed shard down {down_s:.2f}s "
              f"({back_at - t_promo:.2f}s after the promotion), {failed_misses} misses on it; healthy shards "
              f"during the outage: {sum(h for _, h, _ in healthy)} hits, {sum(not h for _, h, _ in healthy)} "
              f"misses, slowest call {max(took for _, _, took in healthy):.3f}s; puts dropped {dropped} of "
              f"{puts[0]}; shard lines: {_shard_lines(caplog, 'shard')}")

        assert wrong == []  # every hit byte-exact
        assert len(healthy) > 0 and all(hit for _, hit, _ in healthy)  # the other shards kept serving
        assert failed_misses > 0 and 0 < dropped < puts[0]
        assert back_at - t_promo < 30
        got = tier.get_many(keys)  # everything replicated before the kill survived the failover
        assert all(rec is not None and torch.equal(rec.tensor, t) for rec, t in zip(got, tensors, strict=True))
        assert tier.shards_down == [] and not tier.down
        assert len(_shard_lines(caplog, "unreachable")) == 1
        assert len(_shard_lines(caplog, "failed over to")) == 1
    finally:
        cluster.config_set("cluster-require-full-coverage", "yes")
        tier.close()


@pytest.mark.redis
def test_master_paused_other_shards_serve(redis_cluster, caplog, monkeypatch):
    """One master SIGSTOPped (a hung host) for less than the cluster's node timeout (no failover): the
    call that finds it hanging waits one timeout, then every call returns at once, the other shards' keys
    hit and its keys miss; after SIGCONT it serves again by itself.

    "One timeout, then at once" is read off the wire, not a stopwatch (which a loaded machine fools): a
    read from the paused master returns only at the socket timeout, so the calls read from it once (one
    timeout waited, none retried) and every later call never touches its socket (it cannot wait on it)."""
    cluster = redis_cluster
    tier = _tier(cluster.url, timeout_s=1.0, retry_after_s=0.3)
    keys, owners = _spread(cluster, tier, 12)
    tensors = [_bytes(3 * KiB, i) for i in range(len(keys))]
    tier.put_many([(k, t, None) for k, t in zip(keys, tensors, strict=True)])
    victim = owners[0]
    victim_port = cluster.nodes[victim].port
    on_victim = [owner == victim for owner in owners]
    caller = threading.get_ident()
    wire = RedisWire.install(monkeypatch)
    calls: list[float] = []
    # per call: the caller's reads from the paused master, and its connects, sends and reads to it in all
    victim_wire: list[tuple[int, int]] = []

    def to_victim() -> tuple[int, int]:
        seen = wire.on(caller, victim_port)
        return sum(c.what == "read" for c in seen), len(seen)

    with caplog.at_level(logging.WARNING):
        cluster.pause(victim)
        try:
            end = time.monotonic() + 2.5
            while time.monotonic() < end or len(calls) < 20:  # several of the prober's tries, and calls
                start = time.monotonic()
                read_before, all_before = to_victim()
                got = tier.get_many(keys)
                found = tier.contains_many(keys)
                calls.append(time.monotonic() - start)
                read, all_ = to_victim()
                victim_wire.append((read - read_before, all_ - all_before))
                for rec, tensor, paused in zip(got, tensors, on_victim, strict=True):
                    assert (rec is None) if paused else torch.equal(rec.tensor, tensor)
                assert found == [not paused for paused in on_victim]
                time.sleep(0.01)
            assert tier.shards_down == [f"127.0.0.1:{cluster.nodes[victim].port}"] and not tier.down
            assert tier.up_share == pytest.approx(2 / 3)  # the tier_up gauge: two masters of three answer
            usage = tier.usage()  # the other masters' figure, at once: the paused one is not asked
            assert usage["down"] is False and usage["bytes_used"] > 0
        finally:
            cluster.resume(victim)
        resumed = time.monotonic()
        wait_until("the paused shard to serve again after SIGCONT",
                   lambda: [rec is not None for rec in tier.get_many(keys)] == [True] * len(keys), poll_s=0.02)
        back_s = time.monotonic() - resumed
    print(f"\npause test: {len(calls)} calls during the pause, slowest {max(calls):.3f}s, others at most "
          f"{sorted(calls)[-2]:.3f}s; shard served again {back_s:.2f}s after SIGCONT")
    # the first call (a get_many, then a contains_many) found it hanging: it read from it once (one timeout
    # waited, not two) and marked its shard down; every other call: at once, never reading from it
    assert victim_wire[0][0] == 1 and victim_wire[1:] == [(0, 0)] * (len(calls) - 1), victim_wire
    assert len(_shard_lines(caplog, "unreachable")) == 1
    assert len(_shard_lines(caplog, "reachable again")) == 1
    assert all(r.levelno < logging.ERROR for r in caplog.records)
    assert tier.shards_down == [] and tier.up_share == 1.0
    tier.close()


@pytest.mark.redis
def test_manual_failover_is_followed(redis_cluster, caplog):
    """A replica takes its master's slots over (CLUSTER FAILOVER: no node fails): the old master answers
    MOVED to the tier's stale slot map; those keys miss until the prober re-reads the map (within
    `SLOT_MAP_REFRESH_S`, not ``retry_after_s``), the other shards never miss, nothing is lost."""
    cluster = redis_cluster
    # retry_after_s far past the wait below: the slots are followed by the slot-map refresh, not a probe
    tier = _tier(cluster.url, timeout_s=0.5, retry_after_s=600)
    keys, owners = _spread(cluster, tier, 9)
    tensors = [_bytes(2 * KiB, i) for i in range(len(keys))]
    tier.put_many([(k, t, None) for k, t in zip(keys, tensors, strict=True)])
    cluster.wait_replicated()
    victim = owners[0]
    replica = cluster.replica_of(victim)
    with cluster.node_client(replica) as c:
        c.execute_command("CLUSTER", "FAILOVER")
    cluster.wait_promoted(replica)
    # the old master knows: it answers MOVED from now on
    wait_until("the old master to become a replica", lambda: cluster.role(victim) == "slave", limit_s=10.0,
               poll_s=0.01)
    start = time.monotonic()
    misses = [0]

    def all_served() -> bool:
        got = tier.get_many(keys)
        for rec, tensor, owner in zip(got, tensors, owners, strict=True):
            assert (rec is None and owner == victim) or torch.equal(rec.tensor, tensor)
        misses[0] += sum(rec is None for rec in got)
        return all(rec is not None for rec in got)

    with caplog.at_level(logging.WARNING):
        # a minute, not SLOT_MAP_REFRESH_S (1 s): a loaded machine may run the prober late; a tier that
        # waited for its next probe (retry_after_s, 600 s) still fails here
        wait_until("the moved slots to be followed", all_served, poll_s=0.01)
    print(f"\nmanual failover: moved shard served again {time.monotonic() - start:.2f}s after the promotion "
          f"({misses[0]} misses on it); lines: {[r.getMessage() for r in _loud(caplog)]}")
    assert misses[0] > 0 and not tier.down and tier.shards_down == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    tier.close()


@pytest.mark.redis
def test_a_batch_racing_close_is_a_quiet_miss(redis_url, caplog):
    """A batch still running when the tier closes finds its client gone (an AttributeError out of the
    routing): a miss counted as an error, not an ERROR line with a traceback (it is no bug); before close
    the same failure is logged once as one."""
    tier = _tier(redis_url)
    with caplog.at_level(logging.DEBUG):
        tier.close()
        tier._calls.failures.failed("get (some records)",
                                    AttributeError("'NoneType' object has no attribute 'nodes_manager'"))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert tier.counters.get("errors") == 1
    live = _tier(redis_url)
    with caplog.at_level(logging.ERROR):
        live._calls.failures.failed("get", AttributeError("boom"))
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    live.close()


@pytest.mark.redis
def test_a_stale_map_reported_before_the_tier_went_down_is_re_read(redis_cluster, monkeypatch):
    """The prober keeps a pending slot-map refresh through a whole-tier outage: a failed probe leaves it
    asked, and the probe that finds the cluster back re-reads the map (it used to be dropped)."""
    tier = _tier(redis_cluster.url)
    rereads: list[int] = []
    monkeypatch.setattr(tier._calls.router, "refresh_slots", lambda client: rereads.append(1))

    class Away:
        def ping(self, **_: object) -> None:
            raise redis.exceptions.ConnectionError("refused")

    health, router = tier._health, tier._calls.router
    with health.lock:
        health._down, health.refresh_asked = True, True
    with pytest.raises(redis.exceptions.ConnectionError):
        router.probe(Away(), health)
    assert health.refresh_asked and not rereads
    assert router.probe(tier._calls.client, health) is True
    assert rereads == [1] and not health.refresh_asked and not tier.down
    tier.close()


@pytest.mark.redis
def test_a_pin_holds_in_memory_while_the_master_holding_it_fails_over(redis_cluster):
    """The pin lives only in the cluster's control hash; the master that holds it is SIGKILLed. The polls
    that cannot read it keep its last good read, so one-off traffic during the failover cannot evict the
    pinned corpus from memory; once the replica is promoted the poll reads the pin from it (replicated
    before the kill) and it still holds."""
    from tests.store.test_pins import (
        CORPUS,
        _wait_for_polls,
        assert_the_pin_holds_while_redis_cannot_answer,
        store_with_a_pinned_corpus,
    )

    cluster = redis_cluster
    with store_with_a_pinned_corpus(cluster.url) as (store, memory, redis_tier):
        cluster.wait_replicated()
        client = cluster.client()
        owner_port = client.get_node_from_key(redis_tier._names.control).port
        client.close()
        victim = next(i for i in cluster.master_nodes() if cluster.nodes[i].port == owner_port)
        replica = cluster.replica_of(victim)
        cluster.kill(victim)
        assert_the_pin_holds_while_redis_cannot_answer(store, memory, redis_tier)
        cluster.wait_promoted(replica)
        wait_until("the promoted replica to serve the control hash", lambda: _reads_control(redis_tier),
                   limit_s=30.0)
        _wait_for_polls(store, 2)  # read from the promoted replica: the pin is still there
        assert memory._pins == frozenset({"corpus:v3"})
        assert memory.contains_many(CORPUS) == [True] * len(CORPUS)


def _reads_control(tier: RedisTier) -> bool:
    """Whether the tier reads a non-empty control hash now (False while its shard cannot answer)."""
    try:
        return bool(tier.read_control())
    except redis.exceptions.RedisError:
        return False

