"""The object tier's requests: one boto3 call at a time, or many in flight on a bounded pool of threads,
never raising for a backend problem.

Each request has the tier's own timeout (connect and each read: `client.make_client`), so a hung endpoint
costs a batch one timeout, not one per record: the first request that runs into it marks the tier down,
and every request of the batch not yet started then returns at once (a ``down`` `Failure`) without
touching the network. While the tier is down, nothing is sent at all (the prober decides when it is
back). A batch of one runs on the caller's thread (no hop onto the pool).

Why apart from the tier: the tier says what to read and write and what an answer means for a record;
this says how requests are put in flight and what a failed one means for the tier, in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import botocore.exceptions
import numpy as np

from vllm_tiercache.shared.store.tiers.object.client import DOWN, THROTTLED, classify, error_code, make_client
from vllm_tiercache.shared.store.tiers.object.config import MAX_RANGE, ObjectTierConfig
from vllm_tiercache.shared.store.tiers.object.direct import DirectRequests, read_into
from vllm_tiercache.shared.store.tiers.object.health import ObjectHealth
from vllm_tiercache.shared.threads import widen_affinity

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741


class Failure:
    """In the place of a request's answer when it failed: ``kind`` as `client.classify` says
    (``missing``, ``conflict``, ``down``, ``error``, ``bug``) and the exception (None when never sent)."""

    __slots__ = ("exc", "kind")

    def __init__(self, kind: str, exc: BaseException | None = None) -> None:
        self.kind, self.exc = kind, exc

    def __repr__(self) -> str:
        return f"Failure({self.kind}, {type(self.exc).__name__ if self.exc else None})"


#: A request never sent because the tier is down.
NOT_SENT = Failure(DOWN)


def failure_reason(failure: Failure) -> str:
    """A failed request in words for a log line or a job's report: its kind and the S3 error code or the
    exception's class (``"throttled: SlowDown"``, ``"down: ReadTimeoutError"``); never a URL or a message,
    which may carry a presigned query."""
    if failure.exc is None:
        return f"{failure.kind}: not sent, the tier is down"
    return f"{failure.kind}: {error_code(failure.exc) or type(failure.exc).__name__}"


def body_into(got: dict[str, Any], out: memoryview | None = None) -> Any:
    """A boto3 GET's body, read whole into one buffer (or ``out``): `direct.read_into`."""
    body = got["Body"]
    return read_into(getattr(body, "_raw_stream", body), got.get("ContentLength"), out,
                     encoded=bool(got.get("ContentEncoding")))


def _waited(futures: Sequence[Future[Any]]) -> Sequence[Future[Any]]:
    """``futures`` once each is done or cancelled (a closing tier cancels what has not started)."""
    wait(futures)
    return futures


