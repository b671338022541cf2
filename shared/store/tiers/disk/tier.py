"""Disk tier: one record file per key under a directory, with an LMDB index for size and eviction order.

Why this shape:

- file names are the key digest in a two-level fan-out (``ab/abcdef....rec``), never key text, so no
  key can turn into a path and directories stay small (`vllm_tiercache.shared.store.tiers.disk.paths`);
- writes go to a temp file in the same directory, are fsynced and then ``os.replace``d, so a reader in
  any process sees either nothing or a complete record, and `records.decode` catches the rest
  (`vllm_tiercache.shared.store.tiers.disk.writes`);
- LMDB is a crash-safe, multi-process index (`vllm_tiercache.shared.store.tiers.disk.index`): its write
  transaction is also the cross-process lock under which files are renamed into place and evicted
  (`vllm_tiercache.shared.store.tiers.disk.capacity`), so a precompute job and a serving engine can share a
  directory while keeping one byte budget;
- reads do not open a write transaction unless the stored access time is older than a few seconds,
  so hot reads stay lock-free (`vllm_tiercache.shared.store.tiers.disk.bookkeeping`).

`DiskTier` is the `Tier` over those parts: the file reads (`reads`, `readahead`), the writes,
the index's bookkeeping and the admin operations (`admin`), each testable alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lmdb
import torch

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import (
    DropsRecords,
    FileTier,
    KeepsControl,
    Prefetches,
    ReadsInto,
    Record,
    StoredRecord,
    StoreKey,
    TakesPayloadAllocator,
)
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tiers.disk.admin import DiskAdmin
from vllm_tiercache.shared.store.tiers.disk.bookkeeping import ReadBookkeeping, adopt_unindexed, rebuild_index
from vllm_tiercache.shared.store.tiers.disk.config import DiskTierConfig
from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex
from vllm_tiercache.shared.store.tiers.disk.order import PrefixOrder, claim_policy
from vllm_tiercache.shared.store.tiers.disk.paths import RecordPaths
from vllm_tiercache.shared.store.tiers.disk.problems import ProblemReporter
from vllm_tiercache.shared.store.tiers.disk.readahead import ReadAhead
from vllm_tiercache.shared.store.tiers.disk.reads import read_payload_apart, read_record_into, read_whole_record
from vllm_tiercache.shared.store.tiers.disk.writes import RecordWriter

log = logging.getLogger(__name__)


class DiskTierError(OSError):
    """The tier's directory or index cannot be used at all; the message names the path and what was tried.

    Raised when the tier is built (a misconfigured path should stop an engine at start, clearly), never
    while serving: there, I/O problems are counted misses and skipped writes.
    """


class DiskTier(FileTier, ReadsInto, Prefetches, TakesPayloadAllocator, KeepsControl, DropsRecords):
    """A byte-bounded directory of record files, shared safely by several processes; evicts by the
    ``prefix`` order (`order`) or by recency."""

    kind = "disk"
    shared_across_processes = True
    #: records also carry the checksum a GPU verifies them with (the GDS tier's; `records.encode`)
    writes_for_gpu_readers = False

    def __init__(self, config: DiskTierConfig, name: str = "disk") -> None:
        self.config = config
        self.name = name
        self.capacity = config.capacity
        self.root = Path(config.path)
        self.counters = TierCounters()
        self._paths = RecordPaths(self.root)
        self._problems = ProblemReporter(self.kind, self.root, self.counters, log)
        self._read_ahead = ReadAhead(self._paths)
        self._index_dir = str(self.root / "index.lmdb")
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            self._open_index()
        except (OSError, lmdb.Error) as exc:
            raise DiskTierError(
                f"tiercache {self.kind} tier: cannot use {self.root} ({type(exc).__name__}: {exc}); tried: "
                f"create the directory (mode 0700) and open its LMDB index {self._index_dir}. Give the "
                f"tier a writable local directory (the 'path' of this tier in the store config)") from exc
        self._closed = False
        #: where whole-record reads put payloads: None, one buffer per file (the default); else a callable
        #: giving a uint8 host tensor of n bytes (a CUDA KV worker gives pinned memory, so a hit's record
        #: goes to the GPU in one copy and, promoted, stays in the memory tier as it is)
        self.payload_allocator: Callable[[int], torch.Tensor] | None = None
        self._adopt_unindexed()

    def _open_index(self) -> None:
        """Open the LMDB index and the parts that work on it; if the index is unreadable (an OS crash
        without fsync), rebuild it from the files."""
        self._index, rebuilt = DiskIndex.open(self._index_dir)
        try:  # one directory, one eviction policy: another process's may differ (`order.claim_policy`)
            claim_policy(self._index, self.config.policy, str(self.root))
        except BaseException:
            self._index.close()
            raise
        if self.config.policy == "prefix":
            self._index.order = PrefixOrder(self._index, self.capacity, self.config.half_life)
        self._bookkeeping = ReadBookkeeping(self._index, self._paths, self._problems)
        self._writer = RecordWriter(self._index, self._paths, self.capacity, self.config.fsync, self.counters,
                                    self._problems, int(self.config.pin_budget * self.capacity))
        self._admin = DiskAdmin(self._index, self._paths, self.capacity, self._problems)
        if rebuilt:
            self.rebuild_index()

    def _adopt_unindexed(self) -> None:
        """Remove a killed writer's stale temp files and index the records it renamed into place but did not
        commit (`bookkeeping.adopt_unindexed`: otherwise never served, and outside the byte budget)."""
        digests = self._paths.sweep()
        try:
            adopted = adopt_unindexed(self._index, self._paths, digests, self.capacity, self._writer.pin_budget)
        except (lmdb.Error, OSError) as exc:
            self._problems.error("adopting record files the index lacks failed", exc)
            return
        if adopted:
            log.info("tiercache %s tier: indexed %d record files under %s that a killed writer had left "
                     "unindexed", self.kind, adopted, self.root)

    def rebuild_index(self) -> int:
        """Index every record file whose header is valid (payload checked when it is read); returns the count."""
        return rebuild_index(self._index, self._paths)

    def path_for(self, key: StoreKey) -> Path:
        """The record file of ``key`` (whether or not it exists)."""
        return self._paths.path(key.digest)

    # ------------------------------------------------------------------------------------------ reads
    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key is indexed; from the index alone, so a lookup opens no file (a read of a record
        whose file has gone since is a miss that drops the entry)."""
        try:
            with self._index.env.begin() as txn:
                return [self._index.get(txn, k.digest) is not None for k in keys]
        except lmdb.Error as exc:
            self._problems.error("index read failed", exc)
            return [False] * len(keys)

    def _read_record(self, path: str | Path, key: StoreKey) -> tuple[Record, int]:
        """A whole record (record, file size): into one buffer per file, or with a `payload_allocator` the
        payload apart, in the memory it gives. The hook `GdsTier` overrides to read into GPU memory."""
        if self.payload_allocator is not None:
            return read_payload_apart(str(path), key, self.payload_allocator)
        return read_whole_record(path, key)

    def prefetch_many(self, keys: Sequence[StoreKey]) -> None:
        """These records' files will be read soon, by this thread, in this order: have the kernel read them
        ahead (``POSIX_FADV_WILLNEED``) if they are not in the page cache.

        Where a read can tell a page-cache miss (``RWF_NOWAIT``), the advice is given when this thread's
        first in-place read (`get_many_into`) after this call finds its file not wholly in the page cache,
        and never for a step whose files are all there; elsewhere it is given at once (`ReadAhead`)."""
        self._read_ahead.prefetch(keys)

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        """Each key's record, verified, or None (missing, corrupt, another build's format, an I/O error)."""
        return self._get_many(keys, None)

    def get_many_into(self, keys: Sequence[StoreKey], into: Sequence[Sequence[memoryview] | None]
                      ) -> list[Record | None]:
        """`get_many`, landing each payload of its destination's size in that destination (`Store.get_many`)."""
        return self._get_many(keys, into)

    def _get_many(self, keys: Sequence[StoreKey], into: Sequence[Sequence[memoryview] | None] | None
                  ) -> list[Record | None]:
        """Read each key's record (a miss is None), then tell the index what the reads found."""
        out: list[Record | None] = []
        hits: list[tuple[bytes, int]] = []  # digest, size
        gone: list[tuple[bytes, int | None]] = []  # digest, inode of a corrupt file (None: file missing)
        corrupt = 0
        for i, key in enumerate(keys):
            path = self._paths.path_text(key.digest)
            destination = into[i] if into is not None else None
            try:
                if destination is None:
                    self._read_ahead.advise_upcoming()  # a whole-file read cannot tell a page-cache miss
                    rec, file_size = self._read_record(path, key)
                else:
                    rec, file_size = read_record_into(path, key, destination, self._read_ahead, self._read_record)
            except FileNotFoundError:
                out.append(None)
                gone.append((key.digest, None))
                continue
            except records.OtherFormatError:  # another build's record: a miss, left for that build
                self.counters.add(other_format=1)
                out.append(None)
                continue
            except records.RecordError as exc:
                corrupt += 1
                log.warning("tiercache disk tier: dropping corrupt record %s (%s)", path, exc)
                try:
                    gone.append((key.digest, os.stat(path).st_ino))
                except OSError:
                    gone.append((key.digest, None))
                out.append(None)
                continue
            except OSError as exc:
                self._problems.error(f"read of {path} failed", exc)
                out.append(None)
                continue
            out.append(rec)
            hits.append((key.digest, file_size))
        if corrupt:
            self.counters.add(corrupt=corrupt)
        if hits or gone:
            self._bookkeeping.after_read(hits, gone)
        return out

    def drop_many(self, keys: Sequence[StoreKey]) -> None:
        """Delete these keys' files and index entries (`DropsRecords`: records the store cannot open)."""
        gone: list[tuple[bytes, int | None]] = []
        for key in keys:
            try:
                gone.append((key.digest, os.stat(self._paths.path_text(key.digest)).st_ino))
            except OSError:
                gone.append((key.digest, None))
        if gone:
            self._bookkeeping.after_read([], gone)

    # ----------------------------------------------------------------------------------------- writes
    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None:
        """Store every record, then evict to the capacity (`RecordWriter.put_many`); never raises for a
        full filesystem or a failed write, which are counted instead."""
        self._writer.put_many(items, for_gpu_readers=self.writes_for_gpu_readers)

    # ------------------------------------------------------------------------------------------ admin
    def iter_index(self) -> Iterator[tuple[bytes, int, float, str]]:
        """(digest, size, last access unix time, key text) of every indexed record (for `tiercache stats`)."""
        return self._admin.iter_index()

    def sizes_many(self, keys: Sequence[StoreKey]) -> list[int | None]:
        """Stored size of each key's record from the index (None: not indexed). No file is read."""
        return self._admin.sizes_many(keys)

    def delete_where(
        self, predicate: Callable[[str, int, float], bool], *, dry_run: bool = False, batch: int = 1000
    ) -> tuple[int, int]:
        """Remove every indexed record for which ``predicate(key_text, size, atime_s)`` is true; returns
        (records, bytes) removed, or that would be with ``dry_run`` (`DiskAdmin.delete_where`)."""
        return self._admin.delete_where(predicate, dry_run=dry_run, batch=batch)

    def iter_stored(self) -> Iterator[StoredRecord]:
        """Every indexed record (the `Tier` admin contract): key text, size, seconds since last access."""
        return self._admin.iter_stored()

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """`delete_where` over `StoredRecord`s (the `Tier` admin contract); idle time counted from now."""
        return self._admin.delete_stored(predicate, dry_run=dry_run)

    # ---------------------------------------------------------------------------------------- control
    def read_control(self) -> dict[str, bytes]:
        """The store's control entries (`vllm_tiercache.shared.store.control`), from the index."""
        with self._index.env.begin() as txn:
            return self._index.control_entries(txn)

    def write_control(self, changes: Mapping[str, bytes | None]) -> None:
        """Set or remove control entries in one index write transaction."""
        with self._index.env.begin(write=True) as txn:
            for name, value in changes.items():
                self._index.set_control(txn, name, value)

    def remove_control(self, name: str) -> bool:
        """Remove one control entry; True only for the caller whose transaction removed it."""
        with self._index.env.begin(write=True) as txn:
            if name not in self._index.control_entries(txn):
                return False
            self._index.set_control(txn, name, None)
            return True

    def usage(self) -> dict[str, Any]:
        """Entries, bytes used, capacity and path, from the index (`DiskAdmin.usage`)."""
        return self._admin.usage()

    def close(self) -> None:
        """Release this tier's hold on the index (the environment stays open while another tier of this
        process uses the same directory)."""
        if not self._closed:
            self._closed = True
            self._index.close()
