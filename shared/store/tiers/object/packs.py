"""The object tier's layout of records into objects: a KV chunk's layer records in one object (a pack), every
other record alone (``layout: chunk``, the default); or every record alone (``layout: record``).

Why packs: a far store's cost is per request as much as per byte. The KV connector stores a chunk as one
record per layer (so that a hit loads layer by layer), and a chunk of an 8-layer model was 8 PUTs, 8 GETs
and 8 lookups' worth of HEADs. Measured on this project's 2-core VM against SeaweedFS (client + server CPU
per chunk): 8 records of 128 KiB cost 34 ms to write and 23 ms to read, one 1 MiB object 13 ms and 4.3 ms;
the client alone, which is what a real S3 leaves on the serving host, 12 against 2.1 ms and 11 against
1.8 ms (docs/benchmarks.md, issue 55).

Which records share a pack: a KV layer record's key text ends in ``|L<layer>`` or ``|L<layer>|G<group>``
(`vllm_tiercache.shared.naming.keys.kv_chunk_key`); its pack's key is the same text with ``Lall``: the
chunk's records of every layer, for one model, rank and KV cache group (`pack_key_of`). Nothing else
stores a chunk's ``Lall`` record (the KV event journal's ``Lall|Gevents`` records are records of their own,
never packed), so the pack's name is free.

A pack is itself a record (`vllm_tiercache.shared.store.records`: header with the pack key's digest, the
format version and the checksum of all that follows), so every tool that lists records (the janitor's
sweeps and ledger, `tiercache stats` / `evict`, the existence cache) sees one record per pack without
knowing packs. Its payload is its members, each a
whole record with its own key digest and checksum, at 64-byte aligned offsets. A reader checks the pack's
header (its own checksum: the member list) and each member it hands out by the member's checksum, so every
byte handed out is checked once (`_index`). The pack's header meta names its members::

    {"pack": PACK_VERSION, "members": [[key digest, offset, length], ...], "tags": [...]}

What a pack promises, and what it does not:
- A put writes each pack it touches whole, with the members of that put: the KV saver puts a step's
  layers of a chunk together, and the background writer only merges jobs, so a chunk's pack holds every
  layer. A later put of some of a pack's members (a memory tier demoting records one eviction at a time)
  would replace the pack with fewer: `PackLayout` remembers which members this process wrote into its
  recent packs (`RECENT_PACKS`) and such a put reads the pack first and keeps the members it does not
  replace (`ObjectTier` does the read). A member still absent from a pack is a miss counted ``partial``,
  never damage: the prefetch of its chunk fails, the scheduler counts it and vLLM computes the chunk.
- Another build of the product that stores one object per record names its records by their own digests
  and never a pack's: the two builds see each other's records as misses, never as damage. A pack of
  another pack version, or a plain record under a pack's name, is ``other_format``: a miss left in place.
- Eviction, pins, idle times and admin deletes act on whole packs: the parent of a pack in the janitor's
  ledger (`prefix` policy) is the pack of its members' parents when this process wrote that pack
  (`RECENT_PARENTS` packs remembered), else none (a root).
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm_tiercache.shared.eviction.lineage import parent_of
from vllm_tiercache.shared.naming.keys import parse_key_text
from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import Item, Record, StoreKey
from vllm_tiercache.shared.store.tags import TAGS_KEY, tags_of

#: The pack format's version, in its header meta (a reader of another version leaves the pack alone).
PACK_VERSION = 1
#: A KV layer record's last fields: ``L<layer>`` and an optional ``G<group>`` (`kv_chunk_key`).
_LAYER_TAIL = re.compile(r"\|L\d+(\|G[^|]+)?$")
#: Packs whose members this process wrote, remembered to keep them when a later put brings only some (about
#: 4 KiB each for 32 layers: 16 MiB at most).
RECENT_PACKS = 1 << 12
#: Packs remembered by one member's digest, for their children's parent in the janitor's ledger (about 200
#: bytes each). One member is enough: a child's members name every layer of its parent pack as parents.
RECENT_PARENTS = 1 << 16


def pack_key_of(key: StoreKey) -> StoreKey | None:
    """The key of the pack a KV layer record goes into (module docstring); None for any other record."""
    text = key.text
    if "|kv|" not in text or (tail := _LAYER_TAIL.search(text)) is None:
        return None
    fields = parse_key_text(text)
    if fields is None or not fields.complete or fields.layer is None:  # not a key `kv_chunk_key` built
        return None
    return StoreKey(f"{text[:tail.start()]}|Lall{tail.group(1) or ''}", tenant=key.tenant)


@dataclass
class Group:
    """One object of a request: its key (a pack's, or the record's own) and the positions of the caller's keys
    or items it answers for (one, unless a pack)."""

    key: StoreKey
    packed: bool
    positions: list[int] = field(default_factory=list)


class Body(NamedTuple):
    """An object's encoded body and what goes beside it: its tags, its parent (hex, for the janitor's ledger)
    and, for a pack, how many records it holds (None for a record alone)."""

    data: bytearray
    tags: tuple[str, ...]
    parent: str | None
    members: int | None


def _aligned(n: int) -> int:
    return -(-n // records.ALIGN) * records.ALIGN


class PackLayout:
    """Which object each record lies in, and a pack's bytes both ways (module docstring). Thread-safe."""

    def __init__(self, pack: bool) -> None:
        self.pack = pack
        self._lock = threading.Lock()
        #: pack digest -> the member digests this process last wrote into it
        self._members: collections.OrderedDict[bytes, frozenset[bytes]] = collections.OrderedDict()
        #: one member's digest of each pack -> the pack's digest (hex), for its children's parent
        self._pack_of: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    def group(self, keys: Sequence[StoreKey]) -> list[Group]:
        """The objects that hold ``keys``, in order of first appearance."""
        groups: dict[bytes, Group] = {}
        for i, key in enumerate(keys):
            pack = pack_key_of(key) if self.pack else None
            obj = pack or key
            got = groups.get(obj.digest)
            if got is None:
                got = groups[obj.digest] = Group(obj, pack is not None)
            got.positions.append(i)
        return list(groups.values())

    # ------------------------------------------------------------------------------------------ writes
    def short_of(self, group: Group, items: Sequence[Item]) -> bool:
        """True when this put of a pack leaves out members this process wrote into it before (the caller then
        reads the pack and keeps them: `encode`'s ``kept``)."""
        if not group.packed:
            return False
        with self._lock:
            before = self._members.get(group.key.digest)
        return before is not None and not before <= {items[i][0].digest for i in group.positions}

    def encode(self, group: Group, items: Sequence[Item], kept: Sequence[tuple[StoreKey, Record]] = ()) -> Body:
        """An object's body: the record alone, or the pack of ``group``'s items plus ``kept`` (members read back
        from the pack, those not put again now)."""
        if not group.packed:
            key, tensor, meta = items[group.positions[0]]
            parent = parent_of(meta)
            return Body(joined(records.encode(key, tensor, meta)), tags_of(meta),
                        None if parent is None else parent.hex(), None)
        members: dict[bytes, tuple[records.Encoded, tuple[str, ...], bytes | None]] = {}
        for key, rec in kept:
            members[key.digest] = (records.encode(key, rec.tensor, rec.meta), tags_of(rec.meta), parent_of(rec.meta))
        for i in group.positions:  # a record put twice in one batch: the last one
            key, tensor, meta = items[i]
            members[key.digest] = (records.encode(key, tensor, meta), tags_of(meta), parent_of(meta))
        offsets, off = [], 0
        for enc, _, _ in members.values():
            offsets.append(off)
            off += _aligned(enc.nbytes)
        payload = np.zeros(off, dtype=np.uint8)  # zero pads: two writers of one pack write equal bytes
        for (enc, _, _), start in zip(members.values(), offsets, strict=True):
            payload[start:start + len(enc.prefix)] = np.frombuffer(enc.prefix, dtype=np.uint8)
            payload[start + len(enc.prefix):start + enc.nbytes] = np.frombuffer(enc.payload, dtype=np.uint8)
        tags = tuple(dict.fromkeys(tag for _, member_tags, _ in members.values() for tag in member_tags))
        meta: dict[str, Any] = {"pack": PACK_VERSION, "members": [
            [digest, start, enc.nbytes] for (digest, (enc, _, _)), start in zip(members.items(), offsets, strict=True)]}
        if tags:
            meta[TAGS_KEY] = list(tags)
        body = joined(records.encode(group.key, torch.from_numpy(payload), meta))
        return Body(body, tags, self._learn(group.key, members), len(members))

    def _learn(self, pack: StoreKey, members: dict[bytes, tuple[Any, Any, bytes | None]]) -> str | None:
        """Remember the pack's members (for `short_of`, and for later packs' parents); the pack's parent."""
        parents = {parent for _, _, parent in members.values() if parent is not None}
        with self._lock:
            self._members[pack.digest] = frozenset(members)
            self._members.move_to_end(pack.digest)
            while len(self._members) > RECENT_PACKS:
                self._members.popitem(last=False)
            found = {self._pack_of.get(parent) for parent in parents}
            one = next(iter(members), None)
            if one is not None:
                self._pack_of[one] = pack.hex
                self._pack_of.move_to_end(one)
            while len(self._pack_of) > RECENT_PARENTS:
                self._pack_of.popitem(last=False)
        found.discard(None)
        return found.pop() if len(found) == 1 else None

    # ------------------------------------------------------------------------------------------- reads
    def decode(self, group: Group, body: Any, keys: Sequence[StoreKey]) -> dict[int, Record]:
        """The records of ``group``'s positions in ``body`` (one object, read whole): position -> record, a
        member absent from its pack left out (a miss, ``partial``). Raises `records.OtherFormatError` (another
        build's, left in place) or `records.RecordError` (damaged: the caller deletes the object)."""
        if not group.packed:
            record = records.decode(body, keys[group.positions[0]])
            return dict.fromkeys(group.positions, record)  # a key asked twice: the one record
        view = memoryview(body).cast("B")
        base, where = _index(view, group.key)
        out: dict[int, Record] = {}
        for i in group.positions:
            span = where.get(keys[i].digest)
            if span is not None:
                out[i] = records.decode(_own(view[base + span[0]:base + span[0] + span[1]]), keys[i])
        return out

    def written(self, pack: StoreKey) -> frozenset[bytes] | None:
        """The member digests this process last wrote into ``pack`` (None when it wrote none lately)."""
        with self._lock:
            return self._members.get(pack.digest)

    def members(self, group: Group, body: Any) -> list[tuple[StoreKey, Record]]:
        """Every member of a pack read whole (for `encode`'s ``kept``), each under a key of its digest only
        (the member's header names no more). Raises as `decode` does."""
        view = memoryview(body).cast("B")
        base, where = _index(view, group.key)
        out = []
        for digest, (start, length) in where.items():
            key = StoreKey("", digest)
            out.append((key, records.decode(view[base + start:base + start + length], key)))
        return out