class ObjectCalls:
    """The tier's boto3 client and its pool of request threads (see the module docstring)."""

    def __init__(self, config: ObjectTierConfig, health: ObjectHealth, thread_name: str) -> None:
        self.config = config
        self.bucket = config.bucket
        self.health = health
        self.client: Any = make_client(config)
        #: a record's GET and PUT and a lookup's HEAD without botocore's per-call work (`direct`), when it can
        self.direct = DirectRequests(self.client, self.bucket)
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix=thread_name,
                                        initializer=widen_affinity)
        #: Probes sent so far (tests check that none ran on a caller's thread).
        self.probes = 0

    def one(self, what: str, fn: Callable[[], T]) -> T | Failure:
        """Run one request; its answer, or a `Failure` (never raises for a backend problem)."""
        if self.health.down:
            return NOT_SENT
        try:
            result = fn()
        except Exception as exc:  # classify() decides what it means; none reaches the caller
            kind = self.health.failed(what, exc)
            return Failure(kind, exc)
        self.health.mark_up()
        return result

    def many(self, what: str, fn: Callable[[I], T], items: Sequence[I]) -> list[T | Failure]:
        """``fn(item)`` for every item, up to ``concurrency`` in flight; answers in order, a `Failure` in
        the place of each that failed or was not sent (the tier went down meanwhile)."""
        if not items:
            return []
        if len(items) == 1:
            return [self.one(what, lambda: fn(items[0]))]
        if self.health.down:
            return [NOT_SENT] * len(items)
        try:
            futures = [self._pool.submit(self.one, what, lambda item=item: fn(item)) for item in items]
        except RuntimeError:  # the pool was shut down: the tier is closing
            return [NOT_SENT] * len(items)
        return [NOT_SENT if future.cancelled() else future.result() for future in _waited(futures)]

    def map_raw(self, fn: Callable[[I], T], items: Sequence[I]) -> list[T]:
        """``fn(item)`` for every item on the pool, raising the first exception (admin commands, which must
        say when the store is unreachable instead of reporting it empty)."""
        return list(self._pool.map(fn, items))

    # ----------------------------------------------------------------------------------- requests
    def head(self, name: str) -> dict[str, Any]:
        return self.client.head_object(Bucket=self.bucket, Key=name)

    def get(self, name: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()

    def get_record(self, name: str) -> Any:
        """An object whole, read straight into one buffer (`direct`)."""
        if self.direct.available:
            return self.direct.get(name)[0]
        return body_into(self.client.get_object(Bucket=self.bucket, Key=name))

    def exists(self, name: str) -> bool:
        """HEAD of an object (`direct`); a missing one raises (a ``missing`` `Failure` in `many`)."""
        if self.direct.available:
            return self.direct.exists(name)
        self.head(name)
        return True

    def get_in_ranges(self, what: str, names: Sequence[str], part: int) -> list[Any]:
        """Each object whole (bytes, or a `Failure`), read in ranged GETs of ``part`` bytes: first every
        object's first range, all in flight; then the other ranges of the objects larger than that, all in
        flight at once, joined into one buffer per object. Why: a few large records (a 16 MiB layer) would
        otherwise be a few requests in flight, each as slow as one connection. Two flat rounds on the pool,
        never a request waiting on another inside it (which could take every thread)."""
        firsts = self.many(what, lambda name: self._first_range(name, part), names)
        # each larger object's buffer: its first range copied in, the other ranges read straight into it
        whole = {i: memoryview(np.empty(got[1], dtype=np.uint8)) for i, got in enumerate(firsts)
                 if not isinstance(got, Failure) and got[1] > len(got[0])}
        for i, view in whole.items():
            first = firsts[i][0]
            view[:len(first)] = first
        jobs = [(i, start, min(start + part, firsts[i][1]) - 1) for i in whole
                for start in range(len(firsts[i][0]), firsts[i][1], part)]
        rest = self.many(what, lambda job: self._range(names[job[0]], job[1], job[2],
                                                       whole[job[0]][job[1]:job[2] + 1]), jobs)
        failed: dict[int, Failure] = {}
        for job, got in zip(jobs, rest, strict=True):
            if isinstance(got, Failure):  # a range lost, or the object changed under the reads
                failed.setdefault(job[0], got)
        return [got if isinstance(got, Failure) else failed[i] if i in failed else whole[i] if i in whole
                else got[0] for i, got in enumerate(firsts)]

    def _first_range(self, name: str, part: int) -> tuple[bytes, int]:
        """The first ``part`` bytes of an object and its whole size (an empty object: no bytes, size 0); the
        whole object by a plain GET when ``part`` is S3's largest object size."""
        if part >= MAX_RANGE:
            body = self.get_record(name)
            return body, len(body)
        try:
            if self.direct.available:
                body, content_range = self.direct.get(name, 0, part - 1)
            else:
                got = self.client.get_object(Bucket=self.bucket, Key=name, Range=f"bytes=0-{part - 1}")
                body, content_range = body_into(got), got.get("ContentRange") or ""
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) == "InvalidRange":  # an empty object: no range of it exists
                return b"", 0
            raise
        return body, int(content_range.rsplit("/", 1)[1]) if "/" in content_range else len(body)

    def _range(self, name: str, first: int, last: int, out: memoryview) -> Any:
        """Bytes ``first`` to ``last`` of an object, read into ``out`` (a short answer: the object changed)."""
        if self.direct.available:
            return self.direct.get(name, first, last, out)[0]
        got = self.client.get_object(Bucket=self.bucket, Key=name, Range=f"bytes={first}-{last}")
        return body_into(got, out)

    def put(self, name: str, body: bytes, metadata: dict[str, str] | None = None, **conditions: str) -> dict[str, Any]:
        return self.client.put_object(Bucket=self.bucket, Key=name, Body=body, Metadata=metadata or {}, **conditions)

    def put_record(self, name: str, body: bytes | bytearray, metadata: dict[str, str]) -> None:
        """A record's PUT (unconditional: concurrent writers of one key write equal bytes), `direct`."""
        if self.direct.available:
            self.direct.put(name, body, metadata)
        else:
            self.put(name, body, metadata)

    def delete(self, name: str, **conditions: str) -> dict[str, Any]:
        return self.client.delete_object(Bucket=self.bucket, Key=name, **conditions)

    def list_names(self, prefix: str) -> Any:
        """Every object under ``prefix``: dicts with ``Key``, ``Size``, ``LastModified`` (pages of 1,000)."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            yield from page.get("Contents", ())

    def probe(self) -> bool:
        """One health check, on the prober's thread only: HEAD of the bucket answers (it exists, the
        credentials are taken). A failure is not logged again."""
        self.probes += 1
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:  # down still: the prober tries again later, without a line
            if classify(exc) != THROTTLED:
                return False  # (a store that asks to slow down is up: its callers back off, `patience`)
        return not self.health.closed

    def close(self) -> None:
        self.health.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.client.close()
        except Exception:  # closing a client with a dead connection must not fail shutdown
            pass
