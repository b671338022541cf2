"""The object tier's usage ledgers: what one writer saw of each record, and every writer's merged for a sweep.

Each writer keeps one ledger, ``sys/use/{writer}``, rewritten by its owner only (`janitor` says why). One CBOR
map; the fields:

- ``writer``, ``writing_at`` (when it last asked to write), ``largest`` (the largest record it asked to
  write): the janitor's grants.
- ``reads``: digest (16 bytes) -> unix time of the record's last use by this writer (a read, or its write).
  Every build reads and writes it so.
- ``counts`` (new): digest -> the record's access count by this writer, decayed as of that last use; absent
  for a count of 1. A write of a record this writer's ledger does not hold counts `order.NEWCOMER` (0.1),
  every read and every rewrite 1.
- ``parents`` (new): digest -> parent digest, for records this writer wrote whose meta names a parent
  (`vllm_tiercache.shared.eviction.lineage`).

Size: the writer rewrites its ledger whole at every sweep, and every sweeper reads it, so it keeps the most
recent uses of a few times the records the last sweep left (`ledger_bound`), not every record touched in the
window: the entries beyond what the bucket holds are ghosts, records evicted lately that count a return if
written again. Nothing in the format changes: an older build reads a bounded ledger as any other.

Versions sharing a bucket: an older build reads ``reads`` only (CBOR maps: the new fields are keys it never
asks for), so its sweeps order by last use as before; a ledger of an older build has no ``counts`` and no
``parents``: its records count 1 access each, as roots (`read_ledgers`).

Why decayed counts and not counts within the window: a ledger keeps an entry for `LEDGER_WINDOW_S` after
its last use, a week, so a raw count would hold a record read a thousand times last week ten half-lives
above one read twice today (the LFU trap the memory policy's decay avoids). Each writer decays its counts
with the half-life in seconds the last sweep it learned of measured (``half_life_s`` in ``sys/usage``:
`order.half_life_s`), none before it knows one. The sweeper sums the writers' counts of a record, each as
of its own writer's last use: approximate by the decay between two writers' last uses of one record,
which is small next to the half-life (it is a fraction of the tier's turnover). On the Mooncake trace
(docs/benchmarks-kv.md, "the object tier's order") windowed counts replayed a little ahead at 0.3M and 1M
tokens and behind at 3M: no reason there to take the LFU trap.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import cbor2

from vllm_tiercache.shared.store.tiers.object.calls import Failure, ObjectCalls
from vllm_tiercache.shared.store.tiers.object.names import ObjectNames
from vllm_tiercache.shared.store.tiers.object.sweeps.evictions import last_use
from vllm_tiercache.shared.store.tiers.object.sweeps.order import NEWCOMER, Candidate

#: Reads a ledger keeps (older ones are dropped; a record read longer ago ages by its write time).
LEDGER_WINDOW_S = 7 * 86400.0
#: The most entries one ledger holds (the most recent uses win): bounds its size (~40 bytes an entry, ~60
#: with a count, ~95 with a parent too) before it knows of a sweep, and always.
MAX_LEDGER_ENTRIES = 200_000
#: Once it knows of a sweep, a ledger keeps the most recent uses of this many times the records that sweep
#: left (`ledger_bound`). Why bound it by the bucket: every sweep rewrites the ledger whole, and a week of
#: records touched is not what the bucket holds (on the Mooncake slice of docs/benchmarks-kv.md, 1.36 MB of
#: ledger for a bucket of 1,171 records, ~0.6 GB of ledger rewritten for 21 MB of records). Why more than
#: one: the entries beyond what the bucket holds are its ghosts (ARC's ghost lists), records evicted lately
#: whose rewrite counts a return (one access) rather than a newcomer (`NEWCOMER`), and a record held for its
#: count may be older than many newer one-offs. Why 8: measured on the Mooncake trace (docs/benchmarks-kv.md,
#: "the object tier's ledger bounded by the bucket"), ``prefix`` kept its hit ratio at 8 (within 0.0005) at
#: every capacity, lost 0.017 at 4 (1M tokens: a record that comes back after four capacities of writes is
#: worth keeping above newcomers) and fell to ``lru``'s at 1.
GHOST_FACTOR = 8
#: The fewest entries a bound leaves (a bucket nearly empty, or of a few large records): ~85 KB of ledger.
MIN_LEDGER_ENTRIES = 1_000


def ledger_bound(held: int | None) -> int:
    """The most entries a ledger keeps when the last sweep it knows of left ``held`` records (None: it knows
    of none): `GHOST_FACTOR` x ``held``, at least `MIN_LEDGER_ENTRIES`, at most `MAX_LEDGER_ENTRIES`."""
    if held is None:
        return MAX_LEDGER_ENTRIES
    return min(MAX_LEDGER_ENTRIES, max(MIN_LEDGER_ENTRIES, int(GHOST_FACTOR * max(0, held))))


class UsageLedger:
    """One writer's ledger in memory: per record (digest hex) its last use, decayed count and parent. Not
    thread-safe: the janitor calls it under its lock."""

    def __init__(self) -> None:
        self.uses: dict[str, float] = {}  # digest hex -> unix time of its last use
        self.counts: dict[str, float] = {}  # digest hex -> access count, decayed as of that last use
        self.parents: dict[str, str] = {}  # digest hex -> parent digest hex (records this writer wrote)
        #: the half-life counts decay by, seconds (the last sweep's, `order.half_life_s`); None: no decay yet
        self.half_life_s: float | None = None
        #: records the last sweep this writer knows of left (``entries`` in ``sys/usage``), and when it listed
        #: them (this ledger's clock): `trim` keeps `ledger_bound` of the first, and every use since the second
        self.held: int | None = None
        self.listed_at = -math.inf

    def _touch(self, h: str, now: float, weight: float) -> None:
        last = self.uses.get(h)
        count = self.counts.get(h, 0.0)
        if last is not None and self.half_life_s:
            count *= 2.0 ** (-max(0.0, now - last) / self.half_life_s)
        self.counts[h] = count + weight
        self.uses[h] = max(now, last or now)

    def read(self, hex_digests: Iterable[str], now: float) -> None:
        """Records were read at ``now``: one access each."""
        for h in hex_digests:
            self._touch(h, now, 1.0)

    def wrote(self, written: Iterable[tuple[str, str | None]], now: float) -> None:
        """Records (digest hex, parent digest hex or None) were written at ``now``: a record this ledger does
        not hold is a newcomer (`NEWCOMER`), one it holds comes back (one access)."""
        for h, parent in written:
            self._touch(h, now, 1.0 if h in self.uses else NEWCOMER)
            if parent is not None:
                self.parents[h] = parent

    def learn(self, held: int, listed_at: float) -> None:
        """A sweep listed the bucket at ``listed_at`` and left ``held`` records: the next `trim` bounds by it."""
        self.held = held
        self.listed_at = listed_at

    def trim(self, now: float) -> None:
        """Drop uses older than `LEDGER_WINDOW_S`, and the oldest beyond `ledger_bound` of the records the
        last known sweep left. Uses since that sweep listed are kept whatever the bound: they are records
        the next sweep lists (written since) or counts it ranks by (read since), and a bucket filling from
        empty holds more than its last sweep left."""
        horizon = now - LEDGER_WINDOW_S
        uses = {h: t for h, t in self.uses.items() if t >= horizon}
        keep = ledger_bound(self.held)
        if len(uses) > keep:
            keep = min(MAX_LEDGER_ENTRIES, max(keep, sum(1 for t in uses.values() if t >= self.listed_at)))
        if len(uses) > keep:
            uses = dict(heapq.nlargest(keep, uses.items(), key=lambda item: item[1]))
        if len(uses) != len(self.uses):
            self.counts = {h: c for h, c in self.counts.items() if h in uses}
            self.parents = {h: p for h, p in self.parents.items() if h in uses}
        self.uses = uses

    def encode(self, header: dict[str, Any]) -> bytes:
        """The ledger object: ``header`` (writer, writing_at, largest) and the three maps (module docstring)."""
        return cbor2.dumps({**header, "reads": {bytes.fromhex(h): t for h, t in self.uses.items()},
                            "counts": {bytes.fromhex(h): c for h, c in self.counts.items() if c != 1.0},
                            "parents": {bytes.fromhex(h): bytes.fromhex(p) for h, p in self.parents.items()}})

    def candidate(self, digest: str, name: str, size: int, written: float) -> Candidate:
        """``digest``, written at ``written``, as a sweep would rank it from this ledger alone (`tiercache bench
        trace --object`): one the ledger forgot (`trim`) is known by its write alone, as in `MergedLedgers`."""
        return Candidate(digest, name, size, self.uses.get(digest, written), self.counts.get(digest, NEWCOMER),
                         self.parents.get(digest))


@dataclass
class MergedLedgers:
    """Every writer's ledger merged: per record its newest use, summed counts and parent; the writers."""

    reads: dict[str, float] = field(default_factory=dict)  # digest hex -> newest use by any writer
    counts: dict[str, float] = field(default_factory=dict)  # digest hex -> sum of the writers' counts
    parents: dict[str, str] = field(default_factory=dict)  # digest hex -> parent digest hex
    #: writers with a ledger rewritten within ``active_s`` that asked to write within it (`read_ledgers`)
    active: set[str] = field(default_factory=set)
    largest: int = 0  # the largest record the active writers asked to write

    def add(self, ledger: dict[Any, Any]) -> None:
        """One ledger's uses, counts and parents (raises on a damaged one: nothing of it is then known)."""
        counts = ledger.get("counts")
        parents = ledger.get("parents")
        counts = counts if isinstance(counts, dict) else {}
        parents = parents if isinstance(parents, dict) else {}
        uses = []
        for digest, t in ledger["reads"].items():
            count = counts.get(digest, 1.0)
            ok = isinstance(count, (int, float)) and math.isfinite(count) and count > 0
            parent = parents.get(digest)
            uses.append((digest.hex(), float(t), float(count) if ok else 1.0,
                         parent.hex() if isinstance(parent, bytes) and parent else None))
        for h, t, count, parent in uses:
            if t > self.reads.get(h, 0.0):
                self.reads[h] = t
            self.counts[h] = self.counts.get(h, 0.0) + count
            if parent is not None:
                self.parents[h] = parent

    def candidate(self, digest: str, name: str, size: int, modified: float) -> Candidate:
        """A listed record (``modified``: its LastModified) as the sweep ranks it: a record no ledger holds
        is known by its write alone (`NEWCOMER`)."""
        return Candidate(digest, name, size, last_use(modified, self.reads.get(digest)),
                         self.counts.get(digest, NEWCOMER), self.parents.get(digest))


