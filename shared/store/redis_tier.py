"""Redis tier: records in a Redis server or cluster, shared by every process and host that reaches it.

Layout per record (``H`` is the key digest in hex, in braces so Redis Cluster puts all pieces of one
record in one slot)::

    {prefix}{H}       head: u32 part count + the record header (`vllm_tiercache.shared.store.records` prefix)
    {prefix}{H}:0..n  payload parts of at most ``part_size`` bytes
    {prefix}{H}#text  the key text (for `tiercache stats` / `tiercache evict`; readers never need it)

Why split: Redis values are capped (512 MB) and huge values block the server; parts keep each command
bounded. The head is written last on the same connection, so a reader never sees a head before its
parts. A batch of lookups or gets is one pipelined round trip (plus one more only for records with more
than one part).

Copies of the payload. A put: the tier copies nothing itself; it hands redis-py each part as a
memoryview slice of the tensor the store gave it (the store's private copy, or with ``owned=True`` the
caller's own tensor: `TieredStore.put_many`). The tier's connections pack a command that carries a payload
with redis-py's Python packer, which sends the memoryview to the socket as it is: no copy
(`vllm_tiercache.shared.store.redis_wire`; redis-py's default with hiredis would copy it three times,
and a plain ``SET`` of bytes pays two of those). A get: hiredis
parses each reply into a bytes object (its own buffer, then the bytes, as for a plain ``GET``); a
one-part record's tensor is built over that bytes object (read-only, no copy), and the parts of a larger
record are copied once into one buffer, checksummed as they are copied (`records.join_payload`).

When the server is unreachable (or stops answering: a call that runs into ``timeout_s``) the tier is
marked down: reads are misses, writes are skipped (counted), one warning names the address, and no
exception reaches the caller. While down, every call returns at once, without touching the network.
Health is learned off the hot path: marking the tier down starts one daemon thread (the prober) that
sends a PING (on a cluster: to every primary) every ``retry_after_s``, with the tier's own timeout, and
marks the tier up, with one line, when it answers; then the thread ends. No request ever pays for a
probe, so a server that hangs stalls only the call that found it hanging (and `TieredStore` bounds even
that one for the schedulers' lookups: ``lookup_budget_ms``). That holds for a cluster too: one that is
unreachable when the tier is built gives a tier that is down (the engine starts without it, and the
prober builds the client once the cluster answers), and one that goes away while running marks the tier
down with one warning, not a traceback per call.

On a cluster, health is per shard (a primary and the slots it serves), not per tier: one master that
dies or hangs costs its own keys only. The tier routes a cluster batch itself (`_cluster_pipeline`: the
client's slot map, one round trip to every primary at once) instead of redis-py's cluster pipeline, which
answers a failed node by resending each of its commands alone, each retried, and re-reading the slot
map inside the caller's call. A node that fails in a call (refused, reset, timed out) fails its own
commands, once, and its shard is marked down (one warning): its keys are misses and its writes are
dropped (counted) at once, without touching the network, while the other shards keep serving. The prober
re-reads the slot map every `SLOT_MAP_REFRESH_S` at most while a shard is down (a failover gives its
slots to the promoted replica, which is then PINGed and served: no need to wait for ``retry_after_s``)
and PINGs a down node that still owns its slots every ``retry_after_s``. Only when every shard is down is
the tier down (the one warning above). A reply that says the slot map is stale (MOVED, ASK) or a slot no
node serves is a miss, and the prober re-reads the map; a CLUSTERDOWN reply (a master failed and the
servers run with ``cluster-require-full-coverage yes``) is a miss from a node that answered.

Errors are per record, not per batch: pipelines run with ``raise_on_error=False``, so a command that
failed (one damaged record, one shard's OOM or READONLY reply) is a miss or a dropped write for the
record it belongs to, and the rest of the batch is served. What each exception means is decided in one
place, `classify`: ``down`` (server or cluster away), ``error`` (the server refused one command), or
``bug`` (the client refused our call, e.g. a multi-key command a cluster pipeline does not route; logged
once as an ERROR with its traceback). A batch fails as a whole only when the whole call raised.
"""

from __future__ import annotations

import inspect
import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import Record, RemoteTier, ReportsHealth, StoredRecord, StoreKey, key_text_bytes
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.redis_config import RedisTierConfig
from vllm_tiercache.shared.store.redis_wire import connection_class
from vllm_tiercache.shared.threads import background_thread

log = logging.getLogger(__name__)
_NPARTS = struct.Struct("<I")
#: Parts deleted per command when a corrupt record is dropped, and the most parts it may have.
DELETE_RUN = 256
MAX_DELETE_PARTS = 1 << 20
#: Errors that mean "the server is not there": the tier goes down and is retried later. (ClusterDownError
#: covers MasterDownError; BusyLoadingError, AuthenticationError are ConnectionErrors.)
_DOWN_ERRORS: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError,
                                                 redis.exceptions.ClusterDownError,
                                                 redis.exceptions.SlotNotCoveredError)
