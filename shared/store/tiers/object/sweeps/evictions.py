"""The object tier's evictions: the janitor lock, what a sweep deletes, and how every process learns of it.

Why apart from `janitor`: the janitor decides *when* and *how much* (ledgers, grants, the low-water mark);
this holds the requests every eviction makes the same way, a sweep's or `tiercache evict`'s: the lock taken
by conditional PUT, the victims chosen in last-use order with pins kept, and the marks in ``sys/usage`` and
``sys/evicted`` that keep every existence cache (`existence`) from promising what an eviction deleted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

import botocore.exceptions
import cbor2

from vllm_tiercache.shared.store.tiers.object.calls import NOT_SENT, Failure, ObjectCalls
from vllm_tiercache.shared.store.tiers.object.client import CONFLICT, DOWN, ERROR, MISSING, THROTTLED, classify, log
from vllm_tiercache.shared.store.tiers.object.names import ObjectNames, tags_in
from vllm_tiercache.shared.store.writes.patience import Backoff

#: Tries of an eviction's DELETEs that the store throttled (503 SlowDown) before the next sweep takes them:
#: with `Backoff`'s defaults, at most about 3 s of pauses.
THROTTLED_DELETE_TRIES = 5
#: Pauses between those tries (full jitter, doubling up to 1.6 s).
DELETE_BACKOFF = Backoff(cap_s=1.6)
#: A janitor lock this old (server time) belongs to a holder that died mid-sweep: it is taken over.
LOCK_STALE_S = 120.0
#: Tries to give the lock back (a refused DELETE is tried again).
UNLOCK_TRIES = 5
#: Pause before the lock is tried again (another writer held it).
RETRY_LOCK_S = 0.1
#: Tries for the lock before `tiercache evict` deletes without it (`EvictionMarks.bracket`): 10 s.
ADMIN_LOCK_TRIES = 100
#: Candidates whose tags are read (HEAD) at once while pins are in force.
TAG_BATCH = 64


def lock_call(calls: ObjectCalls, what: str, fn: Callable[[], Any]) -> Any:
    """One request on the janitor's objects. Only an endpoint that is not there (no answer at all) marks the
    tier down; any refusal is an answer: the lock is not this writer's now, and the next sweep tries
    again. (SeaweedFS answers a conditional PUT that races a DELETE of the same name with a 500.)"""
    if calls.health.down:
        return NOT_SENT
    try:
        return fn()
    except botocore.exceptions.ClientError as exc:
        kind = classify(exc)
        if kind == THROTTLED:
            calls.health.counters.add(throttled=1)
        return Failure(kind if kind in (CONFLICT, MISSING, THROTTLED) else ERROR, exc)
    except Exception as exc:
        return Failure(calls.health.failed(what, exc), exc)


def delete_backing_off(calls: ObjectCalls, names: list[str], tries: int = THROTTLED_DELETE_TRIES,
                       backoff: Backoff = DELETE_BACKOFF) -> list[Any]:
    """DELETE each name, all in flight; those the store throttled (503 SlowDown) are deleted again after a
    backoff, up to ``tries`` rounds, so that a busy store slows an eviction down instead of leaving the tier
    over capacity until the next sweep. Answers in order, a `Failure` for each that still failed."""
    done = calls.many("evict", calls.delete, names)
    delays = backoff.delays()
    for _ in range(tries - 1):
        again = [i for i, r in enumerate(done) if isinstance(r, Failure) and r.kind == THROTTLED]
        if not again or calls.health.closed:
            break
        time.sleep(next(delays))
        for i, r in zip(again, calls.many("evict", calls.delete, [names[i] for i in again]), strict=True):
            done[i] = r
    return done


class JanitorLock:
    """``sys/janitor``: one holder at a time, by conditional PUT; a holder gone is taken over when stale."""

    def __init__(self, calls: ObjectCalls, names: ObjectNames, writer: str, address: str) -> None:
        self.calls, self.names, self.writer, self.address = calls, names, writer, address

    def take(self) -> str | None:
        """The lock's ETag when this writer now holds it, else None (conditional PUTs: one writer wins)."""
        calls = self.calls
        body = cbor2.dumps({"writer": self.writer, "at": time.time()})
        lock = self.names.lock
        got = lock_call(calls, "janitor lock", lambda: calls.put(lock, body, IfNoneMatch="*"))
        if not isinstance(got, Failure):
            return str(got["ETag"])
        if got.kind != CONFLICT:
            return None
        head = lock_call(calls, "janitor lock", lambda: calls.head(lock))
        if isinstance(head, Failure):
            return None
        age = (server_now(head) - head["LastModified"]).total_seconds()
        if age < LOCK_STALE_S:
            return None
        taken = lock_call(calls, "janitor lock", lambda: calls.put(lock, body, IfMatch=head["ETag"]))
        if isinstance(taken, Failure):
            return None
        log.warning("tiercache object tier %s: janitor lock left %.0fs ago by a writer gone, taken over",
                    self.address, age)
        return str(taken["ETag"])

    def give_back(self, etag: str) -> None:
        """Conditional on its ETag (a lock taken over is not ours to delete), tried again on a refusal, so
        that a lost DELETE does not stop every writer's sweeps for `LOCK_STALE_S`."""
        for _ in range(UNLOCK_TRIES):
            done = lock_call(self.calls, "janitor unlock",
                             lambda: self.calls.delete(self.names.lock, IfMatch=etag))
            if not isinstance(done, Failure) or done.kind in (CONFLICT, MISSING, DOWN):
                return
            time.sleep(RETRY_LOCK_S)


