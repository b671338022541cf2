"""Where a Redis Cluster batch goes: routed per shard by the tier itself, and the cluster's health checks.

The tier routes a cluster batch itself (the client's slot map, one round trip to every primary at once)
instead of redis-py's cluster pipeline, which answers a failed node by resending each of its commands
alone, each retried, and re-reading the slot map inside the caller's call. A node that fails in a call
(refused, reset, timed out) fails its own commands, once, and its shard is marked down: its keys are
misses and its writes are dropped (counted) at once, without touching the network, while the other
shards keep serving. A reply that says the slot map is stale (MOVED, ASK) or a slot no node serves is a
miss, and the prober re-reads the map; a CLUSTERDOWN reply (a master failed and the servers run with
``cluster-require-full-coverage yes``) is a miss from a node that answered.

Why apart from the tier: routing knows slots, nodes and their connections, and nothing of records,
counters or log lines; `redis_calls.RedisCalls` decides what its failures mean.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Container
from typing import Any

import redis

from vllm_tiercache.shared.store.tiers.redis.client import pooled_connection
from vllm_tiercache.shared.store.tiers.redis.errors import NODE_ERRORS, ShardDownError, log
from vllm_tiercache.shared.store.tiers.redis.health import TierHealth


class ClusterRouter:
    """Sends a cluster batch to the primaries that serve its keys, and probes the cluster's shards."""

    def __init__(self, address: str, retry_after_s: float) -> None:
        self.address = address
        self.retry_after_s = retry_after_s
        #: Records a batch's commands (a standalone client's pipeline, never executed).
        self._recorder = redis.Redis()

    # ------------------------------------------------------------------------------------------ batches
    def send(self, client: Any, queue: Callable[[Any], None], shards_down: Container[str],
             errors: list[Exception], failed: dict[str, tuple[int, BaseException]]) -> list[Any]:
        """Queue, route and send one cluster batch: one result per command, an exception object in the place
        of a command that failed. Error replies and routing failures go to ``errors``; nodes that failed to
        ``failed`` (name -> a slot it serves, the error).

        The commands are queued on a standalone pipeline that only records them, grouped by the primary
        that serves their slot in the client's slot map (every command names one key; a record's keys
        share one hash tag, so one node), written to every node first and then read back, as redis-py's
        cluster pipeline does, without what it does on a failure. A node that fails (refused, reset, timed
        out) fails its own commands, once; a shard in ``shards_down`` is not sent to (`ShardDownError` in
        its commands' places, at once).
        """
        recorder = self._recorder.pipeline(transaction=False)
        queue(recorder)
        commands: list[tuple[tuple[Any, ...], dict[str, Any]]] = recorder.command_stack
        res: list[Any] = [None] * len(commands)
        slots = client.nodes_manager.slots_cache
        groups: dict[str, tuple[Any, int, list[int]]] = {}  # node name -> node, a slot, command indexes
        skipped: ShardDownError | None = None
        for i, (args, _) in enumerate(commands):
            slot = client.keyslot(args[1])
            owners = slots.get(slot)
            if not owners:
                res[i] = exc = redis.exceptions.SlotNotCoveredError(f"slot {slot} is in no node's slot range")
                errors.append(exc)
                continue
            node = owners[0]
            if node.name in shards_down:
                if skipped is None:
                    skipped = ShardDownError(f"shard {node.name} is marked down")
                res[i] = skipped
                continue
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (node, slot, [])
            group[2].append(i)
        if not groups:
            return res

        def fail(name: str, slot: int, indexes: list[int], exc: BaseException) -> None:
            failed[name] = (slot, exc)
            for i in indexes:
                res[i] = exc

        sent: list[tuple[str, int, list[int], Any, Any]] = []  # name, slot, indexes, node client, connection
        done = 0  # entries of ``sent`` read back (or failed): the rest are disconnected, not reused
        try:
            for name, (node, slot, indexes) in groups.items():
                node_client = client.get_redis_connection(node)
                try:
                    conn = pooled_connection(node_client.connection_pool)
                except NODE_ERRORS as exc:
                    fail(name, slot, indexes, exc)
                    continue
                sent.append((name, slot, indexes, node_client, conn))
                try:
                    conn.send_packed_command(conn.pack_commands([commands[i][0] for i in indexes]))
                except NODE_ERRORS as exc:
                    fail(name, slot, indexes, exc)
            for name, slot, indexes, node_client, conn in sent:
                if name not in failed:
                    for i in indexes:
                        args, options = commands[i]
                        try:
                            res[i] = node_client.parse_response(conn, args[0], **options)
                        except redis.ResponseError as exc:
                            res[i] = exc
                            errors.append(exc)
                        except NODE_ERRORS as exc:
                            fail(name, slot, indexes, exc)
                            break
                done += 1
        finally:
            for k, (name, _, _, node_client, conn) in enumerate(sent):
                if k >= done or name in failed:  # replies unread: a later user would read this call's
                    conn.disconnect()
                node_client.connection_pool.release(conn)
        return res

    def memory_info(self, client: Any, shards_down: Container[str]
                    ) -> tuple[list[dict[str, Any]], dict[str, tuple[int, BaseException]]]:
        """Each answering primary's ``INFO memory`` (a shard in ``shards_down`` is left out), and the nodes
        that failed (name -> a slot it serves, the error)."""
        infos: list[dict[str, Any]] = []
        failed: dict[str, tuple[int, BaseException]] = {}
        for node in client.get_primaries():
            if node.name in shards_down:
                continue
            try:
                infos.append(client.get_redis_connection(node).info("memory"))
            except NODE_ERRORS as exc:
                slot = next((s for s, owners in client.nodes_manager.slots_cache.items()
                             if owners and owners[0].name == node.name), None)
                if slot is not None:
                    failed[node.name] = (slot, exc)
        return infos, failed

    # ----------------------------------------------------------------------------------------- probes
    def probe(self, client: Any, health: TierHealth) -> bool:
        """A cluster's health check, on the prober's thread. Away at start (the tier down, no shard named):
        PING every primary. Else re-read the slot map (a failover gives a shard's slots to its promoted
        replica) and PING the node that now serves each down shard's slots: at once when that node
        changed, else every ``retry_after_s``. Marks up what answered, one line each; True when nothing is
        left to probe. Raises when the cluster did not answer (the refresh it took is kept asked)."""
        from redis.cluster import RedisCluster

        whole, shards, refresh = health.take_probe_work()
        try:
            if whole and not shards:
                client.ping(target_nodes=RedisCluster.PRIMARIES)
                if refresh:  # a stale map reported before the whole tier went down: still re-read it
                    self.refresh_slots(client)
                health.cluster_up({})
                return not health.needs_probe()
            if shards or refresh:
                self.refresh_slots(client)
        except Exception:  # the next probe asks again: a refresh is never dropped
            health.keep_refresh(refresh)
            raise
        now = time.monotonic()
        back: dict[str, str] = {}
        for name, shard in shards.items():
            owners = client.nodes_manager.slots_cache.get(shard.slot)
            if not owners:
                continue  # its slots have no node yet
            owner = owners[0]
            if owner.name == name and now - shard.pinged < self.retry_after_s:
                continue
            shard.pinged = now
            try:
                client.get_redis_connection(owner).ping()
            except Exception as exc:
                log.debug("tiercache redis tier: %s: shard %s probe (%s) failed: %s", self.address, name,
                          owner.name, exc)
                continue
            back[name] = owner.name
        health.cluster_up(back)
        return not health.needs_probe()

    def refresh_slots(self, client: Any) -> None:
        """Re-read the slot map (CLUSTER SLOTS from one node that answers), on the prober's thread; the
        nodes' pooled connections are kept (redis-py would drop the answering node's, and the next
        request would pay the reconnect)."""
        manager = client.nodes_manager
        if "disconnect_startup_nodes_pools" in inspect.signature(manager.initialize).parameters:
            manager.initialize(disconnect_startup_nodes_pools=False)
        else:  # pragma: no cover - an older redis-py
            manager.initialize()
