"""Whether the Redis tier (and each cluster shard) is up, and the prober thread that finds it back.

When the server is unreachable (or stops answering: a call that runs into ``timeout_s``) the tier is
marked down: reads are misses, writes are skipped (counted), one warning names the address, and no
exception reaches the caller. While down, every call returns at once, without touching the network.
Health is learned off the hot path: marking the tier down starts one daemon thread (the prober) that
calls the tier's probe (a PING; on a cluster: to every primary) every ``retry_after_s``, and marks the
tier up, with one line, when it answers; then the thread ends. No request ever pays for a probe, so a
server that hangs stalls only the call that found it hanging.

On a cluster, health is per shard (a primary and the slots it serves), not per tier: a shard whose node
failed in a call is marked down (one warning) and its keys miss while the other shards keep serving; the
prober re-reads the slot map every `SLOT_MAP_REFRESH_S` at most while a shard is down and PINGs a down
node every ``retry_after_s`` (`redis_cluster.ClusterRouter.probe`). Only when every shard is down is the
tier down (the one warning above).

Why apart from the calls: this is a state machine (up, shards down, down, a slot map to re-read) with its
thread and its log lines; it touches no network itself (the probe is handed in), so it is tested alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.tiers.prober import MIN_PROBE_INTERVAL_S, ProbedHealth
from vllm_tiercache.shared.store.tiers.redis.errors import log

#: While a cluster shard is down (or a reply said the slot map is stale), the prober re-reads the slot map
#: this often at most (``retry_after_s`` when shorter): a replica's promotion is served within about this.
SLOT_MAP_REFRESH_S = 1.0


class ShardOutage:
    """A cluster shard marked down: one slot it served (its successor after a failover serves it), since
    when, and when its node was last PINGed."""

    __slots__ = ("pinged", "since", "slot")

    def __init__(self, slot: int, now: float) -> None:
        self.slot, self.since, self.pinged = slot, now, now


class TierHealth(ProbedHealth):
    """The tier's health: up, some cluster shards down, or down; and the prober that runs while it is not up.

    ``lock`` guards the state below and the prober's start and end; the tier swaps its client under it
    too, so `close` and a probe that builds a client agree. ``down`` is read without it on the hot path.
    """

    def __init__(self, address: str, retry_after_s: float, counters: TierCounters, *, cluster: bool,
                 attempt: str, probe: Callable[[], bool], thread_name: str) -> None:
        super().__init__(address, retry_after_s, probe=probe, thread_name=thread_name)
        self.counters = counters
        self.cluster = cluster
        #: What a connection attempt does, in words, for the 'unreachable' line.
        self.attempt = attempt
        #: Cluster shards marked down: primary "host:port" -> `ShardOutage` (a standalone server has none).
        self.outages: dict[str, ShardOutage] = {}
        #: A reply said the cluster's slot map is stale: the prober re-reads it.
        self.refresh_asked = False

    # ------------------------------------------------------------------------------------------ state
    @property
    def down(self) -> bool:
        """The whole tier is down (on a cluster: every shard, or the cluster was away at start)."""
        return self._down

    @property
    def shards_down(self) -> list[str]:
        """The cluster shards (their primary's "host:port") marked down now; empty on a standalone server."""
        with self.lock:
            return sorted(self.outages)

    def up_share(self, count_primaries: Callable[[], int]) -> float:
        """The share of the tier that answers: 0 while down, 1 while every shard answers; with shards marked
        down, the share of the primaries (``count_primaries``, 0 when unknown) that are not."""
        if self._down:
            return 0.0
        with self.lock:
            down = len(self.outages)
        if not down:
            return 1.0
        primaries = count_primaries()
        return max(0.0, 1.0 - down / primaries) if primaries else 0.5

    def needs_probe(self) -> bool:
        """Whether the prober has work: the tier or a shard down, or a slot map to re-read."""
        return self._down or bool(self.outages) or self.refresh_asked

    def probe_interval(self) -> float:
        """The prober's pause: ``retry_after_s``, at most `SLOT_MAP_REFRESH_S` while a shard is down or the
        slot map is to be re-read, at least `MIN_PROBE_INTERVAL_S`."""
        interval = self.retry_after_s
        if self.outages or self.refresh_asked:
            interval = min(interval, SLOT_MAP_REFRESH_S)
        return max(interval, MIN_PROBE_INTERVAL_S)

    # -------------------------------------------------------------------------------------- transitions
    def mark_down(self, exc: BaseException) -> None:
        """The whole tier is away: count it, start the prober, and warn once (not again while down)."""
        self.counters.add(errors=1)
        with self.lock:
            was_down = self._down
            self._down = True
            self._start_prober()
        if not was_down:
            log.warning("tiercache redis tier: %s unreachable (%s: %s); tried: %s; serving misses and "
                        "skipping writes, retrying every %.1fs", self.address, type(exc).__name__, exc,
                        self.attempt, self.retry_after_s)

    def mark_up(self) -> None:
        """A call succeeded: the tier is up (one line when it was down)."""
        if self._down:
            with self.lock:
                was_down, self._down = self._down, False
            if was_down:
                log.warning("tiercache redis tier: %s reachable again", self.address)

    def shards_failed(self, failed: dict[str, tuple[int, BaseException]], primaries: set[str]) -> None:
        """Mark down the cluster shards whose node failed (name -> a slot it serves, the error): their keys
        are misses and their writes dropped until the prober finds them back. One warning for the shards
        newly down; when none of ``primaries`` is left up, the tier is down (`mark_down`'s one warning)."""
        now = time.monotonic()
        with self.lock:
            new = [name for name in failed if name not in self.outages]
            for name in new:
                self.outages[name] = ShardOutage(failed[name][0], now)
            left = primaries - self.outages.keys()
            self._start_prober()
        if not new:
            return
        exc = failed[new[0]][1]
        if not left:
            self.mark_down(exc)
            return
        self.counters.add(errors=1)
        log.warning("tiercache redis tier: %s: shard %s unreachable (%s: %s); its keys are misses and its "
                    "writes are dropped until it answers again (PING every %.1fs) or a replica takes its slots "
                    "over (slot map re-read every %.1fs); %d other shard(s) keep serving", self.address,
                    ", ".join(new), type(exc).__name__, exc, self.retry_after_s,
                    min(self.retry_after_s, SLOT_MAP_REFRESH_S), len(left))

    def ask_refresh(self) -> None:
        """A reply said the slot map is stale: the prober re-reads it (never the caller)."""
        with self.lock:
            self.refresh_asked = True
            self._start_prober()

    def take_probe_work(self) -> tuple[bool, dict[str, ShardOutage], bool]:
        """For a cluster probe: (the whole tier down, a copy of the outages, a slot map to re-read); the
        refresh is taken (`keep_refresh` gives it back when the probe fails)."""
        with self.lock:
            work = self._down, dict(self.outages), self.refresh_asked
            self.refresh_asked = False
        return work

    def keep_refresh(self, refresh: bool) -> None:
        """A probe failed: a refresh it took is asked again, never dropped."""
        with self.lock:
            self.refresh_asked = self.refresh_asked or refresh

    def cluster_up(self, back: dict[str, str]) -> None:
        """Mark up the shards in ``back`` (the name it was down under -> the node now serving its slots),
        and the tier when it was down and something answered: one line each (one in all for the tier)."""
        with self.lock:
            for name in back:
                self.outages.pop(name, None)
            was_down = self._down and (bool(back) or not self.outages)
            if was_down:
                self._down = False
            left = sorted(self.outages)
        if was_down:
            log.warning("tiercache redis tier: %s reachable again%s", self.address,
                        f"; shards still down: {', '.join(left)}" if left else "")
            return
        for name, owner in back.items():
            if owner == name:
                log.warning("tiercache redis tier: %s: shard %s reachable again; its keys are served again",
                            self.address, name)
            else:
                log.warning("tiercache redis tier: %s: shard %s failed over to %s (its replica, promoted); "
                            "its keys are served again", self.address, name, owner)

    # ------------------------------------------------------------------------------------------ prober
    def _after_probe(self, ok: bool) -> bool | None:
        if not ok:
            return None
        if self.cluster:  # the probe marked up what answered; a shard down meanwhile: go on
            return None if self.needs_probe() else False
        return super()._after_probe(ok)

    def _reachable_again(self) -> None:
        log.warning("tiercache redis tier: %s reachable again", self.address)
