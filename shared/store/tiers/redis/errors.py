"""What a redis-py failure means for the Redis tier, and how it is counted and logged: once, never per record.

Errors are per record, not per batch: the tier's pipelines run with ``raise_on_error=False``, so a command
that failed (one damaged record, one shard's OOM or READONLY reply) is a miss or a dropped write for the
record it belongs to, and the rest of the batch is served. What each exception means is decided in one
place, `classify`: ``down`` (server or cluster away), ``error`` (the server refused one command), or
``bug`` (the client refused our call, e.g. a multi-key command a cluster pipeline does not route; logged
once as an ERROR with its traceback). A batch fails as a whole only when the whole call raised.

Why a module of its own: the classification is the one rule every part of the tier (the calls, the
cluster router, the prober) applies, and it is tested without a server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from vllm_tiercache.shared.store.counters import TierCounters

#: Every line of the Redis tier is logged under this one name, whichever of its modules writes it: the
#: name operators (and the tests) filter the tier's lines by.
TIER_LOGGER_NAME = "vllm_tiercache.shared.store.tiers.redis.tier"
log = logging.getLogger(TIER_LOGGER_NAME)

DOWN, ERROR, BUG, THROTTLED = "down", "error", "bug", "throttled"
#: Errors that mean "the server is not there": the tier goes down and is retried later. (ClusterDownError
#: covers MasterDownError; BusyLoadingError, AuthenticationError are ConnectionErrors.)
DOWN_ERRORS: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError,
                                                redis.exceptions.ClusterDownError,
                                                redis.exceptions.SlotNotCoveredError)
#: RedisClusterException texts (redis-py raises it without a subclass) that mean the cluster is away.
CLUSTER_DOWN_TEXTS = ("cannot be connected", "All slots are not covered")
#: What a cluster node's connection raises when the node is away or hangs: its shard goes down.
NODE_ERRORS: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
#: Replies (or a routing failure) that say the client's slot map is stale: the prober re-reads it.
STALE_MAP_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.MovedError, redis.exceptions.AskError,
                                                     redis.exceptions.TryAgainError,
                                                     redis.exceptions.SlotNotCoveredError)


class ShardDownError(redis.ConnectionError):
    """In the place of a command whose cluster shard is marked down: never sent, never raised."""


def classify(exc: BaseException) -> str:
    """What an exception out of a redis-py call means: the one place that decides it.

    - ``down``: the server or cluster is not there: connection refused or reset, a timeout, a server
      still loading, a failed AUTH, CLUSTERDOWN / MASTERDOWN, a slot no reachable node serves, or the
      cluster client found no reachable node (a `RedisClusterException` whose cause is one of those, or
      whose text says so). The tier goes down; its prober thread retries every ``retry_after_s``.
    - ``throttled``: the server is out of memory (OOM): the command's record is a miss, or a write that a
      patient writer puts again after a backoff (`vllm_tiercache.shared.store.writes.patience`); the tier stays up.
      (A server still LOADING is ``down``, since every command fails alike, and is counted as throttled too.)
    - ``error``: the server refused one command (READONLY, WRONGTYPE, a redirect left over after
      the client's own retries, ...): a miss or a dropped write for what it touched.
    - ``bug``: anything else, a `RedisClusterException` that the client raises for a call it will not
      route (a multi-key command in a cluster pipeline, keys of two slots), CROSSSLOT, or an exception
      that is no Redis error at all: a miss, logged once as an ERROR with its traceback.
    """
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return THROTTLED
    if isinstance(exc, DOWN_ERRORS):
        return DOWN
    if isinstance(exc, redis.exceptions.RedisClusterException):
        cause = exc.__cause__
        if (cause is not None and classify(cause) == DOWN) or any(t in str(exc) for t in CLUSTER_DOWN_TEXTS):
            return DOWN
        return BUG
    if isinstance(exc, redis.exceptions.ClusterCrossSlotError):
        return BUG
    if isinstance(exc, redis.RedisError):
        return ERROR
    return BUG


class FailureLog:
    """Counts every failure of the tier's calls (``errors``) and logs each kind once, as `classify` says.

    A ``down`` failure goes to ``mark_down`` (the tier's health, which warns once itself); an ``error``
    is one WARNING per kind of call; a ``bug`` one ERROR with its traceback per kind of call and exception,
    unless the tier is closed (a batch that raced `close()` finds its client gone: no bug to report).
    """

    def __init__(self, address: str, counters: TierCounters, *, is_closed: Callable[[], bool],
                 mark_down: Callable[[BaseException], None]) -> None:
        self.address = address
        self.counters = counters
        self._is_closed = is_closed
        self._mark_down = mark_down
        #: What has been logged already: a line per kind, not per call or record.
        self._warned: set[str] = set()
        #: the last failure in words (``"down: TimeoutError"``), for a patient writer's report: never a message
        self.last_reason = ""

    def failed(self, what: str, exc: BaseException) -> None:
        """Count and log one failure as `classify` says (the tier goes down only for ``down``)."""
        kind = classify(exc)
        self.last_reason = f"{kind}: {type(exc).__name__}"
        if isinstance(exc, redis.exceptions.BusyLoadingError):  # LOADING: down, and an answer to back off from
            self.counters.add(throttled=1)
        if kind == DOWN:
            self._mark_down(exc)
        elif kind == THROTTLED:
            self.counters.add(throttled=1)
            if f"throttled: {what}" not in self._warned:
                self._warned.add(f"throttled: {what}")
                log.warning("tiercache redis tier %s: %s: the server is out of memory (%s); reads miss, a patient "
                            "writer backs off and puts again, others drop the write; logged once",
                            self.address, what, type(exc).__name__)
        elif kind == ERROR:
            self.other_error(what, exc)
        else:
            self.bug(what, exc)

    def other_error(self, what: str, exc: BaseException) -> None:
        """A failure that leaves the tier up (a refused command, a damaged record): one WARNING per kind."""
        self.counters.add(errors=1)
        if what not in self._warned:
            self._warned.add(what)
            log.warning("tiercache redis tier %s: %s failed: %s", self.address, what, exc)

    def bug(self, what: str, exc: BaseException) -> None:
        """A call the client refused, or no Redis error at all: one ERROR with its traceback per kind."""
        self.counters.add(errors=1)
        if self._is_closed():  # a batch that raced `close()` (its client is gone): a miss, no bug to report
            log.debug("tiercache redis tier %s: %s after close: %s", self.address, what, exc)
            return
        seen = f"bug: {what}: {type(exc).__name__}"
        if seen not in self._warned:
            self._warned.add(seen)
            log.error("tiercache redis tier %s: %s failed (%s: %s); served as a miss, logged once",
                      self.address, what, type(exc).__name__, exc, exc_info=exc)

    def stale_map(self, what: str, exc: BaseException, within_s: float) -> None:
        """A reply said the cluster's slot map is stale: one INFO line per kind of call (not counted)."""
        if f"stale: {what}" not in self._warned:
            self._warned.add(f"stale: {what}")
            log.info("tiercache redis tier %s: %s: the slot map is stale (%s %s); those keys miss until "
                     "it is re-read, within %.1fs", self.address, what, type(exc).__name__, exc, within_s)
