"""The disk tier's eviction order for policy ``prefix``: LRFU with a newcomer discount, kept as a virtual
time in the index's sorted ``atime`` db, so the order costs O(log n) per touch, as LRU did.

Why: the memory tier's ``prefix`` policy (`vllm_tiercache.shared.eviction.prefix`) ranks records by decayed
access counts, a never-seen record counting a tenth of an access; on the Mooncake trace that is what lifts it
above LRU. The disk tier holds the larger part of a memory + disk pair, so its order decides most of what the
pair keeps (docs/benchmarks-kv.md, "Which blocks to keep").

The virtual time. A record's decayed count C (each access adds its weight, every half-life H of the clock
halves it) is kept as of its last access v; its key is ``v + H x log2(C)``. At any common later time T, log2
of a record's count is ``(key - T) / H``: comparing keys compares counts, and a key changes only when its
record is touched. A touch at v' with weight w: ``log2(C') = log2(C x 2^-((v' - v) / H) + w)``; a touch
never lowers a key.

- **Clock**: the memory policy's, traffic: ``meta``'s ``lrfu_clock`` advances by the size of every record
  put or read (read refreshes: `bookkeeping`), in the write transaction every process shares; H is
  ``half_life`` capacities of it. Why not wall time: keys of one order must share one H, and the time a
  capacity of traffic takes changes with the load (an 8x faster writer, an idle night); a byte clock needs
  no such measure and replays deterministically.
- **Versions**: the clock counts in ns-like units, ``scale`` ns per byte, starting at the wall time of its
  first use, so that keys written by plain recency (an older build: key = wall time of the last access)
  compare with it at that moment: such a record reads as C = 1 at that time. ``scale`` is fixed at the
  first use (keys of different scales would not compare): the age of the index's oldest record over the
  bytes it holds (an index written by recency: its traffic's pace), else 1. That is what makes an older
  build's directory usable by ``prefix`` from its first touch (the clock starts level with its keys); it
  is not a shared scale from then on. The clock moves with bytes, wall time with seconds: on a new
  directory (1 ns per byte) a disk that sees less than 1 GB/s falls behind wall time by most of every
  second (an idle night: by the night), and one ``H`` is ``half_life x capacity`` ns (a 1 TiB disk:
  18 min), so a newcomer's key sits 3.3 H below the clock. A recency key written now therefore ranks
  above every ``prefix`` key of the directory, however recently read, and eviction takes those first (the
  other way round while the clock runs ahead). So one directory keeps one policy (`claim_policy`): a
  process of this build configured with the other one is refused at start. An older build, which writes
  no policy, still shares a ``prefix`` directory as before (its keys: one access at that time).
- **Batches and the grid**: the records of one commit (one write transaction at one time) are touched at one
  time, the clock as the commit's first record advanced it, and keys are rounded up to a grid of 1/64 of a
  half-life (`_on_grid`): a long prompt saved over many commits raises its chain once per step of the grid,
  not once per record (below: parents).
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

Layout (`lrfu` db): digest -> u64 last access (wall ns: `tiercache stats`), u64 last access on the clock,
f64 log2 of C as of then, u64 the key written with it. The key stays in ``entries``' access-time field,
which an older build reads and deletes its ``atime`` entry by: an entry whose key differs from its state's
was touched by recency since (C = 1 at that time). An older build's deletes leave states behind: read as
ghosts, and `drop_orphans` (run by `tiercache evict`) removes those not listed.
"""

from __future__ import annotations

import logging
import math
import struct
import weakref
from typing import TYPE_CHECKING

import lmdb

from vllm_tiercache.shared.store.tier_config import ConfigError

if TYPE_CHECKING:
    from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex, IndexEntry

log = logging.getLogger(__name__)

_STATE = struct.Struct("<QQdQ")  # last access wall ns, then on the clock, log2 of the count then, its key
_CLOCK = struct.Struct("<Qd")  # the clock, its ns per byte
_CLOCK_KEY = b"lrfu_clock"
#: in ``meta``: the eviction policy the directory is kept in (`claim_policy`): a format byte, then its name
_POLICY_KEY = b"eviction_policy"
POLICY_FORMAT = 1
_TIME = struct.Struct(">Q")  # big endian: the ghosts db iterates oldest first
_MAX_KEY = (1 << 64) - 1
#: the weight of a never-seen record's first put (the memory policy's measured best)
NEWCOMER = 0.1
#: ghosts kept at least (the memory policy's history size), else as many as there are entries
MIN_GHOSTS = 65536
#: the most parents one touch raises (a chain is hundreds of blocks at most; a bound against a damaged index)
_MAX_RAISE = 4096
#: keys are multiples of this fraction of a half-life (`_on_grid`)
KEY_GRID = 64


