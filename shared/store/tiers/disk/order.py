"""The disk tier's eviction order for policy ``prefix``: LRFU with a newcomer discount, kept as a virtual
time in the index's sorted ``atime`` db, so the order costs O(log n) per touch, as LRU did.

Why: the memory tier's ``prefix`` policy (`vllm_tiercache.shared.eviction.prefix`) ranks records by decayed
access counts, a never-seen record counting a tenth of an access; on the Mooncake trace that is what lifts it
above LRU. The disk tier holds the larger part of a memory + disk pair, so its order decides most of what the
pair keeps (docs/benchmarks-kv.md, "Which blocks to keep").

The virtual time. A record's decayed count C (each access adds its weight, every H of the clock halves it) is
kept as of its last access t; its key is ``t + H x log2(C)``. At any common later time T, log2 of a record's
count is ``(key - T) / H``: comparing keys compares counts, and a key changes only when its record is touched.
A touch at ``now`` with weight w: ``log2(C') = log2(C x 2^-((now - t) / H) + w)``, and a touch never lowers a
key. A record keyed by plain recency (key = time of its last access) reads as C = 1: an older build, or a
process of this one configured ``lru``, sharing the directory orders sensibly against this one.

- **Clock**: wall time in ns, shared by every process on the machine (what an older build writes too).
  **Half-life** H: the time the directory took to see ``half_life`` capacities of traffic (bytes put and
  reads that refreshed a record), measured in ``meta`` (``lrfu_window``) so that every process uses one H:
  the memory policy's "a capacity of traffic", in time. A window's measure replaces H only when it is off by
  more than 2x (keys written under one H shift against those written under another). Before the first
  window closes: the age of an index written by recency, scaled to a window, else one hour.
- **Newcomers**: the first put of a digest never seen starts at C = ``newcomer`` (0.1, the memory policy's).
- **Ghosts**: a deleted record (evicted, dropped after promotion to memory, removed) keeps its state, listed
  in ``ghosts`` by last access and bounded (at least `MIN_GHOSTS`, at most as many as there are entries): a
  record written again counts as a returning one. With an exclusive disk (admission ``evicted``) that is
  the common case: a disk hit is promoted and dropped from the disk, and written down again later.
- **Parents at least as high as children**: touching a record raises its parent's key to its own, walking
  up while keys rise (a prefix lookup reads the parent first, so a parent is worth at least its child;
  with a memory tier in front, the disk sees the child's reads and not the parent's). The lowest key is
  then a leaf's, or a chain's whose records are worth the same (eviction's "descendants go along",
  `capacity`, then takes what is worth no more than its victim).

Layout (`lrfu` db): digest -> u64 last access ns, f64 log2 of C as of then, u64 the key written with it. The
key stays in ``entries``' access-time field, which an older build reads, and deletes its ``atime`` entry by:
an entry whose key differs from its state's was touched by recency since (C = 1 at that time). An older
build's deletes leave states behind: read as ghosts, and `drop_orphans` (run by `tiercache evict`) removes
those not listed.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

import lmdb

if TYPE_CHECKING:
    from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex, IndexEntry

_STATE = struct.Struct("<QdQ")  # last access ns, log2 of the decayed count then, the key written with it
_WINDOW = struct.Struct("<QQQ")  # window start ns, bytes touched since, half-life ns (0: none measured yet)
_WINDOW_KEY = b"lrfu_window"
_TIME = struct.Struct(">Q")  # big endian: the ghosts db iterates oldest first
_MAX_KEY = (1 << 64) - 1
#: the weight of a never-seen record's first put (the memory policy's measured best)
NEWCOMER = 0.1
#: ghosts kept at least (the memory policy's history size), else as many as there are entries
MIN_GHOSTS = 65536
#: the half-life until the first window closes, in a directory with no history (ns): longer than any measured
#: one is likely to be, so that the records of the first fill go first, in the order they came
_PROVISIONAL_NS = 3600 * 1_000_000_000
#: the most parents one touch raises (a chain is hundreds of blocks at most; a bound against a damaged index)
_MAX_RAISE = 4096


class PrefixOrder:
    """The ``prefix`` order of one disk tier's index (`DiskIndex.order`): keys for touches, ghosts on delete.

    Args:
        index: the index whose dbs it shares (it opens its own two: ``lrfu``, ``ghosts``).
        capacity: the tier's bytes; ``half_life`` capacities of traffic make one half-life.
        half_life: in capacities of traffic (1: the memory policy's measured best).
        newcomer: the weight of a never-seen record's first put, in (0, 1].
    """

    def __init__(self, index: DiskIndex, capacity: int, half_life: float = 1.0, newcomer: float = NEWCOMER) -> None:
        if half_life <= 0 or not 0.0 < newcomer <= 1.0:
            raise ValueError("half_life must be positive and newcomer in (0, 1]")
        self.index = index
        self.window_bytes = max(1, int(half_life * capacity))
        self.newcomer = float(newcomer)
        with index.env.begin(write=True) as txn:  # see DiskIndex.__init__: open_db in a transaction of our own
            self.states = index.env.open_db(b"lrfu", txn=txn)
            self.ghosts = index.env.open_db(b"ghosts", txn=txn)

    # ----------------------------------------------------------------------------------------- reading
    def _state(self, txn: lmdb.Transaction, digest: bytes) -> tuple[int, float, int] | None:
        raw = txn.get(digest, db=self.states)
        return None if raw is None else _STATE.unpack(raw)

    def _own(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry) -> tuple[int, float]:
        """(last access, log2 of the count then) of an indexed record: its state's, unless the entry was
        touched by recency since (its key is not the state's): then one access at that time."""
        state = self._state(txn, digest)
        return (state[0], state[1]) if state is not None and state[2] == entry.atime_ns else (entry.atime_ns, 0.0)

    def last_access_ns(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry) -> int:
        """When the record was last touched (its key is not: `tiercache stats`, idle times, read refreshes)."""
        return self._own(txn, digest, entry)[0]

    def half_life_ns(self, txn: lmdb.Transaction) -> int:
        """The half-life measured so far (0: the first window is still open)."""
        raw = txn.get(_WINDOW_KEY, db=self.index.meta)
        return _WINDOW.unpack(raw)[2] if raw is not None else 0

    # ----------------------------------------------------------------------------------------- writing
    def key(self, txn: lmdb.Transaction, digest: bytes, size: int, now_ns: int, old: IndexEntry | None) -> int:
        """The key of ``digest`` touched at ``now_ns`` (``old``: its entry, None for a put of a record not
        indexed); its state is written, its parents raised. The caller writes the entry with this key."""
        last, crf, weight = self._history(txn, digest, old)
        half_life = self._advance(txn, now_ns, size)
        decayed = crf - max(0, now_ns - last) / half_life
        crf = decayed + math.log2(1.0 + weight * 2.0 ** -decayed) if decayed > -60.0 else math.log2(weight)
        key = min(_MAX_KEY, max(0, round(now_ns + half_life * crf), old.atime_ns if old is not None else 0))
        txn.put(digest, _STATE.pack(now_ns, crf, key), db=self.states)
        self._raise_parents(txn, digest, key)
        return key

    def _history(self, txn: lmdb.Transaction, digest: bytes, old: IndexEntry | None) -> tuple[int, float, float]:
        """(last access, log2 count then, this touch's weight) of ``digest``."""
        if old is not None:
            return (*self._own(txn, digest, old), 1.0)
        state = self._state(txn, digest)
        if state is not None:  # a ghost coming back
            txn.delete(_TIME.pack(state[0]) + digest, db=self.ghosts)
            return state[0], state[1], 1.0
        return 0, -math.inf, self.newcomer

    def _advance(self, txn: lmdb.Transaction, now_ns: int, size: int) -> float:
        """Count ``size`` bytes of traffic in the window; close it after ``window_bytes``; the half-life (ns).

        A new measure replaces the half-life only when it is off by more than 2x: keys written under one
        half-life and compared under another shift against each other (a newcomer's by 3.3 times the
        change), so the half-life moves only when the traffic's pace really did."""
        raw = txn.get(_WINDOW_KEY, db=self.index.meta)
        start, seen, half_life = _WINDOW.unpack(raw) if raw is not None else self._first_window(txn, now_ns)
        seen += size
        if seen >= self.window_bytes and now_ns > start:
            measured = now_ns - start
            if not half_life // 2 <= measured <= 2 * half_life:
                half_life = measured
            start, seen = now_ns, 0
        txn.put(_WINDOW_KEY, _WINDOW.pack(start, seen, half_life), db=self.index.meta)
        return float(half_life or _PROVISIONAL_NS)

    def _first_window(self, txn: lmdb.Transaction, now_ns: int) -> tuple[int, int, int]:
        """The window of an index that has none, opened now. An index written by recency gives a first
        half-life: the time its contents took to arrive, scaled to a window; else none yet (`_PROVISIONAL_NS`)."""
        oldest = next(iter(txn.cursor(db=self.index.by_atime).iternext(keys=True, values=False)), None)
        total = self.index.total(txn)
        if oldest is None or total <= 0 or _TIME.unpack_from(oldest)[0] >= now_ns:
            return now_ns, 0, 0
        return now_ns, 0, max(1, (now_ns - _TIME.unpack_from(oldest)[0]) * self.window_bytes // total)

    def _raise_parents(self, txn: lmdb.Transaction, digest: bytes, key: int) -> None:
        """Raise the keys of ``digest``'s indexed ancestors to ``key``, up to the first already as high.

        To ``key`` itself, not above it: a chain put in one batch (one time, one weight) has one key, and a
        touch stops at the first parent, O(1); raising each generation one more would walk the whole chain
        for every record put, O(n^2) per batch. Equal keys go in digest order, each victim taking its
        descendants along (`capacity`)."""
        child = digest
        for _ in range(_MAX_RAISE):
            parent = self.index.parent(txn, child)
            entry = self.index.get(txn, parent) if parent is not None else None
            if parent is None or entry is None or entry.atime_ns >= key:
                return
            last, crf = self._own(txn, parent, entry)
            txn.put(parent, _STATE.pack(last, crf, key), db=self.states)
            self.index.rekey(txn, parent, entry, key)
            child = parent

    def bump(self, txn: lmdb.Transaction, digest: bytes, old: IndexEntry, now_ns: int) -> int:
        """The key of ``digest`` moved to at least ``now_ns`` without counting an access (a pinned record an
        eviction passed over: not read, but kept; once unpinned it ages from there with its own count)."""
        key = max(old.atime_ns, now_ns)
        last, crf = self._own(txn, digest, old)
        txn.put(digest, _STATE.pack(last, crf, key), db=self.states)
        return key

    def forget(self, txn: lmdb.Transaction, digest: bytes, old: IndexEntry) -> None:
        """``digest`` is no longer indexed: its state stays, as a ghost (the oldest beyond the bound go)."""
        last, crf = self._own(txn, digest, old)
        txn.put(digest, _STATE.pack(last, crf, 0), db=self.states)
        txn.put(_TIME.pack(last) + digest, b"", db=self.ghosts)
        over = txn.stat(self.ghosts)["entries"] - max(MIN_GHOSTS, self.index.count(txn))
        if over > 0:
            cursor = txn.cursor(db=self.ghosts)
            for _ in range(over):
                if not cursor.first():
                    break
                gone = bytes(cursor.key()[_TIME.size:])
                cursor.delete()
                if self.index.get(txn, gone) is None:
                    txn.delete(gone, db=self.states)

    def drop_orphans(self, txn: lmdb.Transaction) -> int:
        """Remove states of records neither indexed nor listed as ghosts (an older build deleted them)."""
        orphans = []
        for raw_digest, raw in txn.cursor(db=self.states):
            digest = bytes(raw_digest)
            if self.index.get(txn, digest) is None and \
                    txn.get(_TIME.pack(_STATE.unpack(raw)[0]) + digest, db=self.ghosts) is None:
                orphans.append(digest)
        for digest in orphans:
            txn.delete(digest, db=self.states)
        return len(orphans)
