"""How one record lies in Redis: its key names, and its head and parts encoded and decoded.

Layout per record (``H`` is the key digest in hex, in braces so Redis Cluster puts all pieces of one
record in one slot)::

    {prefix}{H}       head: u32 part count + the record header (`vllm_tiercache.shared.store.records` prefix)
    {prefix}{H}:0..n  payload parts of at most ``part_size`` bytes
    {prefix}{H}#text  the key text (for `tiercache stats` / `tiercache evict`; readers never need it)
    {prefix}{H}#tags  the record's tags (`vllm_tiercache.shared.store.tags`), only when it has some
    {prefix}control   the store's control hash (`vllm_tiercache.shared.store.control`): outside the
                      ``{prefix}{*}`` pattern, so no record scan ever meets it

Why split: Redis values are capped (512 MB) and huge values block the server; parts keep each command
bounded. Why apart from the tier: these are pure functions of bytes, tested without a server; the tier
decides what a decoding failure costs (a miss, the record deleted, a counter).

A record is several keys, and Redis evicts (``allkeys-*``, ``volatile-*``) and expires keys, not records: a
head may outlive a part. That is no damage, and `MissingPiece` tells it apart from `records.RecordError`'s
other causes (a checksum, a part count, sizes that do not add up), so the tier counts it ``partial``, not
``corrupt``, and logs nothing. Every head is written with a TTL `head_ttl_lead_ms` shorter than its other
pieces, so that expiry takes the head first (a clean miss, for this build and an older one).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import Record, StoreKey

#: The head's first field: how many payload parts the record has.
PART_COUNT = struct.Struct("<I")
#: The smallest ``part_size`` a config allows (`redis_config.MIN_PART_SIZE`): bounds a head's part count.
_MIN_PART_BYTES = 1024
#: How much sooner a record's head expires than its other pieces (at most a tenth of the TTL): the pieces
#: of one record are written in order, head last, so with one TTL each part would expire a little before
#: its head (by the time the put took to arrive), a window in which a lookup of the head alone says "held".
HEAD_TTL_LEAD_MS = 1000


class MissingPiece(records.RecordError):
    """A piece of the record is gone (evicted or expired by Redis, or a write that did not finish) while
    its head is there: a miss counted ``partial``, never damage.

    A `records.RecordError`, so that code catching damage still catches it as a miss."""


def head_ttl_lead_ms(ttl_ms: int) -> int:
    """How many ms sooner than its other pieces a head written with ``ttl_ms`` expires (`HEAD_TTL_LEAD_MS`,
    at most a tenth of the TTL, so a short TTL keeps its head alive most of it)."""
    return min(HEAD_TTL_LEAD_MS, ttl_ms // 10)


class RecordNames:
    """The Redis key names of records under one ``key_prefix`` (digests only, never key text)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    # one f-string each, not built from the helpers below: these run per key on every read and write
    def head(self, key: StoreKey) -> str:
        return f"{self.prefix}{{{key.hex}}}"

    def part(self, key: StoreKey, i: int) -> str:
        return f"{self.prefix}{{{key.hex}}}:{i}"

    def text(self, key: StoreKey) -> str:
        return f"{self.prefix}{{{key.hex}}}#text"

    def tags(self, key: StoreKey) -> str:
        return f"{self.prefix}{{{key.hex}}}#tags"

    @property
    def control(self) -> str:
        """The store's control hash (invalidations by tag, pins)."""
        return f"{self.prefix}control"

    def head_of(self, hex_digest: str) -> str:
        """The head's name of the record whose key digest is ``hex_digest``."""
        return f"{self.prefix}{{{hex_digest}}}"

    @staticmethod
    def part_of(head_name: str, i: int) -> str:
        """The name of part ``i`` of the record whose head is ``head_name``."""
        return f"{head_name}:{i}"

    @staticmethod
    def text_of(head_name: str) -> str:
        """The name of the key text of the record whose head is ``head_name``."""
        return f"{head_name}#text"

    @staticmethod
    def tags_of(head_name: str) -> str:
        """The name of the tags of the record whose head is ``head_name``."""
        return f"{head_name}#tags"

    @staticmethod
    def head_of_tags(tags_name: str) -> str | None:
        """The head's name for a ``#tags`` name; None when ``tags_name`` is not one."""
        return tags_name[:-len("#tags")] if tags_name.endswith("}#tags") else None

    @property
    def scan_pattern(self) -> str:
        """A SCAN pattern that matches every piece of every record under the prefix."""
        return f"{self.prefix}{{*}}"

    @property
    def tags_pattern(self) -> str:
        """A SCAN pattern that matches the ``#tags`` key of every record under the prefix."""
        return f"{self.prefix}{{*}}#tags"

    @staticmethod
    def is_head(name: str) -> bool:
        """Whether a name `scan_pattern` matched is a head (not a part or a key text)."""
        return name.endswith("}")

    def digest_of(self, head_name: str) -> str:
        """The key digest (hex) in a head's name."""
        return head_name[len(self.prefix) + 1:-1]


