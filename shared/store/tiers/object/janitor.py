"""The object tier's bound on ``capacity`` across every writer on every host, with no server of ours.

Design (docs/operations.md, "The object tier's capacity", says it for operators):

- Every writer keeps a **usage ledger** in the bucket (``sys/use/{writer}``): the records it read or wrote in
  the last `LEDGER_WINDOW_S` (the newest `MAX_LEDGER_ENTRIES`), digest -> unix time, one small CBOR object
  rewritten by its owner only (no two
  writers ever write one object, so no lost update needs a lock).
- One writer at a time **sweeps**: it takes the janitor lock, ``sys/janitor``, by a conditional PUT
  (``If-None-Match: *``: of writers racing for it exactly one succeeds); a lock older than `LOCK_STALE_S`
  by the server's own clock (a holder killed mid-sweep) is taken over by a PUT ``If-Match`` its ETag (again
  exactly one wins). The holder lists the prefix (sizes and write times), merges every ledger into a last
  use per record (the newest of its write and the reads), and deletes the least recently used records until
  the total is ``sweep_share`` below ``capacity``. Records of pinned tags are skipped, up to ``pin_budget``
  of capacity, while unpinned records remain (as the disk tier does); their tags come from a HEAD of each
  candidate. Ledgers not rewritten within `LEDGER_WINDOW_S` (a writer gone) are deleted.
- Each writer sweeps every ``sweep_every_s``, and sooner once it wrote ``sweep_share`` of capacity since the
  last sweep it knows of. The sweeper leaves its result in ``sys/usage`` (bytes, entries), which every
  writer reads when the lock was another's: that tells it a sweep completed, and gives every process the
  usage it reports. A writer that wrote `HARD_FACTOR` x ``sweep_share`` of capacity without learning of a
  completed sweep drops further writes (counted) until one completes, so usage passes capacity by at most
  about writers x `HARD_FACTOR` x ``sweep_share`` x capacity, even while the sweeper is slow.

Why not a usage counter every writer updates (conditional PUT on one object): every put would be a
read-modify-write round trip on one hot object, serialised across hosts. Why not the store's Redis: there
may be none, and the bucket must stay consistent alone. Why not a bucket lifecycle rule alone: it expires
by age, not by use or bytes; where records are written once and read for a fixed time (a corpus refreshed
daily), a lifecycle rule on ``{prefix}r/`` is cheaper than sweeping and can replace it (capacity then only
reports). The price of this design: a sweep lists every record (1,000 per request), so its cost grows with
the record count; ``sweep_every_s`` trades that against how far usage may pass capacity.
"""

from __future__ import annotations

import collections
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

import botocore.exceptions
import cbor2

from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tiers.object.calls import Failure, ObjectCalls
from vllm_tiercache.shared.store.tiers.object.client import CONFLICT, DOWN, ERROR, MISSING, classify, log
from vllm_tiercache.shared.store.tiers.object.config import ObjectTierConfig
from vllm_tiercache.shared.store.tiers.object.names import ObjectNames, tags_in
from vllm_tiercache.shared.threads import background_thread

