"""Keeping the disk tier's LMDB index in step with its files: after reads, when the tier opens (files a killed
writer left unindexed), and rebuilt from the files.

Why a module of its own: the index (`vllm_tiercache.shared.store.tiers.disk.index`) stores entries; deciding
which entries to refresh, adopt or drop takes the record files into account and has its own races with
other processes (an eviction between a read and its bookkeeping). Reads do not open a write transaction
unless a hit's stored access time is older than `ATIME_REFRESH_NS`, so hot reads stay lock-free.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import lmdb

from vllm_tiercache.shared.eviction.lineage import parent_of
from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.tags import tags_of
from vllm_tiercache.shared.store.tiers.disk.capacity import evict_over_capacity
from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex
from vllm_tiercache.shared.store.tiers.disk.paths import RecordPaths, key_named_by
from vllm_tiercache.shared.store.tiers.disk.problems import ProblemReporter

#: Refresh a record's stored access time on read only when older than this: LRU order at one-minute
#: granularity is plenty for a disk cache, and it keeps write transactions (an fsync each) off hot reads.
ATIME_REFRESH_NS = 60_000_000_000
#: How many digests a process remembers as refreshed before it forgets them all (bounds its memory).
_REFRESHED_MAX = 100_000


class ReadBookkeeping:
    """What a batch of reads tells the index: hits to refresh (or adopt), files gone or corrupt to drop."""

    def __init__(self, index: DiskIndex, paths: RecordPaths, problems: ProblemReporter) -> None:
        self.index = index
        self.paths = paths
        self.problems = problems
        #: digest -> when this process last refreshed its access time
        self.refreshed: dict[bytes, int] = {}

    def after_read(self, hits: list[tuple[bytes, int]], gone: list[tuple[bytes, int | None]]) -> None:
        """Refresh stale access times, repair missing index entries, drop corrupt files and dead entries.

        ``hits``: (digest, file size) of records read; ``gone``: (digest, inode of a corrupt file, or None
        when the file was missing).
        """
        now = self.index.clock()
        # Hits this process refreshed less than ATIME_REFRESH_NS ago need no index transaction at all.
        hits = [(d, size) for d, size in hits if now - self.refreshed.get(d, 0) > ATIME_REFRESH_NS]
        if not hits and not gone:
            return
        if len(self.refreshed) > _REFRESHED_MAX:
            self.refreshed.clear()
        for digest, _ in hits:
            self.refreshed[digest] = now
        try:
            with self.index.env.begin() as txn:
                stale = []
                for digest, size in hits:
                    entry = self.index.get(txn, digest)
                    if entry is None or now - self.index.last_access_ns(txn, digest, entry) > ATIME_REFRESH_NS:
                        stale.append((digest, size))
                dead = [(d, ino) for d, ino in gone if ino is not None or self.index.get(txn, d)]
            if not stale and not dead:
                return
            with self.index.env.begin(write=True) as txn:
                for digest, size in stale:
                    self._refresh_or_adopt(txn, digest, size, now)
                for digest, ino in dead:
                    self._drop(txn, digest, ino)
        except lmdb.Error as exc:
            self.problems.error("index update after read failed", exc)

    def _refresh_or_adopt(self, txn: lmdb.Transaction, digest: bytes, size: int, now: int) -> None:
        if self.index.touch(txn, digest, now):
            return
        # A file whose index entry was lost (writer killed): adopt it, unless it was evicted since we read
        # it: files are only unlinked under this write lock, so a file that is still there now stays until
        # we commit.
        try:
            if os.stat(self.paths.path(digest)).st_size != size:
                return  # replaced meanwhile; its writer indexed it
        except FileNotFoundError:
            return  # evicted after our read: adopting it would index a missing file
        self.index.put(txn, digest, size, "", now)

    def _drop(self, txn: lmdb.Transaction, digest: bytes, ino: int | None) -> None:
        path = self.paths.path(digest)
        if ino is not None:
            try:
                if os.stat(path).st_ino != ino:
                    return  # another process already replaced it with a fresh record
                os.unlink(path)
            except FileNotFoundError:
                pass
        elif path.exists():
            return
        self.index.delete(txn, digest)


class _Found(NamedTuple):
    """What a record file's header says to index it by."""

    digest: bytes
    size: int
    tags: tuple[str, ...]
    parent: bytes | None


def _found_in(path: Path) -> _Found | None:
    """The entry a record file is indexed by, from its header; None for a file not to index (a damaged
    header's file is deleted, one whose header names another key is left alone). Another build's record
    is indexed by its file name, so that the order ages it out."""
    try:
        with open(path, "rb") as f:
            head = f.read(records.MAX_HEADER + records.FIXED_SIZE)
            size = os.fstat(f.fileno()).st_size
        header = records.decode_header(head)
        key, tags, parent = header.key, tags_of(header.meta), parent_of(header.meta)
    except records.OtherFormatError:  # another build's record: kept, and indexed by its
        key, tags, parent = key_named_by(path), (), None  # file name so that LRU ages it out
        if key is None:
            return None
    except (OSError, records.RecordError):
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    if path.stem != key.hex():
        return None
    return _Found(key, size, tags, parent)


def rebuild_index(index: DiskIndex, paths: RecordPaths) -> int:
    """Index every record file whose header is valid (payload checked when it is read); returns the count.

    Why: the index commits without an fsync, so an OS crash can leave it unreadable; the record files
    (fsynced) are the truth it is rebuilt from. A file whose header is damaged is deleted; another build's
    record is kept and indexed by its file name, so that LRU ages it out. Rebuilt entries have no key text;
    their tags and parent links (`DiskIndex.descendants`) come back from the headers.
    """
    now = index.clock()
    count = 0
    with index.env.begin(write=True) as txn:
        for path in paths.record_files():
            found = _found_in(path)
            if found is not None:
                index.put(txn, found.digest, found.size, "", now, found.tags, found.parent)
                count += 1
    return count


def adopt_unindexed(index: DiskIndex, paths: RecordPaths, digests: Iterable[bytes], capacity: int,
                    pin_budget: int = 0) -> int:
    """Index the record files among ``digests`` (those in the directory) that the index lacks, then evict
    to ``capacity``; returns how many were adopted.

    Why: a writer renames its batch's files into place inside its index write transaction
    (`writes.RecordWriter.commit`), so a writer killed before that transaction commits leaves complete,
    fsynced record files that the index lacks. Lookups ask the index alone (`DiskTier.contains_many`), so
    no reader would ever read them, and `ReadBookkeeping` adopts only what a read found: they were never
    served and their bytes lay outside the budget for good. The tier adopts them when it opens. Each is
    checked again under the write lock: a live writer's renamed files are indexed by the time another
    process holds it (files appear and go only under that lock), so only a dead writer's are adopted.
    """
    with index.env.begin() as txn:
        missing = [digest for digest in digests if index.get(txn, digest) is None]
    if not missing:
        return 0
    now = index.clock()
    count = 0
    with index.env.begin(write=True) as txn:
        for digest in missing:
            if index.get(txn, digest) is not None:
                continue  # its writer committed meanwhile
            found = _found_in(paths.path(digest))
            if found is not None:
                index.put(txn, found.digest, found.size, "", now, found.tags, found.parent)
                count += 1
        if count:
            evict_over_capacity(index, txn, capacity, paths, pin_budget)
    return count
