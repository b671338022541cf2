"""What a restarted engine (or another engine on the same disk or Redis) announces before any request asks.

A stored record holds KV, not the tokens it was computed from, and a router needs the tokens (it keys
blocks by them). So the scheduler side keeps a journal of the chunks it saves, in the store itself: a ring
of ``SLOTS`` records per model identity, each the event payloads of up to ``PER_SEGMENT`` chunks (CBOR, no
pickle). At start the ring is read once (``SLOTS`` records, one ``get_many``) and every chunk in it whose
KV records the shared tiers still hold is announced (`vllm_tiercache.kvcache.events.discovery`). That
bounds the start-up announcement at ``SLOTS * PER_SEGMENT`` chunks (4,096: 1M tokens at the default chunk
size), the most recently journaled ones; older holdings are announced when a lookup finds them.

When a chunk is journaled: as its save is planned, not once the shared tiers confirm it. Confirmation
needs engine steps after the save (the tracker asks a few chunks per step), and an engine that goes idle
after its last answer takes none: its last chunks were never journaled, and a restart did not announce
them. Journaled at the save, an entry may name a chunk whose records never land (a write-behind drop, an
admission rule that keeps the records in memory, Redis down): it costs a slot of the ring and one lookup
at the next start, never an announcement, since only what the shared tiers hold is announced.

When the journal is written: on its own thread, at most every ``interval_s`` (0.5 s) while something new
was journaled, whether or not the engine steps; a full segment at once. A clean stop writes the rest
(`close`, one write, within vLLM's ``--shutdown-timeout``). So a SIGKILL loses the chunks journaled since
the last write reached the shared tiers: on an idle machine those whose saves were planned in the last
``interval_s`` before it; on a loaded one more (this thread must be scheduled, and the store's write-behind
must carry the record), and the records of those chunks were still on their way too. No time bound holds
on a machine that can be arbitrarily loaded.

The journal keys are KV keys of the model (``...|Lall|Gevents``), so ``tiercache evict`` by model or
namespace removes them with the KV records; a journal entry whose KV records are gone is never announced.
The ring is one per model identity, shared by every engine on the same shared tier: an engine continues
after the newest segment it read at start, and engines running side by side overwrite each other's
slots. A new engine announces the union of what the ring holds (whichever engine wrote each slot) that
the shared tiers still hold; an entry overwritten so is a chunk not announced at start (under-reporting,
never a promise the tiers cannot keep).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Callable
from typing import Any

import cbor2
import torch

from vllm_tiercache.kvcache.events.ledger import ChunkPayload
from vllm_tiercache.kvcache.naming import KVNaming
from vllm_tiercache.shared.naming.keys import kv_chunk_key
from vllm_tiercache.shared.store.api import Store, StoreKey
from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)

FORMAT = 1
SLOTS = 16
PER_SEGMENT = 256
#: Seconds between two writes of the open segment while chunks are being journaled: what a SIGKILL loses on an
#: idle machine (more on a loaded one: the module docstring).
WRITE_INTERVAL_S = 0.5
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
    """The ring of journal records of one model identity in one store (see the module docstring).

    ``background``: a thread of its own writes what is due every ``interval_s`` (the connector's journal);
    without it, the caller writes (`flush_due`, `close`): tests drive it with their own clock. Either way
    nothing is written before the ring was read (`continue_at`), so a start never overwrites the segments
    it is about to announce.
    """

    def __init__(self, store: Store, naming: KVNaming, clock: Callable[[], float],
                 interval_s: float = WRITE_INTERVAL_S, *, background: bool = False) -> None:
        self.store = store
        self.naming = naming
        self.clock = clock
        self.interval_s = interval_s
        self._lock = threading.Lock()
        #: held from `due` to the end of `write`: snapshots of the open segment are written in the order they
        #: were taken (else a stop's last write could land before the writer thread's older one, which would
        #: then overwrite it: a loaded machine stretches that window)
        self._write_lock = threading.Lock()
        #: the sequence number of the first segment not yet handed out (full ones first, then the open one)
        self._base = 0
        self._entries: list[tuple[bytes, ChunkPayload]] = []
        self._dirty = False
        self._next_write = 0.0
        #: full segments not yet handed out (`due` numbers them from `_base`)
        self._full: list[list[tuple[bytes, ChunkPayload]]] = []
        self._read = not background  # a caller-driven journal writes when told; a background one after the read
        self._background = background
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

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
        Touches no state of the journal (`continue_at` then)."""
        segments = []
        for record in self.store.get_many([self.key(slot) for slot in range(SLOTS)]):
            if record is not None and not record.in_place:
                decoded = decode_segment(record.tensor.numpy().tobytes())
                if decoded is not None:
                    segments.append(decoded)
        segments.sort(key=lambda segment: segment[0])
        return [entry for _, entries in segments for entry in entries], (segments[-1][0] + 1 if segments else 0)

    def continue_at(self, seq: int) -> None:
        """Later writes go to the segments after ``seq - 1`` (the newest one read); the writes may start."""
        with self._lock:
            self._base = max(self._base, seq)
            self._read = True
        self._wake.set()

    def add(self, name: bytes, payload: ChunkPayload) -> None:
        """A chunk whose save was planned; written with its segment when the segment is full, or within
        ``interval_s`` (`due`)."""
        with self._lock:
            self._entries.append((name, payload))
            self._dirty = True
            if len(self._entries) >= PER_SEGMENT:
                self._full.append(self._entries)
                self._entries = []
                self._dirty = False
            start = self._background and self._thread is None and not self._closed
            if start:
                self._thread = background_thread(self._write_loop, "tiercache-kv-journal")
        if start:
            self._thread.start()  # type: ignore[union-attr]
        self._wake.set()

    def due(self, *, force: bool = False) -> list[Segment]:
        """The segments to write now: every full one, and the open one when it changed and ``interval_s``
        has passed since the last write (or ``force``). Copies: `write` may run on another thread while
        entries are added. Nothing before the ring was read."""
        with self._lock:
            if not self._read:
                return []
            segments = [(self._base + i, entries) for i, entries in enumerate(self._full)]
            self._base += len(self._full)
            self._full = []
            if self._dirty and (force or self.clock() >= self._next_write):
                segments.append((self._base, list(self._entries)))
                self._dirty = False
                self._next_write = self.clock() + self.interval_s
            return segments

    def write(self, segments: list[Segment]) -> None:
        """Encode and store ``segments`` (from `due`); safe off the step: it reads nothing of the journal."""
        for seq, entries in segments:
            tensor = torch.frombuffer(bytearray(encode_segment(seq, entries)), dtype=torch.uint8)
            # a restarted engine reads it from a shared tier: never held back by the tiers' admission
            self.store.put(self.key(seq % SLOTS), tensor, None, owned=True, always_admit=True)

    def flush_due(self, *, force: bool = False) -> None:
        """Write what `due` says, here and now (after any write in progress: the newest snapshot lands last)."""
        with self._write_lock:
            self.write(self.due(force=force))

    def _write_loop(self) -> None:
        """The background writer: what is due, whenever something was journaled, at most every ``interval_s``."""
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                self.flush_due()
            except Exception as exc:  # a tier bug: the entries stay and go with the next write
                log.warning("tiercache: writing the KV events journal failed: %s", exc)
            wait = self._next_write - self.clock()
            if self._dirty and wait > 0:  # the open segment changed within the interval: written after it
                if self._stop.wait(wait):
                    return
                self._wake.set()

    def abandon(self) -> None:
        """Stop the background writer, writing nothing more (a connector reset: later names are of another
        weights generation, and what is journaled so far stays as last written)."""
        self._closed = True
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        """Write what was journaled since the last write, whatever the interval (the engine is stopping:
        without it, the chunks journaled in its last ``interval_s`` would not be announced after a restart).
        One write, on the caller's thread; the background writer stops."""
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)  # a writer still in a write past this: `flush_due` waits for it
        with self._lock:
            self._read = True  # a stop before the ring was read: its own entries still count
        self.flush_due(force=True)