#: RedisClusterException texts (redis-py raises it without a subclass) that mean the cluster is away.
_CLUSTER_DOWN_TEXTS = ("cannot be connected", "All slots are not covered")
DOWN, ERROR, BUG = "down", "error", "bug"
#: The shortest pause between two probes of a down tier (``retry_after_s`` may be 0).
MIN_PROBE_INTERVAL_S = 0.01
#: While a cluster shard is down (or a reply said the slot map is stale), the prober re-reads the slot map
#: this often at most (``retry_after_s`` when shorter): a replica's promotion is served within about this.
SLOT_MAP_REFRESH_S = 1.0
#: What a cluster node's connection raises when the node is away or hangs: its shard goes down.
_NODE_ERRORS: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
#: Replies (or a routing failure) that say the client's slot map is stale: the prober re-reads it.
_STALE_MAP_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.MovedError, redis.exceptions.AskError,
                                                      redis.exceptions.TryAgainError,
                                                      redis.exceptions.SlotNotCoveredError)


class ShardDownError(redis.ConnectionError):
    """In the place of a command whose cluster shard is marked down: never sent, never raised."""


class _Shard:
    """A cluster shard marked down: one slot it served (its successor after a failover serves it), since
    when, and when its node was last PINGed."""

    __slots__ = ("pinged", "since", "slot")

    def __init__(self, slot: int, now: float) -> None:
        self.slot, self.since, self.pinged = slot, now, now


def classify(exc: BaseException) -> str:
    """What an exception out of a redis-py call means: the one place that decides it.

    - ``down``: the server or cluster is not there: connection refused or reset, a timeout, a server
      still loading, a failed AUTH, CLUSTERDOWN / MASTERDOWN, a slot no reachable node serves, or the
      cluster client found no reachable node (a `RedisClusterException` whose cause is one of those, or
      whose text says so). The tier goes down; its prober thread retries every ``retry_after_s``.
    - ``error``: the server refused one command (OOM, READONLY, WRONGTYPE, a redirect left over after
      the client's own retries, ...): a miss or a dropped write for what it touched.
    - ``bug``: anything else, a `RedisClusterException` that the client raises for a call it will not
      route (a multi-key command in a cluster pipeline, keys of two slots), CROSSSLOT, or an exception
      that is no Redis error at all: a miss, logged once as an ERROR with its traceback.
    """
    if isinstance(exc, _DOWN_ERRORS):
        return DOWN
    if isinstance(exc, redis.exceptions.RedisClusterException):
        cause = exc.__cause__
        if (cause is not None and classify(cause) == DOWN) or any(t in str(exc) for t in _CLUSTER_DOWN_TEXTS):
            return DOWN
        return BUG
    if isinstance(exc, redis.exceptions.ClusterCrossSlotError):
        return BUG
    if isinstance(exc, redis.RedisError):
        return ERROR
    return BUG


def _pooled_connection(pool: Any) -> Any:
    """A connection from a redis-py pool (redis-py before 5.3 wants a command name)."""
    try:
        return pool.get_connection()
    except TypeError:  # pragma: no cover - an older redis-py
        return pool.get_connection("PING")


