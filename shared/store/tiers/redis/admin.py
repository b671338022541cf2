"""The Redis tier's admin operations (`tiercache stats`, `tiercache evict`): list and delete whole records.

Unlike the tier's reads and writes, these must say when Redis is unreachable (they raise ConnectionError)
instead of reporting an empty store. They SCAN (never KEYS, so a big server is not blocked) and read
heads, key texts and idle times in one pipelined round trip per batch.

Why apart from the tier: they walk the whole key space with a client of their own making, and share with
the serving path only the record layout (`records`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from vllm_tiercache.shared.store.api import StoredRecord
from vllm_tiercache.shared.store.tags import decode_tags
from vllm_tiercache.shared.store.tiers.redis.records import (
    RecordNames,
    head_part_count,
    head_record_size,
    head_ttl_lead_ms,
)

#: Heads listed or deleted per pipelined round trip.
ADMIN_BATCH = 500
#: The most parts a head's part count may make a delete remove (a damaged head must not run away).
MAX_ADMIN_PARTS = 1 << 20


class RedisAdmin:
    """`iter_stored` and `delete_stored` of the Redis tier (the `Tier` admin contract)."""

    def __init__(self, names: RecordNames, cluster: bool, client_or_raise: Callable[[], Any]) -> None:
        self.names = names
        self.cluster = cluster
        #: The client, or ConnectionError when Redis is unreachable.
        self._client_or_raise = client_or_raise

    def iter_stored(self) -> Iterator[StoredRecord]:
        """Every record under ``key_prefix``; ConnectionError when unreachable."""
        for _, size, idle_s, text, tags in self.scan_records():
            yield StoredRecord(text, size, idle_s, tags)

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """Delete the records ``predicate`` accepts.

        Returns (records deleted, bytes matched): a record whose head vanished between the SCAN and the
        delete is not counted as deleted; its bytes, read at SCAN time, still are. With ``dry_run`` the
        count is what matched.
        """
        matches = [(hex_digest, size or 0) for hex_digest, size, idle_s, text, tags in self.scan_records()
                   if predicate(StoredRecord(text, size, idle_s, tags))]
        matched_bytes = sum(size for _, size in matches)
        if dry_run:
            return len(matches), matched_bytes
        deleted = self.delete_records([hex_digest for hex_digest, _ in matches])
        self.drop_orphan_tags()
        return deleted, matched_bytes

    def drop_orphan_tags(self) -> int:
        """Delete the ``#tags`` keys whose record's head is gone (an older build deleted the record and not
        its tags); returns how many. One SCAN of the ``#tags`` keys; each head is checked in the same
        batch, so a record written meanwhile (head last) may lose its tags only if its head is not yet
        written, a race as narrow as one put."""
        client = self._client_or_raise()
        heads = [self.names.head_of_tags(raw.decode() if isinstance(raw, bytes) else str(raw))
                 for raw in client.scan_iter(match=self.names.tags_pattern, count=ADMIN_BATCH)]
        heads = [h for h in heads if h is not None]
        dropped = 0
        for lo in range(0, len(heads), ADMIN_BATCH):
            batch = list(heads[lo:lo + ADMIN_BATCH])
            pipe = client.pipeline(transaction=False)
            for name, head in zip(batch, self._mget(client, batch), strict=True):
                if head is None:
                    pipe.delete(self.names.tags_of(name))
                    dropped += 1
            pipe.execute()
        return dropped

    def scan_records(self, batch: int = ADMIN_BATCH
                     ) -> Iterator[tuple[str, int | None, float | None, str, tuple[str, ...]]]:
        """(digest hex, record bytes, idle seconds, key text, tags) of every record under ``key_prefix``.

        SCANs the heads, then one pipelined round trip per batch for the heads, key texts and OBJECT
        IDLETIME. Size is header + payload as the head says (None when the head is unreadable); key text
        is ``""`` for records written before texts were stored; idle time is seconds since the head was
        last read or written.
        """
        client = self._client_or_raise()
        heads: list[str] = []

        def flush() -> Iterator[tuple[str, int | None, float | None, str, tuple[str, ...]]]:
            pipe = client.pipeline(transaction=False)
            for name in heads:
                pipe.object("idletime", name)  # before the GET, which resets the idle time
                pipe.get(name)
                pipe.get(self.names.text_of(name))
                pipe.get(self.names.tags_of(name))
            res = pipe.execute(raise_on_error=False)
            for i, name in enumerate(heads):
                idle, head, text, tags = res[4 * i:4 * i + 4]
                if head is None or isinstance(head, Exception):
                    continue  # expired or deleted between SCAN and GET
                text_str = text.decode(errors="replace") if isinstance(text, bytes) else ""
                idle_s = float(idle) if isinstance(idle, int) else None
                yield (self.names.digest_of(name), head_record_size(head), idle_s, text_str,
                       decode_tags(tags) if isinstance(tags, bytes) else ())
            heads.clear()

        for raw in client.scan_iter(match=self.names.scan_pattern, count=batch):
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if not self.names.is_head(name):
                continue  # a part or a key text
            heads.append(name)
            if len(heads) >= batch:
                yield from flush()
        if heads:
            yield from flush()

    def delete_records(self, hex_digests: Sequence[str]) -> int:
        """Delete whole records (head first, so readers see a miss, then parts and key text); returns count.

        The part count comes from each head; a head that vanished meanwhile counts as not deleted.
        """
        return self._for_each_piece(hex_digests, lambda pipe, piece: pipe.delete(piece))

    def _for_each_piece(self, hex_digests: Sequence[str], act: Callable[[Any, str], Any]) -> int:
        """``act(pipeline, key)`` for every key of each record still stored (`_pieces`), a pipeline per
        `ADMIN_BATCH` records; returns how many records were there (a vanished head is skipped)."""
        client = self._client_or_raise()
        done = 0
        for lo in range(0, len(hex_digests), ADMIN_BATCH):
            names = [self.names.head_of(h) for h in hex_digests[lo:lo + ADMIN_BATCH]]
            heads = self._mget(client, names)
            pipe = client.pipeline(transaction=False)
            for name, head in zip(names, heads, strict=True):
                if head is None:
                    continue
                for piece in self._pieces(name, head):
                    act(pipe, piece)
                done += 1
            pipe.execute()
        return done

    def _pieces(self, name: str, head: bytes) -> list[str]:
        """Every key of the record whose head is ``name``, the head first (deleted first, a concurrent reader
        meets a clean miss, not a head without its parts), then its parts (as many as ``head`` says,
        bounded), key text and tags."""
        parts = [self.names.part_of(name, p) for p in range(min(head_part_count(head), MAX_ADMIN_PARTS))]
        return [name, *parts, self.names.text_of(name), self.names.tags_of(name)]

    def _mget(self, client: Any, names: list[str]) -> list[Any]:
        """Values of ``names``: raises when unreachable (the admin commands must say so)."""
        if not self.cluster:
            return client.mget(names)
        pipe = client.pipeline(transaction=False)  # names of many slots: pipelined GETs
        for name in names:
            pipe.get(name)
        return pipe.execute()

    def hold_tagged(self, tags: Collection[str], hold: bool, ttl_ms: int | None) -> int:
        """PERSIST (``hold``) every piece of each record carrying one of ``tags``, or give it ``ttl_ms``
        back (nothing to give when the tier has no ``ttl_s``), its head a little less, as a put writes it
        (`records.head_ttl_lead_ms`: expiry takes the head first); returns how many records."""
        wanted = set(tags)
        if not hold and ttl_ms is None:
            return 0
        self._client_or_raise()
        held = [h for h, _, _, _, t in self.scan_records() if not wanted.isdisjoint(t)]
        if hold or ttl_ms is None:
            self._for_each_piece(held, lambda pipe, piece: pipe.persist(piece))
        else:
            head_ttl_ms = ttl_ms - head_ttl_lead_ms(ttl_ms)
            names = self.names
            self._for_each_piece(held, lambda pipe, piece: pipe.pexpire(
                piece, head_ttl_ms if names.is_head(piece) else ttl_ms))
        return len(held)

    def read_control(self) -> dict[str, bytes]:
        """The control hash's entries."""
        raw = self._client_or_raise().hgetall(self.names.control)
        return {(k.decode(errors="replace") if isinstance(k, bytes) else str(k)): bytes(v) for k, v in raw.items()}

    def write_control(self, changes: Mapping[str, bytes | None]) -> None:
        """HSET and HDEL the control hash's entries in one transaction (one key: one slot)."""
        client = self._client_or_raise()
        sets = {name: value for name, value in changes.items() if value is not None}
        drops = [name for name, value in changes.items() if value is None]
        pipe = client.pipeline(transaction=not self.cluster)
        if sets:
            pipe.hset(self.names.control, mapping=sets)
        if drops:
            pipe.hdel(self.names.control, *drops)
        pipe.execute()

    def remove_control(self, name: str) -> bool:
        """HDEL one entry; True only for the caller whose HDEL removed it."""
        return bool(self._client_or_raise().hdel(self.names.control, name))