def _on_grid(key: int, half_life: float) -> int:
    """``key`` rounded up to a multiple of ``half_life / KEY_GRID``.

    Why: a long prompt is saved over many commits, a few chunks of each layer's chain at a time, and each
    commit's key outranks the chain stored before it, so every commit raised the whole chain below it
    (`_raise_parents`): a prompt of D chunks cost O(D^2) raises per layer (docs/benchmarks-kv.md,
    "2026-11-30": the cost per put, before and after). On the grid the commits within one step of it
    share a key and stop at their parent; the chain is raised once per step of the clock, not per commit.
    What it costs: records whose counts differ by less than 1/64 of a doubling (1%) can rank as equals
    (then in digest order). A tier of a few records, where one record's put advances the clock by more
    than a step, is keyed as before."""
    step = max(1, int(half_life / KEY_GRID))
    return min(_MAX_KEY, -(-key // step) * step)


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
        self.window_bytes = max(1.0, half_life * capacity)
        self.newcomer = float(newcomer)
        #: (the write transaction, weakly: a finished one is not kept; its ``now_ns``; the clock its first
        #: touch read): the batch being keyed
        self._batch: tuple[weakref.ref[lmdb.Transaction], int, int] | None = None
        with index.env.begin(write=True) as txn:  # see DiskIndex.__init__: open_db in a transaction of our own
            self.states = index.env.open_db(b"lrfu", txn=txn)
            self.ghosts = index.env.open_db(b"ghosts", txn=txn)

    # ----------------------------------------------------------------------------------------- reading
    def _state(self, txn: lmdb.Transaction, digest: bytes) -> tuple[int, int, float, int] | None:
        raw = txn.get(digest, db=self.states)
        return None if raw is None else _STATE.unpack(raw)

    def _own(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry) -> tuple[int, int, float]:
        """(last access wall ns, then on the clock, log2 of the count then) of an indexed record: its
        state's, unless the entry was touched by recency since (its key is not the state's): then one access
        at that time."""
        state = self._state(txn, digest)
        if state is not None and state[3] == entry.atime_ns:
            return state[0], state[1], state[2]
        return entry.atime_ns, entry.atime_ns, 0.0

    def last_access_ns(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry) -> int:
        """When the record was last touched (its key is not: `tiercache stats`, idle times, read refreshes)."""
        return self._own(txn, digest, entry)[0]

    def clock(self, txn: lmdb.Transaction) -> tuple[int, float]:
        """(the clock, its ns per byte); (0, 0.0) before its first use."""
        raw = txn.get(_CLOCK_KEY, db=self.index.meta)
        return _CLOCK.unpack(raw) if raw is not None else (0, 0.0)

    # ----------------------------------------------------------------------------------------- writing
    def key(self, txn: lmdb.Transaction, digest: bytes, size: int, now_ns: int, old: IndexEntry | None) -> int:
        """The key of ``digest`` touched at ``now_ns`` (``old``: its entry, None for a put of a record not
        indexed); its state is written, its parents raised. The caller writes the entry with this key."""
        last_v, crf, weight = self._history(txn, digest, old)
        now_v, half_life = self._advance(txn, now_ns, size)
        decayed = crf - max(0, now_v - last_v) / half_life
        crf = decayed + math.log2(1.0 + weight * 2.0 ** -decayed) if decayed > -60.0 else math.log2(weight)
        key = min(_MAX_KEY, max(0, round(now_v + half_life * crf), old.atime_ns if old is not None else 0))
        key = _on_grid(key, half_life)
        txn.put(digest, _STATE.pack(now_ns, now_v, crf, key), db=self.states)
        self._raise_parents(txn, digest, key)
        return key

    def _history(self, txn: lmdb.Transaction, digest: bytes, old: IndexEntry | None) -> tuple[int, float, float]:
        """(last access on the clock, log2 count then, this touch's weight) of ``digest``."""
        if old is not None:
            return (*self._own(txn, digest, old)[1:], 1.0)
        state = self._state(txn, digest)
        if state is not None:  # a ghost coming back
            txn.delete(_TIME.pack(state[0]) + digest, db=self.ghosts)
            return state[1], state[2], 1.0
        return 0, -math.inf, self.newcomer

    def _advance(self, txn: lmdb.Transaction, now_ns: int, size: int) -> tuple[int, float]:
        """The clock advanced by ``size`` bytes (started at its first use: module docstring); returns the
        time of this touch and the half-life in its units.

        The time of a touch is the clock as the first touch of its batch (one write transaction at one
        ``now_ns``: a commit of written records, a read's refreshes) advanced it: a batch is one time, so a
        chain put in one commit has one key and each record's raise stops at its parent (`_raise_parents`).
        Timed by each record's own advance instead, every record of a chain outranked its parent by its size,
        and each put raised the whole chain above it (the cost: `_on_grid`)."""
        value, scale = self.clock(txn)
        if scale <= 0.0:
            value, scale = now_ns, self._first_scale(txn, now_ns)
        value = min(_MAX_KEY, value + max(1, round(size * scale)))
        txn.put(_CLOCK_KEY, _CLOCK.pack(value, scale), db=self.index.meta)
        batch = self._batch
        if batch is None or batch[0]() is not txn or batch[1] != now_ns:
            self._batch = batch = (weakref.ref(txn), now_ns, value)
        return batch[2], self.window_bytes * scale

    def _first_scale(self, txn: lmdb.Transaction, now_ns: int) -> float:
        """ns per byte: an index written by recency took its age to receive what it holds; else 1."""
        oldest = next(iter(txn.cursor(db=self.index.by_atime).iternext(keys=True, values=False)), None)
        total = self.index.total(txn)
        if oldest is None or total <= 0 or _TIME.unpack_from(oldest)[0] >= now_ns:
            return 1.0
        return max(1e-3, (now_ns - _TIME.unpack_from(oldest)[0]) / total)

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
            txn.put(parent, _STATE.pack(*self._own(txn, parent, entry), key), db=self.states)
            self.index.rekey(txn, parent, entry, key)
            child = parent

    def bump(self, txn: lmdb.Transaction, digest: bytes, old: IndexEntry, now_ns: int) -> int:
        """The key of ``digest`` moved to at least the clock's now without counting an access (a pinned record
        an eviction passed over: not read, but kept; once unpinned it ages from there with its own count)."""
        key = max(old.atime_ns, self.clock(txn)[0])
        txn.put(digest, _STATE.pack(*self._own(txn, digest, old), key), db=self.states)
        return key

    def forget(self, txn: lmdb.Transaction, digest: bytes, old: IndexEntry) -> None:
        """``digest`` is no longer indexed: its state stays, as a ghost (the oldest beyond the bound go)."""
        last, last_v, crf = self._own(txn, digest, old)
        txn.put(digest, _STATE.pack(last, last_v, crf, 0), db=self.states)
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


class PolicyConflict(ConfigError):
    """A disk tier configured with another eviction policy than the directory it opens is kept in."""


def claim_policy(index: DiskIndex, policy: str, directory: str) -> None:
    """Record ``policy`` as the directory's eviction policy in ``meta`` when none is recorded; raise
    `PolicyConflict` (naming the directory, both policies and the ways out) when another one is.

    Why: the two policies key the one eviction order on different scales (module docstring, "Versions"),
    so processes that share a directory with different ``policy`` settings would evict by an order that
    is neither. An index no build of this rule has opened records none, and is taken for what it holds:
    one with the ``prefix`` clock (``lrfu_clock``) was kept by ``prefix``; one without it was keyed by
    recency (an older build, or ``lru``), which either policy takes over (``prefix`` as its docstring
    says: its clock starts level with the recency keys), or is empty. In the index's write transaction, so
    of two processes starting together the first one records its policy and the other is checked against it.
    """
    with index.env.begin(write=True) as txn:
        raw = txn.get(_POLICY_KEY, db=index.meta)
        if raw is not None:
            raw = bytes(raw)
            if raw[:1] != bytes([POLICY_FORMAT]):
                raise PolicyConflict(
                    f"tiercache disk tier: the eviction policy recorded in {directory} is of an unknown format "
                    f"({raw[:1].hex() or 'empty'}), written by another build; open the directory with that build, "
                    f"or give this tier a directory of its own (its 'path' in the store config)")
            recorded, how = raw[1:].decode(errors="replace"), "recorded in its index when it was first used"
        elif txn.get(_CLOCK_KEY, db=index.meta) is not None:
            recorded, how = "prefix", "its index holds the prefix order's clock, kept by an earlier build"
        else:
            recorded, how = None, ""
        if recorded is not None and recorded != policy:
            raise PolicyConflict(
                f"tiercache disk tier: directory {directory} is kept in eviction policy {recorded!r} ({how}), "
                f"and this process is configured with policy {policy!r}. Processes sharing one directory must "
                f"use one policy (the two rank records on different scales: eviction would take every record "
                f"of one before any of the other). Set this tier's 'policy' to {recorded!r}, or give it a "
                f"directory of its own ('path'), or, once no process uses {directory}, delete it to start over "
                f"with {policy!r} (its cached records are lost)")
        if raw is None:
            if recorded is None and policy == "prefix" and index.count(txn):
                log.info("tiercache disk tier: directory %s was keyed by recency (an older build, or policy lru); "
                         "it is kept in policy 'prefix' from now on", directory)
            txn.put(_POLICY_KEY, bytes([POLICY_FORMAT]) + policy.encode(), db=index.meta)
