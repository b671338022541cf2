"""Redis tier: records in a Redis server or cluster, shared by every process and host that reaches it.

Layout per record (``H`` is the key digest in hex, in braces so Redis Cluster puts all pieces of one
record in one slot)::

    {prefix}{H}       head: u32 part count + the record header (`vllm_tiercache.shared.store.records` prefix)
    {prefix}{H}:0..n  payload parts of at most ``part_size`` bytes
    {prefix}{H}#text  the key text (for `tiercache stats` / `tiercache evict`; readers never need it)

Why split: Redis values are capped (512 MB) and huge values block the server; parts keep each command
bounded. Parts are sent as memoryview slices of the tensor (no copy) and the head is written last on
the same connection, so a reader never sees a head before its parts. A batch of lookups or gets is one
pipelined round trip (plus one more only for records with more than one part).

When the server is unreachable the tier is marked down for ``retry_after_s``: reads are misses, writes
are skipped (counted), one warning names the address, and no exception reaches the caller.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import Record, StoredRecord, StoreKey, key_text_bytes
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.redis_config import RedisTierConfig

log = logging.getLogger(__name__)
_NPARTS = struct.Struct("<I")
#: Parts deleted per command when a corrupt record is dropped, and the most parts it may have.
DELETE_RUN = 256
MAX_DELETE_PARTS = 1 << 20
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
            log.warning("tiercache redis tier: %s unreachable (%s: %s); tried: %s; serving misses and "
                        "skipping writes, retrying every %.1fs", self.address, type(exc).__name__, exc,
                        self.tried(), self.config.retry_after_s)

    def tried(self) -> str:
        """What a connection attempt does, for the 'unreachable' line: the address alone rarely says
        whether a timeout, a missing password or a TLS setting was the problem."""
        tls = "TLS" + (f" with CA {self.config.ssl['ssl_ca_certs']}" if self.config.ssl.get("ssl_ca_certs") else "") \
            if self.config.url.startswith("rediss") else "plain TCP (no TLS)"
        auth = "with a password" if self.config.password or re.search(r"//[^/@]*:[^/@]+@", self.config.url) \
            else "without a password"
        return (f"{'cluster' if self.config.cluster else 'single server'}, {tls}, {auth}, "
                f"{self.config.timeout_s:g}s connect/read timeout, 1 immediate retry")

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

    def _text_name(self, key: StoreKey) -> str:
        return f"{self.config.key_prefix}{{{key.hex}}}#text"

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
            except records.OtherFormatError:  # another build's record: a miss, left for that build
                self.counters.add(other_format=1)
            except records.RecordError as exc:
                corrupt.append(key)
                self._other_error(f"decode ({exc})", exc)
        if more:
            self._get_rest(keys, res, more, out, corrupt)
        if corrupt:
            self.counters.add(corrupt=len(corrupt))
            self._run("delete corrupt", lambda: self._delete_pieces(corrupt))
        return out

    def _delete_pieces(self, corrupt: Sequence[StoreKey]) -> None:
        """Drop every piece of corrupt records: head and key text first (readers then miss), then parts.

        The head's part count cannot be trusted (it may be the damage, or another record's head), so
        parts are deleted in runs of `DELETE_RUN` until a run deletes fewer than it names (parts are
        numbered 0..n-1): no orphan part outlives its record (`tiercache evict` finds records by heads).
        """
        pipe = self._client.pipeline(transaction=False)
        for key in corrupt:
            pipe.delete(self._head(key), self._text_name(key))
        pipe.execute()
        for key in corrupt:
            for lo in range(0, MAX_DELETE_PARTS, DELETE_RUN):
                if self._client.delete(*[self._part(key, p) for p in range(lo, lo + DELETE_RUN)]) < DELETE_RUN:
                    break

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
                pipe.set(self._text_name(key), key_text_bytes(key.text), px=ttl_ms)
                pipe.set(self._head(key), _NPARTS.pack(nparts) + enc.prefix, px=ttl_ms)
            return pipe.execute()

        if self._run("put", call) is None:
            self.counters.add(dropped_writes=len(items))
            return
        self.counters.add(puts=len(items), bytes_written=sum(enc.nbytes for _, enc in encoded))

    # ------------------------------------------------------------------------------ admin (stats/evict)
    def iter_stored(self) -> Iterator[StoredRecord]:
        """Every record under ``key_prefix`` (the `Tier` admin contract); ConnectionError when unreachable."""
        for _, size, idle_s, text in self._scan_records():
            yield StoredRecord(text, size, idle_s)

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """Delete the records ``predicate`` accepts (the `Tier` admin contract).

        Returns (records deleted, bytes matched): a record whose head vanished between the SCAN and the
        delete is not counted as deleted; its bytes, read at SCAN time, still are. With ``dry_run`` the
        count is what matched.
        """
        matches = [(hex_digest, size or 0) for hex_digest, size, idle_s, text in self._scan_records()
                   if predicate(StoredRecord(text, size, idle_s))]
        matched_bytes = sum(size for _, size in matches)
        if dry_run:
            return len(matches), matched_bytes
        return self._delete_records([hex_digest for hex_digest, _ in matches]), matched_bytes

    def _client_or_raise(self) -> Any:
        """Admin commands must say when Redis is unreachable, not silently report an empty store."""
        if self._client is None:
            self._connect()
        if self._client is None:
            raise ConnectionError(f"redis tier {self.address} is unreachable")
        return self._client

    def _scan_records(self, batch: int = 500) -> Iterator[tuple[str, int | None, float | None, str]]:
        """(digest hex, record bytes, idle seconds, key text) of every record under ``key_prefix``.

        SCANs the heads (never KEYS, so a big server is not blocked), then one pipelined round trip per
        batch for the heads, key texts and OBJECT IDLETIME. Size is header + payload as the head says
        (None when the head is unreadable); key text is ``""`` for records written before texts were
        stored; idle time is seconds since the head was last read or written.
        """
        client = self._client_or_raise()
        prefix = self.config.key_prefix
        heads: list[str] = []

        def flush() -> Iterator[tuple[str, int | None, float | None, str]]:
            pipe = client.pipeline(transaction=False)
            for name in heads:
                pipe.object("idletime", name)  # before the GET, which resets the idle time
                pipe.get(name)
                pipe.get(f"{name}#text")
            res = pipe.execute(raise_on_error=False)
            for i, name in enumerate(heads):
                idle, head, text = res[3 * i], res[3 * i + 1], res[3 * i + 2]
                if head is None or isinstance(head, Exception):
                    continue  # expired or deleted between SCAN and GET
                size: int | None
                try:
                    header = records.decode_header(memoryview(head)[_NPARTS.size:])
                    size = header.payload_offset + header.nbytes
                except records.RecordError:
                    size = None
                hex_digest = name[len(prefix) + 1:-1]
                text_str = text.decode(errors="replace") if isinstance(text, bytes) else ""
                idle_s = float(idle) if isinstance(idle, int) else None
                yield hex_digest, size, idle_s, text_str
            heads.clear()

        for raw in client.scan_iter(match=f"{prefix}{{*}}", count=batch):
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if not name.endswith("}"):
                continue  # a part or a key text
            heads.append(name)
            if len(heads) >= batch:
                yield from flush()
        if heads:
            yield from flush()

    def _delete_records(self, hex_digests: Sequence[str]) -> int:
        """Delete whole records (head first, so readers see a miss, then parts and key text); returns count.

        The part count comes from each head; a head that vanished meanwhile counts as not deleted.
        """
        client = self._client_or_raise()
        prefix = self.config.key_prefix
        deleted = 0
        for lo in range(0, len(hex_digests), 500):
            names = [f"{prefix}{{{h}}}" for h in hex_digests[lo:lo + 500]]
            heads = self._mget(client, names)
            pipe = client.pipeline(transaction=False)
            for name, head in zip(names, heads, strict=True):
                if head is None:
                    continue
                nparts = _NPARTS.unpack_from(head)[0] if len(head) >= _NPARTS.size else 0
                pipe.delete(name)
                for p in range(min(nparts, 1 << 20)):
                    pipe.delete(f"{name}:{p}")
                pipe.delete(f"{name}#text")
                deleted += 1
            pipe.execute()
        return deleted

    def _mget(self, client: Any, names: list[str]) -> list[Any]:
        if not self.config.cluster:
            return client.mget(names)
        pipe = client.pipeline(transaction=False)  # names of many slots: pipelined GETs
        for name in names:
            pipe.get(name)
        return pipe.execute()

    def sizes_many(self, keys: Sequence[StoreKey]) -> list[int | None]:
        """Record size (header + payload) per key from the heads; None when absent or unreadable."""
        if not keys:
            return []
        names = [self._head(k) for k in keys]
        res = self._run("sizes", lambda: self._mget(self._client, names))
        out: list[int | None] = []
        for head in res or [None] * len(keys):
            try:
                header = records.decode_header(memoryview(head)[_NPARTS.size:]) if head else None
            except records.RecordError:
                header = None
            out.append(None if header is None else header.payload_offset + header.nbytes)
        return out

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
