"""The object tier's bound on ``capacity`` across every writer on every host, with no server of ours.

Design (docs/operations.md, "The object tier's capacity", says it for operators):

- Every writer keeps a **usage ledger** in the bucket (``sys/use/{writer}``): the records it read in the
  last `LEDGER_WINDOW_S`, digest -> unix time, one small CBOR object rewritten by its owner only (no two
  writers ever write one object, so no lost update needs a lock).
- One writer at a time **sweeps**: it takes the janitor lock, ``sys/janitor``, by a conditional PUT
  (``If-None-Match: *``: of writers racing for it exactly one succeeds); a lock older than `LOCK_STALE_S`
  by the server's own clock (a holder killed mid-sweep) is taken over by a PUT ``If-Match`` its ETag (again
  exactly one wins). The holder lists the prefix (sizes and write times), merges every ledger into a last
  use per record (the newest of its write and the reads), and deletes the least recently used records until
  the total is ``sweep_share`` below ``capacity``. Records of pinned tags are skipped, up to ``pin_budget``
  of capacity, while unpinned records remain (as the disk tier does); their tags come from a HEAD of each
  candidate. Ledgers not rewritten within `LEDGER_WINDOW_S` (a writer gone) are deleted.
- Each writer sweeps every ``sweep_every_s``, and sooner once it wrote ``sweep_share`` of capacity since its
  last sweep, so usage passes capacity by at most about writers x ``sweep_share`` x capacity between sweeps.

Why not a usage counter every writer updates (conditional PUT on one object): every put would be a
read-modify-write round trip on one hot object, serialised across hosts. Why not the store's Redis: there
may be none, and the bucket must stay consistent alone. Why not a bucket lifecycle rule alone: it expires
by age, not by use or bytes; where records are written once and read for a fixed time (a corpus refreshed
daily), a lifecycle rule on ``{prefix}r/`` is cheaper than sweeping and can replace it (capacity then only
reports). The price of this design: a sweep lists every record (1,000 per request), so its cost grows with
the record count; ``sweep_every_s`` trades that against how far usage may pass capacity.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import cbor2

from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tiers.object.calls import Failure, ObjectCalls
from vllm_tiercache.shared.store.tiers.object.client import CONFLICT, MISSING, log
from vllm_tiercache.shared.store.tiers.object.config import ObjectTierConfig
from vllm_tiercache.shared.store.tiers.object.names import ObjectNames, tags_in
from vllm_tiercache.shared.threads import background_thread

#: Reads a ledger keeps (older ones are dropped; a record read longer ago ages by its write time).
LEDGER_WINDOW_S = 7 * 86400.0
#: The most entries one ledger holds (the most recent reads win): bounds its size (~40 bytes an entry).
MAX_LEDGER_ENTRIES = 200_000
#: A janitor lock this old (server time) belongs to a holder that died mid-sweep: it is taken over.
LOCK_STALE_S = 300.0
#: Candidates whose tags are read (HEAD) at once while pins are in force.
TAG_BATCH = 64


@dataclass
class SweepResult:
    """What one sweep found and did."""

    entries: int
    bytes_used: int
    evicted: int
    evicted_bytes: int


def new_writer_id() -> str:
    """This writer's name in the bucket: host, process and a random part (a restarted process is new)."""
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Janitor:
    """One writer's usage ledger and capacity sweeps (see the module docstring); a daemon thread, started
    by the tier's first read or write (an admin command that only lists never starts one)."""

    def __init__(self, config: ObjectTierConfig, names: ObjectNames, calls: ObjectCalls, counters: TierCounters,
                 pins: Callable[[], frozenset[str]], thread_name: str) -> None:
        self.config = config
        self.names = names
        self.calls = calls
        self.counters = counters
        self._pins = pins
        self._thread_name = thread_name
        self.writer = new_writer_id()
        self._lock = threading.Lock()
        self._reads: dict[str, float] = {}  # this writer's ledger: digest hex -> unix time of its last read
        self._dirty = False
        self._written = 0  # bytes written since the last sweep
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the last sweep's figures (None before one ran): ``usage()`` reads these, never the network
        self.last: SweepResult | None = None

    # ------------------------------------------------------------------------------------ the hot path
    def read(self, hex_digests: Iterable[str]) -> None:
        """Records were read now: they go into this writer's ledger at its next flush."""
        now = time.time()
        with self._lock:
            for h in hex_digests:
                self._reads[h] = now
            self._dirty = True
        self.start()

    def wrote(self, nbytes: int) -> None:
        """Bytes were written: past ``sweep_share`` of capacity since the last sweep, sweep now."""
        with self._lock:
            self._written += nbytes
            due = self._written >= self.config.sweep_share * self.config.capacity
        self.start()
        if due:
            self._wake.set()

    def start(self) -> None:
        if self._thread is None and not self._stop.is_set():
            with self._lock:
                if self._thread is None:
                    self._thread = background_thread(self._loop, self._thread_name, beside_forward=True)
                    self._thread.start()

    def close(self) -> None:
        """Stop the thread (after flushing the ledger once more, when the endpoint is up)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.config.timeout_s * 3)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.sweep_every_s)
            self._wake.clear()
            try:
                self.flush_ledger()
                if not self._stop.is_set():
                    self.sweep()
            except Exception as exc:  # a bug must not end the thread (the tier would grow without bound)
                self.calls.health.other_error("janitor", exc)
        try:
            self.flush_ledger()
        except Exception:  # closing: nothing left to tell
            pass

    # --------------------------------------------------------------------------------------- ledger
    def flush_ledger(self) -> bool:
        """Write this writer's ledger when it changed; True when written (or nothing to write)."""
        with self._lock:
            if not self._dirty:
                return True
            horizon = time.time() - LEDGER_WINDOW_S
            reads = {h: t for h, t in self._reads.items() if t >= horizon}
            if len(reads) > MAX_LEDGER_ENTRIES:
                reads = dict(sorted(reads.items(), key=lambda item: item[1])[-MAX_LEDGER_ENTRIES:])
            self._reads = reads
            self._dirty = False
            body = cbor2.dumps({"writer": self.writer, "reads": {bytes.fromhex(h): t for h, t in reads.items()}})
        done = self.calls.one("ledger", lambda: self.calls.put(self.names.ledger(self.writer), body))
        if isinstance(done, Failure):
            with self._lock:
                self._dirty = True
            return False
        return True

    def merged_reads(self, now: datetime | None = None) -> dict[str, float]:
        """Every writer's reads merged (digest hex -> newest read); deletes ledgers of writers gone.
        Raises what the listing raises (the admin side reports it)."""
        now = now or datetime.now(tz=timezone.utc)
        merged: dict[str, float] = {}
        for obj in self.calls.list_names(self.names.ledgers):
            if (now - obj["LastModified"]).total_seconds() > LEDGER_WINDOW_S:
                self.calls.one("ledger clean-up", lambda name=obj["Key"]: self.calls.delete(name))
                continue
            raw = self.calls.one("ledger", lambda name=obj["Key"]: self.calls.get(name))
            try:
                reads = cbor2.loads(raw)["reads"] if not isinstance(raw, Failure) else {}
                for digest, t in reads.items():
                    h = digest.hex()
                    if t > merged.get(h, 0.0):
                        merged[h] = float(t)
            except Exception:  # a damaged or foreign ledger: its reads are not known, records age by writes
                continue
        return merged

    # ---------------------------------------------------------------------------------------- sweep
    def sweep(self) -> SweepResult | None:
        """One sweep, when this writer gets the janitor lock; None when another writer holds it or the
        endpoint failed (the next sweep tries again)."""
        with self._lock:
            self._written = 0
        lock = self._take_lock()
        if lock is None:
            return None
        try:
            result = self._sweep_locked()
        finally:
            self.calls.one("janitor unlock", lambda: self.calls.delete(self.names.lock, IfMatch=lock))
        if result is not None:
            self.last = result
            if result.evicted:
                self.counters.add(evictions=result.evicted)
        return result

    def _take_lock(self) -> str | None:
        """The lock's ETag when this writer now holds it, else None (conditional PUTs: one writer wins)."""
        body = cbor2.dumps({"writer": self.writer, "at": time.time()})
        got = self.calls.one("janitor lock", lambda: self.calls.put(self.names.lock, body, IfNoneMatch="*"))
        if not isinstance(got, Failure):
            return str(got["ETag"])
        if got.kind != CONFLICT:
            return None
        head = self.calls.one("janitor lock", lambda: self.calls.head(self.names.lock))
        if isinstance(head, Failure):
            return None
        age = (server_now(head) - head["LastModified"]).total_seconds()
        if age < LOCK_STALE_S:
            return None
        taken = self.calls.one("janitor lock", lambda: self.calls.put(self.names.lock, body, IfMatch=head["ETag"]))
        if isinstance(taken, Failure):
            return None
        log.warning("tiercache object tier %s: janitor lock left %.0fs ago by a writer gone, taken over",
                    self.config.address, age)
        return str(taken["ETag"])

    def _sweep_locked(self) -> SweepResult | None:
        """List, merge the ledgers, evict the least recently used records past capacity."""
        listed = self.calls.one("sweep", lambda: list(self.calls.list_names(self.names.records)))
        if isinstance(listed, Failure):
            return None
        now = datetime.now(tz=listed[0]["LastModified"].tzinfo) if listed else None
        records: list[tuple[float, str, int]] = []  # (last use, name, bytes)
        total = 0
        reads = self.calls.one("ledgers", lambda: self.merged_reads(now)) if now is not None else {}
        if isinstance(reads, Failure):  # records age by their write times this once
            reads = {}
        for obj in listed:
            hex_digest = self.names.digest_of(obj["Key"])
            if hex_digest is None:
                continue
            size = int(obj["Size"])
            total += size
            records.append((max(obj["LastModified"].timestamp(), reads.get(hex_digest, 0.0)), obj["Key"], size))
        capacity = self.config.capacity
        target = int(capacity * (1.0 - self.config.sweep_share))
        if total <= capacity:
            return SweepResult(len(records), total, 0, 0)
        records.sort()
        victims, total = self._choose(records, total, target)
        done = self.calls.many("evict", lambda name: self.calls.delete(name), [name for name, _ in victims])
        evicted = [(name, size) for (name, size), r in zip(victims, done, strict=True)
                   if not isinstance(r, Failure) or r.kind == MISSING]
        gone = sum(size for _, size in victims) - sum(size for _, size in evicted)
        return SweepResult(len(records) - len(evicted), total + gone, len(evicted), sum(s for _, s in evicted))

    def _choose(self, records: list[tuple[float, str, int]], total: int, target: int
                ) -> tuple[list[tuple[str, int]], int]:
        """The records to delete, oldest use first, until ``total`` is at most ``target``: records of pinned
        tags are kept, up to ``pin_budget`` of capacity, while unpinned ones remain (the disk tier's rule)."""
        pins = self._pins()
        budget = self.config.pin_budget * self.config.capacity if pins else 0
        victims: list[tuple[str, int]] = []
        skipped: list[tuple[str, int]] = []
        protected = 0
        pos = 0
        while pos < len(records) and total > target:
            batch = records[pos:pos + TAG_BATCH]
            pos += len(batch)
            tags = (self.calls.many("sweep tags", lambda name: self.calls.head(name), [n for _, n, _ in batch])
                    if budget else [None] * len(batch))
            for (_, name, size), head in zip(batch, tags, strict=True):
                if total <= target:
                    break
                pinned = bool(budget) and isinstance(head, dict) and not pins.isdisjoint(
                    tags_in(head.get("Metadata") or {}))
                if pinned and protected + size <= budget:
                    protected += size
                    skipped.append((name, size))
                    continue
                victims.append((name, size))
                total -= size
        for name, size in skipped:
            if total <= target:
                break
            victims.append((name, size))  # nothing unpinned was left: pinned records go too, oldest first
            total -= size
        return victims, total


def server_now(response: dict[str, Any]) -> datetime:
    """The server's clock from a response's Date header (lock ages are measured in one clock); ours when
    it sent none."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return datetime.now().astimezone()
