"""An engine that starts while its shared tier hangs (the object tier's SeaweedFS, or Redis, stopped with
SIGSTOP: its sockets open, nothing answered), on vLLM's real scheduler over the real servers.

What an operator wants then, and these tests pin down: the scheduler side is built and its steps run while
the server hangs (the tier's start-up request costs one ``timeout_s``, the journal's start-up read and
check run on their own thread, the first step waits for them at most `FIRST_STEP_WAIT_S`); the tier is
marked down (logged); and once the server answers again, the chunks the journal lists are announced after
all, later saves land and are announced, and lookups find them.

Why: the start-up read of the journal went to a tier that was down, so it read nothing, and nothing asked
for the ring again once the tier answered: what the stopped engine had saved was announced only as
requests happened to look it up (the discovery's "asked again once it answers" covered the chunks it
read, not a ring it could not read).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockStored

from tests.kv.events.test_events import BLOCK, Published, _config, _play_saves, _prompt
from tests.support.real_scheduler import hashed_request, schedule_new
from tests.support.waiting import off_this_thread, wait_until
from vllm_tiercache.kvcache.events.ledger import MEDIUM_REMOTE
from vllm_tiercache.kvcache.plan import TieredKVWorkerMetadata
from vllm_tiercache.tools.redis_server import LocalRedisCluster, RedisServer


def _stored_blocks(engine: Published) -> int:
    """One empty step (off the test's thread: it must return while the server hangs); the blocks it
    announced on the shared tiers' medium."""
    def step() -> int:
        engine.report(TieredKVWorkerMetadata())
        return sum(len(event.block_hashes) for event in engine.events(BlockStored, MEDIUM_REMOTE))

    return off_this_thread("an engine step", step, limit_s=120.0)


def _steps_until(engine: Published, what: str, done: Callable[[int], bool]) -> int:
    """Empty steps until ``done(blocks announced so far)``; the blocks they announced."""
    blocks = [0]

    def step_and_check() -> bool:
        blocks[0] += _stored_blocks(engine)
        return done(blocks[0])

    wait_until(what, step_and_check)
    return blocks[0]


def _start_while_hung(tiny_llama: Path, tmp_path: Path, tier: dict[str, Any], server: Any) -> None:
    """An engine saves one prompt (3 chunks, 12 blocks) and stops; the server is stopped; a second engine
    starts and steps while it hangs; the server resumes: the 12 blocks are announced, a new prompt's
    saves land and are announced too."""
    first = Published(_config(tiny_llama, tmp_path / "unused", shared_tier=tier))
    out, meta = schedule_new(first.scheduler, hashed_request("a", _prompt(1), BLOCK))
    names = _play_saves(first.connector, meta)
    first.finish(out, TieredKVWorkerMetadata(added=set(names)))
    first.connector.shutdown()  # the journal's last write, the store flushed
    first.connector._store.close()

    server.pause()
    try:
        second = off_this_thread("the engine's scheduler side to be built",
                                 lambda: Published(_config(tiny_llama, tmp_path / "unused", shared_tier=tier),
                                                   inline=False),  # its questions on its own thread
                                 limit_s=120.0)
        tracker = second.connector._scheduler.events  # type: ignore[union-attr]
        shared = [t for t in second.connector._store.tiers if t.shared_across_processes]
        # the start-up check ends while the server hangs (the tier's own timeout), and the steps go on
        announced = _steps_until(second, "the start-up check to end", lambda _: tracker._startup is None)
        announced += sum(_stored_blocks(second) for _ in range(3))
        assert announced == 0  # nothing is known to be there
        assert all(t.down for t in shared) and not tracker.shared_answering()
    finally:
        server.resume()

    wait_until("the tier to find the server back", lambda: not any(t.down for t in shared))
    back = _steps_until(second, "the journal's chunks announced once the tier answers", lambda n: n >= 12)
    assert back == 12  # every block of the three chunks, once

    # later saves land on the tier, and are confirmed there and announced
    out, meta = schedule_new(second.scheduler, hashed_request("b", _prompt(2), BLOCK))
    later = _play_saves(second.connector, meta)
    second.finish(out, TieredKVWorkerMetadata(added=set(later)))
    assert all(second.connector._store.contains_many(
        [tracker._first_key(name) for name in names + later], shared_only=True, bounded=False))
    assert _steps_until(second, "the later saves announced", lambda n: n >= 12) == 12
    tracker.close()


@pytest.mark.s3
def test_an_engine_starting_while_the_object_store_hangs_serves_and_announces_once_it_answers(
        tiny_llama: Path, tmp_path: Path, s3_bucket: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    _start_while_hung(tiny_llama, tmp_path, s3_bucket.tier_config(timeout_s=2.0, retry_after_s=0.2),
                      s3_bucket.server)
    assert "unreachable" in caplog.text  # the tier said it was down


@pytest.mark.redis
def test_an_engine_starting_while_redis_hangs_serves_and_announces_once_it_answers(
        tiny_llama: Path, tmp_path: Path) -> None:
    with RedisServer() as redis_srv:
        tier = {"kind": "redis", "url": redis_srv.url, "timeout_s": 0.5, "retry_after_s": 0.1}
        _start_while_hung(tiny_llama, tmp_path, tier, redis_srv)


@pytest.mark.redis
@pytest.mark.serial  # as the cluster's hung-node tests are: a healthy node's answer must not miss the timeout
@pytest.mark.parametrize("hung, back_by", [("ring", "resume"), ("ring", "failover"), ("first chunk", "failover")])
def test_an_engine_starting_while_a_cluster_master_hangs_announces_once_its_shard_answers(
        tiny_llama: Path, tmp_path: Path, redis_cluster: LocalRedisCluster, hung: str, back_by: str) -> None:
    """A Redis Cluster one of whose masters hangs (SIGSTOP) while a second engine starts: the master of the
    journal's ring record, or of the first chunk's probe record. The scheduler side is built and steps while
    that shard is down and the others answer; what it holds is not announced meanwhile. Once the shard
    answers, by the master coming back or by its replica taking over (``CLUSTER FAILOVER TAKEOVER``, the hung
    master still stopped), the journal's 12 blocks are announced, each once. The cluster's own failover is
    held off (``cluster-node-timeout`` raised) while the test looks."""
    cluster = redis_cluster
    # every node a seed: with the URL's one node hung, the replica that took over is found through another
    tier = {"kind": "redis", "url": cluster.seeds_url, "timeout_s": 2.0, "retry_after_s": 0.1}
    first = Published(_config(tiny_llama, tmp_path / "unused", shared_tier=tier))
    out, meta = schedule_new(first.scheduler, hashed_request("a", _prompt(1), BLOCK))
    names = _play_saves(first.connector, meta)
    first.finish(out, TieredKVWorkerMetadata(added=set(names)))
    events = first.connector._scheduler.events  # type: ignore[union-attr]
    hung_key = events.journal.key(0) if hung == "ring" else events._first_key(names[0])
    first.connector.shutdown()
    first.connector._store.close()
    victim = cluster.node_of(f"{{{hung_key.hex}}}")  # a record's names carry its digest as their hash tag
    replica = cluster.replica_of(victim)
    cluster.wait_replicated(timeout=60.0)

    cluster.config_set("cluster-node-timeout", "120000")
    cluster.pause(victim)
    try:
        second = off_this_thread("the engine's scheduler side to be built",
                                 lambda: Published(_config(tiny_llama, tmp_path / "unused", shared_tier=tier),
                                                   inline=False),
                                 limit_s=120.0)
        tracker = second.connector._scheduler.events  # type: ignore[union-attr]
        shared = [t for t in second.connector._store.tiers if t.shared_across_processes]
        announced = _steps_until(second, "the start-up check to end", lambda _: tracker._startup is None)
        announced += sum(_stored_blocks(second) for _ in range(3))
        assert announced <= (0 if hung == "ring" else 8)  # what the hung shard holds waits for it
        # the other seed nodes answered: the tier is up, the hung node's shard down
        wait_until("the hung shard marked down", lambda: all(t.shards_down and not t.down for t in shared))
        assert not tracker.shared_answering()
        if back_by == "resume":
            cluster.resume(victim)
        else:
            with cluster.node_client(replica) as client:
                client.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
            cluster.wait_promoted(replica)
        wait_until("every shard to answer again", tracker.shared_answering)
        announced += _steps_until(second, "the journal's chunks announced once the shard answers",
                                  lambda n: announced + n >= 12)
        assert announced == 12  # every block of the three chunks, once
        assert all(second.connector._store.contains_many([tracker._first_key(name) for name in names],
                                                          shared_only=True, bounded=False))
        tracker.close()
    finally:
        cluster.resume(victim)
        cluster.config_set("cluster-node-timeout", str(cluster.node_timeout_ms))
