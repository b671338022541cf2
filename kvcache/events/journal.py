"""What a restarted engine (or another engine on the same disk or Redis) announces before any request asks.

A stored record holds KV, not the tokens it was computed from, and a router needs the tokens (it keys
blocks by them). So the scheduler side keeps a journal of the chunks it announced on the shared tiers, in
the store itself: a ring of ``SLOTS`` records per model identity, each the event payloads of up to
``PER_SEGMENT`` chunks (CBOR, no pickle). At start the ring is read once (``SLOTS`` records, one
``get_many``); every chunk in it whose KV records the shared tiers still hold is announced. That bounds
the start-up announcement at ``SLOTS * PER_SEGMENT`` chunks (4,096: 1M tokens at the default chunk size),
the most recently journaled ones; older holdings are announced when a lookup finds them.

The journal keys are KV keys of the model (``...|Lall|Gevents``), so ``tiercache evict`` by model or
namespace removes them with the KV records; a journal entry whose KV records are gone is never announced.
Engines sharing a tier overwrite each other's slots: an entry lost so is a chunk not announced at start
(under-reporting, never a promise the tiers cannot keep).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from typing import Any

import cbor2
import torch

from vllm_tiercache.kvcache.events.ledger import ChunkPayload
from vllm_tiercache.kvcache.naming import KVNaming
from vllm_tiercache.shared.naming.keys import kv_chunk_key
from vllm_tiercache.shared.store.api import Store, StoreKey

log = logging.getLogger(__name__)

FORMAT = 1
SLOTS = 16
PER_SEGMENT = 256
#: (sequence number, entries): one record of the ring
Segment = tuple[int, list[tuple[bytes, ChunkPayload]]]


def _tuples(value: Any) -> Any:
    """CBOR gives lists back; vLLM's extra keys are tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def encode_segment(seq: int, entries: list[tuple[bytes, ChunkPayload]]) -> bytes:
    return cbor2.dumps({"v": FORMAT, "seq": seq, "chunks": [
        [name, list(p.block_hashes), p.parent_block_hash, p.token_ids.tobytes(), p.lora_name, p.lora_id,
         p.extra_keys, p.start_block] for name, p in entries]})


def decode_segment(data: bytes) -> tuple[int, list[tuple[bytes, ChunkPayload]]] | None:
    """(sequence number, entries), or None for anything that is not a segment of this format."""
    try:
        doc = cbor2.loads(data)
        if not isinstance(doc, dict) or doc.get("v") != FORMAT:
            return None
        entries = []
        for name, hashes, parent, tokens, lora_name, lora_id, extra, start in doc["chunks"]:
            extra_keys = None if extra is None else [_tuples(k) if k is not None else None for k in extra]
            entries.append((bytes(name), ChunkPayload(
                block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=array("q", bytes(tokens)),
                lora_name=lora_name, lora_id=lora_id, extra_keys=extra_keys, start_block=int(start))))
        return int(doc["seq"]), entries
    except Exception:  # a damaged or foreign record: no announcements from it
        return None


class EventJournal:
    """The ring of journal records of one model identity in one store (see the module docstring)."""

    def __init__(self, store: Store, naming: KVNaming, clock: Callable[[], float], interval_s: float = 2.0) -> None:
        self.store = store
        self.naming = naming
        self.clock = clock
        self.interval_s = interval_s
        self._seq = 0
        self._entries: list[tuple[bytes, ChunkPayload]] = []
        self._dirty = False
        self._next_write = 0.0
        #: full segments not yet written (`due` hands them out)
        self._full: list[Segment] = []

    def key(self, slot: int) -> StoreKey:
        return kv_chunk_key(self.naming.namespace, self.naming.identities[0], b"tiercache-events-%02d" % slot,
                            None, "events")

    def read(self) -> list[tuple[bytes, ChunkPayload]]:
        """Every entry of the ring, oldest segment first; later writes continue after the newest segment."""
        entries, next_seq = self.read_ring()
        self.continue_at(next_seq)
        return entries

    def read_ring(self) -> tuple[list[tuple[bytes, ChunkPayload]], int]:
        """Every entry of the ring, oldest segment first, and the sequence number after the newest segment.
        Touches no state of the journal: the event tracker runs it off the step (`continue_at` then)."""
        segments = []
        for record in self.store.get_many([self.key(slot) for slot in range(SLOTS)]):
            if record is not None and not record.in_place:
                decoded = decode_segment(record.tensor.numpy().tobytes())
                if decoded is not None:
                    segments.append(decoded)
        segments.sort(key=lambda segment: segment[0])
        return [entry for _, entries in segments for entry in entries], (segments[-1][0] + 1 if segments else 0)

    def continue_at(self, seq: int) -> None:
        """Later writes go to the segments after ``seq - 1`` (the newest one read)."""
        self._seq = max(self._seq, seq)

    def add(self, name: bytes, payload: ChunkPayload) -> None:
        """A chunk the shared tiers hold now; written with its segment when the segment is full, or within
        ``interval_s`` (`due`)."""
        self._entries.append((name, payload))
        self._dirty = True
        if len(self._entries) >= PER_SEGMENT:
            self._full.append((self._seq, self._entries))
            self._seq += 1
            self._entries = []
            self._dirty = False

    @property
    def is_due(self) -> bool:
        """Whether `due` would hand out a segment now (without ``force``)."""
        return bool(self._full) or (self._dirty and self.clock() >= self._next_write)

    def due(self, *, force: bool = False) -> list[Segment]:
        """The segments to write now: every full one, and the open one when it changed and ``interval_s``
        has passed since the last write (or ``force``). Copies: `write` may run on another thread while
        entries are added."""
        segments, self._full = self._full, []
        if self._dirty and (force or self.clock() >= self._next_write):
            segments.append((self._seq, list(self._entries)))
            self._dirty = False
            self._next_write = self.clock() + self.interval_s
        return segments

    def write(self, segments: list[Segment]) -> None:
        """Encode and store ``segments`` (from `due`); safe off the step: it reads nothing of the journal."""
        for seq, entries in segments:
            tensor = torch.frombuffer(bytearray(encode_segment(seq, entries)), dtype=torch.uint8)
            # a restarted engine reads it from a shared tier: never held back by the tiers' admission
            self.store.put(self.key(seq % SLOTS), tensor, None, owned=True, always_admit=True)

    def flush_due(self) -> None:
        """Write what `due` says, here and now."""
        self.write(self.due())

    def close(self) -> None:
        """Write what was journaled since the last write, whatever the interval (the engine is stopping:
        without it, the chunks confirmed in its last ``interval_s`` would not be announced after a restart)."""
        self.write(self.due(force=True))
