"""The Redis tier's calls to its server or cluster: one client call or one pipelined batch at a time, never
raising for a backend problem, each failure reported to the tier's health and counters.

A call while the tier is down returns at once (None), without touching the network: the prober decides
when it is back. A batch answers one result per command, an exception object in the place of a command
that failed (its record is a miss or a dropped write); None only when the whole call failed. On a cluster
the batch is routed by `redis_cluster.ClusterRouter`, and a failed node marks its own shard down.

Why apart from the tier: the tier says what to read and write and what a reply means for a record; this
says what a call's failure means for the tier (`redis_errors.classify`), in one place for every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tiers.redis.client import make_client
from vllm_tiercache.shared.store.tiers.redis.cluster import ClusterRouter
from vllm_tiercache.shared.store.tiers.redis.config import RedisTierConfig
from vllm_tiercache.shared.store.tiers.redis.errors import (
    BUG,
    DOWN,
    STALE_MAP_ERRORS,
    THROTTLED,
    FailureLog,
    classify,
    log,
)
from vllm_tiercache.shared.store.tiers.redis.health import SLOT_MAP_REFRESH_S, TierHealth


@dataclass(frozen=True)
class RedisMemory:
    """A server's ``INFO memory``, or a cluster's summed over its primaries: for ``usage`` and `tiercache pin`."""

    used: int
    #: the bytes the servers may hold (``maxmemory``, summed), None when one of them has no limit (0)
    limit: int | None
    #: each server's ``maxmemory-policy`` (``volatile-lru``, ``allkeys-lru``, ``noeviction``, ...)
    policies: frozenset[str]

    @classmethod
    def of(cls, infos: Iterable[Mapping[str, Any]]) -> RedisMemory:
        infos = list(infos)
        limits = [int(info.get("maxmemory") or 0) for info in infos]
        return cls(used=sum(int(info.get("used_memory") or 0) for info in infos),
                   limit=sum(limits) if limits and all(limits) else None,
                   policies=frozenset(str(info["maxmemory_policy"]) for info in infos if info.get("maxmemory_policy")))


class RedisCalls:
    """The tier's client and every call made through it (see the module docstring)."""

    def __init__(self, config: RedisTierConfig, health: TierHealth, counters: TierCounters) -> None:
        self.config = config
        self.address = config.address
        self.health = health
        self.failures = FailureLog(self.address, counters, is_closed=lambda: health.closed,
                                   mark_down=health.mark_down)
        self.router = ClusterRouter(self.address, config.retry_after_s) if config.cluster else None
        #: The redis-py client; None while a cluster that was away at start has not answered yet, and after
        #: `close`.
        self.client: Any = None
        #: Probes sent so far (tests check that none ran on a caller's thread).
        self.probes = 0

    def connect(self) -> None:
        """Build the client; a failure marks the tier down (one warning naming the cause) and starts the
        prober, so the tier calls this once every part of it exists."""
        try:
            self.client = make_client(self.config)
        except Exception as exc:  # RedisCluster discovers nodes eagerly: whatever it raises, the tier is
            self.health.mark_down(exc)  # down (one warning naming the cause) and is built again later

    def available(self) -> bool:
        """Whether a call may use the network now: never while down (the prober decides when it is back)."""
        return not self.health.down and self.client is not None

    def client_or_raise(self) -> Any:
        """The client for the admin commands, which must say when Redis is unreachable (ConnectionError),
        not silently report an empty store."""
        if self.client is None:
            self.connect()
        if self.client is None:
            raise ConnectionError(f"redis tier {self.address} is unreachable")
        return self.client

    # ------------------------------------------------------------------------------------------ calls
    def run(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one client call; None when down or failed (never raises for a backend problem)."""
        if not self.available():
            return None
        try:
            result = fn()
        except Exception as exc:  # classify() decides what it means; none reaches the caller
            self.failures.failed(what, exc)
            return None
        self.health.mark_up()
        return result

    def pipeline(self, what: str, queue: Callable[[Any], None]) -> list[Any] | None:
        """One pipelined batch: one result per queued command, an exception object for a command that
        failed (its record is a miss or a dropped write); None when the whole batch failed.

        A batch whose every command failed the same ``down`` way (the server or every node went away
        while it ran) marks the tier down like a batch that raised. On a cluster: `_cluster_pipeline`.
        """
        if self.router is not None:
            return self._cluster_pipeline(what, queue, self.router)

        def call() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            queue(pipe)
            res = pipe.execute(raise_on_error=False)
            if res and all(isinstance(r, Exception) for r in res) and classify(res[0]) == DOWN:
                raise res[0]
            return res

        res = self.run(what, call)
        failed = next((r for r in res if isinstance(r, Exception)), None) if res is not None else None
        if failed is not None:  # counted and logged once per call, whatever the number of records
            if classify(failed) == DOWN:  # some nodes answered: not the whole tier
                self.failures.other_error(f"{what} (some nodes unreachable)", failed)
            else:
                self.failures.failed(f"{what} (some records)", failed)
        return res

    def _cluster_pipeline(self, what: str, queue: Callable[[Any], None], router: ClusterRouter) -> list[Any] | None:
        """`pipeline` on a cluster, routed by ``router`` (`ClusterRouter.send`): one round trip to every
        primary at once. A node that fails marks its shard down (`shards_failed`); a reply saying the slot
        map is stale asks the prober to re-read it; any other error reply (OOM, READONLY, CLUSTERDOWN, ...)
        is its command's own failure, logged once per kind."""
        if not self.available():
            return None
        errors: list[Exception] = []
        failed: dict[str, tuple[int, BaseException]] = {}
        try:
            res = router.send(self.client, queue, self.health.outages, errors, failed)
        except Exception as exc:  # a bug in the queue or the routing: classify() decides, as for one server
            self.failures.failed(what, exc)
            res = None
        if failed:
            self.shards_failed(failed)
        stale = next((e for e in errors if isinstance(e, STALE_MAP_ERRORS)), None)
        if stale is not None:  # a failover or a resharding: misses until the prober re-read the map
            self.health.ask_refresh()
            self.failures.stale_map(what, stale, min(self.config.retry_after_s, SLOT_MAP_REFRESH_S))
        other = next((e for e in errors if not isinstance(e, STALE_MAP_ERRORS)), None)
        if other is not None:
            if classify(other) in (BUG, THROTTLED):
                self.failures.failed(f"{what} (some records)", other)
            else:  # a node answered (OOM, READONLY, CLUSTERDOWN, ...): never the whole tier
                self.failures.other_error(f"{what} (some records)", other)
        return res

    def mget(self, names: list[str], what: str) -> list[Any] | None:
        """Values of ``names`` in one round trip (None when the call failed as a whole): one MGET on one
        server (one command, one reply, least client overhead); pipelined GETs on a cluster, where
        names of many slots cannot share one command, and a failed GET is an exception in its place."""
        if not self.config.cluster:
            return self.run(what, lambda: self.client.mget(names))

        def queue(pipe: Any) -> None:
            for name in names:
                pipe.get(name)

        return self.pipeline(what, queue)

    def memory(self) -> RedisMemory | None:
        """What the server says of its memory (`RedisMemory`); on a cluster summed over the primaries that
        answer (one that fails costs its own figures and marks its shard down, not the whole tier), None
        when none did. Raises on one server."""
        if self.router is None:
            return RedisMemory.of([self.client.info("memory")])
        infos, failed = self.router.memory_info(self.client, self.health.outages)
        if failed:
            self.shards_failed(failed)
        return RedisMemory.of(infos) if infos else None

    # ---------------------------------------------------------------------------------------- health
    def shards_failed(self, failed: dict[str, tuple[int, BaseException]]) -> None:
        """Mark down the shards whose node failed, against the primaries the client's slot map knows."""
        client = self.client
        primaries = {node.name for node in client.get_primaries()} if client is not None else set()
        self.health.shards_failed(failed, primaries)

    def primary_count(self) -> int:
        """How many primaries the client's slot map knows (from memory, never the network); 0 when unknown."""
        try:
            return len(self.client.get_primaries())
        except Exception:  # a client without a slot map yet: say only that something is down
            return 0

    def probe(self) -> bool:
        """One health check, on the prober's thread only: build the client if there is none (a cluster
        away at start), then PING with the tier's timeout (a cluster: `ClusterRouter.probe`). True when it
        answered (a cluster: when nothing is left down); a failure is not logged again."""
        self.probes += 1
        try:
            client = self.client
            if client is None:
                client = make_client(self.config)
                with self.health.lock:
                    if self.health.closed:
                        client.close()
                        return False
                    self.client = client
            if self.router is not None:
                return self.router.probe(client, self.health) and not self.health.closed
            client.ping()
        except Exception as exc:
            log.debug("tiercache redis tier: %s probe failed: %s", self.address, exc)
            return False
        return not self.health.closed

    def close(self) -> None:
        """Stop the prober and close the client (a dead connection must not fail shutdown)."""
        self.health.close()
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead connection must not fail shutdown
                pass
