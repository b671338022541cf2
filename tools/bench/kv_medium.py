"""What each tier's medium does alone with the bytes a hit loads, measured beside `tiercache bench kv`'s hits.

Why: a hit's time over vLLM's resident hit is the price of moving the prefix's KV into the engine's
blocks. Printed next to the raw medium's time for the same bytes (a memory copy, a read from the page
cache, an ``O_DIRECT`` read, redis-py GETs), it says how much of that price is the medium and how much
is ours (per-record work, copies, waits): ``share`` = raw time / (hit - resident). 1.0 would be a hit
that costs exactly its bytes' trip through the medium.

Every measurement moves the bytes in 1 MiB pieces into a buffer allocated once, and reports the median
of several rounds, on the calling thread with torch limited to one thread (as a vLLM CPU worker runs).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: Bytes per piece, for every medium (a KV record of a 256-token chunk is 128 KiB-1 MiB on small models).
PIECE = 1 << 20
ROUNDS = 7


def _median_time(fn: Callable[[], None], rounds: int = ROUNDS) -> float:
    fn()  # warm: first-touch page faults, connections
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def memory_copy_s(nbytes: int) -> float:
    """``Tensor.copy_`` of ``nbytes`` in 1 MiB pieces between two preallocated host tensors."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)

        def copy() -> None:
            for off in range(0, nbytes, PIECE):
                dst[off : off + PIECE].copy_(src[off : off + PIECE])

        return _median_time(copy)
    finally:
        torch.set_num_threads(threads)


def _write_file(path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:
        block = os.urandom(PIECE)
        for off in range(0, nbytes, PIECE):
            f.write(block[: min(PIECE, nbytes - off)])
        f.flush()
        os.fsync(f.fileno())


def page_cache_read_s(nbytes: int, work: Path) -> float:
    """``readinto`` of a ``nbytes`` file, already in the page cache, into a preallocated buffer."""
    path = work / "medium-page-cache.bin"
    _write_file(path, nbytes)
    buf = memoryview(bytearray(nbytes))

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            for off in range(0, nbytes, PIECE):
                f.readinto(buf[off : off + PIECE])

    try:
        return _median_time(read)
    finally:
        path.unlink(missing_ok=True)


def direct_read_s(nbytes: int, work: Path) -> float | None:
    """``O_DIRECT`` read of a ``nbytes`` file (what a cold disk gives); None where the filesystem refuses
    ``O_DIRECT`` (tmpfs, some overlay filesystems)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    path = work / "medium-direct.bin"
    size = -(-nbytes // PIECE) * PIECE
    _write_file(path, size)
    buf = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        path.unlink(missing_ok=True)
        return None

    def read() -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        for _ in range(0, size, PIECE):
            os.readv(fd, [buf])

    try:
        return _median_time(read)
    except OSError:
        return None
    finally:
        os.close(fd)
        buf.close()
        path.unlink(missing_ok=True)


def redis_get_s(nbytes: int, url: str) -> float | None:
    """Pipelined redis-py GETs of ``nbytes`` stored as 1 MiB values (hiredis parser when installed)."""
    import redis

    client = redis.Redis.from_url(url)
    keys = [f"tiercache-bench-medium:{i}" for i in range(-(-nbytes // PIECE))]
    try:
        block = os.urandom(PIECE)
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, block)
        pipe.execute()

        def get() -> None:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            pipe.execute()

        return _median_time(get)
    except redis.RedisError:
        return None
    finally:
        with contextlib.suppress(redis.RedisError):
            client.delete(*keys)
        client.close()


def raw_medium_times(nbytes: int, work: Path, redis_url: str | None = None) -> dict[str, float | None]:
    """Seconds each medium takes to move ``nbytes``: ``memory``, ``page_cache``, ``o_direct``, ``redis``."""
    work.mkdir(parents=True, exist_ok=True)
    return {
        "memory": memory_copy_s(nbytes),
        "page_cache": page_cache_read_s(nbytes, work),
        "o_direct": direct_read_s(nbytes, work),
        "redis": redis_get_s(nbytes, redis_url) if redis_url else None,
    }
