"""`tiercache bench tiers`: put/get throughput per tier beside a plain reference measured in the same run.

Why references: absolute GiB/s depend on the machine; the ratio to what the same machine does with a
plain torch copy (memory), a plain write+fsync / read of the same bytes (disk) or plain redis-py
SET/GET (Redis) shows what the store's format, checksums and bookkeeping cost.

Each tier is driven through a `TieredStore` holding only that tier, so the numbers are what a
connector gets. Memory puts include the store's ownership copy; disk and Redis puts pass
``owned=True`` so they measure the tier itself (the copy is the memory row). Reported numbers are
medians over ``--repeat`` runs, ours and the reference interleaved so drift hits both alike.

Arguments are checked before anything runs (argparse ``type=``: sizes, tier names, repeat count, Redis
URL; then the directory and the Redis server): a bad one is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_tiercache.shared.config import ConfigError, StoreConfig, parse_size
from vllm_tiercache.shared.store import StoreKey, TieredStore
from vllm_tiercache.tools.cli import UsageError, int_at_least, writable_directory

GIB = float(1 << 30)
TARGETS = {"memory": 0.7, "disk": 0.7, "redis": 0.8}
#: the tiers this benchmark drives, in the order of the table
TIERS = tuple(TARGETS)
#: bounds of one record size: smaller times the call overhead only, larger than 1 GiB x --repeat records
#: would not fit in memory
MIN_SIZE, MAX_SIZE = 1 << 10, 1 << 30
#: URL schemes of --redis-url (the reference is a plain redis-py client: no cluster)
REDIS_URL_SCHEMES = ("redis://", "rediss://")


def size_list(text: str) -> list[int]:
    """argparse ``type=`` of --sizes: comma-separated sizes, each from 1KiB to 1GiB, at least one."""
    allowed = 'comma-separated sizes from 1KiB to 1GiB, e.g. "1MiB,16MiB"'
    sizes = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            size = parse_size(item, "--sizes")
        except ConfigError:
            raise argparse.ArgumentTypeError(f"invalid size {item!r}; allowed: {allowed}") from None
        if not MIN_SIZE <= size <= MAX_SIZE:
            raise argparse.ArgumentTypeError(f"invalid size {item!r}; allowed: {allowed}")
        sizes.append(size)
    if not sizes:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: {allowed}")
    return sizes


def tier_list(text: str) -> list[str]:
    """argparse ``type=`` of --tiers: comma-separated names of `TIERS`, at least one (duplicates dropped)."""
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [name for name in names if name not in TIERS]
    if bad or not names:
        shown = repr(bad[0]) if bad else repr(text)
        raise argparse.ArgumentTypeError(f"invalid tier {shown}; allowed: a comma-separated list of "
                                         f"{', '.join(TIERS)}")
    return names


def redis_url(text: str) -> str:
    """argparse ``type=`` of --redis-url: a redis:// or rediss:// URL redis-py can parse."""
    from vllm_tiercache.shared.store.redis_config import check_redis_url

    if not text.startswith(REDIS_URL_SCHEMES):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: a URL starting with "
                                         f"{' or '.join(REDIS_URL_SCHEMES)}")
    try:
        check_redis_url(text, "--redis-url")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--redis-url: ")) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", help="directory for the disk tier and the reference files "
                        "(default: a temp dir, removed afterwards)")
    parser.add_argument("--redis-url", type=redis_url,
                        help="Redis to use (default: start a private redis-server)")
    parser.add_argument("--sizes", type=size_list, default="1MiB,16MiB",
                        help="comma-separated record sizes, 1KiB to 1GiB each (default %(default)s)")
    parser.add_argument("--repeat", type=int_at_least(1, 100_000), default=30,
                        help="runs per measurement, 1 or more (default %(default)s)")
    parser.add_argument("--tiers", type=tier_list, default=",".join(TIERS),
                        help=f"comma-separated tiers out of {', '.join(TIERS)} (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _usable_dir(directory: str) -> str:
    """``--dir``, created if missing; a `UsageError` naming it when it cannot be created or written."""
    writable_directory(directory, "--dir")
    return directory


def _check_redis(url: str) -> None:
    """A `UsageError` when --redis-url does not answer PING (checked before any measurement)."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=2.0)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise UsageError(f"--redis-url: cannot reach {url} ({exc}); allowed: a reachable Redis server, or "
                         "no --redis-url to start a private redis-server") from None
    finally:
        client.close()


def _median_time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(ours: Callable[[int], Any], ref: Callable[[int], Any], repeat: int) -> tuple[float, float]:
    """Median seconds of ours(i) and ref(i), interleaved, after one warm-up each."""
    ours(-1)
    ref(-1)
    a, b = [], []
    for i in range(repeat):
        a.append(_median_time(lambda i=i: ours(i)))
        b.append(_median_time(lambda i=i: ref(i)))
    return statistics.median(a), statistics.median(b)


def _row(tier: str, size: int, put: tuple[float, float], get: tuple[float, float]) -> dict[str, Any]:
    def gib(s: float) -> float:
        return round(size / s / GIB, 3)

    return {
        "tier": tier, "size": size,
        "put_gib_s": gib(put[0]), "put_ref_gib_s": gib(put[1]), "put_ratio": round(put[1] / put[0], 3),
        "get_gib_s": gib(get[0]), "get_ref_gib_s": gib(get[1]), "get_ratio": round(get[1] / get[0], 3),
        "target": TARGETS[tier],
    }


def _keys(prefix: str) -> Callable[[int], StoreKey]:
    run = uuid.uuid4().hex[:8]
    return lambda i: StoreKey(f"bench|{prefix}|{run}|{i}")


def bench_memory(size: int, repeat: int) -> dict[str, Any]:
    data = torch.randint(0, 255, (size,), dtype=torch.uint8)
    cfg = {"tiers": [{"kind": "memory", "capacity": size * (repeat + 4)}]}
    store = TieredStore(StoreConfig.from_dict(cfg))
    key = _keys("mem")
    try:
        put = _measure(lambda i: store.put(key(i), data), lambda i: data.clone(), repeat)
        get = _measure(lambda i: store.get(key(i)), lambda i: data.clone(), repeat)
    finally:
        store.close()
    return _row("memory", size, put, get)


def bench_disk(size: int, repeat: int, directory: str) -> dict[str, Any]:
    data = torch.randint(0, 255, (size,), dtype=torch.uint8)
    raw = memoryview(data.numpy())
    tier_dir = os.path.join(directory, f"tier-{uuid.uuid4().hex[:8]}")
    ref_dir = os.path.join(directory, f"ref-{uuid.uuid4().hex[:8]}")
    os.makedirs(ref_dir)
    cfg = {"tiers": [{"kind": "disk", "path": tier_dir, "capacity": size * (repeat + 4) * 2}]}
    store = TieredStore(StoreConfig.from_dict(cfg))
    key = _keys("disk")

    def ref_put(i: int) -> None:
        with open(os.path.join(ref_dir, f"{i}.bin"), "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())

    def ref_get(i: int) -> bytes:
        with open(os.path.join(ref_dir, f"{i}.bin"), "rb") as f:
            return f.read()

    try:
        put = _measure(lambda i: store.put(key(i), data, owned=True), ref_put, repeat)
        get = _measure(lambda i: store.get(key(i)), ref_get, repeat)
        assert store.get(key(0)) is not None
    finally:
        store.close()
    return _row("disk", size, put, get)


def bench_redis(size: int, repeat: int, url: str, ssl: dict[str, Any]) -> dict[str, Any]:
    import redis

    data = torch.randint(0, 255, (size,), dtype=torch.uint8)
    raw = data.numpy().tobytes()
    store = TieredStore(StoreConfig.from_dict({"tiers": [{"kind": "redis", "url": url, **ssl}]}))
    client = redis.Redis.from_url(url, **ssl)
    key = _keys("redis")
    run = uuid.uuid4().hex[:8]
    try:
        put = _measure(lambda i: store.put(key(i), data, owned=True),
                       lambda i: client.set(f"bench-ref:{run}:{i}", raw), repeat)
        get = _measure(lambda i: store.get(key(i)), lambda i: client.get(f"bench-ref:{run}:{i}"), repeat)
        if store.get(key(0)) is None:
            raise RuntimeError(f"the redis tier at {url} did not return what was put (is it reachable?)")
    finally:
        store.close()
        client.close()
    return _row("redis", size, put, get)


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    if url:
        yield url, {}
        return
    from vllm_tiercache.tools.redis_server import RedisServer

    with RedisServer() as server:
        yield server.url, server.ssl_kwargs


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = args.sizes if isinstance(args.sizes, list) else size_list(args.sizes)
    tiers = args.tiers if isinstance(args.tiers, list) else tier_list(args.tiers)
    if args.repeat < 1:
        raise UsageError(f"--repeat: invalid value {args.repeat}; allowed: an integer of at least 1")
    if args.dir and "disk" in tiers:
        _usable_dir(args.dir)
    if args.redis_url and "redis" in tiers:
        _check_redis(args.redis_url)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        directory = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="tiercache-bench-"))
        redis_conn = stack.enter_context(_redis(args.redis_url)) if "redis" in tiers else None
        for size in sizes:
            if "memory" in tiers:
                rows.append(bench_memory(size, args.repeat))
            if "disk" in tiers:
                rows.append(bench_disk(size, args.repeat, directory))
            if redis_conn is not None:
                rows.append(bench_redis(size, args.repeat, *redis_conn))
    return rows


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n} B"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'tier':<7} {'size':>7} | {'put GiB/s':>9} {'ref':>8} {'ratio':>6} | "
            f"{'get GiB/s':>9} {'ref':>8} {'ratio':>6} | target")
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = "ok" if min(r["put_ratio"], r["get_ratio"]) >= r["target"] else "BELOW"
        lines.append(
            f"{r['tier']:<7} {_fmt_size(r['size']):>7} | {r['put_gib_s']:>9.2f} {r['put_ref_gib_s']:>8.2f} "
            f"{r['put_ratio']:>6.2f} | {r['get_gib_s']:>9.2f} {r['get_ref_gib_s']:>8.2f} "
            f"{r['get_ratio']:>6.2f} | >= {r['target']:.1f} {ok}")
    lines.append("ratio = tier / reference (memory: torch clone; disk: write+fsync / read of a plain file; "
                 "redis: redis-py SET/GET)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = run_bench(args)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0
