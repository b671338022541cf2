"""Replaying a trace's store traffic through a real store of a memory tier and a disk tier (`build_store`),
and optionally a shared Redis tier behind them (`shared_tier`: a private redis-server bounded to its share).

Why beside `replay`: the memory tier alone answers "which blocks to keep in memory"; an operator sizes
the pair, and the disk tier decides by its own rules (an LRU over its cross-process LMDB index, a record
evicted with its descendants: `vllm_tiercache.shared.store.tiers.disk.capacity`). Same traffic rules as
`replay` (`contains_many` of the store, `get_many` of the leading run found, `put_many` of the rest, each
block a record naming its parent), through the store's real read path: a disk hit is promoted into memory.

Two arrangements of the pair (`ARRANGEMENTS`): ``write-through`` (the disk's default admission, ``always``:
every put is written to disk too, so memory holds copies of what disk holds) and ``exclusive`` (the disk's
admission ``evicted``: a put stays in memory, and memory's evictions are written down to disk,
`vllm_tiercache.shared.store.writes.demotion`).

With a Redis tier behind (``--shared-share``), Redis is written through in both arrangements (a shared tier
is there for the other instances: every put reaches it), and evicts by its own ``maxmemory-policy``. The
store's read path promotes a Redis hit into memory (at once) and into the disk (through the background
writer, whatever the disk's admission: an exclusive disk then holds a copy of what memory holds).

Three settings differ from a serving store, so that the replay is deterministic and says what the
policies do rather than how the threads race: the slower tier's writes are waited for after every
request (`TieredStore.flush`: the write queue never drops), a disk read refreshes its record's access
time at every read instead of at most once a minute (`bookkeeping.ATIME_REFRESH_NS`: a replay runs in
seconds what the trace spread over 17 minutes, so the minute would turn the disk's LRU into FIFO), and
the disk index's clock is the trace's (`TraceClock`: the time a server at the trace's pace would see; the
``lru`` order's keys, whatever the replay's speed; the ``prefix`` order runs on bytes and needs no clock).
The disk's policy is ``disk_policy`` (the tier's default, ``prefix``, or ``lru``: the order before it).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_tiercache.tools.bench.trace.replay import Asked, BlockKeys, serve
from vllm_tiercache.tools.bench.trace.shared_tier import SharedTier

#: arrangement -> the disk tier's admission section
ARRANGEMENTS: dict[str, dict[str, str]] = {"write-through": {"policy": "always"}, "exclusive": {"policy": "evicted"}}


@dataclass
class TierSplit:
    """A combined capacity split between the tiers, in blocks (``shared_blocks``: Redis's; 0: no Redis)."""

    memory_blocks: int
    disk_blocks: int
    shared_blocks: int = 0

    @classmethod
    def of(cls, blocks: int, disk_share: float) -> TierSplit:
        """``disk_share`` of ``blocks`` on disk (at least one block each), the rest in memory."""
        disk = min(blocks - 1, max(1, round(blocks * disk_share)))
        return cls(max(1, blocks - disk), max(1, disk))

    @classmethod
    def of_three(cls, blocks: int, disk_share: float, shared_share: float) -> TierSplit:
        """``shared_share`` of ``blocks`` in Redis, the rest split as `of` says (at least one block each)."""
        shared = min(blocks - 2, max(1, round(blocks * shared_share)))
        pair = cls.of(max(2, blocks - shared), disk_share)
        return cls(pair.memory_blocks, pair.disk_blocks, max(1, shared))


@dataclass
class TiersResult:
    """Blocks found (the leading runs the lookups said are held), of the blocks asked, and how many of them
    each tier served (the tiers' own hit counters: ``memory + disk (+ redis) == found`` checks that the store
    was asked what we think; with Redis, ``partial`` is the records its reads found with a piece evicted
    (the tier's ``partial`` counter: Redis evicted part of a record, `shared_tier`) and ``corrupt`` the
    damaged ones (none expected); ``redis_stats``: the server's evictions."""

    found: int
    memory: int
    disk: int
    asked: int
    seconds: float
    redis: int = 0
    partial: int = 0
    corrupt: int = 0
    redis_misses: int = 0
    redis_stats: dict[str, int] | None = None

    def ratio(self, found: int) -> float:
        return found / self.asked if self.asked else 0.0


class TraceClock:
    """The disk index's clock in a replay: the current request's arrival (ns), one ns later at each call so
    that touches keep their order (as wall time would), counted from an epoch as far from 0 as wall time's
    (the ``prefix`` order's byte clock starts at it, and a newcomer's key lies before it)."""

    EPOCH_NS = 1_700_000_000_000_000_000

    def __init__(self) -> None:
        self.now_ns = self.last = self.EPOCH_NS

    def at(self, timestamp_ms: float) -> None:
        """The next request arrives at ``timestamp_ms`` (the trace's time)."""
        self.now_ns = self.EPOCH_NS + int(timestamp_ms * 1_000_000)

    def __call__(self) -> int:
        self.last = max(self.last + 1, self.now_ns)
        return self.last


def disk_record_bytes(record_bytes: int, largest_block: int) -> int:
    """The file size of one block's record on disk (payload, header, the parent's digest, the key text of the
    largest block id): the disk tier's capacity is in file bytes, the memory tier's in payload bytes."""
    import torch

    from vllm_tiercache.shared.eviction.lineage import PARENT_KEY
    from vllm_tiercache.shared.store import records
    from vllm_tiercache.shared.store.api import StoreKey

    key = StoreKey(f"trace|{largest_block}")
    return records.encode(key, torch.empty(record_bytes, dtype=torch.uint8), {PARENT_KEY: key.digest}).nbytes


def replay_memory_disk(traffic: Sequence[Asked], memory_policy: str, split: TierSplit, record_bytes: int,
                       progress: Callable[[int], None] | None = None, arrangement: str = "write-through",
                       shared: SharedTier | None = None, disk_policy: str = "prefix") -> TiersResult:
    """``traffic`` through a real store: memory (``memory_policy``) then disk (``disk_policy``), in a fresh
    temp directory, the disk admitting as ``arrangement`` says (`ARRANGEMENTS`); then, given ``shared``, its
    Redis server emptied and bounded to ``split.shared_blocks`` records."""
    import torch

    import vllm_tiercache.shared.store.tiers.disk.bookkeeping as bookkeeping
    from vllm_tiercache.shared.store import build_store

    largest = max((b for t in traffic for b in t.blocks), default=0)
    disk_bytes = split.disk_blocks * disk_record_bytes(record_bytes, largest)
    record = torch.empty(record_bytes, dtype=torch.uint8)
    key = BlockKeys()

    refresh = bookkeeping.ATIME_REFRESH_NS
    bookkeeping.ATIME_REFRESH_NS = 0
    try:
        with tempfile.TemporaryDirectory(prefix="tiercache-trace-") as directory:
            store = build_store({"tiers": [
                {"kind": "memory", "capacity": split.memory_blocks * record_bytes, "policy": memory_policy},
                {"kind": "disk", "path": directory, "capacity": disk_bytes, "fsync": False,
                 "policy": disk_policy, "admission": ARRANGEMENTS[arrangement]},
                *([shared.bound(split.shared_blocks)] if shared is not None else [])]})
            memory_tier, disk_tier = store.tiers[:2]
            clock = disk_tier._index.clock = TraceClock()
            try:
                asked = found = 0
                started = time.perf_counter()
                for done, request in enumerate(traffic, 1):
                    clock.at(request.timestamp_ms)
                    found += serve(store, request, key, record, lambda items: store.put_many(items, owned=True))
                    asked += len(request.blocks)
                    store.flush()
                    if progress is not None and done % 256 == 0:
                        progress(256)
                if progress is not None:
                    progress(len(traffic) % 256)
                seconds = time.perf_counter() - started
                result = TiersResult(found, int(memory_tier.counters.get("hits")),
                                     int(disk_tier.counters.get("hits")), asked, seconds)
                if shared is not None:
                    redis_tier = store.tiers[2]
                    result.redis = int(redis_tier.counters.get("hits"))
                    result.partial = int(redis_tier.counters.get("partial"))
                    result.corrupt = int(redis_tier.counters.get("corrupt"))
                    result.redis_misses = int(redis_tier.counters.get("misses"))
                    result.redis_stats = shared.stats()
                return result
            finally:
                store.close()
    finally:
        bookkeeping.ATIME_REFRESH_NS = refresh
