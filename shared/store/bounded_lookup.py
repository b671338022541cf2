"""`BoundedLookup`: one remote tier's lookup thread, so a scheduler's lookup waits a bounded time.

Why its own module: `vllm_tiercache.shared.store.tiered` (the store, which uses it for every tier that
declares `RemoteTier`) explains the budget; this is the thread that keeps it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from vllm_tiercache.shared.store.api import StoreKey, Tier
from vllm_tiercache.shared.threads import background_thread


class BoundedLookup:
    """One remote tier's lookup thread: runs one ``contains_many`` at a time; the caller waits a bounded time.

    Why one thread and one call at a time: a call that hangs holds the thread until the tier's own timeout,
    and lookups queued behind it would only pile up (each answered late, as a miss anyway). So while a call
    is outstanding, `ask` answers None (not asked) at once. The thread is a daemon; a hung call never delays
    the process's exit.

    Why started with the store, not on first use: ``Thread.start`` returns only once the new thread has run,
    and on a loaded machine that took up to 0.5 s (2 cores, load 14): the first lookup, on the scheduler's
    thread, waited that long past a 30 ms budget (tests/kv/test_lookup_budget.py, seen in the serial pass).
    """

    def __init__(self, tier: Tier, on_error: Callable[[Tier, str, BaseException], None]) -> None:
        self.tier = tier
        self._on_error = on_error
        self._cond = threading.Condition()
        self._job: _LookupJob | None = None
        self._busy = False
        self._closed = False
        #: Lookups answered "miss" because the budget ran out, and because a call was still outstanding.
        self.past_budget = 0
        self.busy = 0
        self._thread = background_thread(self._loop, f"tiercache-lookup-{tier.name}")
        self._thread.start()

    def ask(self, keys: Sequence[StoreKey], timeout_s: float) -> list[bool] | None:
        """The tier's answer if it comes within ``timeout_s``; None when it did not, or was not asked."""
        with self._cond:
            if self._closed:
                return None
            if self._busy:
                self.busy += 1
                self.tier.counters.add(lookups_skipped=1)
                return None
            self._busy = True
            job = self._job = _LookupJob(list(keys))
            self._cond.notify()
        if job.done.wait(max(timeout_s, 0.0)):
            return job.result
        with self._cond:
            self.past_budget += 1
        self.tier.counters.add(lookups_past_budget=1)
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                job, self._job = self._job, None
            try:
                job.result = self.tier.contains_many(job.keys)
            except Exception as exc:  # a tier bug: a miss plus a log line, as inline
                self._on_error(self.tier, "contains_many", exc)
            finally:
                with self._cond:  # free before done: a caller that got its answer may ask again at once
                    self._busy = False
                    self._cond.notify_all()
                job.done.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is outstanding (one a caller stopped waiting for included); False if one still
        is after ``timeout_s``. For a tool that closes the tier next and must not leave the call running
        against what it tears down (`tiercache bench lookups`); the scheduler never waits here."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _LookupJob:
    __slots__ = ("done", "keys", "result")

    def __init__(self, keys: list[StoreKey]) -> None:
        self.keys = keys
        self.result: list[bool] | None = None
        self.done = threading.Event()
