"""Redis tier: records in a Redis server or cluster, shared by every process and host that reaches it.

Layout per record (``H`` is the key digest in hex, in braces so Redis Cluster puts all pieces of one
record in one slot)::

    {prefix}{H}       head: u32 part count + the record header (`shared.records` prefix)
    {prefix}{H}:0..n  payload parts of at most ``part_size`` bytes

Why split: Redis values are capped (512 MB) and huge values block the server; parts keep each command
bounded. Parts are sent as memoryview slices of the tensor (no copy) and the head is written last on
the same connection, so a reader never sees a head before its parts. A batch of lookups or gets is one
pipelined round trip (plus one more only for records with more than one part).

When the server is unreachable the tier is marked down for ``retry_after_s``: reads are misses, writes
are skipped (counted), one warning names the address, and no exception reaches the caller.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared import records
from shared.config import RedisTierConfig
from shared.store.api import Record, StoreKey
from shared.store.counters import TierCounters

log = logging.getLogger(__name__)
_NPARTS = struct.Struct("<I")
#: Errors that mean "the server is not there": the tier goes down and is retried later.
_DOWN_ERRORS: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
try:  # cluster-wide unavailability counts as down too
    from redis.exceptions import ClusterDownError, MasterDownError

    _DOWN_ERRORS = (*_DOWN_ERRORS, ClusterDownError, MasterDownError)
except ImportError:  # pragma: no cover - older redis-py
    pass


def make_client(config: RedisTierConfig) -> Any:
    """A redis-py client (pooled; hiredis parser when installed) or RedisCluster for +cluster URLs."""
    kwargs: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        **dict(config.ssl),
    }
    if config.password is not None:
        kwargs["password"] = config.password
    if config.cluster:
        from redis.cluster import RedisCluster

        url = config.url.replace("+cluster://", "://", 1)
        return RedisCluster.from_url(url, **kwargs)
    # One retry with no backoff: reconnects a pooled connection that a server restart closed, without
    # stalling callers when the server is really gone.
    return redis.Redis.from_url(config.url, retry=Retry(NoBackoff(), 1), **kwargs)


class RedisTier:
    """Pipelined, part-splitting Redis tier that degrades to misses when the server is down."""

    kind = "redis"
    shared_across_processes = True

    def __init__(self, config: RedisTierConfig, name: str = "redis") -> None:
        self.config = config
        self.name = name
        self.address = config.address
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self._warned_errors: set[str] = set()
        self._client: Any = None
        self._closed = False
        self._connect()

    def _connect(self) -> None:
        try:
            self._client = make_client(self.config)
        except _DOWN_ERRORS as exc:  # RedisCluster discovers nodes eagerly
            self._mark_down(exc)
        except redis.RedisError as exc:
            self._other_error("client setup", exc)

    # ------------------------------------------------------------------------------------ availability
    @property
    def down(self) -> bool:
        return self._down

    def _available(self) -> bool:
        if not self._down:
            return self._client is not None or self._retry_connect()
        if time.monotonic() < self._down_until:
            return False
        return self._client is not None or self._retry_connect()

    def _retry_connect(self) -> bool:
        if self._closed:
            return False
        self._connect()
        return self._client is not None

    def _mark_down(self, exc: BaseException) -> None:
        self.counters.add(errors=1)
        with self._lock:
            was_down = self._down
            self._down = True
            self._down_until = time.monotonic() + self.config.retry_after_s
        if not was_down:
            log.warning("tiercache redis tier: %s unreachable (%s: %s); serving misses and skipping "
                        "writes, retrying every %.1fs", self.address, type(exc).__name__, exc,
                        self.config.retry_after_s)

    def _mark_up(self) -> None:
        if self._down:
            with self._lock:
                self._down = False
                self._down_until = 0.0
            log.warning("tiercache redis tier: %s reachable again", self.address)

    def _other_error(self, what: str, exc: BaseException) -> None:
        self.counters.add(errors=1)
        if what not in self._warned_errors:
            self._warned_errors.add(what)
            log.warning("tiercache redis tier %s: %s failed: %s", self.address, what, exc)

    def _run(self, what: str, fn: Any) -> Any:
        """Run one client call; None when down or failed (never raises for a backend problem)."""
        if not self._available():
            return None
        try:
            result = fn()
        except _DOWN_ERRORS as exc:
            self._mark_down(exc)
            return None
        except redis.RedisError as exc:
            self._other_error(what, exc)
            return None
        self._mark_up()
        return result

    # ------------------------------------------------------------------------------------------- keys
    def _head(self, key: StoreKey) -> str:
        return f"{self.config.key_prefix}{{{key.hex}}}"

    def _part(self, key: StoreKey, i: int) -> str:
        return f"{self.config.key_prefix}{{{key.hex}}}:{i}"

    # ------------------------------------------------------------------------------------------ reads
    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        if not keys:
            return []

        def call() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._head(k))
            return pipe.execute()

        res = self._run("contains", call)
        return [bool(r) for r in res] if res is not None else [False] * len(keys)

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        if not keys:
            return []

        def first() -> list[Any]:
            names = [name for k in keys for name in (self._head(k), self._part(k, 0))]
            if not self.config.cluster:  # one MGET: one command, one reply, least client overhead
                return self._client.mget(names)
            pipe = self._client.pipeline(transaction=False)  # keys of many slots: pipelined GETs
            for name in names:
                pipe.get(name)
            return pipe.execute()

        res = self._run("get", first)
        out: list[Record | None] = [None] * len(keys)
        if res is None:
            return out
        more: list[tuple[int, records.Header, int, bytes]] = []  # index, header, nparts, part0
        corrupt: list[StoreKey] = []
        for i, key in enumerate(keys):
            head, part0 = res[2 * i], res[2 * i + 1]
            if head is None:
                continue
            try:
                if len(head) < _NPARTS.size or part0 is None:
                    raise records.RecordError("head without its first part (expired or partial write)")
                nparts = _NPARTS.unpack_from(head)[0]
                prefix = memoryview(head)[_NPARTS.size:]
                if nparts == 1:
                    out[i] = records.decode_split(prefix, part0, key)
                else:
                    header = records.decode_header(prefix, key)
                    if nparts < 1 or nparts > header.nbytes // 1024 + 2:  # part_size is at least 1KiB
                        raise records.RecordError(f"bad part count {nparts}")
                    more.append((i, header, nparts, part0))
            except records.RecordError as exc:
                corrupt.append(key)
                self._other_error(f"decode ({exc})", exc)
        if more:
            self._get_rest(keys, res, more, out, corrupt)
        if corrupt:
            self.counters.add(corrupt=len(corrupt))
            self._run("delete corrupt", lambda: self._client.delete(*[self._head(k) for k in corrupt]))
        return out

    def _get_rest(self, keys: Sequence[StoreKey], res: list[Any], more: list[tuple[int, Any, int, bytes]],
                  out: list[Record | None], corrupt: list[StoreKey]) -> None:
        """Second round trip for multi-part records: fetch parts 1..n-1 and assemble into one buffer."""

        def call() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for i, _, nparts, _ in more:
                for p in range(1, nparts):
                    pipe.get(self._part(keys[i], p))
            return pipe.execute()

        parts = self._run("get parts", call)
        if parts is None:
            return
        pos = 0
        for i, header, nparts, part0 in more:
            pieces = [part0, *parts[pos:pos + nparts - 1]]
            pos += nparts - 1
            key = keys[i]
            try:
                if any(p is None for p in pieces):
                    raise records.RecordError("missing part (expired or partial write)")
                total = sum(len(p) for p in pieces)
                if total != header.nbytes:
                    raise records.RecordError(f"parts hold {total} bytes, header says {header.nbytes}")
                buf = torch.empty(total, dtype=torch.uint8).numpy()
                off = 0
                for p in pieces:
                    buf[off:off + len(p)] = memoryview(p)
                    off += len(p)
                prefix = memoryview(res[2 * i])[_NPARTS.size:]
                out[i] = records.decode_split(prefix, buf, key)
            except (records.RecordError, ValueError) as exc:
                corrupt.append(key)
                self._other_error(f"decode ({exc})", exc)

    # ----------------------------------------------------------------------------------------- writes
    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None:
        if not items:
            return
        ttl_ms = int(self.config.ttl_s * 1000) if self.config.ttl_s else None
        part_size = self.config.part_size
        encoded = [(key, records.encode(key, tensor, meta)) for key, tensor, meta in items]

        def call() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key, enc in encoded:
                payload = enc.payload
                nparts = max(1, -(-payload.nbytes // part_size))
                for p in range(nparts):
                    pipe.set(self._part(key, p), payload[p * part_size:(p + 1) * part_size], px=ttl_ms)
                pipe.set(self._head(key), _NPARTS.pack(nparts) + enc.prefix, px=ttl_ms)
            return pipe.execute()

        if self._run("put", call) is None:
            self.counters.add(dropped_writes=len(items))
            return
        self.counters.add(puts=len(items), bytes_written=sum(enc.nbytes for _, enc in encoded))

    # ------------------------------------------------------------------------------------------- misc
    def usage(self) -> dict[str, Any]:
        info = self._run("info", lambda: self._client.info("memory")) if not self._down else None
        used = info.get("used_memory") if isinstance(info, dict) else None
        return {"entries": None, "bytes_used": used, "down": self._down, "address": self.address}

    def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead connection must not fail shutdown
                pass
