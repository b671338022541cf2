"""Writing records into the disk tier: a temp file each, fsynced, then renamed into place and indexed.

Why this shape: a reader in any process sees either nothing or a complete record, because a file appears
under its final name only by ``os.replace`` of a fully written (and, with ``fsync``, durable) temp file in
the same directory. The renames and the index entries share one index write transaction, the
cross-process lock that eviction takes too, so a directory shared by several processes keeps one byte
budget. A full filesystem skips writes (counted, logged once); it never raises to the caller.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import lmdb
import torch

from vllm_tiercache.shared.eviction.lineage import parent_of
from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tags import tags_of
from vllm_tiercache.shared.store.tiers.disk.capacity import evict_over_capacity
from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex
from vllm_tiercache.shared.store.tiers.disk.paths import RecordPaths
from vllm_tiercache.shared.store.tiers.disk.problems import ProblemReporter

#: "No room for this write": a full filesystem, a quota, a file-size limit (RLIMIT_FSIZE).
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class WrittenFile(NamedTuple):
    """A record written to its temp file, waiting to be renamed into place and indexed."""

    digest: bytes
    tmp: str
    final: str
    size: int
    text: str
    tags: tuple[str, ...] = ()
    parent: bytes | None = None  # the parent digest its meta names (`lineage`): indexed with it


class RecordWriter:
    """Writes batches of records into one tier directory within a byte budget."""

    def __init__(self, index: DiskIndex, paths: RecordPaths, capacity: int, fsync: bool,
                 counters: TierCounters, problems: ProblemReporter, pin_budget: int = 0) -> None:
        self.index = index
        self.pin_budget = pin_budget
        self.paths = paths
        self.capacity = capacity
        self.fsync = fsync
        self.counters = counters
        self.problems = problems

    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]], *,
                 for_gpu_readers: bool) -> None:
        """Write every record (those larger than the whole capacity are refused and counted), then commit
        the batch under one index write transaction and evict what no longer fits."""
        written: list[WrittenFile] = []
        refused = 0
        for key, tensor, meta in items:
            enc = records.encode(key, tensor, meta, for_gpu_readers=for_gpu_readers)
            if enc.nbytes > self.capacity:
                refused += 1
                continue
            w = self.write_temp(key, enc)
            if w is not None:
                written.append(w._replace(tags=tags_of(meta), parent=parent_of(meta)))
        if refused:
            self.counters.add(refused=refused)
        if written:
            self.commit(written)

    def write_temp(self, key: StoreKey, enc: records.Encoded) -> WrittenFile | None:
        """Write one encoded record to a fresh temp file beside its final path; None when it failed (the
        temp file removed, the failure counted)."""
        final = self.paths.path(key.digest)
        tmp = self.paths.temp_path(final)
        fd = -1
        try:
            os.makedirs(final.parent, mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            for piece in (memoryview(enc.prefix), enc.payload):
                while piece.nbytes:
                    n = os.write(fd, piece)
                    piece = piece[n:]
            if self.fsync:
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
            if exc.errno in FULL_ERRNOS:
                self.counters.add(dropped_writes=1, errors=1)
                self.problems.warn_once("full", f"tiercache disk tier: filesystem full under {self.paths.root} "
                                        f"({exc.strerror}); skipping writes until space is free")
            else:
                self.problems.error(f"write of {final} failed", exc)
                self.counters.add(dropped_writes=1)
            return None
        return WrittenFile(key.digest, str(tmp), str(final), enc.nbytes, key.text)

    def commit(self, written: list[WrittenFile]) -> None:
        """Rename files into place and account for them under the index's write lock, then evict."""
        evicted = puts = nbytes = 0
        try:
            with self.index.env.begin(write=True) as txn:
                now = self.index.clock()
                for w in written:
                    os.replace(w.tmp, w.final)
                    self.index.put(txn, w.digest, w.size, w.text, now, w.tags, w.parent)
                    puts += 1
                    nbytes += w.size
                evicted = evict_over_capacity(self.index, txn, self.capacity, self.paths, self.pin_budget)
        except (lmdb.Error, OSError) as exc:
            self.problems.error("commit of written records failed", exc)
            for w in written:
                for leftover in (w.tmp, w.final):
                    try:
                        os.unlink(leftover)
                    except OSError:
                        pass
            self.counters.add(dropped_writes=len(written))
            return
        self.counters.add(puts=puts, bytes_written=nbytes, evictions=evicted)
