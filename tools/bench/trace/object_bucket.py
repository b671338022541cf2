"""`tiercache bench trace --object-bucket`: the object tier's sweeps on a trace through a real bucket.

Why beside `object_sweep`: that replay runs the sweep's ranking functions on a simulated ledger, in seconds;
this one checks it against the tier itself. Per policy and capacity, a real `ObjectTier` (`build_store`, one
tier, its own prefix in the bucket) serves the trace as the other replays do (`replay.serve`: the store's
`contains_many`, `get_many` of the leading run found, `put_many` of the rest, each record naming its parent),
and its janitor does what it does in service: the writer's usage ledger flushed to the bucket, the janitor
lock, the listing, grants, deletes in the policy's order, ``sys/usage``. Same settings as the simulation:
``sweep_share`` (``--sweep-share``, default `object_sweep.SWEEP_SHARE`, the tier's: a sweep when half the
grant is written; a put past the grant waits for one), ``half_life`` `object_sweep.HALF_LIFE`, one writer, no pins.

Four things differ from a served tier, so that a run compares with the simulation rather than with how
fast this machine is or how the threads raced: the store's write-behind is flushed after every request,
and then the janitor is settled (`Janitor.settle`: a sweep due is done, one under way is waited out), and
its thread is not woken by writes (`Janitor.wakes_on_writes`; a put past the grant still waits for a sweep),
so no sweep lists while the replay's PUTs land. Why: such a sweep lists records its ledger (flushed first)
does not hold yet, and ranks them by LastModified, a day behind the trace's clock: the oldest, where the
simulation ranks them newest; a tiny trace's hit ratio moved by 0.024 for lru and 0.013 for prefix from run
to run on a loaded machine. Also, ``sweep_every_s`` is an hour, so sweeps come from writes alone; and the janitor's
clock (`Janitor.clock`: its ledger's uses, its writes against a listing, the listings' times, hence the
turnover) is the trace's (`TraceClock`), as the disk tier's index is in `tiers`. Why the clock: on wall time
the replay's pace (PUTs and sweeps of this machine) is the tier's sense of time, and the prefix order's
close calls (a chain read once some turnovers ago against this request's one-off blocks) went either way
from run to run: a 60-request trace's hit ratio moved by 0.04. What still differs from the simulation: ties
in last use broken by the objects' names (digests), and capacity in bytes of whole records
(`disk_record_bytes`: header, parent digest and key text included), so the low-water mark may hold one
record less than the simulation's.

Cost: a sweep lists every record (about 0.1 ms of botocore's parsing per record on this project's 2-core
machines) and rewrites the writer's ledger, so one written block costs about as much listing as ``2 /
sweep_share`` blocks listed, and at least one sweep's fixed requests (lock, ledger, usage) per half grant
(at least one record): minutes for a few hundred requests. ``--requests`` replays a leading slice.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_tiercache.tools.bench.trace.mooncake import format_tokens
from vllm_tiercache.tools.bench.trace.object_sweep import HALF_LIFE, OBJECT_POLICIES, SWEEP_SHARE
from vllm_tiercache.tools.bench.trace.replay import Asked, BlockKeys, serve
from vllm_tiercache.tools.bench.trace.tiers import disk_record_bytes

#: an hour between timed sweeps: in a replay of minutes, sweeps come from the writes (half a grant) alone
SWEEP_EVERY_S = 3600.0
#: how far ahead of wall time the trace's clock starts: a replay's ledger times must never be older than
#: its objects' LastModified (`evictions.last_use` would take the object's second instead)
CLOCK_LEAD_S = 86400.0


class TraceClock:
    """The janitor's clock in a replay (`Janitor.clock`): the current request's arrival on the trace's clock,
    in seconds from `CLOCK_LEAD_S` ahead of the replay's start, a microsecond later at each call so that uses
    keep their order (as wall time would). Called from the replay's thread and the janitor's."""

    def __init__(self) -> None:
        self.base = time.time() + CLOCK_LEAD_S
        self.now = self.last = self.base
        self._lock = threading.Lock()

    def at(self, timestamp_ms: float) -> None:
        """The next request arrives at ``timestamp_ms`` (the trace's time)."""
        with self._lock:
            self.now = self.base + timestamp_ms / 1000.0

    def __call__(self) -> float:
        with self._lock:
            self.last = max(self.last + 1e-6, self.now)
            return self.last


@dataclass
class BucketReplay:
    """One policy at one capacity through the bucket: blocks found and asked, and what the janitor did."""

    found: int
    asked: int
    #: blocks the lookup found that the read did not (deleted in between: none expected, sweeps are settled)
    lost: int
    sweeps: int
    evicted: int
    #: records the tier did not write (no room in its grant and no sweep came: none expected)
    dropped: int
    #: records the last sweep left, and its low-water mark in records
    held: int
    low_water: int
    seconds: float
    #: bytes of the writer's usage ledger at the end (every sweep rewrites it whole, every sweeper reads it)
    ledger_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.found / self.asked if self.asked else 0.0


def replay_object_bucket(traffic: Sequence[Asked], policy: str, blocks: int, record_bytes: int,
                         item: dict[str, Any], progress: Callable[[int], None] | None = None,
                         sweep_share: float = SWEEP_SHARE) -> BucketReplay:
    """``traffic`` through a real object tier of ``blocks`` records with ``policy`` and ``sweep_share``, in
    the bucket of ``item`` (an object tier's config item: endpoint, bucket) under a prefix of its own,
    deleted after."""
    import torch

    from vllm_tiercache.shared.store import build_store
    from vllm_tiercache.shared.store.tiers.object.sweeps.janitor import settle

    largest = max((b for t in traffic for b in t.blocks), default=0)
    size = disk_record_bytes(record_bytes, largest)  # an object is the record as every tier encodes it
    prefix = f"trace-{uuid.uuid4().hex[:8]}/"
    store = build_store({"tiers": [{**item, "prefix": prefix, "capacity": blocks * size, "policy": policy,
                                    "sweep_share": sweep_share, "half_life": HALF_LIFE,
                                    "sweep_every_s": SWEEP_EVERY_S, "timeout_s": 30.0}]})
    tier = store.tiers[0]
    janitor = tier.janitor
    clock = janitor.clock = TraceClock()
    janitor.wakes_on_writes = False  # sweeps between requests (`settle`) or when a put needs one (docstring)
    record = torch.empty(record_bytes, dtype=torch.uint8)
    key = BlockKeys()
    found = asked = lost = 0
    started = time.perf_counter()
    try:
        for done, request in enumerate(traffic, 1):
            clock.at(request.timestamp_ms)
            hit = serve(store, request, key, record, lambda items: store.put_many(items, owned=True))
            found += hit
            asked += len(request.blocks)
            store.flush()
            settle(janitor)
            if progress is not None and done % 256 == 0:
                progress(256)
        if progress is not None:
            progress(len(traffic) % 256)
        seconds = time.perf_counter() - started
        hits = int(tier.counters.get("hits"))
        lost = found - hits
        last = janitor.last
        result = BucketReplay(found, asked, lost, janitor.sweeps, int(tier.counters.get("evictions")),
                              int(tier.counters.get("dropped_writes")), last.entries if last else 0,
                              last.low_water // size if last else 0, seconds)
    finally:
        store.close()  # first: its janitor's last ledger write lands before the clean-up
        ledgers = _delete_prefix(item, prefix)
    result.ledger_bytes = ledgers
    return result


def _delete_prefix(item: dict[str, Any], prefix: str) -> int:
    """Delete everything the replay left under ``prefix`` (records, the ledger, ``sys/usage``, the janitor's
    marks); the bytes of the usage ledgers among them."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.store.tiers.object.client import make_client
    from vllm_tiercache.shared.store.tiers.object.names import ObjectNames

    config = StoreConfig.from_dict({"tiers": [{**item, "prefix": prefix}]}).tiers[0]
    client, bucket, names = make_client(config), item["bucket"], ObjectNames(config.prefix)
    ledgers = 0
    with ThreadPoolExecutor(config.concurrency) as pool:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=names.prefix):
            listed = page.get("Contents", ())
            ledgers += sum(int(o["Size"]) for o in listed if o["Key"].startswith(names.ledgers))
            list(pool.map(lambda o: client.delete_object(Bucket=bucket, Key=o["Key"]), listed))
    return ledgers


def bucket_cells(traffic: Sequence[Asked], blocks: int, record_bytes: int, item: dict[str, Any],
                 progress: Callable[[int], None] | None = None, sweep_share: float = SWEEP_SHARE
                 ) -> dict[str, dict[str, Any]]:
    """Per object tier policy: the bucket replay's hit ratio and what its janitor did, at ``blocks``."""
    cells = {}
    for policy in OBJECT_POLICIES:
        r = replay_object_bucket(traffic, policy, blocks, record_bytes, item, progress, sweep_share)
        cells[policy] = {"ratio": r.ratio, "sweeps": r.sweeps, "evicted": r.evicted, "lost": r.lost,
                         "dropped": r.dropped, "held": r.held, "low_water": r.low_water,
                         "ledger_bytes": r.ledger_bytes, "seconds": round(r.seconds, 1)}
    return cells


def format_bucket_table(result: dict[str, Any]) -> str:
    """Per capacity and policy: the bucket's hit ratio beside the simulated replay's (sweeps, evicted)."""
    header = ["capacity", "blocks", *(f"object {p}: bucket / simulated (sweeps, evicted)" for p in OBJECT_POLICIES),
              "prefix - lru: bucket / simulated"]
    lines, notes = [], []
    for row in result["rows"]:
        real, sim = row["object_bucket"], row["object"]
        cells = [format_tokens(row["capacity_tokens"]), str(row["capacity_blocks"])]
        for p in OBJECT_POLICIES:
            cells.append(f"{real[p]['ratio']:.4f} ({real[p]['sweeps']}, {real[p]['evicted']}) / "
                         f"{sim[p]['ratio']:.4f} ({sim[p]['sweeps']}, {sim[p]['evicted']})")
            notes.append(f"{format_tokens(row['capacity_tokens'])} {p}: {real[p]['seconds']:g} s, held "
                         f"{real[p]['held']} (low water {real[p]['low_water']}), lost {real[p]['lost']}, "
                         f"dropped {real[p]['dropped']}, ledger {real[p]['ledger_bytes'] / 1e6:.2f} MB")
        cells.append(f"{real['prefix']['ratio'] - real['lru']['ratio']:+.4f} / "
                     f"{sim['prefix']['ratio'] - sim['lru']['ratio']:+.4f}")
        lines.append(cells)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    text = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in [header, *lines]]
    text.append(f"(bucket: a real object tier on {result.get('object_bucket_at', 'a bucket')}, its janitor's "
                f"sweeps, sweep_share {result.get('sweep_share', SWEEP_SHARE):g}, settled after each request; "
                f"simulated: `--object`, the sweep's ranking on one ledger, no bucket; {result['requests']} requests)")
    text.append("Per replay: seconds, records the last sweep left and its low-water mark, blocks the lookup "
                "found and the read did not (lost), records not written (dropped), the writer's usage ledger at "
                "the end (rewritten whole by every sweep): " + "; ".join(notes))
    return "\n".join(text)
