"""Background writer: one thread that drains a bounded queue of slower-tier writes.

Why: a put must return as fast as the fastest tier; disk fsyncs and Redis round trips happen here.
Why bounded and non-blocking: when slower tiers cannot keep up, dropping a cache write costs a future
miss, while blocking would stall vLLM's forward pass. Drops are counted per tier (`dropped_writes`).
Urgent writes (a prefill/decode hand-off's records, which another engine is waiting for) go ahead of the
queued ones, in their own batches, and are never dropped for a full queue.

A patient writer (``patience_s`` > 0: a batch job's store, `vllm_tiercache.shared.store.writes.patience`) is the
other way round: a full queue makes `submit` wait (the job's forward pass slows down to what the store
takes), and what a tier leaves unwritten is put again after a backoff instead of being dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from vllm_tiercache.shared.store.api import Item, Tier
from vllm_tiercache.shared.store.writes.patience import put_patiently
from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)

#: Called with a job's items once every tier of the job has been written (or has failed).
DoneCallback = Callable[[Sequence[Item]], None]
Job = tuple[Sequence[Tier], Sequence[Item], DoneCallback | None]
#: What a batch's (tier, items) groups become before they are written (`BackgroundWriter`'s ``prepare``).
Prepare = Callable[[list[tuple[Tier, list[Item]]]], list[tuple[Tier, list[Item]]]]
#: At most this many queued jobs are merged into one batched `put_many` per tier.
MAX_BATCH = 32
#: Put on the queue to wake the writer for an urgent job (which waits in its own deque).
_WAKE = ("wake", (), None)


class BackgroundWriter:
    """Queue of (tiers, items) jobs; `submit` never blocks; `flush` waits for everything submitted."""

    def __init__(self, maxsize: int, name: str = "tiercache-writer", prepare: Prepare | None = None,
                 patience_s: float = 0.0) -> None:
        #: turns each batch's (tier, items) groups into what the tiers store (a sealing store seals them)
        self._prepare = prepare
        #: > 0: a full queue makes `submit` wait, and unwritten records are put again (module docstring)
        self.patience_s = patience_s
        #: set on close: a patient wait ends at once
        self._closing = threading.Event()
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize)
        self._urgent: deque[Job] = deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._stopped = False
        self._thread = background_thread(self._loop, name, beside_forward=True)
        self._thread.start()

    def submit(self, tiers: Sequence[Tier], items: Sequence[Item], on_done: DoneCallback | None = None, *,
               urgent: bool = False) -> bool:
        """Queue a write of ``items`` to ``tiers``; False (and counted as dropped) when the queue is full.

        ``on_done(items)`` runs on the writer thread after the write, only for a job that was queued.
        ``urgent``: written before every job queued and not yet taken (never dropped for a full queue).
        """
        if not tiers or not items:
            return True
        if self._stopped:
            self._count_dropped(tiers, items)
            return False
        with self._cond:
            self._pending += 1
        if urgent:
            self._urgent.append((tiers, items, on_done))
            if self._queue.empty():  # the writer may be waiting on the queue: wake it
                try:
                    self._queue.put_nowait(_WAKE)  # type: ignore[arg-type]
                except queue.Full:
                    pass
            return True
        try:
            if self.patience_s > 0:  # a batch job: wait for room (the writer always drains, patiently)
                self._queue.put((tiers, items, on_done))
            else:
                self._queue.put_nowait((tiers, items, on_done))
        except queue.Full:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
            self._count_dropped(tiers, items)
            return False
        return True

    @staticmethod
    def _count_dropped(tiers: Sequence[Tier], items: Sequence[Item]) -> None:
        for tier in tiers:
            tier.counters.add(dropped_writes=len(items))

    def _take_urgent(self) -> list[Job]:
        jobs: list[Job] = []
        while self._urgent and len(jobs) < MAX_BATCH:
            jobs.append(self._urgent.popleft())
        return jobs

    def _loop(self) -> None:
        while True:
            if urgent := self._take_urgent():
                self._run(urgent)
                with self._cond:
                    self._pending -= len(urgent)
                    self._cond.notify_all()
                continue
            job = self._queue.get()
            if job is None:
                return
            jobs = [] if job is _WAKE else [job]
            stop = False
            while len(jobs) < MAX_BATCH and not self._urgent:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                if nxt is not _WAKE:
                    jobs.append(nxt)
            self._run(jobs)
            with self._cond:
                self._pending -= len(jobs)
                self._cond.notify_all()
            if stop:
                return

    def _run(self, jobs: list[Job]) -> None:
        by_tier: dict[int, tuple[Tier, list[Item]]] = {}
        for tiers, items, _ in jobs:
            for tier in tiers:
                by_tier.setdefault(id(tier), (tier, []))[1].extend(items)
        groups = list(by_tier.values())
        if self._prepare is not None:
            try:
                groups = self._prepare(groups)
            except Exception as exc:  # nothing is written unsealed: the batch is dropped, counted
                for tier, items in groups:
                    tier.counters.add(errors=1, dropped_writes=len(items))
                log.exception("tiercache writer: preparing a batch failed: %s", exc)
                groups = []
        for tier, items in groups:
            start = time.perf_counter()
            try:
                put_patiently(tier, items, self.patience_s, stop=self._closing)
            except Exception as exc:  # a tier bug must not kill the writer thread
                tier.counters.add(errors=1, dropped_writes=len(items))
                log.exception("tiercache writer: %s tier put failed: %s", tier.name, exc)
            tier.counters.add(write_seconds=time.perf_counter() - start)
        for _, items, on_done in jobs:
            if on_done is not None:
                try:
                    on_done(items)
                except Exception as exc:  # a callback bug must not kill the writer thread either
                    log.exception("tiercache writer: completion callback failed: %s", exc)

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job is written; False if ``timeout`` seconds passed first. A patient
        writer waits its patience longer: its writes may be waiting out a tier."""
        deadline = None if timeout is None else time.monotonic() + timeout + self.patience_s
        with self._cond:
            while self._pending > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush (a patient writer: its patience longer), then stop the thread: what a patient writer still
        waits for then is given up. Returns whether everything was written."""
        done = self.flush(timeout)
        self._closing.set()
        if not self._stopped:
            self._stopped = True
            try:
                self._queue.put(None, timeout=1.0)
            except queue.Full:
                pass
            self._thread.join(timeout=5.0)
        return done
