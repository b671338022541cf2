"""The LMDB index of one disk-tier directory: per record its size, order key and key text, in eviction order.

Why a module of its own: the index is the disk tier's cross-process state, with its own binary layout,
its own per-process environment cache (LMDB forbids opening one environment twice in a process) and its
own crash story (commits without fsync; a damaged index is moved aside and rebuilt from the record
headers, `bookkeeping.rebuild_index`). The disk tier's other modules (`tier`, `writes`,
`capacity`, `bookkeeping`, `admin`) do files and records and call only what is here, so
the entry layout below is written and read in one place.

Databases of the environment:

- ``entries``: digest -> u64 size, u64 order key | key text (bytes, may be empty);
- ``atime``: big-endian u64 order key + digest -> b"" (iterates lowest first: the eviction order). The key is
  the last access (ns) under plain recency (policy ``lru``, and every older build), a virtual time under
  ``prefix`` (`order`: its own dbs ``lrfu`` and ``ghosts``). The two share a unit (ns), not a scale: the
  virtual clock moves with traffic and drifts from wall time without bound (`order`, "Versions"), so
  one directory is kept in one policy (``eviction_policy`` below);
- ``meta``: ``total_bytes`` -> u64, the sum of all entry sizes; ``eviction_policy`` -> a format byte and
  the policy's name, written by the first process of a build that records it (`order.claim_policy`: a
  process configured with another policy is refused at start; an index without it is an older build's);
- ``tags``: digest -> the record's tags (`vllm_tiercache.shared.store.tags.encode_tags`), only for records
  that have tags. An older build never opens it: it keeps reading ``entries`` as before, and a record it
  evicts leaves its tags entry behind, an orphan that readers skip (no ``entries`` entry) and
  `DiskIndex.drop_orphan_tags` removes;
- ``control``: the store's shared control entries (`vllm_tiercache.shared.store.control`: invalidations
  by tag, pins), name -> value;
- ``parents``: digest -> the parent digest its record's meta names (`vllm_tiercache.shared.eviction.lineage`:
  a KV block's record names the record of the block before it), only for records that name one;
- ``children``: parent digest -> child digest, one duplicate per child (``dupsort``): the inverse of
  ``parents``, so that eviction finds a victim's descendants in O(log n) each (`capacity`). A record's
  parent follows from its key (the key names a block with every block before it), so a link never
  changes; it is written with the entry and removed with it (`delete`), in the same transaction.

Versions: the two lineage dbs came after the others. An index from a build without them opens as it is
(LMDB creates the missing dbs); its records are roots (no parent known) until rewritten, said once in a
log line when the marker ``lineage_version`` is first written to ``meta``. An older build still sharing the
directory deletes entries without their links: readers check a link against ``parents`` and ``entries``
(`descendants`) and `drop_orphan_links` removes what it left.

Every method takes the caller's transaction: the tier's write transaction is also the cross-process lock
under which record files are renamed into place and unlinked, so the two must share one transaction.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import lmdb

from vllm_tiercache.shared.store.api import key_text_bytes
from vllm_tiercache.shared.store.tags import decode_tags, encode_tags

log = logging.getLogger(__name__)
_ENTRY = struct.Struct("<QQ")  # size, atime_ns ; followed by the key text (utf-8)
_ATIME = struct.Struct(">Q")  # big endian, so LMDB's byte order is time order
_TOTAL = b"total_bytes"
_U64 = struct.Struct("<Q")
_LINEAGE = b"lineage_version"  # in ``meta``: the lineage dbs are kept (absent: an index of an older build)
LINEAGE_VERSION = 1

_ENV_LOCK = threading.Lock()
_ENVS: dict[str, list[Any]] = {}  # realpath -> [env, refcount]; LMDB forbids opening one env twice


class IndexEntry(NamedTuple):
    """One record as the index knows it (``text`` is ``""`` for entries rebuilt from record headers)."""

    size: int
    atime_ns: int
    text: str


class Order(Protocol):
    """An eviction order other than plain recency (`order.PrefixOrder`): the key each touch writes."""

    def key(self, txn: lmdb.Transaction, digest: bytes, size: int, now_ns: int, old: IndexEntry | None) -> int: ...

    def bump(self, txn: lmdb.Transaction, digest: bytes, old: IndexEntry, now_ns: int) -> int: ...

    def forget(self, txn: lmdb.Transaction, digest: bytes, old: IndexEntry) -> None: ...

    def last_access_ns(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry) -> int: ...

    def drop_orphans(self, txn: lmdb.Transaction) -> int: ...


def _open_env(index_dir: str) -> lmdb.Environment:
    real = os.path.realpath(index_dir)
    with _ENV_LOCK:
        if real in _ENVS:
            _ENVS[real][1] += 1
            return _ENVS[real][0]
        # No fsync per index commit: record files are fsynced themselves, LMDB stays consistent across
        # process crashes without it, and an index damaged by an OS crash is rebuilt from the record
        # headers (see DiskIndex.open). Two fsyncs per put would halve put throughput.
        # The directory is made here, owner-only: LMDB would mkdir it with the file mode (0600, no
        # search bit), which only root can then create files in.
        os.makedirs(real, mode=0o700, exist_ok=True)
        env = lmdb.open(real, map_size=4 << 30, max_dbs=16, subdir=True, sync=False, metasync=False,
                        readahead=False, max_readers=1024, mode=0o600)
        _ENVS[real] = [env, 1]
        return env


def _release_env(index_dir: str) -> None:
    real = os.path.realpath(index_dir)
    with _ENV_LOCK:
        slot = _ENVS.get(real)
        if slot is None:
            return
        slot[1] -= 1
        if slot[1] <= 0:
            del _ENVS[real]
            slot[0].close()


def _unpack(raw: Any) -> IndexEntry:
    size, atime = _ENTRY.unpack_from(raw)
    return IndexEntry(size, atime, bytes(raw[_ENTRY.size:]).decode(errors="replace"))


class DiskIndex:
    """The index of one directory; `open` it, use it inside `env` transactions, `close` it once."""

    def __init__(self, index_dir: str) -> None:
        self.dir = index_dir
        #: the eviction order (None: plain recency, the key of a touch is its time); set by the tier
        self.order: Order | None = None
        #: the clock of touches, ns (a replay sets its trace's time: `tools/bench/trace/tiers`)
        self.clock: Callable[[], int] = time.time_ns
        self.env = _open_env(index_dir)
        try:
            # In a transaction of our own: `open_db` without one begins its write transaction holding the
            # GIL (py-lmdb 3.0), and deadlocks against a thread of this process that holds the write lock
            # of this shared environment and waits for the GIL (a writer's commit renames files inside its
            # transaction). `begin(write=True)` waits for the lock with the GIL released.
            with self.env.begin(write=True) as txn:
                self.entries = self.env.open_db(b"entries", txn=txn)
                self.by_atime = self.env.open_db(b"atime", txn=txn)
                self.meta = self.env.open_db(b"meta", txn=txn)
                self.tags = self.env.open_db(b"tags", txn=txn)
                self.control = self.env.open_db(b"control", txn=txn)
                self.parents = self.env.open_db(b"parents", txn=txn)
                self.children = self.env.open_db(b"children", txn=txn, dupsort=True)
                self._mark_lineage(txn)
            with self.env.begin() as txn:
                self.total(txn)
        except lmdb.Error:
            _release_env(index_dir)
            raise

    def _mark_lineage(self, txn: lmdb.Transaction) -> None:
        """Write the lineage marker into ``meta`` once; say so when records were indexed without links."""
        if txn.get(_LINEAGE, db=self.meta) is not None:
            return
        count = self.count(txn)
        if count:
            log.warning("tiercache disk tier: index %s was written by a build without parent links; its %d "
                        "records are roots (evicted by recency alone, descendants not followed) until "
                        "rewritten; records written from now on are linked to their parents", self.dir, count)
        txn.put(_LINEAGE, _U64.pack(LINEAGE_VERSION), db=self.meta)

    @classmethod
    def open(cls, index_dir: str) -> tuple[DiskIndex, bool]:
        """Open the index; if it is unreadable (an OS crash without fsync), move it aside, start afresh.

        Returns (index, rebuilt): with ``rebuilt`` the caller must index its record files again.
        """
        try:
            return cls(index_dir), False
        except lmdb.Error as exc:
            log.warning("tiercache disk tier: index %s is damaged (%s); rebuilding it from the record files",
                        index_dir, exc)
        damaged = f"{index_dir}.damaged-{os.getpid()}-{time.time_ns()}"
        with contextlib.suppress(OSError):
            os.replace(index_dir, damaged)
            shutil.rmtree(damaged, ignore_errors=True)
        return cls(index_dir), True

    def close(self) -> None:
        _release_env(self.dir)

    # ----------------------------------------------------------------------------------------- reading
    def total(self, txn: lmdb.Transaction) -> int:
        """Bytes of every indexed record, as kept in ``meta`` (no scan)."""
        raw = txn.get(_TOTAL, db=self.meta)
        return _U64.unpack(raw)[0] if raw else 0

    def count(self, txn: lmdb.Transaction) -> int:
        return txn.stat(self.entries)["entries"]

    def get(self, txn: lmdb.Transaction, digest: bytes) -> IndexEntry | None:
        raw = txn.get(digest, db=self.entries)
        return None if raw is None else _unpack(raw)

    def scan(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, IndexEntry]]:
        """Every entry, in digest order."""
        for digest, raw in txn.cursor(db=self.entries):
            yield bytes(digest), _unpack(raw)

    def get_tags(self, txn: lmdb.Transaction, digest: bytes) -> tuple[str, ...]:
        """The tags of an indexed record (() when it has none)."""
        return decode_tags(txn.get(digest, db=self.tags))

    def scan_tags(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, tuple[str, ...]]]:
        """(digest, tags) of every record that has tags, orphans included (see the module docstring)."""
        for digest, raw in txn.cursor(db=self.tags):
            yield bytes(digest), decode_tags(raw)

    def parent(self, txn: lmdb.Transaction, digest: bytes) -> bytes | None:
        """The parent digest of a record (None: a root, or not indexed with a link)."""
        raw = txn.get(digest, db=self.parents)
        return None if raw is None else bytes(raw)

    def descendants(self, txn: lmdb.Transaction, digest: bytes,
                    keep: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """The indexed records below ``digest`` (children first, breadth first), each once.

        Why: a record is found only by a prefix lookup that found its parent first, so once a record goes
        its descendants are dead weight. A link is followed only while the child is indexed and names this
        parent (an older build may have deleted a child without its link). ``keep(child)``: a child the
        caller keeps (a pinned record): it is left out, and so is everything below it.
        """
        out: list[bytes] = []
        seen = {digest}
        frontier = [digest]
        while frontier:
            nxt: list[bytes] = []
            for parent in frontier:
                cursor = txn.cursor(db=self.children)
                if not cursor.set_key(parent):
                    continue
                for raw in cursor.iternext_dup(keys=False, values=True):
                    child = bytes(raw)
                    if child in seen or txn.get(child, db=self.entries) is None or self.parent(txn, child) != parent:
                        continue
                    seen.add(child)
                    if keep is not None and keep(child):
                        continue
                    out.append(child)
                    nxt.append(child)
            frontier = nxt
        return out

    def oldest(self, txn: lmdb.Transaction) -> Iterator[bytes]:
        """Digests in the eviction order: least recent first, or lowest `order` key first."""
        for akey in txn.cursor(db=self.by_atime).iternext(keys=True, values=False):
            yield bytes(akey[_ATIME.size:])

    # ----------------------------------------------------------------------------------------- writing
    def put(self, txn: lmdb.Transaction, digest: bytes, size: int, text: str, now_ns: int,
            tags: tuple[str, ...] | list[str] = (), parent: bytes | None = None) -> None:
        """Index a record (replacing its old entry and tags), accessed at ``now_ns``; keeps the total in step.

        ``parent``: the digest its meta names (`lineage.parent_of`); None keeps the link it has, if any (an
        entry adopted or rebuilt without its meta: a key's parent never changes).
        """
        if parent is not None and parent != digest:
            self._link(txn, digest, parent)
        if tags:
            txn.put(digest, encode_tags(tags), db=self.tags)
        else:
            txn.delete(digest, db=self.tags)
        total = self.total(txn)
        old = self.get(txn, digest)
        if old is not None:
            total -= old.size
            txn.delete(_ATIME.pack(old.atime_ns) + digest, db=self.by_atime)
        key = now_ns if self.order is None else self.order.key(txn, digest, size, now_ns, old)
        txn.put(digest, _ENTRY.pack(size, key) + key_text_bytes(text), db=self.entries)
        txn.put(_ATIME.pack(key) + digest, b"", db=self.by_atime)
        txn.put(_TOTAL, _U64.pack(max(0, total + size)), db=self.meta)

    def touch(self, txn: lmdb.Transaction, digest: bytes, now_ns: int, access: bool = True) -> bool:
        """An access of a record at ``now_ns``: its key moves (by recency, or as `order` says; size and key
        text kept); False if not indexed. ``access=False``: moved to at least ``now_ns`` without counting
        an access (a pinned record an eviction passed over)."""
        old = self.get(txn, digest)
        if old is None:
            return False
        if self.order is None:
            key = now_ns
        elif access:
            key = self.order.key(txn, digest, old.size, now_ns, old)
        else:
            key = self.order.bump(txn, digest, old, now_ns)
        self.rekey(txn, digest, old, key)
        return True

    def rekey(self, txn: lmdb.Transaction, digest: bytes, old: IndexEntry, key: int) -> None:
        """Move an indexed record to ``key`` in the eviction order. The key is also the entry's access-time
        field: an older build deletes the ``atime`` entry that field names, so the two never differ."""
        raw = txn.get(digest, db=self.entries)
        txn.delete(_ATIME.pack(old.atime_ns) + digest, db=self.by_atime)
        txn.put(digest, _ENTRY.pack(old.size, key) + bytes(raw[_ENTRY.size:]), db=self.entries)
        txn.put(_ATIME.pack(key) + digest, b"", db=self.by_atime)

    def last_access_ns(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry) -> int:
        """When the record was last touched (with an `order`, its key is not a time)."""
        return entry.atime_ns if self.order is None else self.order.last_access_ns(txn, digest, entry)

    def delete(self, txn: lmdb.Transaction, digest: bytes) -> None:
        """Forget a record (no-op when it is not indexed); keeps the total in step; the `order` keeps its
        history (a ghost)."""
        old = self.get(txn, digest)
        if old is None:
            return
        txn.delete(digest, db=self.entries)
        txn.delete(digest, db=self.tags)
        txn.delete(_ATIME.pack(old.atime_ns) + digest, db=self.by_atime)
        txn.put(_TOTAL, _U64.pack(max(0, self.total(txn) - old.size)), db=self.meta)
        self._unlink(txn, digest)
        if self.order is not None:
            self.order.forget(txn, digest, old)

    def _link(self, txn: lmdb.Transaction, digest: bytes, parent: bytes) -> None:
        """Record ``parent`` as the parent of ``digest`` (both directions; a different old link is replaced)."""
        old = self.parent(txn, digest)
        if old == parent:
            return
        if old is not None:
            txn.delete(old, digest, db=self.children)
        txn.put(digest, parent, db=self.parents)
        txn.put(parent, digest, db=self.children)

    def _unlink(self, txn: lmdb.Transaction, digest: bytes) -> None:
        """Forget the link of ``digest`` to its parent. Its own children keep theirs: they name it, and
        whoever removes it decides about them (eviction and admin deletes take them along: `descendants`)."""
        old = self.parent(txn, digest)
        if old is not None:
            txn.delete(old, digest, db=self.children)
            txn.delete(digest, db=self.parents)

    def drop_orphan_tags(self, txn: lmdb.Transaction) -> int:
        """Remove tags entries whose record is no longer indexed (an older build evicted it); returns how many."""
        orphans = [digest for digest, _ in self.scan_tags(txn) if txn.get(digest, db=self.entries) is None]
        for digest in orphans:
            txn.delete(digest, db=self.tags)
        return len(orphans)

    def drop_orphan_links(self, txn: lmdb.Transaction) -> int:
        """Remove parent links (and `order` states) of records no longer indexed (an older build deleted
        them); returns how many links."""
        orphans = [bytes(d) for d in txn.cursor(db=self.parents).iternext(keys=True, values=False)
                   if txn.get(d, db=self.entries) is None]
        for digest in orphans:
            self._unlink(txn, digest)
        if self.order is not None:
            self.order.drop_orphans(txn)
        return len(orphans)

    # ----------------------------------------------------------------------------------------- control
    def control_entries(self, txn: lmdb.Transaction) -> dict[str, bytes]:
        """Every control entry (name -> value)."""
        return {bytes(k).decode(errors="replace"): bytes(v) for k, v in txn.cursor(db=self.control)}

    def set_control(self, txn: lmdb.Transaction, name: str, value: bytes | None) -> None:
        """Set a control entry (None: remove it)."""
        if value is None:
            txn.delete(name.encode(), db=self.control)
        else:
            txn.put(name.encode(), value, db=self.control)
