"""The redis-py client the Redis tier talks through, and what a connection attempt does, in words.

Why apart: building the client is configuration (timeouts, TLS, retries, the payload-packing connection
class of `vllm_tiercache.shared.store.tiers.redis.wire`); the tier and its prober build it, the tests inspect it.
"""

from __future__ import annotations

import re
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from vllm_tiercache.shared.store.tiers.redis.config import RedisTierConfig, seed_urls
from vllm_tiercache.shared.store.tiers.redis.wire import connection_class


def make_client(config: RedisTierConfig) -> Any:
    """A redis-py client (pooled; hiredis parser when installed) or RedisCluster for +cluster URLs, whose
    connections send payloads without copying them (`vllm_tiercache.shared.store.tiers.redis.wire`)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        **dict(config.ssl),
    }
    if config.password is not None:
        kwargs["password"] = config.password
    if config.cluster:
        from redis.cluster import ClusterNode, RedisCluster

        url, *more = seed_urls(config.url)
        # The same one immediate retry (redis-py's default is 10 with backoff, seconds per call while a
        # node is away); a retry re-reads the slot map, so a moved slot is still followed. (The tier's own
        # batches take no retry: `redis_cluster.ClusterRouter`.) A slot map with a hole is taken: the
        # slots no node serves are misses, the others are served. The URL's other seed nodes are asked
        # for the slot map when the first does not answer (`config.seed_urls`).
        seeds = [ClusterNode(parsed["host"], parsed.get("port", 6379))
                 for parsed in (parse_url(seed) for seed in more)]
        return RedisCluster.from_url(url, retry=Retry(NoBackoff(), 1), require_full_coverage=False,
                                     connection_class=connection_class(url), startup_nodes=seeds, **kwargs)
    # One retry with no backoff: reconnects a pooled connection that a server restart closed, without
    # stalling callers when the server is really gone. Payloads go to the socket uncopied (`wire`).
    return redis.Redis.from_url(config.url, retry=Retry(NoBackoff(), 1), connection_class=connection_class(config.url),
                                **kwargs)


def pooled_connection(pool: Any) -> Any:
    """A connection from a redis-py pool (redis-py before 5.3 wants a command name)."""
    try:
        return pool.get_connection()
    except TypeError:  # pragma: no cover - an older redis-py
        return pool.get_connection("PING")


def describe_attempt(config: RedisTierConfig) -> str:
    """What a connection attempt does, for the 'unreachable' line: the address alone rarely says whether a
    timeout, a missing password or a TLS setting was the problem."""
    tls = "TLS" + (f" with CA {config.ssl['ssl_ca_certs']}" if config.ssl.get("ssl_ca_certs") else "") \
        if config.url.startswith("rediss") else "plain TCP (no TLS)"
    auth = "with a password" if config.password or re.search(r"//[^/@]*:[^/@]+@", config.url) \
        else "without a password"
    seeds = len(seed_urls(config.url))
    one_seed = " (name several in the URL, a,b,c: while the one seed is away the cluster is not found)"
    kind = (f"cluster, {seeds} seed node{'s' if seeds > 1 else one_seed}" if config.cluster else "single server")
    return (f"{kind}, {tls}, {auth}, {config.timeout_s:g}s connect/read timeout, "
            f"{'each node tried once per call' if config.cluster else '1 immediate retry'}")
