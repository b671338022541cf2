"""What the remote tier kinds' health shares: up or down, and one prober thread that runs while it is down.

Why one place: the Redis tier (`tiers/redis/health.py`) and the object tier (`tiers/object/health.py`)
both learn their health off the hot path. A failed call marks the tier down and starts one daemon thread
that calls the tier's probe every ``retry_after_s`` (no request ever pays for a probe), marks the tier up
when it answers, logs that once and ends. The thread's start, its end, a close racing a probe and a late
call's success marking the tier up first are the subtle parts; each kind keeps only what is its own: its
failure classes and log lines, and (Redis) cluster shards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from vllm_tiercache.shared.threads import background_thread

#: The shortest pause between two probes of a down tier (``retry_after_s`` may be 0).
MIN_PROBE_INTERVAL_S = 0.01


class ProbedHealth:
    """The down flag, ``lock`` that guards it and the prober's start and end, and the prober.

    A subclass says what a probe's answer means (`_after_probe`), when the prober has work (`needs_probe`),
    how long it pauses (`probe_interval`) and what it logs when the tier is back (`_reachable_again`).
    """

    def __init__(self, address: str, retry_after_s: float, *, probe: Callable[[], bool], thread_name: str) -> None:
        self.address = address
        self.retry_after_s = retry_after_s
        #: One health check, on the prober's thread: True when the tier answered.
        self._probe = probe
        self._thread_name = thread_name
        self.lock = threading.Lock()
        self._down = False
        self.closed = False
        #: The prober (a daemon thread while the tier is not up), and its wake-up.
        self._prober: threading.Thread | None = None
        self._stop = threading.Event()

    def needs_probe(self) -> bool:
        """Whether the prober has work (the tier is down)."""
        return self._down

    def probe_interval(self) -> float:
        """The prober's pause: ``retry_after_s``, at least `MIN_PROBE_INTERVAL_S`."""
        return max(self.retry_after_s, MIN_PROBE_INTERVAL_S)

    def close(self) -> None:
        """No prober runs after this (one running ends at its next wake-up, which this brings forward)."""
        with self.lock:
            self.closed = True
        self._stop.set()

    def _start_prober(self) -> None:
        """Start the prober unless it runs; call with ``lock`` held."""
        if self._prober is None and not self.closed:
            self._prober = background_thread(self._probe_loop, self._thread_name)
            self._prober.start()

    def _after_probe(self, ok: bool) -> bool | None:
        """With ``lock`` held, after a probe: None to probe again, else whether the tier came back (it is up
        now, and the prober ends)."""
        if not ok:
            return None
        was_down, self._down = self._down, False
        return was_down

    def _reachable_again(self) -> None:
        """The tier answers again: one line (outside ``lock``)."""

    def _probe_loop(self) -> None:
        while True:
            self._stop.wait(self.probe_interval())
            with self.lock:
                if self.closed or not self.needs_probe():  # closed, or a late call's success marked it up
                    self._prober = None
                    return
            ok = self._probe()
            with self.lock:
                if self.closed:
                    self._prober = None
                    return
                back = self._after_probe(ok)
                if back is None:
                    continue
                self._prober = None  # with the tier up, under one lock: a failure right after starts a new one
            if back:
                self._reachable_again()
            return