def _own(member: memoryview) -> memoryview:
    """A member's bytes in a buffer of their own. Why a copy: a member's tensor would otherwise keep its whole
    pack alive, and the memory tier, which counts the member's bytes only, may keep one layer of a chunk
    after evicting the others (host memory then exceeds its budget by up to a pack per kept layer). One
    memcpy per member, about 0.1 ms per MiB."""
    return memoryview(np.frombuffer(member, dtype=np.uint8).copy())


def _index(view: memoryview, pack: StoreKey) -> tuple[int, dict[bytes, tuple[int, int]]]:
    """Where a pack's payload starts and its members (`_members`), from its header, checked (key digest,
    version, header checksum, the payload's length). The payload's own checksum is not computed: every member
    is a record with its own, which `PackLayout.decode` checks before handing it out, so every byte handed
    out is checked once, not twice (the pads between members are never read)."""
    header = records.decode_header(view, pack)
    if view.nbytes != header.payload_offset + header.nbytes:
        raise records.RecordError(f"truncated or oversized pack: {view.nbytes} bytes, header says "
                                  f"{header.payload_offset + header.nbytes}")
    return header.payload_offset, _members(header.meta, header.nbytes)


def _members(meta: dict[str, Any], payload_size: int) -> dict[bytes, tuple[int, int]]:
    """A pack header's members (digest -> offset, length), checked to lie inside its payload."""
    if "pack" not in meta:
        raise records.OtherFormatError("a record of its own under a pack's name")
    if meta["pack"] != PACK_VERSION:
        raise records.OtherFormatError(f"pack format {meta['pack']!r}, this build reads {PACK_VERSION}")
    listed = meta.get("members")
    if not isinstance(listed, list):
        raise records.RecordError("pack without a member list")
    out: dict[bytes, tuple[int, int]] = {}
    for entry in listed:
        if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], bytes)
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in entry[1:])
                or entry[1] < 0 or entry[2] < 0 or entry[1] + entry[2] > payload_size):
            raise records.RecordError("pack member entry out of its payload")
        out[entry[0]] = (entry[1], entry[2])
    return out


def joined(enc: records.Encoded) -> bytearray:
    """A record's two pieces as one body (what a PUT sends), in one copy of the payload (`Encoded.tobytes`
    makes two: the payload's bytes, then the concatenation)."""
    body = bytearray(enc.nbytes)
    body[:len(enc.prefix)] = enc.prefix
    body[len(enc.prefix):] = enc.payload
    return body
