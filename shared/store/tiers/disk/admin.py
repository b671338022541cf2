"""The disk tier's admin operations (the `Tier` contract `tiercache stats`, `tiercache evict` and the
precompute jobs use): list records, their sizes, remove records by a predicate, usage.

Why a module of its own: these run beside serving processes, from other processes, and read only the
index (never a record file), so their one concern is taking the index's transactions in a way that
never blocks or confuses writers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lmdb

from vllm_tiercache.shared.store.api import StoredRecord, StoreKey
from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex, IndexEntry
from vllm_tiercache.shared.store.tiers.disk.paths import RecordPaths
from vllm_tiercache.shared.store.tiers.disk.problems import ProblemReporter


class DiskAdmin:
    """Admin operations over one tier directory's index (and the files they remove)."""

    def __init__(self, index: DiskIndex, paths: RecordPaths, capacity: int, problems: ProblemReporter) -> None:
        self.index = index
        self.paths = paths
        self.capacity = capacity
        self.problems = problems

    def iter_index(self) -> Iterator[tuple[bytes, int, float, str]]:
        """(digest, size, last access unix time, key text) of every indexed record (for `tiercache stats`)."""
        with self.index.env.begin() as txn:
            for digest, entry in self.index.scan(txn):
                yield digest, entry.size, self.index.last_access_ns(txn, digest, entry) / 1e9, entry.text

    def sizes_many(self, keys: Sequence[StoreKey]) -> list[int | None]:
        """Stored size of each key's record from the index (None: not indexed). No file is read.

        Why: offline jobs report how many bytes they stored without reading the records back.
        """
        try:
            with self.index.env.begin() as txn:
                entries = [self.index.get(txn, key.digest) for key in keys]
            return [None if entry is None else entry.size for entry in entries]
        except lmdb.Error as exc:
            self.problems.error("index read failed", exc)
            return [None] * len(keys)

    def delete_where(
        self, predicate: Callable[[str, int, float], bool], *, dry_run: bool = False, batch: int = 1000
    ) -> tuple[int, int]:
        """Remove every indexed record for which ``predicate(key_text, size, atime_s)`` is true.

        Returns (records, bytes) removed (or that would be, with ``dry_run``). Safe beside serving
        processes: matches are collected under a read transaction, then removed in batches, each under
        the index's write transaction (the same cross-process lock writers and eviction take), so a
        writer never sees its fresh record accounted twice or unaccounted. A reader that already opened a
        file keeps reading it (POSIX unlink), a later reader gets a miss. Entries whose key text is
        unknown (an index rebuilt from record headers stores none) get ``""`` as key text. A match's
        descendants (records whose parent chain leads to it) go with it and are counted.
        """
        def match(txn: lmdb.Transaction, digest: bytes, entry: IndexEntry) -> bool:
            return predicate(entry.text, entry.size, self.index.last_access_ns(txn, digest, entry) / 1e9)

        return self._delete_matching(match, dry_run=dry_run, batch=batch)

    def _delete_matching(self, match: Callable[[lmdb.Transaction, bytes, IndexEntry], bool], *,
                         dry_run: bool, batch: int = 1000) -> tuple[int, int]:
        """`delete_where` over ``match(txn, digest, entry)``, each match with its descendants (counted in
        the result, dry run too); a real run also drops orphan tags entries and parent links.

        Why descendants go too: a record is found only by a prefix lookup that found its parent first,
        so a child left behind would be dead weight that only LRU would clear, and the bytes reported
        freed would understate what the deletion makes unreachable (eviction does the same: `capacity`).
        """
        matches: list[bytes] = []
        matched_bytes = 0
        with self.index.env.begin() as txn:
            for digest, entry in self.index.scan(txn):
                if match(txn, digest, entry):
                    matches.append(digest)
            if dry_run:  # no write transaction: a dry run never blocks writers
                counted: set[bytes] = set()
                for digest in matches:
                    for gone in (digest, *self.index.descendants(txn, digest, keep=counted.__contains__)):
                        if gone not in counted:
                            counted.add(gone)
                            entry = self.index.get(txn, gone)
                            matched_bytes += entry.size if entry is not None else 0
                return len(counted), matched_bytes
        removed = removed_bytes = 0
        for lo in range(0, len(matches), batch):
            with self.index.env.begin(write=True) as txn:
                for digest in matches[lo:lo + batch]:
                    entry = self.index.get(txn, digest)
                    if entry is None:
                        continue  # evicted or removed by another process meanwhile (or taken as a descendant)
                    if not match(txn, digest, entry):
                        continue  # rewritten or read since the scan (e.g. atime refreshed)
                    for gone in (digest, *self.index.descendants(txn, digest)):
                        gone_entry = self.index.get(txn, gone)
                        if gone_entry is None:
                            continue
                        removed += 1
                        removed_bytes += gone_entry.size
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self.paths.path(gone))
                        self.index.delete(txn, gone)
        with self.index.env.begin(write=True) as txn:
            self.index.drop_orphan_tags(txn)
            self.index.drop_orphan_links(txn)
        return removed, removed_bytes

    def iter_stored(self) -> Iterator[StoredRecord]:
        """Every indexed record (the `Tier` admin contract): key text, size, seconds since last access, tags."""
        now = self.index.clock() / 1e9
        with self.index.env.begin() as txn:
            for digest, entry in self.index.scan(txn):
                yield StoredRecord(entry.text, entry.size, now - self.index.last_access_ns(txn, digest, entry) / 1e9,
                                   self.index.get_tags(txn, digest))

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """`delete_where` over `StoredRecord`s (the `Tier` admin contract); idle time counted from now."""
        now = self.index.clock() / 1e9
        return self._delete_matching(
            lambda txn, digest, entry: predicate(StoredRecord(entry.text, entry.size,
                                                              now - self.index.last_access_ns(txn, digest, entry) / 1e9,
                                                              self.index.get_tags(txn, digest))),
            dry_run=dry_run)

    def usage(self) -> dict[str, Any]:
        """Entries, bytes used, capacity and path (None for the counts when the index cannot be read)."""
        try:
            with self.index.env.begin() as txn:
                return {"entries": self.index.count(txn), "bytes_used": self.index.total(txn),
                        "capacity": self.capacity, "path": str(self.paths.root)}
        except lmdb.Error:
            return {"entries": None, "bytes_used": None, "capacity": self.capacity, "path": str(self.paths.root)}