class EvictionMarks:
    """``sys/usage``'s eviction generation and ``evicting`` mark, and ``sys/evicted`` (`existence`)."""

    def __init__(self, calls: ObjectCalls, names: ObjectNames, writer: str) -> None:
        self.calls, self.names, self.writer = calls, names, writer

    def usage_object(self) -> dict[str, Any] | Failure:
        """``sys/usage`` (the GET's answer, a `Failure` when absent or unreadable)."""
        calls = self.calls
        return lock_call(calls, "usage", lambda: calls.client.get_object(Bucket=calls.bucket, Key=self.names.usage))

    def previous_usage(self) -> dict[str, Any]:
        """``sys/usage`` as the last sweep left it ({} when absent or damaged: this sweep rewrites it)."""
        got = self.usage_object()
        if isinstance(got, Failure):
            return {}
        try:
            usage = cbor2.loads(got["Body"].read())
            return {k: v for k, v in usage.items() if k != "evicting"} if isinstance(usage, dict) else {}
        except Exception:
            return {}

    def generation(self) -> str | None:
        """The eviction generation in ``sys/usage`` (one GET): "" before any sweep wrote one; None while an
        eviction is in progress, or when it cannot be read (nothing cached is answered then)."""
        got = self.usage_object()
        if isinstance(got, Failure):
            return "" if got.kind == MISSING else None
        try:
            usage = cbor2.loads(got["Body"].read())
            return None if usage.get("evicting") else str(usage.get("generation") or "")
        except Exception:  # damaged: the next sweep rewrites it
            return None

    def evicted_between(self) -> tuple[str, str, list[str] | None] | None:
        """``sys/evicted``: (generation before, generation after, the digests that eviction deleted; None
        when not known), or None when unreadable (a cache at the first generation drops only those)."""
        got = lock_call(self.calls, "evicted", lambda: self.calls.get(self.names.evicted))
        if isinstance(got, Failure):
            return None
        try:
            change = cbor2.loads(got)
            digests = change.get("digests")
            return (str(change["from"]), str(change["to"]),
                    None if digests is None else [bytes(d).hex() for d in digests])
        except Exception:  # damaged: every cache drops everything
            return None

    def record_evicted(self, before: str, after: str, names: list[str] | None) -> None:
        """Before the new generation is written to ``sys/usage``: which digests went from ``before`` to
        ``after`` (None: not known, e.g. `tiercache evict`; caches then drop everything)."""
        digests = None if names is None else [
            bytes.fromhex(h) for h in (self.names.digest_of(n) for n in names) if h is not None]
        body = cbor2.dumps({"from": before, "to": after, "digests": digests})
        self.calls.one("evicted", lambda: self.calls.put(self.names.evicted, body))

    def mark_evicting(self, previous: dict[str, Any]) -> None:
        """Before deleting records: ``sys/usage`` says an eviction is in progress (the last sweep's figures
        kept), so that no lookup answers from its existence cache until the new generation is written."""
        body = cbor2.dumps({**previous, "evicting": self.writer})
        self.calls.one("usage", lambda: self.calls.put(self.names.usage, body))

    def bracket(self, lock: JanitorLock, delete: Callable[[], Any]) -> Any:
        """Run ``delete`` (records deleted outside a sweep: `tiercache evict`) between an ``evicting`` mark and
        a new generation in ``sys/usage``, holding the janitor lock when it comes within `ADMIN_LOCK_TRIES`
        tries (else without it: the marks still empty every existence cache)."""
        etag = None
        for _ in range(ADMIN_LOCK_TRIES):
            etag = lock.take()
            if etag is not None or self.calls.health.down:
                break
            time.sleep(RETRY_LOCK_S)
        previous = self.previous_usage()
        try:
            self.mark_evicting(previous)
            return delete()
        finally:
            generation = uuid.uuid4().hex
            self.record_evicted(str(previous.get("generation") or ""), generation, None)
            body = cbor2.dumps({**previous, "generation": generation})
            self.calls.one("usage", lambda: self.calls.put(self.names.usage, body))
            if etag is not None:
                lock.give_back(etag)


def choose_victims(calls: ObjectCalls, records: list[tuple[float, str, int]], total: int, target: int,
                   pins: frozenset[str], budget: float) -> tuple[list[tuple[str, int]], int]:
    """The records to delete, oldest use first, until ``total`` is at most ``target``: records of ``pins``
    (tags read by HEAD) are kept, up to ``budget`` bytes, while unpinned ones remain (the disk tier's rule)."""
    victims: list[tuple[str, int]] = []
    skipped: list[tuple[str, int]] = []
    protected = 0
    pos = 0
    while pos < len(records) and total > target:
        batch = records[pos:pos + TAG_BATCH]
        pos += len(batch)
        tags = (calls.many("sweep tags", lambda name: calls.head(name), [n for _, n, _ in batch])
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
