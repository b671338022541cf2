"""The janitor: one writer's usage ledger, its grant, and the capacity sweeps it runs or learns of (the
design, and why it bounds usage: this package's docstring; grants and the low-water mark: `grants`; the
order: `order`; the ledgers: `ledger`; the lock and eviction marks: `evictions`).
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone

import cbor2

from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tiers.object.calls import Failure, ObjectCalls
from vllm_tiercache.shared.store.tiers.object.client import MISSING, log
from vllm_tiercache.shared.store.tiers.object.config import ObjectTierConfig
from vllm_tiercache.shared.store.tiers.object.names import ObjectNames
from vllm_tiercache.shared.store.tiers.object.sweeps.evictions import (
    RETRY_LOCK_S,
    EvictionMarks,
    JanitorLock,
    choose_victims,
    delete_backing_off,
    server_now,
)
from vllm_tiercache.shared.store.tiers.object.sweeps.grants import (
    ADMIT_WAIT_TIMEOUTS,
    FALLBACK_SHARES,
    SweepResult,
    active_seconds,
    grant_size,
    leading_fit,
    low_water_mark,
    positive,
)
from vllm_tiercache.shared.store.tiers.object.sweeps.ledger import MergedLedgers, UsageLedger, read_ledgers
from vllm_tiercache.shared.store.tiers.object.sweeps.order import half_life_s, lru_order, prefix_order, sweep_turnover
from vllm_tiercache.shared.threads import background_thread


def new_writer_id() -> str:
    """This writer's name in the bucket: host, process and a random part (a restarted process is new)."""
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Janitor:
    """One writer's usage ledger, grant and capacity sweeps (see the module docstring); a daemon thread,
    started by the tier's first read or write (an admin command that only lists never starts one)."""

    def __init__(self, config: ObjectTierConfig, names: ObjectNames, calls: ObjectCalls, counters: TierCounters,
                 pins: Callable[[], frozenset[str]], thread_name: str) -> None:
        self.config = config
        self.names = names
        self.calls = calls
        self.counters = counters
        self._pins = pins
        self._thread_name = thread_name
        self.writer = new_writer_id()
        self.lock = JanitorLock(calls, names, self.writer, config.address)
        self.marks = EvictionMarks(calls, names, self.writer)
        self.active_s = active_seconds(config)
        self._lock = threading.Lock()
        self._ledger = UsageLedger()  # this writer's ledger (last use, count and parent per record)
        self._dirty = False
        #: bytes written after the ``listed_at`` of the last sweep this writer knows of, and (unix time, bytes)
        #: of each of those writes (a sweep that listed the bucket at time T accounts for those before T)
        self._written = 0
        self._writes: collections.deque[tuple[float, int]] = collections.deque()
        self._reserved = 0  # bytes admitted and not yet written (or failed)
        #: bytes this writer may write after ``_epoch`` (the last sweep's ``listed_at`` it knows); None: none
        self._grant: int | None = None
        self._epoch = 0.0
        #: a grant counts only from a sweep that listed after this time (set when a stale ledger is rewritten)
        self._grant_after = 0.0
        self._wants_since: float | None = None  # last time this writer asked to write (its ledger says so)
        #: the largest record this writer asked to write (its ledger says so: a sweep grants room for two),
        #: and when a ledger saying so was written (a grant from a sweep before then may be too small)
        self._largest = 0
        self._largest_told_at = float("inf")
        self._flushed_at: float | None = None  # when the ledger was last rewritten (our clock, before the PUT)
        self._warned_large = False
        self._waiting = 0  # puts waiting in `admit` for room: a sweep is due
        #: `_epoch` when a wait in `admit` last ran out: until a newer sweep is learned, `admit` does not wait
        #: again but admits within the fallback allowance (`FALLBACK_SHARES`)
        self._gave_up_at: float | None = None
        self._warned_fallback = False
        self._usage_etag: str | None = None  # ``sys/usage`` as last seen
        self._wake = threading.Event()
        #: notified when a sweep completed (this writer's or, as `learn_usage` found, another's) or the
        #: ledger was rewritten
        self._swept = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the last sweep's figures (None before one ran): ``usage()`` reads these, never the network
        self.last: SweepResult | None = None
        self.sweeps = 0  # sweeps this writer completed (`tiercache bench trace --object-bucket` reports them)
        #: the clock of ledger uses, of this writer's writes against a sweep's ``listed_at``, and of listings
        #: (the turnover): wall time; a replay on a trace's clock sets one never behind wall time (the ledger
        #: must be as new as LastModified: `evictions.last_use`), `tiercache bench trace --object-bucket`
        self.clock: Callable[[], float] = time.time
        #: whether a write past half the grant wakes the thread; a replay sweeps between requests (`settle`)
        self.wakes_on_writes = True

    # ------------------------------------------------------------------------------------ the hot path
    def read(self, hex_digests: Iterable[str]) -> None:
        """Records were read now: they go into this writer's ledger at its next flush."""
        now = self.clock()
        with self._lock:
            self._ledger.read(hex_digests, now)
            self._dirty = True
        self.start()

    @property
    def grant(self) -> int | None:
        """Bytes this writer may write after the last sweep it knows of (None: it has no grant)."""
        return self._grant

    def admit(self, sizes: Sequence[int]) -> int:
        """How many of the leading records of ``sizes`` (bytes each) this writer may write now; their bytes
        are reserved until `wrote` releases them. With no room left in its grant (or no grant) it wakes its
        janitor and waits for a sweep, up to `ADMIT_WAIT_TIMEOUTS` x ``timeout_s`` (the store's background
        writer: backpressure on the write-behind queue, whose overflow is counted); 0 when none came, or
        when the first record is larger than a whole grant (warned once: raise capacity or sweep_share)."""
        if not sizes:
            return 0
        self.start()
        deadline = time.monotonic() + ADMIT_WAIT_TIMEOUTS * self.config.timeout_s
        with self._swept:
            self._wants_since = time.time()
            if max(sizes) > self._largest:
                self._largest = max(sizes)
                self._largest_told_at = float("inf")
                self._dirty = True
            while not self._stop.is_set():
                self._check_fresh()
                if self._grant is not None:
                    n, total = leading_fit(sizes, self._grant - self._written - self._reserved)
                    if n:  # past half the grant, `wrote` wakes the janitor once these landed (not now: why there)
                        self._reserved += total
                        return n
                    if self._written + self._reserved == 0 and sizes[0] > self._grant and \
                            self._epoch >= self._largest_told_at:  # the sweep knew of it: it never fits
                        self._warn_large(sizes[0])
                        return 0
                self._wake.set()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._gave_up_at == self._epoch:
                    self._gave_up_at = self._epoch
                    return self._fallback(sizes)
                self._waiting += 1
                try:
                    self._swept.wait(remaining)
                finally:
                    self._waiting -= 1
        return 0

    def _fallback(self, sizes: Sequence[int]) -> int:
        """(Lock held.) No sweep came: how many of the leading records fit in the fallback allowance, the larger
        of `FALLBACK_SHARES` x ``sweep_share`` of capacity and this writer's grant, less what it wrote since the
        last sweep it knows of and what it has in flight (reserved as `admit` reserves)."""
        allowance = max(int(FALLBACK_SHARES * self.config.sweep_share * self.config.capacity), self._grant or 0)
        n, total = leading_fit(sizes, allowance - self._written - self._reserved)
        self._reserved += total
        if n and not self._warned_fallback:
            self._warned_fallback = True
            log.warning("tiercache object tier %s: no capacity sweep came within %gs; writing within %g x "
                        "sweep_share of capacity until one does (logged once)", self.config.address,
                        ADMIT_WAIT_TIMEOUTS * self.config.timeout_s, FALLBACK_SHARES)
        return n

    def wrote(self, reserved: int, written: int, records: Iterable[tuple[str, str | None]]) -> None:
        """Admitted records were written now (``written`` of the ``reserved`` bytes; the rest failed): each
        written one (digest hex, parent digest hex or None) goes into the ledger (an object's LastModified has
        whole seconds only, too coarse to order a batch). Past half the grant, the janitor is woken here, once
        the batch landed, and not when it was admitted: a sweep woken then listed the batch's records before
        its ledger (flushed first) had them, ranking them roots as new as the end of their LastModified
        second, and left the writes that landed after its listing counted in the grant, so the next sweep
        came sooner (`tiercache bench trace --object-bucket`: 4-17% more sweeps than one per half grant on the
        Mooncake slice)."""
        now = self.clock()
        with self._lock:
            self._ledger.wrote(records, now)
            self._dirty = True
            self._reserved = max(0, self._reserved - reserved)
            if written:
                self._written += written
                self._writes.append((now, written))
            due = self._due() and self.wakes_on_writes
        if due:
            self._wake.set()

    def _check_fresh(self) -> None:
        """(Lock held.) A writer admits only while its ledger is younger than half of ``active_s``: any sweep
        then counts it active and reserves its grant. Past a quarter, the ledger is rewritten; past half,
        the grant is void until a sweep that listed after the ledger was rewritten grants a new one."""
        now = time.time()
        age = now - self._flushed_at if self._flushed_at is not None else float("inf")
        if age >= self.active_s / 4:
            self._dirty = True
            self._wake.set()
        if age >= self.active_s / 2 and self._grant is not None:
            self._grant = None
            self._grant_after = float("inf")  # set by the rewrite (`flush_ledger`)

    def _warn_large(self, size: int) -> None:
        if not self._warned_large:
            self._warned_large = True
            log.warning("tiercache object tier %s: a record of %d bytes is larger than this writer's grant of %d "
                        "bytes (capacity x sweep_share, shared by the active writers): it is dropped; raise "
                        "capacity or sweep_share", self.config.address, size, self._grant)

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
        """Whether this writer needs a sweep now: it asked to write lately, and it has no grant, or used half
        of it, or its ledger needs rewriting."""
        if self._wants_since is None or time.time() - self._wants_since > self.active_s:
            return False
        if self._grant is None or self._waiting:
            return True
        return self._written + self._reserved >= self._grant / 2

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
            if self._stop.is_set():  # woken by `close`: no usage GET to an endpoint that may be gone already
                break
            self._wake.clear()
            pause = self.config.sweep_every_s
            try:
                if not self._due() and self._swept_lately():
                    self.flush_ledger()  # another writer swept within sweep_every_s: no listing this round
                    continue
                if not self._stop.is_set():
                    if self.sweep() is None:
                        if self._due():
                            pause = min(pause, RETRY_LOCK_S)  # another writer sweeps: look again soon
                    else:
                        self._wake.clear()  # wakes that asked for the sweep just done
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
            started = time.time()
            self._ledger.trim(started)
            self._dirty = False
            largest = self._largest
            body = self._ledger.encode({"writer": self.writer, "writing_at": self._wants_since,
                                        "largest": largest})
        done = self.calls.one("ledger", lambda: self.calls.put(self.names.ledger(self.writer), body))
        with self._swept:
            if isinstance(done, Failure):
                self._dirty = True
                return False
            if self._grant_after == float("inf"):
                self._grant_after = started
            if largest == self._largest and self._largest_told_at == float("inf"):
                self._largest_told_at = started
            self._flushed_at = started
            self._swept.notify_all()
        return True

    def merged_reads(self, now: datetime | None = None) -> dict[str, float]:
        """Every writer's reads merged (digest hex -> newest read); deletes ledgers of writers gone.
        Raises what the listing raises (the admin side reports it)."""
        return read_ledgers(self.calls, self.names, self.active_s, now).reads

    # ---------------------------------------------------------------------------------------- sweep
    def sweep(self) -> SweepResult | None:
        """One sweep, when this writer gets the janitor lock; None when another writer holds it or the
        endpoint failed (the next sweep tries again). Either way, a sweep another writer completed since
        the last one this writer knew of gives it its new grant (`admit`)."""
        self.flush_ledger()
        lock = self._take_lock()
        if lock is None:
            self.learn_usage()
            return None
        try:
            result = self._sweep_locked()
            if result is not None:
                body = cbor2.dumps({"entries": result.entries, "bytes": result.bytes_used, "writer": self.writer,
                                    "listed_at": result.listed_at, "low_water": result.low_water,
                                    "grants": result.grants, "generation": result.generation,
                                    "half_life_s": result.half_life_s, "turnover_s": result.turnover_s})
                put = self.calls.one("usage", lambda: self.calls.put(self.names.usage, body))
                self._usage_etag = None if isinstance(put, Failure) else put["ETag"]
        finally:
            self._unlock(lock)
        if result is not None:
            self._learn(result.listed_at, result.grants, result.half_life_s, result.entries)
            self.last = result
            self.sweeps += 1
            if result.evicted:
                self.counters.add(evictions=result.evicted)
        return result

    def learn_usage(self) -> float | None:
        """Read ``sys/usage``: a sweep completed since the last one seen gives this writer its new grant and
        resets its count of bytes written. Returns how many seconds ago (the server's clock) the last sweep
        of any writer completed; None when unknown."""
        got = self.marks.usage_object()
        if isinstance(got, Failure):
            return None
        age = (server_now(got) - got["LastModified"]).total_seconds()
        if got["ETag"] == self._usage_etag:
            return age
        try:
            usage = cbor2.loads(got["Body"].read())
            if usage.get("evicting"):  # a sweep deletes now: its result comes after
                return None
            listed_at = float(usage["listed_at"])
            grants = {str(w): int(g) for w, g in (usage.get("grants") or {}).items()}
            half_life = positive(usage.get("half_life_s"))  # absent from an lru sweep's, or an older build's
            held = int(usage["entries"])
            self.last = SweepResult(held, int(usage["bytes"]), 0, 0,
                                    int(usage.get("low_water") or 0), grants, listed_at,
                                    str(usage.get("generation") or ""), half_life)
        except Exception:  # damaged: the next sweep rewrites it
            return None
        self._usage_etag = got["ETag"]
        self._learn(listed_at, grants, half_life, held)
        return age

    def _learn(self, listed_at: float, grants: dict[str, int], half_life: float | None, held: int) -> None:
        """A sweep listed the bucket at ``listed_at``, granted ``grants`` and left ``held`` records: this
        writer's writes before then are accounted for (another host's clock may differ by its skew: the bound
        is approximate by that much), and its grant is the one the sweep gave it (none when it was not active
        then); its ledger's counts decay by the sweep's ``half_life`` (None: an ``lru`` sweep, the last one
        known is kept), and its next rewrite keeps entries for a few times ``held`` (`ledger.ledger_bound`:
        beyond that they are history of records long evicted, rewritten at every sweep for nothing)."""
        with self._swept:
            if listed_at < self._epoch:
                return  # an older sweep than one already learned
            if half_life is not None:
                self._ledger.half_life_s = half_life
            self._ledger.learn(held, listed_at)
            self._epoch = listed_at
            while self._writes and self._writes[0][0] < listed_at:
                self._written -= self._writes.popleft()[1]
            self._written = max(0, self._written)
            granted = grants.get(self.writer)
            self._grant = granted if granted is not None and listed_at >= self._grant_after else None
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

    def _take_lock(self) -> str | None:
        return self.lock.take()

    def _unlock(self, etag: str) -> None:
        self.lock.give_back(etag)

    def _sweep_locked(self) -> SweepResult | None:
        """Read the ledgers (uses, active writers), then list the records, grant each active writer its share
        and evict records in the order of ``policy`` (`order`) down to the low-water mark. The ledgers are read
        first: a writer whose ledger this sweep finds stale stopped admitting before it lists."""
        now = datetime.now(tz=timezone.utc)
        ledgers = self.calls.one("ledgers", lambda: read_ledgers(self.calls, self.names, self.active_s, now))
        if isinstance(ledgers, Failure):  # every record known by its write alone
            ledgers = MergedLedgers(active={self.writer}, largest=self._largest)
        previous_usage = self.marks.previous_usage()
        listed_at = self.clock()
        listed = self.calls.one("sweep", lambda: list(self.calls.list_names(self.names.records)))
        if isinstance(listed, Failure):
            return None
        candidates = []
        total, active, largest = 0, ledgers.active, ledgers.largest
        for obj in listed:
            hex_digest = self.names.digest_of(obj["Key"])
            if hex_digest is None:
                continue
            size = int(obj["Size"])
            total += size
            largest = max(largest, size)
            candidates.append(ledgers.candidate(hex_digest, obj["Key"], size, obj["LastModified"].timestamp()))
        turnover = sweep_turnover(previous_usage, total, listed_at, self.config.capacity, candidates)
        half_life = half_life_s(turnover, self.config.half_life) if self.config.policy == "prefix" else None
        capacity = self.config.capacity
        share = grant_size(capacity, self.config.sweep_share, len(active), largest)
        low_water = low_water_mark(capacity, share, active, previous_usage)
        evicted: list[tuple[str, int]] = []
        victims: list[tuple[str, int]] = []
        if total > low_water:
            records = lru_order(candidates) if half_life is None else prefix_order(candidates, half_life)
            pins = self._pins()
            budget = self.config.pin_budget * capacity if pins else 0
            victims, _ = choose_victims(self.calls, records, total, low_water, pins, budget)
            if victims:
                self.marks.mark_evicting(previous_usage)
            done = delete_backing_off(self.calls, [name for name, _ in victims])
            evicted = [(name, size) for (name, size), r in zip(victims, done, strict=True)
                       if not isinstance(r, Failure) or r.kind == MISSING]
            total -= sum(size for _, size in evicted)
        if total > low_water and active:  # deletes failed: what is left above usage is shared out instead
            share = min(share, max(0, capacity - total) // len(active))
        # a new generation once anything may have been deleted (a failed DELETE may have deleted all the same)
        generation = str(previous_usage.get("generation") or "")
        if victims:
            generation, before = uuid.uuid4().hex, generation
            self.marks.record_evicted(before, generation, [name for name, _ in victims])
        return SweepResult(len(candidates) - len(evicted), total, len(evicted), sum(s for _, s in evicted), low_water,
                           dict.fromkeys(sorted(active), share), listed_at, generation, half_life, turnover)


def settle(janitor: Janitor, tries: int = 600) -> None:
    """Return once ``janitor``'s writer is not due for a sweep (half its grant written, or none), sweeping here
    while it is; a sweep under way (its own thread's, another writer's) holds the lock and is waited out,
    `RETRY_LOCK_S` at a time. For `tiercache bench trace --object-bucket`: its next request must not overlap a
    sweep, as in the simulated replay it is compared with. (Beside the class, which holds the tier's own work.)"""
    for _ in range(tries):
        with janitor._lock:
            if not janitor._due():
                return
        if janitor.sweep() is None:
            if janitor.calls.health.down:
                return
            time.sleep(RETRY_LOCK_S)