#: Reads a ledger keeps (older ones are dropped; a record read longer ago ages by its write time).
LEDGER_WINDOW_S = 7 * 86400.0
#: The most entries one ledger holds (the most recent reads win): bounds its size (~40 bytes an entry).
MAX_LEDGER_ENTRIES = 200_000
#: A janitor lock this old (server time) belongs to a holder that died mid-sweep: it is taken over.
LOCK_STALE_S = 120.0
#: Tries to give the lock back (a refused DELETE is tried again).
UNLOCK_TRIES = 5
#: Candidates whose tags are read (HEAD) at once while pins are in force.
TAG_BATCH = 64
#: A writer that wrote this many times ``sweep_share`` of capacity since the last sweep it knows of (its own
#: or another writer's) drops further writes (counted) until a sweep completes: the bound holds even while
#: the sweeping writer is slow or gone.
HARD_FACTOR = 2.0
#: How many ``timeout_s`` a writer past its share waits for a sweep before it drops the put.
ADMIT_WAIT_TIMEOUTS = 4
#: Pause before a writer whose sweep is due tries the lock again (another writer held it).
RETRY_LOCK_S = 0.1


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
        self._written = 0  # bytes written since the last sweep this writer knows of
        #: (unix time, bytes) of this writer's writes counted in ``_written``: a sweep that listed the bucket
        #: at time T accounts for those before T only
        self._writes: collections.deque[tuple[float, int]] = collections.deque()
        self._usage_etag: str | None = None  # ``sys/usage`` as last seen
        self._wake = threading.Event()
        #: notified when a sweep completed (this writer's or, as `learn_usage` found, another's)
        self._swept = threading.Condition(self._lock)
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

    def admits(self) -> bool:
        """Whether this writer may write now. Past `HARD_FACTOR` x ``sweep_share`` of capacity written since
        the last sweep it knows of, the caller waits for a sweep to complete, up to `ADMIT_WAIT_TIMEOUTS` x
        ``timeout_s`` (a sweep is a few requests, each within ``timeout_s``; the
        store's background writer: backpressure on the write-behind queue, whose overflow is counted),
        and the put is dropped (counted) if none did."""
        hard = HARD_FACTOR * self.config.sweep_share * self.config.capacity
        if self._written < hard:
            return True
        self.start()
        self._wake.set()
        with self._swept:
            return self._swept.wait_for(lambda: self._written < hard or self._stop.is_set(),
                                        timeout=ADMIT_WAIT_TIMEOUTS * self.config.timeout_s
                                        ) and not self._stop.is_set()

    def wrote(self, nbytes: int, hex_digests: Iterable[str]) -> None:
        """Records were written now: they go into the ledger (an object's LastModified has whole seconds
        only, too coarse to order a batch), and past ``sweep_share`` of capacity since the last sweep,
        this writer sweeps now."""
        now = time.time()
        with self._lock:
            for h in hex_digests:
                self._reads[h] = now
            self._dirty = True
            self._written += nbytes
            self._writes.append((now, nbytes))
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
        with self._swept:
            self._swept.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.config.timeout_s * 3)

    def _due(self) -> bool:
        return self._written >= self.config.sweep_share * self.config.capacity

    def _swept_lately(self) -> bool:
        """Whether any writer completed a sweep within the last ``sweep_every_s`` (one GET of ``sys/usage``):
        every process that reads or writes runs a janitor, and without this each would list the whole
        prefix every ``sweep_every_s``, one after the other."""
        age = self.learn_usage()
        return age is not None and age < self.config.sweep_every_s

    def _loop(self) -> None:
        pause = self.config.sweep_every_s
        while not self._stop.is_set():
            self._wake.wait(pause)
            self._wake.clear()
            pause = self.config.sweep_every_s
            try:
                if not self._due() and self._swept_lately():
                    self.flush_ledger()  # another writer swept within sweep_every_s: no listing this round
                    continue
                if not self._stop.is_set() and self.sweep() is None and self._due():
                    pause = min(pause, RETRY_LOCK_S)  # another writer sweeps: look again soon
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
        endpoint failed (the next sweep tries again). Either way, a sweep another writer completed since
        the last one this writer knew of resets its count of bytes written (`admits`)."""
        self.flush_ledger()
        lock = self._take_lock()
        if lock is None:
            self.learn_usage()
            return None
        try:
            listed_at = time.time()
            result = self._sweep_locked()
            if result is not None:
                body = cbor2.dumps({"entries": result.entries, "bytes": result.bytes_used, "writer": self.writer,
                                    "listed_at": listed_at})
                put = self.calls.one("usage", lambda: self.calls.put(self.names.usage, body))
                self._usage_etag = None if isinstance(put, Failure) else put["ETag"]
        finally:
            self._unlock(lock)
        if result is not None:
            self._accounted(listed_at)
            self.last = result
            if result.evicted:
                self.counters.add(evictions=result.evicted)
        return result

    def learn_usage(self) -> float | None:
        """Read ``sys/usage``: a sweep completed since the last one seen resets the bytes written count.
        Returns how many seconds ago (the server's clock) the last sweep of any writer completed; None when
        unknown."""
        got = self._lock_call("usage", lambda: self.calls.client.get_object(Bucket=self.calls.bucket,
                                                                           Key=self.names.usage))
        if isinstance(got, Failure):
            return None
        age = (server_now(got) - got["LastModified"]).total_seconds()
        if got["ETag"] == self._usage_etag:
            return age
        try:
            usage = cbor2.loads(got["Body"].read())
            self.last = SweepResult(int(usage["entries"]), int(usage["bytes"]), 0, 0)
            listed_at = float(usage["listed_at"])
        except Exception:  # damaged: the next sweep rewrites it
            return None
        self._usage_etag = got["ETag"]
        self._accounted(listed_at)
        return age

    def _accounted(self, listed_at: float) -> None:
        """A sweep listed the bucket at ``listed_at``: this writer's writes before then are accounted for
        (another host's clock may differ by its skew: the bound is approximate by that much)."""
        with self._lock:
            while self._writes and self._writes[0][0] < listed_at:
                self._written -= self._writes.popleft()[1]
            self._written = max(0, self._written)
            self._swept.notify_all()

    def sweep_now(self, tries: int = 600) -> SweepResult | None:
        """Sweep as soon as the lock is this writer's (tests, `tiercache bench`): another writer's sweep in
        progress is waited out, `RETRY_LOCK_S` at a time, ``tries`` times at most."""
        for _ in range(tries):
            result = self.sweep()
            if result is not None or self.calls.health.down:
                return result
            time.sleep(RETRY_LOCK_S)
        return None

    def _lock_call(self, what: str, fn: Callable[[], Any]) -> Any:
        """One request on the janitor lock. Only an endpoint that is not there (no answer at all) marks the
        tier down; any refusal is an answer: the lock is not this writer's now, and the next sweep tries
        again. (SeaweedFS answers a conditional PUT that races a DELETE of the same name with a 500.)"""
        if self.calls.health.down:
            return Failure(DOWN)
        try:
            return fn()
        except botocore.exceptions.ClientError as exc:
            return Failure(classify(exc) if classify(exc) in (CONFLICT, MISSING) else ERROR, exc)
        except Exception as exc:
            return Failure(self.calls.health.failed(what, exc), exc)

    def _take_lock(self) -> str | None:
        """The lock's ETag when this writer now holds it, else None (conditional PUTs: one writer wins)."""
        body = cbor2.dumps({"writer": self.writer, "at": time.time()})
        lock = self.names.lock
        got = self._lock_call("janitor lock", lambda: self.calls.put(lock, body, IfNoneMatch="*"))
        if not isinstance(got, Failure):
            return str(got["ETag"])
        if got.kind != CONFLICT:
            return None
        head = self._lock_call("janitor lock", lambda: self.calls.head(lock))
        if isinstance(head, Failure):
            return None
        age = (server_now(head) - head["LastModified"]).total_seconds()
        if age < LOCK_STALE_S:
            return None
        taken = self._lock_call("janitor lock", lambda: self.calls.put(lock, body, IfMatch=head["ETag"]))
        if isinstance(taken, Failure):
            return None
        log.warning("tiercache object tier %s: janitor lock left %.0fs ago by a writer gone, taken over",
                    self.config.address, age)
        return str(taken["ETag"])

    def _unlock(self, etag: str) -> None:
        """Give the lock back: conditional on its ETag (a lock taken over is not ours to delete), tried
        again on a refusal, so that a lost DELETE does not stop every writer's sweeps for `LOCK_STALE_S`."""
        for _ in range(UNLOCK_TRIES):
            done = self._lock_call("janitor unlock", lambda: self.calls.delete(self.names.lock, IfMatch=etag))
            if not isinstance(done, Failure) or done.kind in (CONFLICT, MISSING, DOWN):
                return
            time.sleep(RETRY_LOCK_S)

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
            records.append((last_use(obj["LastModified"].timestamp(), reads.get(hex_digest)), obj["Key"], size))
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


def last_use(modified: float, ledger: float | None) -> float:
    """A record's last use: its ledger time when that is as new as the object (the ledger has the exact time;
    LastModified whole seconds only), else the end of the object's LastModified second (written after any
    ledger entry: counted as new as it may be, so that it is never evicted ahead of an older record)."""
    return ledger if ledger is not None and ledger >= modified else modified + 1.0


def server_now(response: dict[str, Any]) -> datetime:
    """The server's clock from a response's Date header (lock ages are measured in one clock); ours when
    it sent none."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return datetime.now().astimezone()
