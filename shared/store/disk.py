"""Disk tier: one record file per key under a directory, with an LMDB index for size and LRU order.

Why this shape:

- file names are the key digest in a two-level fan-out (``ab/abcdef....rec``), never key text, so no
  key can turn into a path and directories stay small;
- writes go to a temp file in the same directory, are fsynced and then ``os.replace``d, so a reader in
  any process sees either nothing or a complete record (and `records.decode` catches the rest);
- LMDB is a crash-safe, multi-process index (`vllm_tiercache.shared.store.disk_index`): its write
  transaction is also the cross-process lock under which files are renamed into place and evicted, so a
  precompute job and a serving engine can share a directory while keeping one byte budget;
- reads do not open a write transaction unless the stored access time is older than a few seconds,
  so hot reads stay lock-free.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb
import torch
import xxhash

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import (
    KEY_DIGEST_SIZE,
    FileTier,
    Prefetches,
    ReadsInto,
    Record,
    StoredRecord,
    StoreKey,
    TakesPayloadAllocator,
)
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.disk_config import DiskTierConfig
from vllm_tiercache.shared.store.disk_index import DiskIndex

log = logging.getLogger(__name__)

#: Bytes read per call; the payload checksum follows each piece while it is hot in cache.
READ_PIECE = 1 << 20
#: Bytes a reader with its own payload memory (`DiskTier.payload_allocator`) reads first: the header and,
#: for most records, all of it (a header is a few hundred bytes; longer ones take a second read).
HEAD_READ = 4096
#: Refresh a record's stored access time on read only when older than this: LRU order at one-minute
#: granularity is plenty for a disk cache, and it keeps write transactions (an fsync each) off hot reads.
ATIME_REFRESH_NS = 60_000_000_000
#: Leftover temp files (from a killed writer) older than this are removed when a tier opens.
STALE_TMP_S = 600
#: "No room for this write": a full filesystem, a quota, a file-size limit (RLIMIT_FSIZE).
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: ``preadv`` flag: serve the read from the page cache or fail at once (Linux); None where absent.
_NOWAIT = getattr(os, "RWF_NOWAIT", None) if hasattr(os, "posix_fadvise") else None


class DiskTierError(OSError):
    """The tier's directory or index cannot be used at all; the message names the path and what was tried.

    Raised when the tier is built (a misconfigured path should stop an engine at start, clearly), never
    while serving: there, I/O problems are counted misses and skipped writes.
    """


class _Pending:
    __slots__ = ("digest", "final", "size", "text", "tmp")

    def __init__(self, digest: bytes, tmp: str, final: str, size: int, text: str) -> None:
        self.digest, self.tmp, self.final, self.size, self.text = digest, tmp, final, size, text


class DiskTier(FileTier, ReadsInto, Prefetches, TakesPayloadAllocator):
    """A byte-bounded LRU directory of record files, shared safely by several processes."""

    kind = "disk"
    shared_across_processes = True
    #: records also carry the checksum a GPU verifies them with (the GDS tier's; `records.encode`)
    writes_for_gpu_readers = False

    def __init__(self, config: DiskTierConfig, name: str = "disk") -> None:
        self.config = config
        self.name = name
        self.capacity = config.capacity
        self.root = Path(config.path)
        self._root_text = str(self.root)
        self.counters = TierCounters()
        self._warned: set[str] = set()
        self._refreshed: dict[bytes, int] = {}  # digest -> when this process last refreshed its atime
        #: per thread: the keys `prefetch_many` was told of and has not advised the kernel of yet
        self._upcoming = threading.local()
        #: reads can tell a page-cache miss (`_NOWAIT`); off for good once the filesystem refuses the flag
        self._nowait = _NOWAIT is not None
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
        self._remove_stale_tmp()

    def _open_index(self) -> None:
        """Open the LMDB index; if it is unreadable (an OS crash without fsync), rebuild it from the files."""
        self._index, rebuilt = DiskIndex.open(self._index_dir)
        self._env = self._index.env  # transactions of the index are the tier's cross-process lock
        if rebuilt:
            self.rebuild_index()

    def rebuild_index(self) -> int:
        """Index every record file whose header is valid (payload checked when it is read); returns the count."""
        now = time.time_ns()
        count = 0
        with self._env.begin(write=True) as txn:
            for path in self.root.glob("??/*.rec"):
                try:
                    with open(path, "rb") as f:
                        head = f.read(records.MAX_HEADER + records.FIXED_SIZE)
                        size = os.fstat(f.fileno()).st_size
                    key = records.decode_header(head).key
                except records.OtherFormatError:  # another build's record: kept, and indexed by its
                    key = _key_named_by(path)  # file name so that LRU ages it out
                    if key is None:
                        continue
                except (OSError, records.RecordError):
                    with contextlib.suppress(OSError):
                        path.unlink()
                    continue
                if path.stem != key.hex():
                    continue
                self._index.put(txn, key, size, "", now)
                count += 1
        return count

    # ------------------------------------------------------------------------------------------ paths
    def path_for(self, key: StoreKey) -> Path:
        return self._path(key.digest)

    def _path(self, digest: bytes) -> Path:
        h = digest.hex()
        return self.root / h[:2] / f"{h}.rec"

    def _path_text(self, digest: bytes) -> str:
        """`_path` as text, for the read path (building a `Path` per record cost more than its read's
        syscalls)."""
        h = digest.hex()
        return f"{self._root_text}/{h[:2]}/{h}.rec"

    def _remove_stale_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_S
        for tmp in self.root.glob("??/.tmp-*"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                pass

    # ------------------------------------------------------------------------------------------ reads
    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        try:
            with self._env.begin() as txn:
                return [self._index.get(txn, k.digest) is not None for k in keys]
        except lmdb.Error as exc:
            self._error("index read failed", exc)
            return [False] * len(keys)

    def _read_record(self, path: str | Path, key: StoreKey) -> tuple[Record, int]:
        """Read a whole file into one preallocated buffer and decode it in place. Returns (record, size).

        The payload checksum is computed piece by piece as the file is read, while each piece is still
        in the CPU cache, instead of in a second pass over memory. With a `payload_allocator` the payload
        lands apart, in the memory it gives (`_read_payload_apart`).
        """
        if self.payload_allocator is not None:
            return self._read_payload_apart(str(path), key, self.payload_allocator)
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            buf = torch.empty(st.st_size, dtype=torch.uint8).numpy() if st.st_size else bytearray()
            view = memoryview(buf)
            got = 0
            payload_start: int | None = None
            hashed_until = 0
            hasher = xxhash.xxh3_64()
            while got < st.st_size:
                n = f.readinto(view[got:got + READ_PIECE])
                if not n:
                    break
                got += n
                if payload_start is None:
                    payload_start = records.payload_start(view[:got])
                if payload_start is not None and max(payload_start, hashed_until) < got:
                    hasher.update(view[max(payload_start, hashed_until):got])
                    hashed_until = got
            if got != st.st_size:
                raise records.RecordError(f"short read: {got} of {st.st_size} bytes")
        checksum = hasher.intdigest() if payload_start is not None else None
        return records.decode(buf, key, payload_checksum=checksum), st.st_size

    def _read_payload_apart(self, path: str, key: StoreKey, allocate: Callable[[int], torch.Tensor]
                            ) -> tuple[Record, int]:
        """A whole record whose payload lands in ``allocate(payload bytes)``, the header in a small buffer:
        the first `HEAD_READ` bytes, the header checked, then the rest of the payload with ``preadv``. The
        file's size must be exactly the header's offset plus payload (checked before anything is allocated,
        so a foreign header cannot ask for a huge buffer); the payload is hashed in one pass afterwards."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            head = bytearray(min(size, HEAD_READ))
            got = os.preadv(fd, [head], 0)
            start = records.payload_start(memoryview(head)[:got])
            if start is None:
                raise records.RecordError(f"truncated or corrupt header ({size} bytes)")
            if start > got:  # a long header: read the rest of it
                more = bytearray(min(size, start) - got)
                read = os.preadv(fd, [more], got)
                head = head[:got] + more[:read]
                got += read
            header = records.decode_header(memoryview(head)[: min(got, start)], key)
            if header.payload_offset != start or start + header.nbytes != size:
                raise records.RecordError(f"truncated or oversized: {size} bytes, the header says "
                                          f"{start + header.nbytes}")
            view = records.byte_view(allocate(header.nbytes))
            already = max(0, min(got, size) - start)
            if already:
                view[:already] = memoryview(head)[start : start + already]
            while already < header.nbytes:  # one call reads it all, unless a filesystem returns less
                read = os.preadv(fd, [view[already:]], start + already)
                if not read:  # the file ended before its fstat size: it changed under us
                    raise records.RecordError(f"short read: {start + already} of {size} bytes")
                already += read
        finally:
            os.close(fd)
        return records.decode_payload(header, view, xxhash.xxh3_64_intdigest(view)), size

    def _read_record_into(self, path: str, key: StoreKey, pieces: Sequence[memoryview]) -> tuple[Record, int]:
        """Read the payload straight into ``pieces`` (one after the other) when the record is exactly their
        size: one copy from the page cache into the caller's memory (the KV cache's blocks), no buffer to
        allocate and fault in.

        One open, fstat and ``preadv`` per record (the per-call costs, not the bytes, dominated a hit of
        many 256 KiB records): the file's size minus the destination's is where the payload must start,
        so the header lands in a small buffer and the payload in the pieces in one call; the payload is
        then hashed in one pass while it is still in the CPU cache. A record of another size or layout,
        or a short read, is read the usual way (`_read_record`).
        """
        views = pieces
        want = sum(view.nbytes for view in views)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            start = size - want
            if not records.FIXED_SIZE <= start <= records.payload_offset(records.MAX_HEADER):
                return self._read_record(path, key)
            head = bytearray(start)
            got = self._read_cached(fd, [head, *views]) if self._has_upcoming() else -1
            if got != size:  # not asked to read ahead, or part of the file is not in the page cache
                self._advise_upcoming()
                got = os.preadv(fd, [head, *views], 0)
        finally:
            os.close(fd)
        if got != size or records.payload_start(head) != start:
            # a short read, or a record of another size than the destination (its header is not where the
            # sizes put it): the usual read decides whether it is damaged, never this guess
            return self._read_record(path, key)
        header = records.decode_header(head, key)
        if header.payload_offset != start or header.nbytes != want:
            return self._read_record(path, key)
        if len(views) == 1:
            checksum = xxhash.xxh3_64_intdigest(views[0])
        else:
            hasher = xxhash.xxh3_64()
            for view in views:
                hasher.update(view)
            checksum = hasher.intdigest()
        return records.decode_into(header, pieces, checksum), size

    def prefetch_many(self, keys: Sequence[StoreKey]) -> None:
        """These records' files will be read soon, by this thread, in this order: have the kernel read them
        ahead (``POSIX_FADV_WILLNEED``) if they are not in the page cache.

        Why: a load reads its records one after another; from a cold disk each read waited for the device
        alone (0.17 of an ``O_DIRECT`` read's speed). Advised ahead, the reads of a whole step are queued
        at once while the first layer loads.

        Where a read can tell a page-cache miss (``RWF_NOWAIT``), the advice is given when this thread's
        first in-place read (`get_many_into`) after this call finds its file not wholly in the page cache,
        and never for a step whose files are all there: the advice costs an open, an fadvise and a close
        per file (1.4-1.8 ms for the 128 files of an 8193-token hit on the issue-20 model, 0.3-0.5 ms of a
        2049-token hit's 4 ms load), and a warm read needs none of it.
        Elsewhere it is given at once."""
        if self._nowait:
            self._upcoming.keys = list(keys)
        else:
            self._advise(keys)

    def _has_upcoming(self) -> bool:
        return bool(getattr(self._upcoming, "keys", None))

    def _advise_upcoming(self) -> None:
        """Give the read-ahead advice `prefetch_many` deferred, once."""
        keys = getattr(self._upcoming, "keys", None)
        if keys:
            self._upcoming.keys = None
            self._advise(keys)

    def _read_cached(self, fd: int, buffers: list[Any]) -> int:
        """``preadv`` from offset 0 that only takes what the page cache holds now: the bytes read, fewer
        than the file's (or -1) when some of it would have to come from the device."""
        try:
            return os.preadv(fd, buffers, 0, _NOWAIT)
        except BlockingIOError:
            return -1
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._nowait = False  # this filesystem cannot say: advise at once from now on
            return -1

    def _advise(self, keys: Sequence[StoreKey]) -> None:
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        for key in keys:
            try:
                fd = os.open(self._path_text(key.digest), os.O_RDONLY)
            except OSError:
                continue  # not stored here: the read will miss
            try:
                advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        return self._get_many(keys, None)

    def get_many_into(self, keys: Sequence[StoreKey], into: Sequence[Sequence[memoryview] | None]
                      ) -> list[Record | None]:
        """`get_many`, landing each payload of its destination's size in that destination (`Store.get_many`)."""
        return self._get_many(keys, into)

    def _get_many(self, keys: Sequence[StoreKey], into: Sequence[Sequence[memoryview] | None] | None
                  ) -> list[Record | None]:
        out: list[Record | None] = []
        hits: list[tuple[bytes, int]] = []  # digest, size
        gone: list[tuple[bytes, int | None]] = []  # digest, inode of a corrupt file (None: file missing)
        corrupt = 0
        for i, key in enumerate(keys):
            path = self._path_text(key.digest)
            destination = into[i] if into is not None else None
            try:
                if destination is None:
                    self._advise_upcoming()  # a whole-file read cannot tell a page-cache miss
                    rec, file_size = self._read_record(path, key)
                else:
                    rec, file_size = self._read_record_into(path, key, destination)
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
                self._error(f"read of {path} failed", exc)
                out.append(None)
                continue
            out.append(rec)
            hits.append((key.digest, file_size))
        if corrupt:
            self.counters.add(corrupt=corrupt)
        if hits or gone:
            self._after_read(hits, gone)
        return out

    def _after_read(self, hits: list[tuple[bytes, int]], gone: list[tuple[bytes, int | None]]) -> None:
        """Refresh stale access times, repair missing index entries, drop corrupt files and dead entries."""
        now = time.time_ns()
        # Hits this process refreshed less than ATIME_REFRESH_NS ago need no index transaction at all.
        hits = [(d, size) for d, size in hits if now - self._refreshed.get(d, 0) > ATIME_REFRESH_NS]
        if not hits and not gone:
            return
        if len(self._refreshed) > 100_000:
            self._refreshed.clear()
        for digest, _ in hits:
            self._refreshed[digest] = now
        try:
            with self._env.begin() as txn:
                stale = []
                for digest, size in hits:
                    entry = self._index.get(txn, digest)
                    if entry is None or now - entry.atime_ns > ATIME_REFRESH_NS:
                        stale.append((digest, size))
                dead = [(d, ino) for d, ino in gone if ino is not None or self._index.get(txn, d)]
            if not stale and not dead:
                return
            with self._env.begin(write=True) as txn:
                for digest, size in stale:
                    if self._index.touch(txn, digest, now):
                        continue
                    # A file whose index entry was lost (writer killed): adopt it, unless it was evicted
                    # since we read it: files are only unlinked under this write lock, so a file that is
                    # still there now stays until we commit.
                    try:
                        if os.stat(self._path(digest)).st_size != size:
                            continue  # replaced meanwhile; its writer indexed it
                    except FileNotFoundError:
                        continue  # evicted after our read: adopting it would index a missing file
                    self._index.put(txn, digest, size, "", now)
                for digest, ino in dead:
                    path = self._path(digest)
                    if ino is not None:
                        try:
                            if os.stat(path).st_ino != ino:
                                continue  # another process already replaced it with a fresh record
                            os.unlink(path)
                        except FileNotFoundError:
                            pass
                    elif path.exists():
                        continue
                    self._index.delete(txn, digest)
        except lmdb.Error as exc:
            self._error("index update after read failed", exc)

    # ----------------------------------------------------------------------------------------- writes
    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None:
        pending: list[_Pending] = []
        refused = 0
        for key, tensor, meta in items:
            enc = records.encode(key, tensor, meta, for_gpu_readers=self.writes_for_gpu_readers)
            if enc.nbytes > self.capacity:
                refused += 1
                continue
            p = self._write_tmp(key, enc)
            if p is not None:
                pending.append(p)
        if refused:
            self.counters.add(refused=refused)
        if pending:
            self._commit(pending)

    def _write_tmp(self, key: StoreKey, enc: records.Encoded) -> _Pending | None:
        final = self._path(key.digest)
        tmp = final.parent / f".tmp-{final.stem}-{uuid.uuid4().hex[:12]}"
        fd = -1
        try:
            os.makedirs(final.parent, mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            for piece in (memoryview(enc.prefix), enc.payload):
                while piece.nbytes:
                    n = os.write(fd, piece)
                    piece = piece[n:]
            if self.config.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if exc.errno in _FULL_ERRNOS:
                self.counters.add(dropped_writes=1, errors=1)
                self._warn_once("full", f"tiercache disk tier: filesystem full under {self.root} "
                                f"({exc.strerror}); skipping writes until space is free")
            else:
                self._error(f"write of {final} failed", exc)
                self.counters.add(dropped_writes=1)
            return None
        return _Pending(key.digest, str(tmp), str(final), enc.nbytes, key.text)

    def _commit(self, pending: list[_Pending]) -> None:
        """Rename files into place and account for them under the index's write lock, then evict."""
        evicted = puts = written = 0
        try:
            with self._env.begin(write=True) as txn:
                now = time.time_ns()
                for p in pending:
                    os.replace(p.tmp, p.final)
                    self._index.put(txn, p.digest, p.size, p.text, now)
                    puts += 1
                    written += p.size
                evicted = self._evict_over_capacity(txn)
        except (lmdb.Error, OSError) as exc:
            self._error("commit of written records failed", exc)
            for p in pending:
                for leftover in (p.tmp, p.final):
                    try:
                        os.unlink(leftover)
                    except OSError:
                        pass
            self.counters.add(dropped_writes=len(pending))
            return
        self.counters.add(puts=puts, bytes_written=written, evictions=evicted)

    def _evict_over_capacity(self, txn: lmdb.Transaction) -> int:
        """Unlink least recently used records until the total fits the capacity; returns how many."""
        total = self._index.total(txn)
        victims = []
        for digest in self._index.oldest(txn):
            if total <= self.capacity:
                break
            entry = self._index.get(txn, digest)
            victims.append(digest)
            if entry is not None:
                total -= entry.size
        for digest in victims:
            self._index.delete(txn, digest)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(digest))
        return len(victims)

    # ------------------------------------------------------------------------------------------ index
    def _index_delete(self, txn: lmdb.Transaction, digest: bytes) -> None:
        """Forget one record inside the caller's write transaction (its file is the caller's business)."""
        self._index.delete(txn, digest)

    def iter_index(self) -> Iterator[tuple[bytes, int, float, str]]:
        """(digest, size, last access unix time, key text) of every indexed record (for `tiercache stats`)."""
        with self._env.begin() as txn:
            for digest, entry in self._index.scan(txn):
                yield digest, entry.size, entry.atime_ns / 1e9, entry.text

    def sizes_many(self, keys: Sequence[StoreKey]) -> list[int | None]:
        """Stored size of each key's record from the index (None: not indexed). No file is read.

        Why: offline jobs report how many bytes they stored without reading the records back.
        """
        try:
            with self._env.begin() as txn:
                entries = [self._index.get(txn, key.digest) for key in keys]
            return [None if entry is None else entry.size for entry in entries]
        except lmdb.Error as exc:
            self._error("index read failed", exc)
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
        unknown (an index rebuilt from record headers stores none) get ``""`` as key text.
        """
        matches: list[bytes] = []
        matched_bytes = 0
        with self._env.begin() as txn:
            for digest, entry in self._index.scan(txn):
                if predicate(entry.text, entry.size, entry.atime_ns / 1e9):
                    matches.append(digest)
                    matched_bytes += entry.size
        if dry_run:  # no write transaction: a dry run never blocks writers
            return len(matches), matched_bytes
        removed = removed_bytes = 0
        for lo in range(0, len(matches), batch):
            with self._env.begin(write=True) as txn:
                for digest in matches[lo:lo + batch]:
                    entry = self._index.get(txn, digest)
                    if entry is None:
                        continue  # evicted or removed by another process meanwhile
                    if not predicate(entry.text, entry.size, entry.atime_ns / 1e9):
                        continue  # rewritten or read since the scan (e.g. atime refreshed)
                    removed += 1
                    removed_bytes += entry.size
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path(digest))
                    self._index.delete(txn, digest)
        return removed, removed_bytes

    def iter_stored(self) -> Iterator[StoredRecord]:
        """Every indexed record (the `Tier` admin contract): key text, size, seconds since last access."""
        now = time.time()
        for _, size, atime, text in self.iter_index():
            yield StoredRecord(text, size, now - atime)

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """`delete_where` over `StoredRecord`s (the `Tier` admin contract); idle time counted from now."""
        now = time.time()
        return self.delete_where(lambda text, size, atime: predicate(StoredRecord(text, size, now - atime)),
                                 dry_run=dry_run)

    def usage(self) -> dict[str, Any]:
        try:
            with self._env.begin() as txn:
                return {"entries": self._index.count(txn), "bytes_used": self._index.total(txn),
                        "capacity": self.capacity, "path": str(self.root)}
        except lmdb.Error:
            return {"entries": None, "bytes_used": None, "capacity": self.capacity, "path": str(self.root)}

    # ------------------------------------------------------------------------------------------- misc
    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def _error(self, what: str, exc: BaseException) -> None:
        self.counters.add(errors=1)
        self._warn_once(what, f"tiercache {self.kind} tier {self.root}: {what}: {exc}")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._index.close()


def _key_named_by(path: Path) -> bytes | None:
    """The key digest a record file is named by, or None for a file name that is not one."""
    try:
        digest = bytes.fromhex(path.stem)
    except ValueError:
        return None
    return digest if len(digest) == KEY_DIGEST_SIZE else None
