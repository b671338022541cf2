"""Reading one record file of the disk tier: whole into one buffer, with the payload apart in memory the
caller gives, or straight into the caller's destination (the KV cache's blocks).

Why a module of its own: the three reads share one job, turning a file into a verified `Record` with as
few copies and system calls as each destination allows, and each is tested alone. A read raises
`records.RecordError` for a damaged file (the tier counts it and deletes the file), `OSError` for I/O
problems, and never touches the index.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import xxhash

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import Record, StoreKey
from vllm_tiercache.shared.store.tiers.disk.readahead import ReadAhead

#: Bytes read per call; the payload checksum follows each piece while it is hot in cache.
READ_PIECE = 1 << 20
#: Bytes a reader with its own payload memory (`DiskTier.payload_allocator`) reads first: the header and,
#: for most records, all of it (a header is a few hundred bytes; longer ones take a second read).
HEAD_READ = 4096

#: A whole-record read: (record, file size) of the file at a path, checked against the key.
WholeRead = Callable[[str, StoreKey], tuple[Record, int]]


def read_whole_record(path: str | Path, key: StoreKey) -> tuple[Record, int]:
    """Read a whole file into one preallocated buffer and decode it in place. Returns (record, size).

    The payload checksum is computed piece by piece as the file is read, while each piece is still
    in the CPU cache, instead of in a second pass over memory.
    """
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


def read_payload_apart(path: str, key: StoreKey, allocate: Callable[[int], torch.Tensor]) -> tuple[Record, int]:
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


def read_record_into(path: str, key: StoreKey, pieces: Sequence[memoryview], read_ahead: ReadAhead,
                     read_whole: WholeRead) -> tuple[Record, int]:
    """Read the payload straight into ``pieces`` (one after the other) when the record is exactly their
    size: one copy from the page cache into the caller's memory (the KV cache's blocks), no buffer to
    allocate and fault in.

    One open, fstat and ``preadv`` per record (the per-call costs, not the bytes, dominate a hit of many
    small records): the file's size minus the destination's is where the payload must start, so the
    header lands in a small buffer and the payload in the pieces in one call; the payload is then hashed
    in one pass while it is still in the CPU cache. The first read after a `ReadAhead.prefetch` asks the
    page cache alone, and gives the deferred advice when it finds the file cold. A record of another size
    or layout, or a short read, is read by ``read_whole`` (the tier's usual read), which decides whether
    it is damaged.
    """
    views = pieces
    want = sum(view.nbytes for view in views)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        start = size - want
        if not records.FIXED_SIZE <= start <= records.payload_offset(records.MAX_HEADER):
            return read_whole(path, key)
        head = bytearray(start)
        got = read_ahead.read_cached(fd, [head, *views]) if read_ahead.has_upcoming() else -1
        if got != size:  # not asked to read ahead, or part of the file is not in the page cache
            read_ahead.advise_upcoming()
            got = os.preadv(fd, [head, *views], 0)
    finally:
        os.close(fd)
    if got != size or records.payload_start(head) != start:
        # a short read, or a record of another size than the destination (its header is not where the
        # sizes put it): the usual read decides whether it is damaged, never this guess
        return read_whole(path, key)
    header = records.decode_header(head, key)
    if header.payload_offset != start or header.nbytes != want:
        return read_whole(path, key)
    if len(views) == 1:
        checksum = xxhash.xxh3_64_intdigest(views[0])
    else:
        hasher = xxhash.xxh3_64()
        for view in views:
            hasher.update(view)
        checksum = hasher.intdigest()
    return records.decode_into(header, pieces, checksum), size
