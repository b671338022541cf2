"""Whether the object tier's endpoint is up, how each failure is counted and logged, and the prober.

As for Redis (`vllm_tiercache.shared.store.tiers.redis.health`): an endpoint that refuses connections, hangs
past ``timeout_s``, answers 5xx, lost its bucket or refuses the credentials marks the tier down with one
warning; while down every call returns at once without touching the network (reads miss, writes are
dropped and counted), and one daemon thread probes (HEAD of the bucket) every ``retry_after_s`` until it
answers, then marks the tier up with one line and ends. No request ever pays for a probe.

Why its own module: a small state machine with its thread and its log lines, touching no network itself
(the probe is handed in), so it is tested without a server.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tiers.object.client import BUG, DOWN, ERROR, THROTTLED, classify, error_code, log
from vllm_tiercache.shared.store.tiers.prober import ProbedHealth


class ObjectHealth(ProbedHealth):
    """Up or down, the prober while down, and the once-per-kind failure log of one object tier."""

    def __init__(self, address: str, retry_after_s: float, counters: TierCounters, *, attempt: Callable[[], str],
                 probe: Callable[[], bool], thread_name: str) -> None:
        super().__init__(address, retry_after_s, probe=probe, thread_name=thread_name)
        self.counters = counters
        self._attempt = attempt
        #: what has been logged already: one line per kind of failure, not per call or record
        self._warned: set[str] = set()

    @property
    def down(self) -> bool:
        return self._down

    # -------------------------------------------------------------------------------------- failures
    def failed(self, what: str, exc: BaseException) -> str:
        """Count and log one failed call as `classify` says; returns the class. Missing objects and lost
        conditions are answers, not failures: neither counted nor logged."""
        kind = classify(exc)
        if kind == DOWN:
            self.mark_down(what, exc)
        elif kind == BUG:
            self.counters.add(errors=1)
            seen = f"bug: {what}: {type(exc).__name__}"
            if seen not in self._warned and not self.closed:
                self._warned.add(seen)
                log.error("tiercache object tier %s: %s failed (%s: %s); served as a miss, logged once",
                          self.address, what, type(exc).__name__, exc, exc_info=exc)
        elif kind == ERROR:
            self.other_error(what, exc)
        elif kind == THROTTLED:
            self.throttled(what, exc)
        return kind

    def throttled(self, what: str, exc: BaseException) -> None:
        """The store asked to be called less often: counted (``throttled``), one WARNING per kind of call;
        the tier stays up (a patient writer backs off, `vllm_tiercache.shared.store.writes.patience`)."""
        self.counters.add(throttled=1)
        seen = f"throttled: {what}"
        if seen not in self._warned and not self.closed:
            self._warned.add(seen)
            log.warning("tiercache object tier %s: the store asks to slow down during %s (%s); reads miss, a "
                        "patient writer backs off and puts again, others drop the write; logged once",
                        self.address, what, error_code(exc) or type(exc).__name__)

    def other_error(self, what: str, exc: BaseException | str) -> None:
        """A failure that leaves the tier up (a refused request, a damaged record): one WARNING per kind."""
        self.counters.add(errors=1)
        if what not in self._warned:
            self._warned.add(what)
            log.warning("tiercache object tier %s: %s failed: %s", self.address, what, exc)

    # ------------------------------------------------------------------------------------ transitions
    def mark_down(self, what: str, exc: BaseException) -> None:
        """The endpoint is away (or the bucket, or the credentials): count it, start the prober, warn once."""
        self.counters.add(errors=1)
        with self.lock:
            was_down, self._down = self._down, True
            self._start_prober()
        if not was_down and not self.closed:
            code = error_code(exc)
            log.warning("tiercache object tier: %s unreachable during %s (%s%s: %s); tried: %s; serving misses and "
                        "skipping writes, retrying every %.1fs", self.address, what, type(exc).__name__,
                        f" {code}" if code else "", exc, self._attempt(), self.retry_after_s)

    def mark_up(self) -> None:
        """A call succeeded: the tier is up (one line when it was down)."""
        if self._down:
            with self.lock:
                was_down, self._down = self._down, False
            if was_down:
                log.warning("tiercache object tier: %s reachable again", self.address)

    def _reachable_again(self) -> None:
        log.warning("tiercache object tier: %s reachable again", self.address)
