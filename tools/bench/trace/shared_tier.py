"""The shared tier of `bench trace --shared-share`: a private real redis-server, bounded so that it evicts.

Why its own module: the memory and disk tiers take a capacity in bytes from the store config, Redis does
not: it holds what its server's ``maxmemory`` allows and evicts by its ``maxmemory-policy``
(``allkeys-lru``, as docs/operations.md tells operators to run it). ``maxmemory`` counts the server's own
memory (its empty ``used_memory``, each key's allocation, the key names, the dict entries), so a capacity
in blocks is converted with a measurement, not a formula: the server's ``used_memory`` grown by
`SAMPLE_RECORDS` records of the replay's size and key shape, written through the Redis tier itself (three
Redis keys per record: head, payload part, key text; `vllm_tiercache.shared.store.tiers.redis.records`).
``maxmemory`` = the server's ``used_memory`` when it holds no record but a store is connected to it (its
clients' connections and buffers count: measured once, about 120 KiB, the room of 65 records) + blocks x
the bytes one record took. Approximate: jemalloc's size classes and the dict's rehashing make a record's
cost vary a little with the count held, and a client's query buffer grows while a large pipeline
arrives (a request's put), during which Redis evicts to make room for it.

What Redis evicts is keys, not records: under ``allkeys-lru`` a record's head may stay while its payload
part went. The tier's lookup asks for both (one ``EXISTS`` of head and part 0) and says "not held"; a read
that finds a head without its part (evicted since the lookup) is a miss counted ``partial``, not damage,
and the pieces are deleted. The replay reports those (``partial``, and ``corrupt``: none expected) beside
the keys Redis evicted (`SharedTier.stats`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: records written once to measure what one record costs the server
SAMPLE_RECORDS = 2000
#: Redis's eviction policy for the replay (docs/operations.md: what to run a cache with)
MAXMEMORY_POLICY = "allkeys-lru"


class SharedTier:
    """One redis-server for a whole sweep; `bound` empties it and sizes it for each replay."""

    def __init__(self, server: Any, record_bytes: int, largest_block: int) -> None:
        self.server = server
        self.item: dict[str, Any] = {"kind": "redis", "url": server.url, "timeout_s": 30.0}
        #: ``used_memory`` of the server holding no record, a store connected; bytes per record
        self.empty_bytes, self.record_cost = _measure(self.item, server, record_bytes, largest_block)

    def bound(self, blocks: int) -> dict[str, Any]:
        """Empty the server, zero its stats, and let it hold about ``blocks`` records; the tier's config item."""
        with self.server.client() as client:
            client.flushall()
            client.config_resetstat()
            client.config_set("maxmemory", str(self.empty_bytes + blocks * self.record_cost))
        return dict(self.item)

    def stats(self) -> dict[str, int]:
        """Keys Redis evicted since `bound`, and the memory it uses now."""
        with self.server.client() as client:
            return {"evicted_keys": int(client.info("stats")["evicted_keys"]),
                    "used_memory": int(client.info("memory")["used_memory"])}


def _measure(item: dict[str, Any], server: Any, record_bytes: int, largest_block: int) -> tuple[int, int]:
    """(``used_memory`` of the server holding nothing while a store is connected, bytes of ``used_memory`` one
    record of the replay's shape takes: keys ``trace|<id>`` as long as the trace's largest id, a parent digest
    in its meta), written by the Redis tier behind a tiny memory tier, and read back (the reading connection
    open too)."""
    import torch

    from vllm_tiercache.shared.eviction.lineage import PARENT_KEY
    from vllm_tiercache.shared.store import build_store
    from vllm_tiercache.shared.store.api import StoreKey

    width = len(str(max(largest_block, SAMPLE_RECORDS)))
    keys = [StoreKey(f"trace|{i:0{width}d}") for i in range(SAMPLE_RECORDS)]
    record = torch.empty(record_bytes, dtype=torch.uint8)
    store = build_store({"tiers": [{"kind": "memory", "capacity": record_bytes}, item]})
    try:
        items = [(k, record, {PARENT_KEY: keys[i - 1].digest} if i else None) for i, k in enumerate(keys)]
        for lo in range(0, len(items), 100):
            store.put_many(items[lo:lo + 100], owned=True)
            store.flush()
        store.get_many(keys[-64:])  # memory holds the last one: Redis is read too
        with server.client() as client:
            used = int(client.info("memory")["used_memory"])
            held = int(client.dbsize())
            client.flushall()
            empty = int(client.info("memory")["used_memory"])
    finally:
        store.close()
    if held < 3 * SAMPLE_RECORDS:  # the measurement is only as good as the records it counted
        raise RuntimeError(f"measuring Redis's cost per record: {held} keys held after {SAMPLE_RECORDS} records "
                           "(three keys each expected)")
    return empty, max(1, round((used - empty) / SAMPLE_RECORDS))


@contextmanager
def shared_tier(record_bytes: int, largest_block: int) -> Iterator[SharedTier]:
    """A private redis-server (`RedisServer`: loopback, no persistence) evicting by `MAXMEMORY_POLICY`."""
    from vllm_tiercache.tools.cli import UsageError
    from vllm_tiercache.tools.redis_server import RedisServer, RedisServerError

    try:  # missing or failing to start: a one-line error naming the flag, not a traceback
        server = RedisServer(extra_args=["--maxmemory-policy", MAXMEMORY_POLICY])
    except RedisServerError as exc:
        raise UsageError(f"--shared-share: {exc}") from None
    try:
        try:
            server.start()
        except RedisServerError as exc:
            raise UsageError(f"--shared-share: {exc}") from None
        yield SharedTier(server, record_bytes, largest_block)
    finally:
        server.close()
