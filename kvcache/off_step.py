"""`OffStepJob`: the scheduler side's slow questions run beside the engine step, one at a time.

Why: vLLM calls ``take_events`` inside every engine step, on the thread that schedules. What the KV cache
events need from the shared tiers (has the disk or Redis got every record of a chunk yet, is an
announced chunk still there) is file-system and network work: done inline it
was most of what events cost per step, and a slow or hung Redis would stretch every step it ran in.
So the event tracker hands that work to one background thread and applies the answer on a later step
(the next one, when the thread is done by then).

Why one job at a time: a job is a batch of lookups sized for one step; while one is out, the tracker
posts nothing new (its state says what is still to ask), so a tier that hangs holds one thread, never a
queue of stale questions. The lookups on this thread wait for the tier's answer instead of taking the
scheduler's bounded lookup thread, which stays free for requests.

``inline=True`` runs each job at once, in the caller: the tracker's logic step by step, in tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)


class OffStepJob:
    """At most one job in flight on a daemon thread; its answer is applied by the caller (`apply_done`)."""

    def __init__(self, name: str, *, inline: bool = False) -> None:
        self.name = name
        self.inline = inline
        self._cond = threading.Condition()
        self._work: Callable[[], Any] | None = None
        self._apply: Callable[[Any], None] | None = None
        self._result: Any = None
        self._failed = False
        self._state = "idle"  # idle -> queued -> running -> done -> (apply_done) idle
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        """Nothing in flight and no answer waiting to be applied: a new job may be posted."""
        with self._cond:
            return self._state == "idle"

    @property
    def settled(self) -> bool:
        """`idle`, read without the lock (one attribute read: the step's fast path). Only the caller's
        thread moves the state back to idle, so a True here stays true until it posts; a False may be a
        job that finished a moment ago, seen on the next call."""
        return self._state == "idle"

    def submit(self, work: Callable[[], Any], apply: Callable[[Any], None]) -> bool:
        """Run ``work()`` off the step; ``apply(result)`` runs in the caller's `apply_done` after it finished.
        False (nothing posted) while another job is out or after `close`. Inline: both run now."""
        if self.inline:
            apply(work())
            return True
        with self._cond:
            if self._closed or self._state != "idle":
                return False
            self._work, self._apply, self._state = work, apply, "queued"
            self._start_locked()
            self._cond.notify_all()
        return True

    def start(self) -> None:
        """Start the thread now (else the first `submit` does): an owner whose first submit comes on the
        scheduling thread starts it when it is built, since ``Thread.start`` returns only once the new thread
        has run (up to half a second on a loaded machine). Nothing to start inline or after `close`."""
        with self._cond:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is None and not self.inline and not self._closed:
            self._thread = background_thread(self._loop, self.name)
            self._thread.start()

    def apply_done(self) -> bool:
        """In the caller's thread: apply the finished job's answer (once). True when one was applied; a job
        that raised was logged by the thread and is dropped here (its questions are asked again later)."""
        if self._state != "done":  # read without the lock: only the job's thread sets "done"; seen next time
            return False
        with self._cond:
            if self._state != "done":
                return False
            apply, result, failed = self._apply, self._result, self._failed
            self._work = self._apply = self._result = None
            self._failed = False
            self._state = "idle"
        if not failed and apply is not None:
            apply(result)
        return not failed

    def wait(self, timeout: float | None = None) -> bool:
        """Until the job in flight (if any) has finished; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._state not in ("queued", "running"), timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Let the job in flight finish (up to ``timeout``), apply it, post nothing more."""
        self.wait(timeout)
        self.apply_done()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._state == "queued" or self._closed)
                if self._state != "queued":
                    return
                work, self._state = self._work, "running"
            try:
                result, failed = work() if work is not None else None, False
            except Exception as exc:  # a tier bug: no answer this time; never kill the thread
                log.exception("tiercache: %s failed: %s", self.name, exc)
                result, failed = None, True
            with self._cond:
                self._result, self._failed, self._state = result, failed, "done"
                self._cond.notify_all()