def read_ledgers(calls: ObjectCalls, names: ObjectNames, active_s: float, now: datetime | None = None
                 ) -> MergedLedgers:
    """Every writer's ledger merged (`MergedLedgers`), the active writers (a ledger rewritten within
    ``active_s``, `janitor.active_seconds`, whose owner asked to write within it; one that cannot be read
    counts as active: a grant too many costs room, a grant too few the bound) and the largest record they
    asked to write; deletes ledgers of writers gone."""
    now = now or datetime.now(tz=timezone.utc)
    merged = MergedLedgers()
    for obj in calls.list_names(names.ledgers):
        age = (now - obj["LastModified"]).total_seconds()
        if age > LEDGER_WINDOW_S:
            calls.one("ledger clean-up", lambda name=obj["Key"]: calls.delete(name))
            continue
        writer = obj["Key"][len(names.ledgers):]
        raw = calls.one("ledger", lambda name=obj["Key"]: calls.get(name))
        try:
            ledger = cbor2.loads(raw) if not isinstance(raw, Failure) else None
            writing_at = ledger.get("writing_at") if ledger is not None else now.timestamp()
            if age <= active_s and writing_at is not None and \
                    float(writing_at) >= now.timestamp() - active_s:
                merged.active.add(writer)
                merged.largest = max(merged.largest, int(ledger.get("largest") or 0) if ledger is not None else 0)
            if ledger is not None:
                merged.add(ledger)
        except Exception:  # a damaged or foreign ledger: its uses are not known, records age by writes
            if age <= active_s:
                merged.active.add(writer)
            continue
    return merged
