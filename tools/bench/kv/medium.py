"""What each tier's medium does alone with the bytes a hit loads, measured beside `tiercache bench kv`'s hits.

Why: a hit's time over vLLM's resident hit is the price of moving the prefix's KV into the engine's
blocks. Printed next to the raw medium's time for the same bytes (a memory copy, a read from the page
cache, an ``O_DIRECT`` read, redis-py GETs, boto3 GETs of an S3 bucket), it says how much of that price is
the medium and how much is ours (per-record work, copies, waits): ``share`` = raw time / (hit - resident).
1.0 would be a hit that costs exactly its bytes' trip through the medium.

Every measurement but the S3 one moves the bytes in 1 MiB pieces into buffers allocated beforehand, and
reports the median of several rounds, on the calling thread with torch limited to one thread (as a vLLM CPU
worker runs). The S3 one (`object_get_s`) GETs objects of the sizes the object tier stores, with as many in
flight as the tier puts (a round trip per object is the medium's cost there, so 1 MiB pieces would not be
the same work).

Memory and page-cache reads are measured twice. *From DRAM* (``memory``, ``page_cache``, the yardstick of
the shares): each round moves bytes that were last touched more than `COLD_SPAN` ago, as a hit's are (its
record was written seconds before, and the forward pass ran since; the KV blocks it lands in are a few
of a pool of gigabytes). *Cache-hot* (``memory_hot``, ``page_cache_hot``): the same buffers every round,
so on a CPU whose last-level cache holds them the copy never leaves it, at a speed no hit meets (figures of
both in docs/benchmarks-kv.md); printed for reference.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

#: Bytes per piece, for every medium (a KV record of a 256-token chunk is 128 KiB-1 MiB on small models).
PIECE = 1 << 20
ROUNDS = 7
#: Bytes the from-DRAM measurements spread their rounds over (per buffer), more than a server CPU's
#: last-level cache, so no round finds the bytes of an earlier one (or of the set-up) still cached.
COLD_SPAN = 128 << 20


def _median_time(fn: Callable[[], None], rounds: int = ROUNDS) -> float:
    fn()  # warm: first-touch page faults, connections
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _slots(nbytes: int, cold: bool) -> list[int]:
    """Byte offsets of the rounds' buffers: one (cache-hot), or spread over `COLD_SPAN` (from DRAM)."""
    if not cold:
        return [0]
    count = ROUNDS + 1  # the warm-up round too
    stride = max(nbytes, -(-(COLD_SPAN // count) // PIECE) * PIECE)
    return [k * stride for k in range(count)]


def memory_copy_s(nbytes: int, *, cold: bool = True) -> float:
    """``Tensor.copy_`` of ``nbytes`` in 1 MiB pieces between preallocated host tensors (from DRAM, or
    the same cache-hot pair every round)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        slots = _slots(nbytes, cold)
        src = torch.ones(slots[-1] + nbytes, dtype=torch.uint8)
        dst = torch.ones(slots[-1] + nbytes, dtype=torch.uint8)  # written: its pages exist before the timing
        bases = itertools.cycle(slots)

        def copy() -> None:
            base = next(bases)
            for off in range(base, base + nbytes, PIECE):
                end = min(off + PIECE, base + nbytes)
                dst[off:end].copy_(src[off:end])

        return _median_time(copy)
    finally:
        torch.set_num_threads(threads)


def _write_file(path: Path, nbytes: int, *, sync: bool = True) -> None:
    with open(path, "wb") as f:
        block = os.urandom(PIECE)
        for off in range(0, nbytes, PIECE):
            f.write(block[: min(PIECE, nbytes - off)])
        f.flush()
        if sync:
            os.fsync(f.fileno())


def page_cache_read_s(nbytes: int, work: Path, *, cold: bool = True) -> float:
    """``readinto`` of a ``nbytes`` file, already in the page cache, into a preallocated buffer (from DRAM:
    another file and another part of the buffer every round; cache-hot: the same ones)."""
    slots = _slots(nbytes, cold)
    paths = [work / f"medium-page-cache-{k}.bin" for k in range(len(slots))]
    try:
        for path in paths:
            _write_file(path, nbytes, sync=False)
        buf = memoryview(torch.ones(slots[-1] + nbytes, dtype=torch.uint8).numpy())
        rounds = itertools.cycle(range(len(slots)))

        def read() -> None:
            k = next(rounds)
            with open(paths[k], "rb", buffering=0) as f:
                for off in range(0, nbytes, PIECE):
                    f.readinto(buf[slots[k] + off : slots[k] + min(off + PIECE, nbytes)])

        return _median_time(read)
    finally:
        for path in paths:
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


def object_get_s(sizes: Sequence[int], item: dict[str, Any], concurrency: int) -> float | None:
    """boto3 ``get_object`` of one object of each of ``sizes`` bytes, ``concurrency`` in flight (one thread
    each, on one client tuned as the object tier's own: `make_client`), bodies read whole: what the tier's
    fetch of a hit's records costs without the tier. ``item`` is the tier's config item (its endpoint, bucket
    and prefix; credentials from the AWS chain). The objects go under ``<prefix>raw-get/`` and are deleted
    afterwards. None when the bucket cannot be reached (the row then has no share)."""
    import botocore.exceptions

    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.store.tiers.object.client import make_client

    config = StoreConfig.from_dict({"tiers": [{**item, "concurrency": concurrency}]}).tiers[0]
    client = make_client(config)
    bucket, prefix = item["bucket"], f"{item.get('prefix', 'tiercache/')}raw-get/"
    names = [f"{prefix}{i}" for i in range(len(sizes))]
    block = os.urandom(max(sizes, default=0))
    pool = ThreadPoolExecutor(concurrency)
    try:
        list(pool.map(lambda n_s: client.put_object(Bucket=bucket, Key=n_s[0], Body=block[: n_s[1]]),
                      zip(names, sizes, strict=True)))

        def get() -> None:
            list(pool.map(lambda name: client.get_object(Bucket=bucket, Key=name)["Body"].read(), names))

        return _median_time(get)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
        return None
    finally:
        with contextlib.suppress(botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            list(pool.map(lambda name: client.delete_object(Bucket=bucket, Key=name), names))
        pool.shutdown()


def kv_bytes_per_layer_token(model: str, dtype: str) -> tuple[int, int] | None:
    """(layers, KV bytes per layer and token) of a model directory's config.json (a multimodal model's
    ``text_config``), or None when it does not say."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    itemsize = {"float32": 4}.get(dtype, 2)
    return layers, 2 * kv_heads * head_dim * itemsize


def raw_medium_times(nbytes: int, work: Path, redis_url: str | None = None) -> dict[str, float | None]:
    """Seconds each medium takes to move ``nbytes``: ``memory``, ``page_cache`` (from DRAM), ``memory_hot``,
    ``page_cache_hot`` (cache-hot), ``o_direct``, ``redis``."""
    work.mkdir(parents=True, exist_ok=True)
    return {
        "memory": memory_copy_s(nbytes),
        "page_cache": page_cache_read_s(nbytes, work),
        "memory_hot": memory_copy_s(nbytes, cold=False),
        "page_cache_hot": page_cache_read_s(nbytes, work, cold=False),
        "o_direct": direct_read_s(nbytes, work),
        "redis": redis_get_s(nbytes, redis_url) if redis_url else None,
    }


def drop_page_cache(directory: Path) -> int:
    """Ask the kernel to drop every file under ``directory`` from the page cache (``POSIX_FADV_DONTNEED``:
    no root needed; clean pages go, so the files are synced first). Returns how many files were advised."""
    count = 0
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count