def make_client(config: RedisTierConfig) -> Any:
    """A redis-py client (pooled; hiredis parser when installed) or RedisCluster for +cluster URLs, whose
    connections send payloads without copying them (`vllm_tiercache.shared.store.redis_wire`)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        **dict(config.ssl),
    }
    if config.password is not None:
        kwargs["password"] = config.password
    if config.cluster:
        from redis.cluster import RedisCluster

        url = config.url.replace("+cluster://", "://", 1)
        # The same one immediate retry (redis-py's default is 10 with backoff, seconds per call while a
        # node is away); a retry re-reads the slot map, so a moved slot is still followed. (The tier's own
        # batches take no retry: `RedisTier._cluster_pipeline`.) A slot map with a hole is taken: the
        # slots no node serves are misses, the others are served.
        return RedisCluster.from_url(url, retry=Retry(NoBackoff(), 1), require_full_coverage=False,
                                     connection_class=connection_class(url), **kwargs)
    # One retry with no backoff: reconnects a pooled connection that a server restart closed, without
    # stalling callers when the server is really gone. Payloads go to the socket uncopied (`redis_wire`).
    return redis.Redis.from_url(config.url, retry=Retry(NoBackoff(), 1), connection_class=connection_class(config.url),
                                **kwargs)


class RedisTier(RemoteTier, ReportsHealth):
    """Pipelined, part-splitting Redis tier that degrades to misses when the server is down."""

    kind = "redis"
    shared_across_processes = True
    # `RemoteTier`: one call may hang up to ``timeout_s`` twice (with the retry), so the store bounds lookups.

    def __init__(self, config: RedisTierConfig, name: str = "redis") -> None:
        self.config = config
        self.name = name
        self.address = config.address
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._down = False
        self._warned_errors: set[str] = set()
        self._client: Any = None
        self._closed = False
        #: The prober (a daemon thread while the tier is down, see the module docstring), and its wake-up.
        self._prober: threading.Thread | None = None
        self._stop = threading.Event()
        #: Probes sent so far (tests check that none ran on a caller's thread).
        self.probes = 0
        #: Cluster shards marked down: primary "host:port" -> `_Shard` (a standalone server has none).
        self._shards_down: dict[str, _Shard] = {}
        #: A reply said the cluster's slot map is stale: the prober re-reads it.
        self._refresh_asked = False
        #: Records a cluster batch's commands (a standalone client's pipeline, never executed).
        self._recorder = redis.Redis() if config.cluster else None
        self._connect()

    def _connect(self) -> None:
        try:
            self._client = make_client(self.config)
        except Exception as exc:  # RedisCluster discovers nodes eagerly: whatever it raises, the tier is
            self._mark_down(exc)  # down (one warning naming the cause) and is built again later

    # ------------------------------------------------------------------------------------ availability
    @property
    def down(self) -> bool:
        """The whole tier is down (on a cluster: every shard, or the cluster was away at start)."""
        return self._down

    @property
    def shards_down(self) -> list[str]:
        """The cluster shards (their primary's "host:port") marked down now; empty on a standalone server."""
        with self._lock:
            return sorted(self._shards_down)

    @property
    def up_share(self) -> float:
        """The share of the tier that answers, for the ``tier_up`` gauge: 0 while down, 1 while every shard
        answers; on a cluster with shards marked down, the share of its primaries that are not (read from
        the client's slot map in memory, never from the network)."""
        if self._down:
            return 0.0
        with self._lock:
            down = len(self._shards_down)
        if not down:
            return 1.0
        try:
            primaries = len(self._client.get_primaries())
        except Exception:  # a client without a slot map yet: say only that something is down
            primaries = 0
        return max(0.0, 1.0 - down / primaries) if primaries else 0.5

    def _available(self) -> bool:
        """Whether a call may use the network now: never while down (the prober decides when it is back)."""
        return not self._down and self._client is not None

    def _start_prober(self) -> None:
        """Start the prober unless it runs; call with ``_lock`` held."""
        if self._prober is None and not self._closed:
            self._prober = background_thread(self._probe_loop, f"tiercache-probe-{self.name}")
            self._prober.start()

    def _mark_down(self, exc: BaseException) -> None:
        self.counters.add(errors=1)
        with self._lock:
            was_down = self._down
            self._down = True
            self._start_prober()
        if not was_down:
            log.warning("tiercache redis tier: %s unreachable (%s: %s); tried: %s; serving misses and "
                        "skipping writes, retrying every %.1fs", self.address, type(exc).__name__, exc,
                        self.tried(), self.config.retry_after_s)

    def _shards_failed(self, failed: dict[str, tuple[int, BaseException]]) -> None:
        """Mark down the cluster shards whose node failed (name -> a slot it serves, the error): their keys
        are misses and their writes dropped until the prober finds them back. One warning for the shards
        newly down; when no shard is left up, the tier is down (`_mark_down`'s one warning instead)."""
        client = self._client
        primaries = {node.name for node in client.get_primaries()} if client is not None else set()
        now = time.monotonic()
        with self._lock:
            new = [name for name in failed if name not in self._shards_down]
            for name in new:
                self._shards_down[name] = _Shard(failed[name][0], now)
            left = primaries - self._shards_down.keys()
            self._start_prober()
        if not new:
            return
        exc = failed[new[0]][1]
        if not left:
            self._mark_down(exc)
            return
        self.counters.add(errors=1)
        log.warning("tiercache redis tier: %s: shard %s unreachable (%s: %s); its keys are misses and its "
                    "writes are dropped until it answers again (PING every %.1fs) or a replica takes its slots "
                    "over (slot map re-read every %.1fs); %d other shard(s) keep serving", self.address,
                    ", ".join(new), type(exc).__name__, exc, self.config.retry_after_s,
                    min(self.config.retry_after_s, SLOT_MAP_REFRESH_S), len(left))

    def _ask_refresh(self) -> None:
        """A reply said the slot map is stale: the prober re-reads it (never the caller)."""
        with self._lock:
            self._refresh_asked = True
            self._start_prober()

    def tried(self) -> str:
        """What a connection attempt does, for the 'unreachable' line: the address alone rarely says
        whether a timeout, a missing password or a TLS setting was the problem."""
        tls = "TLS" + (f" with CA {self.config.ssl['ssl_ca_certs']}" if self.config.ssl.get("ssl_ca_certs") else "") \
            if self.config.url.startswith("rediss") else "plain TCP (no TLS)"
        auth = "with a password" if self.config.password or re.search(r"//[^/@]*:[^/@]+@", self.config.url) \
            else "without a password"
        return (f"{'cluster' if self.config.cluster else 'single server'}, {tls}, {auth}, "
                f"{self.config.timeout_s:g}s connect/read timeout, "
                f"{'each node tried once per call' if self.config.cluster else '1 immediate retry'}")

    def _mark_up(self) -> None:
        if self._down:
            with self._lock:
                was_down, self._down = self._down, False
            if was_down:
                log.warning("tiercache redis tier: %s reachable again", self.address)

    def _needs_probe(self) -> bool:
        """Whether the prober has work: the tier or a shard down, or a slot map to re-read."""
        return self._down or bool(self._shards_down) or self._refresh_asked

    def _probe_interval(self) -> float:
        interval = self.config.retry_after_s
        if self._shards_down or self._refresh_asked:
            interval = min(interval, SLOT_MAP_REFRESH_S)
        return max(interval, MIN_PROBE_INTERVAL_S)

    def _probe_loop(self) -> None:
        """The prober: while the tier (or a cluster shard) is down, one `_probe` every ``retry_after_s``
        (every `SLOT_MAP_REFRESH_S` at most while a shard is down); marks it up and ends."""
        while True:
            self._stop.wait(self._probe_interval())
            with self._lock:
                if self._closed or not self._needs_probe():  # closed, or a late call's success marked it up
                    self._prober = None
                    return
            ok = self._probe()
            with self._lock:
                if self._closed:
                    self._prober = None
                    return
                if not ok:
                    continue
                if self.config.cluster:  # `_probe` marked up what answered; a shard down meanwhile: go on
                    if self._needs_probe():
                        continue
                    self._prober = None
                    return
                self._prober = None  # with the tier up, under one lock: a failure right after starts a new one
                was_down, self._down = self._down, False
            if was_down:
                log.warning("tiercache redis tier: %s reachable again", self.address)
            return

    def _probe(self) -> bool:
        """One health check, on the prober's thread only: build the client if there is none (a cluster
        away at start), then PING with the tier's timeout (a cluster: `_probe_cluster`). True when it
        answered (a cluster: when nothing is left down); a failure is not logged again."""
        self.probes += 1
        try:
            client = self._client
            if client is None:
                client = make_client(self.config)
                with self._lock:
                    if self._closed:
                        client.close()
                        return False
                    self._client = client
            if self.config.cluster:
                return self._probe_cluster(client) and not self._closed
            client.ping()
        except Exception as exc:
            log.debug("tiercache redis tier: %s probe failed: %s", self.address, exc)
            return False
        return not self._closed

    def _probe_cluster(self, client: Any) -> bool:
        """A cluster's health check. Away at start (the tier down, no shard named): PING every primary.
        Else re-read the slot map (a failover gives a shard's slots to its promoted replica) and PING the
        node that now serves each down shard's slots: at once when that node changed, else every
        ``retry_after_s``. Marks up what answered, one line each; True when nothing is left to probe."""
        from redis.cluster import RedisCluster

        with self._lock:
            whole, shards, refresh = self._down, dict(self._shards_down), self._refresh_asked
            self._refresh_asked = False
        try:
            if whole and not shards:
                client.ping(target_nodes=RedisCluster.PRIMARIES)
                if refresh:  # a stale map reported before the whole tier went down: still re-read it
                    self._refresh_slots(client)
                self._cluster_up({})
                return not self._needs_probe()
            if shards or refresh:
                self._refresh_slots(client)
        except Exception:  # the next probe asks again: a refresh is never dropped
            with self._lock:
                self._refresh_asked = self._refresh_asked or refresh
            raise
        now = time.monotonic()
        back: dict[str, str] = {}
        for name, shard in shards.items():
            owners = client.nodes_manager.slots_cache.get(shard.slot)
            if not owners:
                continue  # its slots have no node yet
            owner = owners[0]
            if owner.name == name and now - shard.pinged < self.config.retry_after_s:
                continue
            shard.pinged = now
            try:
                client.get_redis_connection(owner).ping()
            except Exception as exc:
                log.debug("tiercache redis tier: %s: shard %s probe (%s) failed: %s", self.address, name,
                          owner.name, exc)
                continue
            back[name] = owner.name
        self._cluster_up(back)
        return not self._needs_probe()

    def _refresh_slots(self, client: Any) -> None:
        """Re-read the slot map (CLUSTER SLOTS from one node that answers), on the prober's thread; the
        nodes' pooled connections are kept (redis-py would drop the answering node's, and the next
        request would pay the reconnect)."""
        manager = client.nodes_manager
        if "disconnect_startup_nodes_pools" in inspect.signature(manager.initialize).parameters:
            manager.initialize(disconnect_startup_nodes_pools=False)
        else:  # pragma: no cover - an older redis-py
            manager.initialize()

    def _cluster_up(self, back: dict[str, str]) -> None:
        """Mark up the shards in ``back`` (the name it was down under -> the node now serving its slots),
        and the tier when it was down and something answered: one line each (one in all for the tier)."""
        with self._lock:
            for name in back:
                self._shards_down.pop(name, None)
            was_down = self._down and (bool(back) or not self._shards_down)
            if was_down:
                self._down = False
            left = sorted(self._shards_down)
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

    def _other_error(self, what: str, exc: BaseException) -> None:
        self.counters.add(errors=1)
        if what not in self._warned_errors:
            self._warned_errors.add(what)
            log.warning("tiercache redis tier %s: %s failed: %s", self.address, what, exc)

    def _bug(self, what: str, exc: BaseException) -> None:
        self.counters.add(errors=1)
        if self._closed:  # a batch that raced `close()` (its client is gone): a miss, no bug to report
            log.debug("tiercache redis tier %s: %s after close: %s", self.address, what, exc)
            return
        seen = f"bug: {what}: {type(exc).__name__}"
        if seen not in self._warned_errors:
            self._warned_errors.add(seen)
            log.error("tiercache redis tier %s: %s failed (%s: %s); served as a miss, logged once",
                      self.address, what, type(exc).__name__, exc, exc_info=exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        """Count and log one failure as `classify` says (the tier goes down only for ``down``)."""
        kind = classify(exc)
        if kind == DOWN:
            self._mark_down(exc)
        elif kind == ERROR:
            self._other_error(what, exc)
        else:
            self._bug(what, exc)

    def _run(self, what: str, fn: Any) -> Any:
        """Run one client call; None when down or failed (never raises for a backend problem)."""
        if not self._available():
            return None
        try:
            result = fn()
        except Exception as exc:  # classify() decides what it means; none reaches the caller
            self._failed(what, exc)
            return None
        self._mark_up()
        return result

    def _pipeline(self, what: str, queue: Callable[[Any], None]) -> list[Any] | None:
        """One pipelined batch: one result per queued command, an exception object for a command that
        failed (its record is a miss or a dropped write); None when the whole batch failed.

        A batch whose every command failed the same ``down`` way (the server or every node went away
        while it ran) marks the tier down like a batch that raised. On a cluster: `_cluster_pipeline`.
        """
        if self.config.cluster:
            return self._cluster_pipeline(what, queue)

        def call() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            queue(pipe)
            res = pipe.execute(raise_on_error=False)
            if res and all(isinstance(r, Exception) for r in res) and classify(res[0]) == DOWN:
                raise res[0]
            return res

        res = self._run(what, call)
        failed = next((r for r in res if isinstance(r, Exception)), None) if res is not None else None
        if failed is not None:  # counted and logged once per call, whatever the number of records
            if classify(failed) == DOWN:  # some nodes answered: not the whole tier
                self._other_error(f"{what} (some nodes unreachable)", failed)
            else:
                self._failed(f"{what} (some records)", failed)
        return res

    def _cluster_pipeline(self, what: str, queue: Callable[[Any], None]) -> list[Any] | None:
        """`_pipeline` on a cluster, routed by this tier: one round trip to every primary at once.

        The commands are queued on a standalone pipeline that only records them, grouped by the primary
        that serves their slot in the client's slot map (every command names one key; a record's keys
        share one hash tag, so one node), written to every node first and then read back, as redis-py's
        cluster pipeline does, without what it does on a failure (each failed command resent alone,
        retried, the slot map re-read in the caller's call). A node that fails (refused, reset, timed
        out) fails its own commands, once, and its shard is marked down (`_shards_failed`); a shard
        marked down is not sent to (`ShardDownError` in its commands' places, at once). A reply saying
        the slot map is stale asks the prober to re-read it (`_ask_refresh`); any other error reply
        (OOM, READONLY, CLUSTERDOWN, ...) is its command's own failure, logged once per kind.
        """
        if not self._available():
            return None
        errors: list[Exception] = []
        failed: dict[str, tuple[int, BaseException]] = {}
        try:
            res = self._send_routed(queue, errors, failed)
        except Exception as exc:  # a bug in the queue or the routing: classify() decides, as for one server
            self._failed(what, exc)
            res = None
        if failed:
            self._shards_failed(failed)
        stale = next((e for e in errors if isinstance(e, _STALE_MAP_ERRORS)), None)
        if stale is not None:  # a failover or a resharding: misses until the prober re-read the map
            self._ask_refresh()
            if f"stale: {what}" not in self._warned_errors:
                self._warned_errors.add(f"stale: {what}")
                log.info("tiercache redis tier %s: %s: the slot map is stale (%s %s); those keys miss until "
                         "it is re-read, within %.1fs", self.address, what, type(stale).__name__, stale,
                         min(self.config.retry_after_s, SLOT_MAP_REFRESH_S))
        other = next((e for e in errors if not isinstance(e, _STALE_MAP_ERRORS)), None)
        if other is not None:
            if classify(other) == BUG:
                self._bug(f"{what} (some records)", other)
            else:  # a node answered (OOM, READONLY, CLUSTERDOWN, ...): never the whole tier
                self._other_error(f"{what} (some records)", other)
        return res

    def _send_routed(self, queue: Callable[[Any], None], errors: list[Exception],
                     failed: dict[str, tuple[int, BaseException]]) -> list[Any]:
        """Queue, route and send one cluster batch (see `_cluster_pipeline`): one result per command, an
        exception object in the place of a command that failed. Error replies and routing failures go
        to ``errors``; nodes that failed to ``failed`` (name -> a slot it serves, the error)."""
        client = self._client
        recorder = self._recorder.pipeline(transaction=False)
        queue(recorder)
        commands: list[tuple[tuple[Any, ...], dict[str, Any]]] = recorder.command_stack
        res: list[Any] = [None] * len(commands)
        slots = client.nodes_manager.slots_cache
        down = self._shards_down
        groups: dict[str, tuple[Any, int, list[int]]] = {}  # node name -> node, a slot, command indexes
        skipped: ShardDownError | None = None
        for i, (args, _) in enumerate(commands):
            slot = client.keyslot(args[1])
            owners = slots.get(slot)
            if not owners:
                res[i] = exc = redis.exceptions.SlotNotCoveredError(f"slot {slot} is in no node's slot range")
                errors.append(exc)
                continue
            node = owners[0]
            if node.name in down:
                if skipped is None:
                    skipped = ShardDownError(f"shard {node.name} is marked down")
                res[i] = skipped
                continue
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (node, slot, [])
            group[2].append(i)
        if not groups:
            return res

        def fail(name: str, slot: int, indexes: list[int], exc: BaseException) -> None:
            failed[name] = (slot, exc)
            for i in indexes:
                res[i] = exc

        sent: list[tuple[str, int, list[int], Any, Any]] = []  # name, slot, indexes, node client, connection
        done = 0  # entries of ``sent`` read back (or failed): the rest are disconnected, not reused
        try:
            for name, (node, slot, indexes) in groups.items():
                node_client = client.get_redis_connection(node)
                try:
                    conn = _pooled_connection(node_client.connection_pool)
                except _NODE_ERRORS as exc:
                    fail(name, slot, indexes, exc)
                    continue
                sent.append((name, slot, indexes, node_client, conn))
                try:
                    conn.send_packed_command(conn.pack_commands([commands[i][0] for i in indexes]))
                except _NODE_ERRORS as exc:
                    fail(name, slot, indexes, exc)
            for name, slot, indexes, node_client, conn in sent:
                if name not in failed:
                    for i in indexes:
                        args, options = commands[i]
                        try:
                            res[i] = node_client.parse_response(conn, args[0], **options)
                        except redis.ResponseError as exc:
                            res[i] = exc
                            errors.append(exc)
                        except _NODE_ERRORS as exc:
                            fail(name, slot, indexes, exc)
                            break
                done += 1
        finally:
            for k, (name, _, _, node_client, conn) in enumerate(sent):
                if k >= done or name in failed:  # replies unread: a later user would read this call's
                    conn.disconnect()
                node_client.connection_pool.release(conn)
        return res

    # ------------------------------------------------------------------------------------------- keys
    def _head(self, key: StoreKey) -> str:
        return f"{self.config.key_prefix}{{{key.hex}}}"

    def _part(self, key: StoreKey, i: int) -> str:
        return f"{self.config.key_prefix}{{{key.hex}}}:{i}"

    def _text_name(self, key: StoreKey) -> str:
        return f"{self.config.key_prefix}{{{key.hex}}}#text"

    # ------------------------------------------------------------------------------------------ reads
    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        if not keys:
            return []

        def queue(pipe: Any) -> None:
            for k in keys:
                pipe.exists(self._head(k))

        res = self._pipeline("contains", queue)
        if res is None:
            return [False] * len(keys)
        return [not isinstance(r, Exception) and bool(r) for r in res]

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        if not keys:
            return []

        names = [name for k in keys for name in (self._head(k), self._part(k, 0))]
        res = self._mget(names, "get")
        out: list[Record | None] = [None] * len(keys)
        if res is None:
            return out
        more: list[tuple[int, records.Header, int, bytes]] = []  # index, header, nparts, part0
        corrupt: list[StoreKey] = []
        for i, key in enumerate(keys):
            head, part0 = res[2 * i], res[2 * i + 1]
            if head is None or isinstance(head, Exception) or isinstance(part0, Exception):
                continue  # absent, or its node failed this command: a miss, not damage
            try:
                if len(head) < _NPARTS.size or part0 is None:
                    raise records.RecordError("head without its first part (expired or partial write)")
                nparts = _NPARTS.unpack_from(head)[0]
                prefix = memoryview(head)[_NPARTS.size:]
                if nparts == 1:
                    out[i] = records.decode_split(prefix, part0, key)
                else:
                    header = records.decode_header(prefix, key)
                    if nparts < 1 or nparts > header.nbytes // 1024 + 2:  # part_size is at least 1KiB
                        raise records.RecordError(f"bad part count {nparts}")
                    more.append((i, header, nparts, part0))
            except records.OtherFormatError:  # another build's record: a miss, left for that build
                self.counters.add(other_format=1)
            except records.RecordError as exc:
                corrupt.append(key)
                self._other_error(f"decode ({exc})", exc)
        if more:
            self._get_rest(keys, res, more, out, corrupt)
        if corrupt:
            self.counters.add(corrupt=len(corrupt))
            self._delete_pieces(corrupt)
        return out

    def _delete_pieces(self, corrupt: Sequence[StoreKey]) -> None:
        """Drop every piece of corrupt records: head and key text first (readers then miss), then parts.

        The head's part count cannot be trusted (it may be the damage, or another record's head), so
        parts are deleted in runs of `DELETE_RUN` until a run deletes fewer than it names (parts are
        numbered 0..n-1): no orphan part outlives its record (`tiercache evict` finds records by heads).
        One pipelined round trip per run, for all records at once. A cluster pipeline refuses a
        multi-key ``delete()``; one DEL of keys that share a slot (a record's hash tag) it routes, so the
        runs go as raw DEL commands and head and key text as two single-key deletes. A record whose
        delete failed is left for the next reader that finds it damaged.
        """

        def heads(pipe: Any) -> None:
            for key in corrupt:
                pipe.delete(self._head(key))
                pipe.delete(self._text_name(key))

        if self._pipeline("delete corrupt", heads) is None:
            return
        left = list(corrupt)
        for lo in range(0, MAX_DELETE_PARTS, DELETE_RUN):
            run = range(lo, lo + DELETE_RUN)
            batch = left

            def parts(pipe: Any, batch: list[StoreKey] = batch, run: range = run) -> None:
                for key in batch:
                    pipe.execute_command("DEL", *[self._part(key, p) for p in run])

            res = self._pipeline("delete corrupt", parts)
            if res is None:
                return
            left = [key for key, n in zip(batch, res, strict=True) if n == DELETE_RUN]
            if not left:
                return

    def _get_rest(self, keys: Sequence[StoreKey], res: list[Any], more: list[tuple[int, Any, int, bytes]],
                  out: list[Record | None], corrupt: list[StoreKey]) -> None:
        """Second round trip for multi-part records: fetch parts 1..n-1 and join them into one buffer
        (the one copy a get makes; a one-part record's tensor is built over its reply, no copy)."""

        def queue(pipe: Any) -> None:
            for i, _, nparts, _ in more:
                for p in range(1, nparts):
                    pipe.get(self._part(keys[i], p))

        parts = self._pipeline("get parts", queue)
        if parts is None:
            return
        pos = 0
        for i, header, nparts, part0 in more:
            pieces = [part0, *parts[pos:pos + nparts - 1]]
            pos += nparts - 1
            key = keys[i]
            if any(isinstance(p, Exception) for p in pieces):
                continue  # its node failed a command: a miss, not damage
            try:
                if any(p is None for p in pieces):
                    raise records.RecordError("missing part (expired or partial write)")
                total = sum(len(p) for p in pieces)
                if total != header.nbytes:
                    raise records.RecordError(f"parts hold {total} bytes, header says {header.nbytes}")
                # the one copy of a get: the parts into one buffer, checksummed as they are copied
                buf, checksum = records.join_payload(pieces)
                prefix = memoryview(res[2 * i])[_NPARTS.size:]
                out[i] = records.decode_split(prefix, buf, key, payload_checksum=checksum)
            except (records.RecordError, ValueError) as exc:
                corrupt.append(key)
                self._other_error(f"decode ({exc})", exc)

    # ----------------------------------------------------------------------------------------- writes
    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None:
        if not items:
            return
        ttl_ms = int(self.config.ttl_s * 1000) if self.config.ttl_s else None
        part_size = self.config.part_size
        encoded = [(key, records.encode(key, tensor, meta)) for key, tensor, meta in items]

        counts = [max(1, -(-enc.payload.nbytes // part_size)) + 2 for _, enc in encoded]  # parts, text, head

        def queue(pipe: Any) -> None:
            for key, enc in encoded:
                payload = enc.payload
                nparts = max(1, -(-payload.nbytes // part_size))
                for p in range(nparts):
                    pipe.set(self._part(key, p), payload[p * part_size:(p + 1) * part_size], px=ttl_ms)
                pipe.set(self._text_name(key), key_text_bytes(key.text), px=ttl_ms)
                pipe.set(self._head(key), _NPARTS.pack(nparts) + enc.prefix, px=ttl_ms)

        res = self._pipeline("put", queue)
        if res is None:
            self.counters.add(dropped_writes=len(items))
            return
        pos, done, nbytes = 0, 0, 0
        for (_, enc), n in zip(encoded, counts, strict=True):
            # a record with a failed command is dropped; a head written without all its parts reads as
            # damaged and is deleted by the first reader
            if not any(isinstance(r, Exception) for r in res[pos:pos + n]):
                done += 1
                nbytes += enc.nbytes
            pos += n
        self.counters.add(puts=done, bytes_written=nbytes)
        if done < len(items):
            self.counters.add(dropped_writes=len(items) - done)

    # ------------------------------------------------------------------------------ admin (stats/evict)
    def iter_stored(self) -> Iterator[StoredRecord]:
        """Every record under ``key_prefix`` (the `Tier` admin contract); ConnectionError when unreachable."""
        for _, size, idle_s, text in self._scan_records():
            yield StoredRecord(text, size, idle_s)

    def delete_stored(self, predicate: Callable[[StoredRecord], bool], *,
                      dry_run: bool = False) -> tuple[int, int]:
        """Delete the records ``predicate`` accepts (the `Tier` admin contract).

        Returns (records deleted, bytes matched): a record whose head vanished between the SCAN and the
        delete is not counted as deleted; its bytes, read at SCAN time, still are. With ``dry_run`` the
        count is what matched.
        """
        matches = [(hex_digest, size or 0) for hex_digest, size, idle_s, text in self._scan_records()
                   if predicate(StoredRecord(text, size, idle_s))]
        matched_bytes = sum(size for _, size in matches)
        if dry_run:
            return len(matches), matched_bytes
        return self._delete_records([hex_digest for hex_digest, _ in matches]), matched_bytes

    def _client_or_raise(self) -> Any:
        """Admin commands must say when Redis is unreachable, not silently report an empty store."""
        if self._client is None:
            self._connect()
        if self._client is None:
            raise ConnectionError(f"redis tier {self.address} is unreachable")
        return self._client

    def _scan_records(self, batch: int = 500) -> Iterator[tuple[str, int | None, float | None, str]]:
        """(digest hex, record bytes, idle seconds, key text) of every record under ``key_prefix``.

        SCANs the heads (never KEYS, so a big server is not blocked), then one pipelined round trip per
        batch for the heads, key texts and OBJECT IDLETIME. Size is header + payload as the head says
        (None when the head is unreadable); key text is ``""`` for records written before texts were
        stored; idle time is seconds since the head was last read or written.
        """
        client = self._client_or_raise()
        prefix = self.config.key_prefix
        heads: list[str] = []

        def flush() -> Iterator[tuple[str, int | None, float | None, str]]:
            pipe = client.pipeline(transaction=False)
            for name in heads:
                pipe.object("idletime", name)  # before the GET, which resets the idle time
                pipe.get(name)
                pipe.get(f"{name}#text")
            res = pipe.execute(raise_on_error=False)
            for i, name in enumerate(heads):
                idle, head, text = res[3 * i], res[3 * i + 1], res[3 * i + 2]
                if head is None or isinstance(head, Exception):
                    continue  # expired or deleted between SCAN and GET
                size: int | None
                try:
                    header = records.decode_header(memoryview(head)[_NPARTS.size:])
                    size = header.payload_offset + header.nbytes
                except records.RecordError:
                    size = None
                hex_digest = name[len(prefix) + 1:-1]
                text_str = text.decode(errors="replace") if isinstance(text, bytes) else ""
                idle_s = float(idle) if isinstance(idle, int) else None
                yield hex_digest, size, idle_s, text_str
            heads.clear()

        for raw in client.scan_iter(match=f"{prefix}{{*}}", count=batch):
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if not name.endswith("}"):
                continue  # a part or a key text
            heads.append(name)
            if len(heads) >= batch:
                yield from flush()
        if heads:
            yield from flush()

    def _delete_records(self, hex_digests: Sequence[str]) -> int:
        """Delete whole records (head first, so readers see a miss, then parts and key text); returns count.

        The part count comes from each head; a head that vanished meanwhile counts as not deleted.
        """
        client = self._client_or_raise()
        prefix = self.config.key_prefix
        deleted = 0
        for lo in range(0, len(hex_digests), 500):
            names = [f"{prefix}{{{h}}}" for h in hex_digests[lo:lo + 500]]
            heads = self._admin_mget(client, names)
            pipe = client.pipeline(transaction=False)
            for name, head in zip(names, heads, strict=True):
                if head is None:
                    continue
                nparts = _NPARTS.unpack_from(head)[0] if len(head) >= _NPARTS.size else 0
                pipe.delete(name)
                for p in range(min(nparts, 1 << 20)):
                    pipe.delete(f"{name}:{p}")
                pipe.delete(f"{name}#text")
                deleted += 1
            pipe.execute()
        return deleted

    def _admin_mget(self, client: Any, names: list[str]) -> list[Any]:
        """Values of ``names`` for the admin commands: raises when unreachable (they must say so)."""
        if not self.config.cluster:
            return client.mget(names)
        pipe = client.pipeline(transaction=False)  # names of many slots: pipelined GETs
        for name in names:
            pipe.get(name)
        return pipe.execute()

    def _mget(self, names: list[str], what: str) -> list[Any] | None:
        """Values of ``names`` in one round trip (None when the call failed as a whole): one MGET on one
        server (one command, one reply, least client overhead); pipelined GETs on a cluster, where
        names of many slots cannot share one command, and a failed GET is an exception in its place."""
        if not self.config.cluster:
            return self._run(what, lambda: self._client.mget(names))

        def queue(pipe: Any) -> None:
            for name in names:
                pipe.get(name)

        return self._pipeline(what, queue)

    def sizes_many(self, keys: Sequence[StoreKey]) -> list[int | None]:
        """Record size (header + payload) per key from the heads; None when absent or unreadable."""
        if not keys:
            return []
        res = self._mget([self._head(k) for k in keys], "sizes")
        out: list[int | None] = []
        for head in res or [None] * len(keys):
            try:
                header = records.decode_header(memoryview(head)[_NPARTS.size:]) \
                    if isinstance(head, bytes) and head else None
            except records.RecordError:
                header = None
            out.append(None if header is None else header.payload_offset + header.nbytes)
        return out

    # ------------------------------------------------------------------------------------------- misc
    def usage(self) -> dict[str, Any]:
        """``bytes_used``: the server's ``used_memory``; on a cluster the sum over its masters that answer
        (the replicas hold copies of the same records; a shard marked down is left out). None when down
        or unknown."""
        used = self._run("info", self._used_memory) if not self._down else None
        return {"entries": None, "bytes_used": used, "down": self._down, "address": self.address}

    def _used_memory(self) -> int | None:
        if not self.config.cluster:
            return self._client.info("memory").get("used_memory")
        # per primary: one that fails costs its own figure and marks its shard down, not the whole tier
        client = self._client
        total, answered = 0, 0
        failed: dict[str, tuple[int, BaseException]] = {}
        for node in client.get_primaries():
            if node.name in self._shards_down:
                continue
            try:
                total += int(client.get_redis_connection(node).info("memory")["used_memory"])
                answered += 1
            except _NODE_ERRORS as exc:
                slot = next((s for s, owners in client.nodes_manager.slots_cache.items()
                             if owners and owners[0].name == node.name), None)
                if slot is not None:
                    failed[node.name] = (slot, exc)
        if failed:
            self._shards_failed(failed)
        return total if answered else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._stop.set()
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead connection must not fail shutdown
                pass
