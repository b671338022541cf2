"""TieredStore: ordered tiers (fastest first) behind the one `Store` interface connectors use.

Read path: ask tiers in order, each only for the keys still missing (one batched call per tier); a hit
in a slower tier is promoted into the faster ones. Write path: the fastest tier synchronously, slower
tiers through the bounded background writer, so a put costs one memory copy, never an fsync or a
network round trip. A slower tier whose admission is ``evicted`` is exclusive of memory instead: it is
written what memory evicts, and on a clean close what memory still holds (`writes.demotion`).

Write-behind stays readable: a record queued for the slower tiers stays in the write-behind buffer
(`vllm_tiercache.shared.store.writes.behind`) until the writer has written it, and reads consult it right
after the fastest tier; an eviction of such a record reaches listeners only once its write is done.

Why copy on put: the caller's tensor may be a view into vLLM's paged KV cache, or an encoder output vLLM
keeps, that is reused right after the call, while the slower tiers are written later, by the writer. So
by default a put makes one private copy (`own_tensor`: one pass over the bytes, on the calling thread).
A caller that hands over a tensor nobody touches afterwards (a freshly gathered block tensor, a
device-to-host copy made for the store) passes ``owned=True``: the store keeps that very tensor, the
memory tier holds it and the slower tiers write from it, with no copy. Either way that is the store's
only copy; what a tier adds on its way out is the tier's own (Redis: see `tiers/redis/tier.py`).

The schedulers' lookups never wait on the network: ``contains_many(..., shared_only=True)`` (the lookup
a scheduler makes for every new request, synchronously, on the engine's one scheduling thread) asks a
tier declaring `RemoteTier` (Redis) on that tier's own lookup thread (`BoundedLookup`) and waits at most
``lookup_budget_ms`` in all; what the tier has not answered by then is a miss, never a hit it did not
confirm. A call that hangs (a paused server, a partition that drops packets) keeps that thread until the
tier's own timeout; meanwhile further lookups of that tier answer "miss" at once instead of queueing
behind it. Local tiers (memory, disk, GDS) answer inline. Worker-side reads and writes are not bounded
this way: they have the tier's own timeouts and fall back to recompute.

Numbers for `/metrics`: counters are in-process and cheap; `take_counter_deltas` hands out what moved
since the last call (one baseline per store, so the two connectors sharing a store never report an
increment twice). Usage (bytes held, Redis reachability) may cost a backend round trip (Redis `INFO`),
so it never runs on a connector's step: `gauge_report` returns the latest snapshot of a background
thread (`vllm_tiercache.shared.store.usage`).

Tiers are used through `Tier` and the capabilities their classes declare (`vllm_tiercache.shared.store.api`)
only: the store never looks for an attribute on a tier, nor decides anything by a tier's kind.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.admission import AdmissionGate, drop_orphans
from vllm_tiercache.shared.store.api import (
    InProcessTier,
    PayloadAllocator,
    Prefetches,
    Reach,
    ReadsInto,
    Record,
    RemoteTier,
    ReportsEvictions,
    ReportsHealth,
    StoreKey,
    TakesPayloadAllocator,
    Tier,
    in_reach,
)
from vllm_tiercache.shared.store.bounded_lookup import BoundedLookup
from vllm_tiercache.shared.store.control import ControlPoller
from vllm_tiercache.shared.store.counters import CounterBaseline
from vllm_tiercache.shared.store.registry import make_tier
from vllm_tiercache.shared.store.sealing.boundary import sealed_tiers, seals
from vllm_tiercache.shared.store.series import tier_names
from vllm_tiercache.shared.store.usage import UsageRefresh, tier_usage
from vllm_tiercache.shared.store.writes.background import BackgroundWriter, Item
from vllm_tiercache.shared.store.writes.behind import WriteBehindBuffer
from vllm_tiercache.shared.store.writes.demotion import Demotion
from vllm_tiercache.shared.store.writes.patience import put_patiently

log = logging.getLogger(__name__)

#: An integer dtype of each element size: a CPU copy moves bytes, so any dtype of that size is viewed as it.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _promotable(record: Record) -> torch.Tensor:
    """What a faster tier keeps of a record a slower one returned: the record's own tensor, or a host copy
    when its data is the caller's (read in place) or lies in GPU memory (the GDS tier reads there; the
    memory tier keeps host bytes and counts them against a host budget)."""
    if record.in_place:
        return records.joined_copy(record)
    if record.tensor.device.type != "cpu":
        return own_tensor(record.tensor)
    return record.tensor


def own_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """One contiguous CPU copy of ``tensor``: the store's private copy (one pass over the bytes).

    A CPU source is copied by numpy on the calling thread (a memcpy when contiguous, a strided loop
    otherwise; numpy lets the GIL go meanwhile), never by ``Tensor.copy_``: torch splits a copy of more
    than 32 Ki elements over its intra-op thread pool and waits for every thread, so on a machine whose
    other cores are busy (other processes, vLLM's own CPU threads) it stalls (figures: docs/benchmarks.md,
    on the memory put). A device source is one device-to-host copy.
    """
    src = tensor.detach()
    out = torch.empty(src.shape, dtype=src.dtype)
    if src.device.type == "cpu" and src.numel() > 0:
        as_int = _INT_OF_SIZE.get(src.element_size())
        if as_int is not None:
            try:
                dst_np, src_np = out.view(as_int).numpy(), src.view(as_int).numpy()
            except (RuntimeError, TypeError):  # a conj/neg bit, a quantized dtype: torch copies below
                pass
            else:
                np.copyto(dst_np, src_np, casting="no")
                return out
    out.copy_(src)
    return out


def _tier_error(tier: Tier, what: str, exc: BaseException) -> None:
    """A tier bug (tiers handle their own backend errors) becomes a miss plus a log line."""
    tier.counters.add(errors=1)
    log.exception("tiercache: %s tier %s failed: %s", tier.name, what, exc)


class TieredStore:
    """The process's store: thread-safe, never raises for a backend problem, see module docstring."""

    def __init__(self, config: StoreConfig, tiers: Sequence[Tier] | None = None) -> None:
        self.config = config
        config_tiers = None
        if tiers is None:
            tiers = config_tiers = [make_tier(tc, name)
                                    for tc, name in zip(config.tiers, tier_names(config.tiers), strict=True)]
        self.tiers: list[Tier] = list(tiers)
        #: The background usage refresh (`gauge_report`)
        self.usage_refresh = UsageRefresh(self.tiers)
        if not self.tiers:
            raise ValueError("a TieredStore needs at least one tier")
        #: a sealing store's seal and open steps (`encryption`); None: every tier keeps plaintext
        self._sealed = sealed_tiers(config.encryption)
        self._writer = BackgroundWriter(config.write_queue_size,
                                        prepare=self._sealed.prepare if self._sealed else None,
                                        patience_s=config.write_patience_s)
        self._write_behind = WriteBehindBuffer()
        self._closed = False
        self._close_lock = threading.Lock()
        #: What `take_counter_deltas` handed out so far, per tier (and the write-behind hits).
        self._reported = CounterBaseline()
        self.source = f"{os.getpid()}:{id(self):x}"
        #: The budget of the schedulers' lookups, and each remote tier's lookup thread (by tier index).
        self.lookup_budget_s = float(config.lookup_budget_ms) / 1000.0
        self._bounded: dict[int, BoundedLookup] = {
            i: BoundedLookup(t, _tier_error) for i, t in enumerate(self.tiers) if isinstance(t, RemoteTier)}
        self.control = ControlPoller(self.tiers, config.control_poll_s)  # invalidations, pins (`control`)
        self.control.start()
        #: each slower tier's admission (`vllm_tiercache.shared.store.admission`); tiers built by the caller
        #: have no config here: they admit everything
        rules = [getattr(tc, "admission", None) for tc in config.tiers[1:]] if tiers is config_tiers else []
        self._admission = AdmissionGate(self.tiers[1:], rules or [None] * (len(self.tiers) - 1))
        if self._admission.active and isinstance(self.tiers[0], ReportsEvictions):
            self.tiers[0].add_eviction_listener(self._admission.forget)
        #: memory's evictions written down to the tiers exclusive of it (admission ``evicted``); None: none are
        self._demotion = Demotion.of(self.tiers, self._admission.demote_to, self._write_down)

    # ------------------------------------------------------------------------------------------ reads
    def _tiers(self, shared_only: bool, reach: Reach = "all") -> list[tuple[int, Tier]]:
        return [(i, t) for i, t in enumerate(self.tiers)
                if (t.shared_across_processes or not shared_only) and in_reach(t, reach)]

    @property
    def far_tiers(self) -> list[Tier]:
        """The tiers whose calls cross the network (`RemoteTier`: Redis, the object tier)."""
        return [t for t in self.tiers if isinstance(t, RemoteTier)]

    def contains_many(self, keys: Sequence[StoreKey], shared_only: bool = False, *,
                      bounded: bool | None = None, reach: Reach = "all") -> list[bool]:
        """Which keys some tier holds; ``shared_only`` consults only tiers other processes also see;
        ``reach`` only the near (in-process, local files) or the far (`RemoteTier`) tiers.

        A record still on its way to the slower tiers counts as held, except for ``shared_only``: other
        processes can't read this process's write-behind buffer.

        ``bounded`` (default: ``shared_only``, the schedulers' lookup): remote tiers are asked on their
        lookup thread and the call waits at most ``lookup_budget_ms`` for them in all; what they did not
        answer by then is a miss (module docstring). ``bounded=False`` waits for every answer (offline
        checks that must not mistake a slow answer for a missing record).
        """
        if bounded is None:
            bounded = shared_only
        deadline = time.monotonic() + self.lookup_budget_s if bounded else 0.0
        found = [False] * len(keys)
        missing = list(range(len(keys)))
        for ti, tier in self._tiers(shared_only, reach):
            if not missing:
                break
            if ti == 1 and not shared_only:
                held, missing = self._write_behind.split(keys, missing)
                for i in held:
                    found[i] = True
                if not missing:
                    break
            lookup = self._bounded.get(ti) if bounded else None
            if lookup is not None and not (isinstance(tier, ReportsHealth) and tier.down):  # down: inline, at once
                res = lookup.ask([keys[i] for i in missing], deadline - time.monotonic())
                if res is None:  # past the budget, or a call still outstanding: misses
                    continue
            else:
                try:
                    res = tier.contains_many([keys[i] for i in missing])
                except Exception as exc:
                    _tier_error(tier, "contains_many", exc)
                    continue
            still = []
            for i, hit in zip(missing, res, strict=True):
                if hit:
                    found[i] = True
                else:
                    still.append(i)
            missing = still
        return found

    def get(self, key: StoreKey) -> Record | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[StoreKey], *, into: Sequence[Sequence[memoryview] | None] | None = None,
                 reach: Reach = "all") -> list[Record | None]:
        """Records for ``keys`` (None for a miss): fastest tier, write-behind buffer, then slower tiers;
        ``reach="near"`` never asks a tier across the network (a forward pass reading what was prefetched).

        ``into`` (`Store.get_many`) goes to the tiers that read into a destination (``get_many_into``);
        a record they land in place is promoted as a copy, since the destination stays the caller's."""
        out: list[Record | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        found_in: list[tuple[int, list[Item]]] = []
        first_hits: list[int] = []
        for ti, tier in enumerate(self.tiers):
            if not missing:
                break
            if ti == 1:
                held, missing = self._write_behind.split(keys, missing, count_hits=True)
                for i, record in held.items():
                    out[i] = record
                if not missing:
                    break
            if not in_reach(tier, reach):
                continue
            start = time.perf_counter()
            asked = [keys[i] for i in missing]
            try:
                if into is not None and isinstance(tier, ReadsInto) and not (self._sealed and seals(tier)):
                    res = tier.get_many_into(asked, [into[i] for i in missing])
                else:
                    res = tier.get_many(asked)
                if self._sealed:  # opened into the caller's memory where it gave some
                    res = self._sealed.incoming(tier, asked, res, None if into is None else [into[i] for i in missing])
            except Exception as exc:
                _tier_error(tier, "get_many", exc)
                res = [None] * len(missing)
            elapsed = time.perf_counter() - start
            still, promoted, nbytes = [], [], 0
            for i, rec in zip(missing, res, strict=True):
                if rec is None:
                    still.append(i)
                    continue
                out[i] = rec
                nbytes += rec.nbytes
                if ti == 0:
                    first_hits.append(i)
                else:
                    promoted.append((keys[i], _promotable(rec), rec.meta))
            tier.counters.add(hits=len(missing) - len(still), misses=len(still), bytes_read=nbytes,
                              read_seconds=elapsed)
            if promoted:
                found_in.append((ti, promoted))
            missing = still
        for ti, items in found_in:
            self._promote(ti, items)
        if self._admission.active:  # count the hits; write down what they admit
            self._write_down(self._admission.on_read(keys, out, first_hits))
        return out

    def prefetch(self, keys: Sequence[StoreKey]) -> None:
        """Tell the tiers that can read ahead (`Prefetches`: disk) that ``keys`` will be read soon; keys an
        in-process tier in front (`InProcessTier`: memory) holds are left out (no device reads for its hits)."""
        readers = [tier for tier in self.tiers if isinstance(tier, Prefetches)]
        if not readers or not keys:
            return
        front = self.tiers[0]
        held = front.contains_many(keys) if isinstance(front, InProcessTier) else [False] * len(keys)
        wanted = [key for key, h in zip(keys, held, strict=True) if not h]
        for tier in readers:
            try:
                tier.prefetch_many(wanted)
            except Exception as exc:  # a hint: never let it fail a load
                _tier_error(tier, "prefetch_many", exc)

    def _write_down(self, groups: list[tuple[list[Tier], list[Item]]], urgent: bool = False) -> None:
        """Queue each (slower tiers, items) group, readable from the write-behind buffer until written."""
        for tiers, items in groups:
            self._write_behind.hold(items)
            if not self._writer.submit(tiers, items, on_done=self._write_behind.release, urgent=urgent):
                self._write_behind.release(items)

    def _promote(self, found_tier: int, items: list[Item]) -> None:
        """Copy hits into faster tiers: the fastest synchronously, the ones in between in background."""
        self._put_sync(self.tiers[0], items)
        if self._demotion is not None:  # a tier exclusive of memory drops what memory now holds
            self._demotion.promoted(self.tiers[found_tier], [key for key, _, _ in items])
        if found_tier > 1:
            self._writer.submit(self.tiers[1:found_tier], items)

    # ----------------------------------------------------------------------------------------- writes
    def put(self, key: StoreKey, tensor: torch.Tensor, meta: dict[str, Any] | None = None, *,
            owned: bool = False, always_admit: bool = False) -> None:
        self.put_many([(key, tensor, meta)], owned=owned, always_admit=always_admit)

    def put_many(self, items: Sequence[Item], *, owned: bool = False, urgent: bool = False,
                 always_admit: bool = False, reused_shares: Sequence[float | None] | None = None) -> None:
        """Store records: fastest tier now, slower tiers queued (dropped and counted when the queue is full;
        ``urgent`` ones, which another engine waits for, go ahead of the queue and are never dropped).
        Each slower tier takes what its admission admits (`vllm_tiercache.shared.store.admission`);
        ``always_admit`` (precomputed, pinned records) and ``urgent`` puts bypass it, and ``reused_shares``
        (per item, the share of its prompt the putting request reused; None: no request) may admit at once.

        ``owned=True``: the caller hands the tensors over and never mutates them afterwards, so the store
        keeps them as they are instead of copying (CPU, contiguous tensors only; others are still copied
        once). The default, ``owned=False``, copies each tensor once (`own_tensor`): the caller may reuse
        its buffer as soon as the call returns.
        """
        if self._closed or not items:
            return
        mine: list[Item] = []
        for key, tensor, meta in items:
            if not (owned and tensor.device.type == "cpu" and tensor.is_contiguous()):
                tensor = own_tensor(tensor)
            mine.append((key, tensor.detach(), dict(meta) if meta else {}))
        if len(self.tiers) == 1:
            self._put_sync(self.tiers[0], mine)
            return
        down = mine
        if not (always_admit or urgent):  # dead on arrival: memory only (`admission.drop_orphans`)
            down, reused_shares = drop_orphans(mine, reused_shares, self._held_near, self.tiers[1:])
        groups = (self._admission.on_put(down, exempt=always_admit or urgent, reused_shares=reused_shares)
                  if down else [])
        for _, admitted in groups:  # before the fastest tier, which may evict one of them right away
            self._write_behind.hold(admitted)
        self._put_sync(self.tiers[0], mine)
        for tiers, admitted in groups:
            if not self._writer.submit(tiers, admitted, on_done=self._write_behind.release, urgent=urgent):
                self._write_behind.release(admitted)

    def _held_near(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Which keys a near tier or the write-behind buffer holds; all of them when the store has a far
        tier (a parent held only there is not asked for: a network round trip on every put)."""
        return [True] * len(keys) if self.far_tiers else self.contains_many(keys, reach="near", bounded=False)

    def _put_sync(self, tier: Tier, items: list[Item]) -> None:
        start = time.perf_counter()
        try:
            put_patiently(tier, self._sealed.outgoing(tier, items) if self._sealed else items,
                          self.config.write_patience_s)
        except Exception as exc:
            _tier_error(tier, "put_many", exc)
            tier.counters.add(dropped_writes=len(items))
        tier.counters.add(write_seconds=time.perf_counter() - start)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued slower-tier writes (and drops, `writes.demotion`) are done; False when ``timeout``
        passed first. A patient store (``write_patience_s``) waits longer: its writes may be waiting out a tier."""
        return self._writer.flush(timeout) and (self._demotion is None or self._demotion.flush(timeout))

    @property
    def write_patience_s(self) -> float:
        return self.config.write_patience_s

    @property
    def pending_writes(self) -> int:
        return self._writer.pending

    # ------------------------------------------------------------------------------------------- misc
    @property
    def memory_tier(self) -> Tier | None:
        """The in-process memory tier (`InProcessTier`), if any: the one tier other processes can't see
        (residency reports)."""
        return next((tier for tier in self.tiers if isinstance(tier, InProcessTier)), None)

    def add_eviction_listener(self, listener: Callable[[str, bytes], None]) -> None:
        """Call `listener(tier_kind, digest)` whenever a tier that reports evictions (`ReportsEvictions`)
        drops a record.

        For a record whose write to the slower tiers is still queued, the call waits until that write is
        done: a listener (a residency report) may then tell other processes to look in a shared tier.
        """
        for tier in self.tiers:
            if isinstance(tier, ReportsEvictions):
                tier.add_eviction_listener(
                    lambda digest, t=tier: self._write_behind.on_eviction(t, digest, lambda: listener(t.kind, digest)))

    @property
    def reads_into(self) -> bool:
        """True when some tier lands payloads in the caller's memory (`ReadsInto`; `get_many`'s ``into``), or a
        sealing store opens records there (every tier it seals)."""
        return any(isinstance(tier, ReadsInto) or (self._sealed is not None and seals(tier)) for tier in self.tiers)

    def set_payload_allocator(self, allocator: PayloadAllocator | None) -> None:
        """Hand ``allocator`` to the tiers that read whole records into memory they are given
        (`TakesPayloadAllocator`: a CUDA KV worker's pinned memory); None: their own buffers again."""
        for tier in self.tiers:
            if isinstance(tier, TakesPayloadAllocator):
                tier.set_payload_allocator(allocator)

    def stats(self, cached_usage: bool = False) -> dict[str, Any]:
        """JSON-able snapshot: {"tiers": {name: counters + usage}, "write_queue": {...}}.

        ``cached_usage``: the usage fields come from the background refresh (`gauge_report`) instead of
        asking every tier now (a Redis `INFO` round trip); use it on any path that runs per step.
        """
        cached = self.usage_refresh.snapshot() if cached_usage else {}
        tiers: dict[str, Any] = {}
        for tier in self.tiers:
            entry: dict[str, Any] = {"kind": tier.kind,
                                     "shared_across_processes": tier.shared_across_processes}
            entry.update(tier.counters.snapshot())
            if cached_usage:
                usage = cached.get(tier.name)
                entry.update(usage["raw"] if usage else {"entries": None, "bytes_used": None})
            else:
                entry.update(tier_usage(tier))
            tiers[tier.name] = entry
        return {
            "namespace": self.config.namespace,
            "tiers": tiers,
            "write_queue": {"pending": self._writer.pending, "capacity": self.config.write_queue_size,
                            "hits": self._write_behind.hits},
            "lookup": {"budget_ms": self.lookup_budget_s * 1000.0,
                       "past_budget": sum(b.past_budget for b in self._bounded.values()),
                       "busy": sum(b.busy for b in self._bounded.values())},
        }

    # ------------------------------------------------------------------------------------ /metrics
    def take_counter_deltas(self) -> dict[str, Any]:
        """What the tiers' counters grew by since the last call: {"tiers": {tier: {name: increment}},
        "write_queue_hits": n}, only what moved. In-process and cheap (no backend call).

        One baseline per store: a store two connectors share hands each increment to one of them.
        """
        return self._reported.take(self.tiers, self._write_behind.hits)

    def gauge_report(self) -> dict[str, Any]:
        """This store's gauges for `/metrics`, never blocking on a backend: {"tiers": {tier: {"bytes_used",
        "up", "shared"}}, "write_queue": pending}. Usage is the background refresh's latest snapshot (None
        before its first pass); reachability and the queue are read now (in-process). Capacity is not
        here: `/metrics` has it from the configuration."""
        cached = self.usage_refresh.snapshot()
        tiers: dict[str, Any] = {}
        for tier in self.tiers:
            usage = cached.get(tier.name, {})
            # a tier that reports its health: the share that answers (a cluster's shards); others are up
            up = tier.up_share if isinstance(tier, ReportsHealth) else 1
            tiers[tier.name] = {"bytes_used": usage.get("bytes_used"), "up": up,
                                "shared": int(bool(tier.shared_across_processes))}
        return {"tiers": tiers, "write_queue": self._writer.pending}

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_for_lookups(self, timeout_s: float) -> bool:
        """Wait until no remote tier's bounded lookup has a call outstanding (`BoundedLookup.wait_idle`);
        False if one still has after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return all(lookup.wait_idle(max(0.0, deadline - time.monotonic())) for lookup in self._bounded.values())

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush queued writes (up to ``timeout`` s), stop the writer, release every tier."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.usage_refresh.close()
        self.control.close()
        for lookup in self._bounded.values():
            lookup.close()
        if self._demotion is not None:  # a clean close: what only memory holds is written down first
            self._demotion.write_down_held()
        if not self._writer.close(timeout):
            log.warning("tiercache: closing with %d slower-tier writes not flushed", self._writer.pending)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as exc:
                log.warning("tiercache: closing %s tier failed: %s", tier.name, exc)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
