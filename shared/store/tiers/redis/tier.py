"""Redis tier: records in a Redis server or cluster, shared by every process and host that reaches it.

A record is a head, its payload parts and its key text, all in one cluster slot (`records` has the
layout). The head is written last on the same connection, so a reader never sees a head before its
parts. A batch of lookups or gets is one pipelined round trip (plus one more only for records with more
than one part).

Redis evicts and expires keys, not records (`records`): a lookup asks for the head and the first part in
one ``EXISTS`` per record and says "held" only when both are there, and a read that finds a piece gone
counts the record ``partial`` (a miss, its remaining pieces deleted, nothing logged), keeping ``corrupt``
for damage. The head expires a little before the other pieces (`records.head_ttl_lead_ms`).

Copies of the payload. A put: the tier copies nothing itself; it hands redis-py each part as a
memoryview slice of the tensor the store gave it (the store's private copy, or with ``owned=True`` the
caller's own tensor: `TieredStore.put_many`). The tier's connections pack a command that carries a payload
with redis-py's Python packer, which sends the memoryview to the socket as it is: no copy
(`vllm_tiercache.shared.store.tiers.redis.wire`; redis-py's default with hiredis would copy it three times,
and a plain ``SET`` of bytes pays two of those). A get: hiredis
parses each reply into a bytes object (its own buffer, then the bytes, as for a plain ``GET``); a
one-part record's tensor is built over that bytes object (read-only, no copy), and the parts of a larger
record are copied once into one buffer, checksummed as they are copied (`records.join_payload`).

No request fails because Redis is down or slow. The tier is a thin layer over its parts, each with one job:

- `redis_calls.RedisCalls`: the client and every call through it; never raises for a backend problem.
- `redis_health.TierHealth`: up, shards down or down, and the prober thread that finds the tier back
  (no request ever pays for a probe; `TieredStore` bounds even a hung call for the schedulers' lookups:
  ``lookup_budget_ms``). A cluster unreachable when the tier is built gives a tier that is down (the
  engine starts without it, and the prober builds the client once the cluster answers); one that goes
  away while running marks the tier down with one warning, not a traceback per call.
- `redis_cluster.ClusterRouter`: a cluster batch routed per shard by the tier itself; one failed master
  costs its own keys only.
- `errors`: what each exception means (`classify`: ``down``, ``error``, ``bug``) and how it is
  counted and logged (once per kind); errors are per record, not per batch.
- `records`: key names, head and parts encoded and decoded.
- `redis_admin.RedisAdmin`: `iter_stored` and `delete_stored` for `tiercache stats` and `tiercache evict`.
- `client`: the redis-py client (`make_client`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import (
    DropsRecords,
    ExpiresRecords,
    HonorsPins,
    KeepsControl,
    Record,
    RemoteTier,
    ReportsHealth,
    ReportsUnwritten,
    StoredRecord,
    StoreKey,
    Unwritten,
    key_text_bytes,
)
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tags import encode_tags, tags_of
from vllm_tiercache.shared.store.tiers.redis.admin import RedisAdmin
from vllm_tiercache.shared.store.tiers.redis.calls import RedisCalls
from vllm_tiercache.shared.store.tiers.redis.client import describe_attempt, make_client
from vllm_tiercache.shared.store.tiers.redis.config import RedisTierConfig
from vllm_tiercache.shared.store.tiers.redis.errors import BUG, DOWN, ERROR, THROTTLED, ShardDownError, classify
from vllm_tiercache.shared.store.tiers.redis.health import TierHealth
from vllm_tiercache.shared.store.tiers.redis.records import (
    MissingPiece,
    MultiPart,
    RecordNames,
    decode_first,
    decode_rest,
    head_record_size,
    head_ttl_lead_ms,
    head_value,
    part_count,
    payload_parts,
)

#: Names other modules and tests import from here (the tier's module before it was split by job).
__all__ = ["BUG", "DELETE_RUN", "DOWN", "ERROR", "MAX_DELETE_PARTS", "RedisTier", "ShardDownError", "classify",
           "make_client"]

#: Parts deleted per command when a corrupt record is dropped, and the most parts it may have.
DELETE_RUN = 256
MAX_DELETE_PARTS = 1 << 20


class RedisTier(RemoteTier, ReportsHealth, KeepsControl, HonorsPins, ExpiresRecords, DropsRecords,
                ReportsUnwritten):
    """Pipelined, part-splitting Redis tier that degrades to misses when the server is down."""

    kind = "redis"
    shared_across_processes = True
    # `RemoteTier`: one call may hang up to ``timeout_s`` twice (with the retry), so the store bounds lookups.

    def __init__(self, config: RedisTierConfig, name: str = "redis") -> None:
        self.config = config
        self.name = name
        self.address = config.address
        self.counters = TierCounters()
        self._names = RecordNames(config.key_prefix)
        # the prober calls ``self._probe`` as it is when it runs (tests wrap it to see which thread probes)
        self._health = TierHealth(self.address, config.retry_after_s, self.counters, cluster=config.cluster,
                                  attempt=describe_attempt(config), probe=lambda: self._probe(),
                                  thread_name=f"tiercache-probe-{name}")
        self._calls = RedisCalls(config, self._health, self.counters)
        self._admin = RedisAdmin(self._names, config.cluster, self._calls.client_or_raise)
        #: tags pinned now (`set_pinned_tags`): records carrying one are written without a TTL
        self._pins: frozenset[str] = frozenset()
        self._calls.connect()  # last: a failure starts the prober, which calls back into the parts above

    # ------------------------------------------------------------------------------------ availability
    @property
    def down(self) -> bool:
        """The whole tier is down (on a cluster: every shard, or the cluster was away at start)."""
        return self._health.down

    @property
    def shards_down(self) -> list[str]:
        """The cluster shards (their primary's "host:port") marked down now; empty on a standalone server."""
        return self._health.shards_down

    @property
    def up_share(self) -> float:
        """The share of the tier that answers, for the ``tier_up`` gauge: 0 while down, 1 while every shard
        answers; on a cluster with shards marked down, the share of its primaries that are not (read from
        the client's slot map in memory, never from the network)."""
        return self._health.up_share(self._calls.primary_count)

    @property
    def probes(self) -> int:
        """Probes sent so far (tests check that none ran on a caller's thread)."""
        return self._calls.probes

    def tried(self) -> str:
        """What a connection attempt does, for the 'unreachable' line: the address alone rarely says
        whether a timeout, a missing password or a TLS setting was the problem."""
        return describe_attempt(self.config)

    def _probe(self) -> bool:
        """One health check, on the prober's thread only (`RedisCalls.probe`)."""
        return self._calls.probe()

    # ------------------------------------------------------------------------------------------- keys
    def _head(self, key: StoreKey) -> str:
        return self._names.head(key)

    def _part(self, key: StoreKey, i: int) -> str:
        return self._names.part(key, i)

    def _text_name(self, key: StoreKey) -> str:
        return self._names.text(key)

    # ------------------------------------------------------------------------------------------ reads
    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each record is held: its head and its first part both there (one ``EXISTS`` of the two per
        record, pipelined; the two share a hash slot, so one command on a cluster too).

        Why both: Redis evicts keys, not records; a head whose payload was evicted would be a promised hit
        that the read cannot give (a recompute after a wait on the network). A later part of a multi-part
        record evicted is found only by the read (counted ``partial``)."""
        if not keys:
            return []
        names = self._names

        def queue(pipe: Any) -> None:
            for k in keys:
                pipe.exists(names.head(k), names.part(k, 0))

        res = self._calls.pipeline("contains", queue)
        if res is None:
            return [False] * len(keys)
        return [not isinstance(r, Exception) and r == 2 for r in res]

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        if not keys:
            return []
        names = [name for k in keys for name in (self._names.head(k), self._names.part(k, 0))]
        res = self._calls.mget(names, "get")
        out: list[Record | None] = [None] * len(keys)
        if res is None:
            return out
        more: list[tuple[int, MultiPart]] = []  # index, what its first round trip read
        corrupt: list[StoreKey] = []
        partial: list[StoreKey] = []
        for i, key in enumerate(keys):
            head, part0 = res[2 * i], res[2 * i + 1]
            if head is None or isinstance(head, Exception) or isinstance(part0, Exception):
                continue  # absent, or its node failed this command: a miss, not damage
            try:
                first = decode_first(head, part0, key)
            except records.OtherFormatError:  # another build's record: a miss, left for that build
                self.counters.add(other_format=1)
                continue
            except MissingPiece:  # Redis evicted or expired its first part: a miss, not damage
                partial.append(key)
                continue
            except records.RecordError as exc:
                corrupt.append(key)
                self._calls.failures.other_error(f"decode ({exc})", exc)
                continue
            if isinstance(first, MultiPart):
                more.append((i, first))
            else:
                out[i] = first
        if more:
            self._get_rest(keys, more, out, corrupt, partial)
        if corrupt or partial:
            self.counters.add(corrupt=len(corrupt), partial=len(partial))
            # a partial record's other pieces would be kept by no reader (and listed by `tiercache stats`)
            self._delete_pieces([*corrupt, *partial])
        return out

    def _get_rest(self, keys: Sequence[StoreKey], more: list[tuple[int, MultiPart]], out: list[Record | None],
                  corrupt: list[StoreKey], partial: list[StoreKey]) -> None:
        """Second round trip for multi-part records: fetch parts 1..n-1 and join them into one buffer
        (the one copy a get makes; a one-part record's tensor is built over its reply, no copy). A record
        with a part gone goes to ``partial``, one whose parts do not check to ``corrupt``."""
        names = self._names

        def queue(pipe: Any) -> None:
            for i, first in more:
                for p in range(1, first.nparts):
                    pipe.get(names.part(keys[i], p))

        parts = self._calls.pipeline("get parts", queue)
        if parts is None:
            return
        pos = 0
        for i, first in more:
            rest = parts[pos:pos + first.nparts - 1]
            pos += first.nparts - 1
            if any(isinstance(p, Exception) for p in rest):
                continue  # its node failed a command: a miss, not damage
            try:
                out[i] = decode_rest(first, rest, keys[i])
            except MissingPiece:  # Redis evicted or expired one of its parts: a miss, not damage
                partial.append(keys[i])
            except (records.RecordError, ValueError) as exc:
                corrupt.append(keys[i])
                self._calls.failures.other_error(f"decode ({exc})", exc)

    def drop_many(self, keys: Sequence[StoreKey]) -> None:
        """Delete every piece of these keys' records (`DropsRecords`: records the store cannot open)."""
        if keys:
            self._delete_pieces(keys)

    def _delete_pieces(self, corrupt: Sequence[StoreKey]) -> None:
        """Drop every piece of corrupt or partial records: head and key text first (readers then miss), then
        parts.

        The head's part count cannot be trusted (it may be the damage, or another record's head), so
        parts are deleted in runs of `DELETE_RUN` until a run deletes fewer than it names (parts are
        numbered 0..n-1): no orphan part outlives its record (`tiercache evict` finds records by heads).
        One pipelined round trip per run, for all records at once. A cluster pipeline refuses a
        multi-key ``delete()``; one DEL of keys that share a slot (a record's hash tag) it routes, so the
        runs go as raw DEL commands and head and key text as two single-key deletes. A record whose
        delete failed is left for the next reader that finds it damaged.
        """
        names = self._names

        def heads(pipe: Any) -> None:
            for key in corrupt:
                pipe.delete(names.head(key))
                pipe.delete(names.text(key))
                pipe.delete(names.tags(key))

        if self._calls.pipeline("delete corrupt", heads) is None:
            return
        left = list(corrupt)
        for lo in range(0, MAX_DELETE_PARTS, DELETE_RUN):
            run = range(lo, lo + DELETE_RUN)
            batch = left

            def parts(pipe: Any, batch: list[StoreKey] = batch, run: range = run) -> None:
                for key in batch:
                    pipe.execute_command("DEL", *[names.part(key, p) for p in run])

            res = self._calls.pipeline("delete corrupt", parts)
            if res is None:
                return
            left = [key for key, n in zip(batch, res, strict=True) if n == DELETE_RUN]
            if not left:
                return

    # ----------------------------------------------------------------------------------------- writes
    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None:
        """`try_put_many`, each record it left unwritten a dropped write (counted)."""
        unwritten = self.try_put_many(items)
        if unwritten is not None:
            self.counters.add(dropped_writes=len(unwritten.positions))

    def try_put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]
                     ) -> Unwritten | None:
        """One pipelined write of every record's parts, text, tags and head; the records a failed command
        belongs to (or all, when the batch failed) come back for the caller to drop or put again."""
        if not items:
            return None
        ttl_ms = int(self.config.ttl_s * 1000) if self.config.ttl_s else None
        # the head expires first: expiry leaves a clean miss, not a head without its parts
        head_ttl_ms = ttl_ms - head_ttl_lead_ms(ttl_ms) if ttl_ms else None
        part_size = self.config.part_size
        names = self._names
        pins = self._pins
        encoded = [(key, records.encode(key, tensor, meta), tags_of(meta)) for key, tensor, meta in items]

        # parts, text, head, and tags when the record has some
        counts = [part_count(enc.payload.nbytes, part_size) + 2 + bool(tags) for _, enc, tags in encoded]

        def queue(pipe: Any) -> None:
            for key, enc, tags in encoded:
                # a pinned record is written without a TTL (`vllm_tiercache.shared.store.pins`)
                pinned = bool(pins) and not pins.isdisjoint(tags)
                px = None if pinned else ttl_ms
                parts = payload_parts(enc.payload, part_size)
                for p, part in enumerate(parts):
                    pipe.set(names.part(key, p), part, px=px)
                pipe.set(names.text(key), key_text_bytes(key.text), px=px)
                if tags:
                    pipe.set(names.tags(key), encode_tags(tags), px=px)
                pipe.set(names.head(key), head_value(len(parts), enc.prefix), px=None if pinned else head_ttl_ms)

        available = self._calls.available()
        res = self._calls.pipeline("put", queue) if available else None
        if res is None:
            reason = self._calls.failures.last_reason if available else "down: not sent, the tier is down"
            return Unwritten(tuple(range(len(items))), reason or "down", reason.startswith(THROTTLED))
        pos, done, nbytes = 0, 0, 0
        failed: list[int] = []
        first: Exception | None = None
        for i, ((_, enc, _), n) in enumerate(zip(encoded, counts, strict=True)):
            # a record with a failed command is unwritten; a head written without all its parts reads as
            # damaged and is deleted by the first reader
            error = next((r for r in res[pos:pos + n] if isinstance(r, Exception)), None)
            if error is None:
                done += 1
                nbytes += enc.nbytes
            else:
                failed.append(i)
                first = first or error
            pos += n
        self.counters.add(puts=done, bytes_written=nbytes)
        if first is None:
            return None
        kind = classify(first)
        return Unwritten(tuple(failed), f"{kind}: {type(first).__name__}", kind == THROTTLED)

    # ------------------------------------------------------------------------------ admin (stats/evict)
    def iter_stored(self) -> Iterator[StoredRecord]:
        """Every record under ``key_prefix`` (the `Tier` admin contract); ConnectionError when unreachable."""
        return self._admin.iter_stored()

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """Delete the records ``predicate`` accepts (the `Tier` admin contract): (records deleted, bytes
        matched); `RedisAdmin.delete_stored` says what each counts."""
        return self._admin.delete_stored(predicate, dry_run=dry_run)

    def sizes_many(self, keys: Sequence[StoreKey]) -> list[int | None]:
        """Record size (header + payload) per key from the heads; None when absent or unreadable."""
        if not keys:
            return []
        res = self._calls.mget([self._names.head(k) for k in keys], "sizes")
        return [head_record_size(head) if isinstance(head, bytes) and head else None
                for head in res or [None] * len(keys)]

    # ------------------------------------------------------------------------------ control and pins
    def read_control(self) -> dict[str, bytes]:
        """The store's control entries (the hash ``{key_prefix}control``); ConnectionError when unreachable."""
        return self._admin.read_control()

    def write_control(self, changes: Mapping[str, bytes | None]) -> None:
        """Set or remove control entries at once; ConnectionError when unreachable."""
        self._admin.write_control(changes)

    def remove_control(self, name: str) -> bool:
        """Remove one control entry; True only for the caller whose HDEL removed it."""
        return self._admin.remove_control(name)

    def set_pinned_tags(self, tags: frozenset[str]) -> None:
        """Records carrying one of ``tags`` are written without a TTL from now on."""
        self._pins = frozenset(tags)

    def hold_tagged(self, tags: Collection[str], hold: bool) -> int:
        """PERSIST the records of ``tags`` (``hold``), or give them ``ttl_s`` back; returns how many."""
        return self._admin.hold_tagged(tags, hold, int(self.config.ttl_s * 1000) if self.config.ttl_s else None)

    # ------------------------------------------------------------------------------------------- misc
    def usage(self) -> dict[str, Any]:
        """``bytes_used``: the server's ``used_memory``; ``capacity``: its ``maxmemory`` (None without a
        limit); ``eviction_policy``: its ``maxmemory-policy``. On a cluster, sums over its masters that
        answer (the replicas hold copies of the same records; a shard marked down is left out). None when
        down or unknown."""
        memory = self._calls.run("info", self._calls.memory) if not self._health.down else None
        return {"entries": None, "bytes_used": memory.used if memory else None,
                "capacity": memory.limit if memory else None,
                "eviction_policy": ",".join(sorted(memory.policies)) if memory and memory.policies else None,
                "down": self._health.down, "address": self.address}

    def close(self) -> None:
        self._calls.close()
