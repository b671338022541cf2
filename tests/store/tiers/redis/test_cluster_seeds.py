"""A Redis Cluster URL with several seed nodes: the client learns the cluster from one that answers.

Why: with one seed, a process that starts while that node hangs (SIGSTOP: connected, silent) or is gone
never reaches the cluster until the node answers again, even once the cluster has promoted its replica and
serves every key. tests/kv/events/test_startup_hangs.py shows it with an engine's scheduler side.
"""

from __future__ import annotations

import itertools

import pytest
import redis.cluster
import torch

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import RedisTier, StoreKey
from vllm_tiercache.shared.store.tiers.redis.client import describe_attempt
from vllm_tiercache.shared.store.tiers.redis.config import seed_urls
from vllm_tiercache.tools.redis_server import LocalRedisCluster

#: like tests/store/tiers/redis/test_cluster.py: a hung node costs a read timeout, which a second engine
#: beside the test would stretch
pytestmark = pytest.mark.serial


def _config(url: str):
    # 5 s: the hung seed costs it twice (the start, the touch); a healthy node on a loaded machine is well within
    return StoreConfig.from_dict({"tiers": [{"kind": "redis", "url": url, "timeout_s": 5.0,
                                             "retry_after_s": 0.1}]}).tiers[0]


def test_a_cluster_url_names_several_seed_nodes():
    assert seed_urls("rediss+cluster://u:p,w@a:7000,b:7001,[::1]:7002/0?x=1") == [
        "rediss://u:p,w@a:7000/0?x=1", "rediss://u:p,w@b:7001/0?x=1", "rediss://u:p,w@[::1]:7002/0?x=1"]
    assert seed_urls("redis://cache:6379") == ["redis://cache:6379"]
    one, three = (_config(url) for url in ("redis+cluster://a:7000", "redis+cluster://a:1,b:2,c:3"))
    assert "1 seed node (name several in the URL" in describe_attempt(one)  # in the 'unreachable' line
    assert "cluster, 3 seed nodes, plain TCP" in describe_attempt(three)


@pytest.mark.redis
def test_a_cluster_whose_seed_node_hangs_is_reached_through_another(redis_cluster: LocalRedisCluster,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The hung master is the URL's first host and the seed the client asks first (redis-py's shuffle of the
    seeds made a reversal: it appends the URL's host after the others): the tier starts up through the next
    one, the hung node's shard is marked down once touched, and the other shards' records are written and
    read. With the URL's first host alone as the seed, the tier would start down and stay so."""
    masters = redis_cluster.master_nodes()
    hung, others = masters[0], masters[1:]
    keys = list(itertools.islice((key for key in (StoreKey(f"seed|{i}") for i in itertools.count())
                                  if redis_cluster.node_of(f"{{{key.hex}}}") in others), 8))
    on_hung = next(key for key in (StoreKey(f"seed-hung|{i}") for i in itertools.count())
                   if redis_cluster.node_of(f"{{{key.hex}}}") == hung)
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{redis_cluster.nodes[i].port}" for i in [hung, *others])
    monkeypatch.setattr(redis.cluster.random, "shuffle", lambda seq: seq.reverse())  # the URL's first host first
    redis_cluster.config_set("cluster-node-timeout", "120000")  # no failover while the test looks
    redis_cluster.pause(hung)
    tier = None
    try:
        tier = RedisTier(_config(url))
        assert not tier.down
        assert tier.get_many([on_hung]) == [None]  # its shard, hung: a miss, and marked down
        assert tier.shards_down == [f"127.0.0.1:{redis_cluster.nodes[hung].port}"] and not tier.down
        tier.put_many([(key, torch.full((16,), i, dtype=torch.uint8), None) for i, key in enumerate(keys)])
        got = tier.get_many(keys)
        assert all(rec is not None and int(rec.tensor[0]) == i for i, rec in enumerate(got))
    finally:
        if tier is not None:
            tier.close()
        redis_cluster.resume(hung)
        redis_cluster.config_set("cluster-node-timeout", str(redis_cluster.node_timeout_ms))