def part_count(payload_bytes: int, part_size: int) -> int:
    """How many parts a payload is split into (one at least, for an empty payload)."""
    return max(1, -(-payload_bytes // part_size))


def payload_parts(payload: memoryview, part_size: int) -> list[memoryview]:
    """The payload's parts: slices of its memory, no copy (redis-py sends them as they are)."""
    return [payload[p * part_size:(p + 1) * part_size] for p in range(part_count(payload.nbytes, part_size))]


def head_value(nparts: int, prefix: bytes) -> bytes:
    """A record's head: its part count, then the record's header (`records.Encoded.prefix`)."""
    return PART_COUNT.pack(nparts) + prefix


def head_part_count(head: bytes) -> int:
    """The part count a head says (0 for a head too short to say): for deleting, never for reading."""
    return PART_COUNT.unpack_from(head)[0] if len(head) >= PART_COUNT.size else 0


def head_record_size(head: bytes) -> int | None:
    """The record's size (header + payload) a head says; None when the head is unreadable."""
    try:
        header = records.decode_header(memoryview(head)[PART_COUNT.size:])
    except records.RecordError:
        return None
    return header.payload_offset + header.nbytes


class MultiPart(NamedTuple):
    """A record whose head says more than one part: what its first round trip read."""

    header: records.Header
    nparts: int
    part0: bytes
    #: The head without its part count: the record's header, as `records.decode_split` takes it.
    prefix: memoryview


def decode_first(head: bytes, part0: bytes | None, key: StoreKey) -> Record | MultiPart:
    """Decode a record from its head and first part: the record when it has one part (its tensor is built
    over ``part0``, no copy), else what `decode_rest` needs once the other parts are read.

    Raises `records.OtherFormatError` for another build's record, `MissingPiece` for a head without its
    first part (Redis evicted or expired it), `records.RecordError` for damage (a head too short to say its
    part count, a part count its header cannot have, a header or payload that does not check).
    """
    if len(head) < PART_COUNT.size:
        raise records.RecordError(f"head of {len(head)} bytes, too short for its part count")
    if part0 is None:
        raise MissingPiece("head without its first part (evicted or expired by the server, or a partial write)")
    nparts = PART_COUNT.unpack_from(head)[0]
    prefix = memoryview(head)[PART_COUNT.size:]
    if nparts == 1:
        return records.decode_split(prefix, part0, key)
    header = records.decode_header(prefix, key)
    if nparts < 1 or nparts > header.nbytes // _MIN_PART_BYTES + 2:
        raise records.RecordError(f"bad part count {nparts}")
    # every part but the last is as long as the first (`payload_parts`, in every build): a part count that
    # is not what the first part makes of the payload's size is damage, not a later part evicted
    if not part0 or part_count(header.nbytes, len(part0)) != nparts:
        raise records.RecordError(f"bad part count {nparts} for {header.nbytes} bytes in parts of {len(part0)}")
    return MultiPart(header, nparts, part0, prefix)


def decode_rest(first: MultiPart, rest: Sequence[Any], key: StoreKey) -> Record:
    """Decode a multi-part record from `decode_first`'s answer and its parts 1..n-1: the parts are copied
    once into one buffer, checksummed as they are copied (the one copy a get makes).

    Raises `MissingPiece` for a missing part (evicted or expired), `records.RecordError` (or ValueError) for
    parts that do not add up.
    """
    pieces = [first.part0, *rest]
    if any(p is None for p in pieces):
        raise MissingPiece("missing part (evicted or expired by the server, or a partial write)")
    total = sum(len(p) for p in pieces)
    if total != first.header.nbytes:
        raise records.RecordError(f"parts hold {total} bytes, header says {first.header.nbytes}")
    buf, checksum = records.join_payload(pieces)
    return records.decode_split(first.prefix, buf, key, payload_checksum=checksum)
