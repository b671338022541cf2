"""Scheduler side: when a chunk becomes servable from a tier, or stops being, turn that into KV cache events.

`vllm_tiercache.kvcache.events.ledger` builds the events; this module decides *when*, from what the scheduler
process learns anyway:

- **memory tier** (``CPU``): the workers' residency reports (`TieredKVWorkerMetadata`: a chunk every layer
  of which every rank's memory tier holds, or one it dropped), applied in the same step vLLM publishes.
- **shared tiers** (``DISK`` for disk/GDS, ``STORAGE`` for a store whose shared tiers are all remote):
  a chunk whose save was planned, or that the memory tier reported dropped while not announced there (a
  tier exclusive of memory, admission ``evicted``, is written it then), is asked of the shared tiers (at
  most ``confirm_per_step`` chunks per step, only while some are waiting: their last-written record, then
  every record of every rank of those that have it) until they hold it, or until ``confirm_timeout_s``
  passes (a write-behind dropped it). A lookup that finds a chunk stored announces it too (after a
  restart, the disk's chunks are announced as requests find them), and one that finds an announced chunk
  gone withdraws it. Records another process drops (`tiercache evict`, a disk LRU of another engine, a
  corrupt record deleted by a reader) are found by a sweep: every ``sweep_interval_s``, ``sweep_chunks``
  announced chunks in turn are asked again (by one record each).
- every chunk whose save is planned is journaled (`vllm_tiercache.kvcache.events.journal`, written on its
  own thread), and at start the chunks the journal lists and the shared tiers still hold are announced
  with the first step (`vllm_tiercache.kvcache.events.discovery`: checked on a thread started with the
  scheduler; at most the journal's 4,096 chunks; a ring a hung or down shared tier kept from being read
  is read and checked again once every shared tier answers);
- the questions to the shared tiers (confirmation, sweep, chunks asked again after an outage) run off the
  step (`vllm_tiercache.kvcache.off_step`): each step posts one batch when the last one is
  answered, and applies the answer on the step after it came. A chunk is so announced a step or two
  after its records land, and a slow or hung shared tier delays its own events, never the step;
- a shared tier that does not answer (Redis down or hung past its timeout, some cluster shards down) is
  no place to load from: what the sweep, a confirmation or a lookup then finds missing is withdrawn, as
  any missing chunk is, but kept aside (at most `MAX_UNREACHABLE` chunks, with their payloads), and once
  every shared tier answers again those chunks are asked for once more and announced again if they are
  still there. An outage so costs the router's view only while it lasts;
- a load that failed withdraws the chunk from every medium; a connector reset (a new weights generation)
  publishes `AllBlocksCleared`; a reset of vLLM's own prefix cache (vLLM publishes `AllBlocksCleared`,
  and routers then forget the tiers too) re-announces everything still held.

Nothing runs unless vLLM's ``kv_events_config`` enables events: the connector then builds no tracker.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm_tiercache.kvcache.events.discovery import FIRST_STEP_WAIT_S, Discovered, StartupDiscovery
from vllm_tiercache.kvcache.events.journal import PER_SEGMENT, SLOTS, EventJournal
from vllm_tiercache.kvcache.events.ledger import MEDIUM_DISK, MEDIUM_MEMORY, MEDIUM_REMOTE, KVEventLedger
from vllm_tiercache.kvcache.naming import KVNaming, RequestNames
from vllm_tiercache.kvcache.off_step import OffStepJob
from vllm_tiercache.shared.store.api import FileTier, ReportsHealth, Store, StoreKey
from vllm_tiercache.shared.vllm_compat import prefix_cache_epoch

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

#: Chunks withdrawn while a shared tier did not answer, kept to be asked again once it does (the journal's
#: bound: beyond it, the oldest are left to be found again by the requests that look them up).
MAX_UNREACHABLE = 4096
#: Chunks asked of the shared tiers per batch for their confirmation (`bench kv-step` sizes its settling by it).
CONFIRM_PER_STEP = 8


def shared_medium(store: Store) -> str | None:
    """The medium a chunk in the store's shared tiers is announced as: ``DISK`` when one of them keeps files
    (a load from the shared tiers reads a local file first), ``STORAGE`` when all are remote (Redis), None
    without shared tiers."""
    shared = [tier for tier in store.tiers if tier.shared_across_processes]
    if not shared:
        return None
    return MEDIUM_DISK if any(isinstance(tier, FileTier) for tier in shared) else MEDIUM_REMOTE


class TierEventTracker:
    """Everything the scheduler side does for KV cache events (see the module docstring)."""

    def __init__(self, *, store: Store, naming: KVNaming, clock: Callable[[], float] = time.monotonic,
                 confirm_per_step: int = CONFIRM_PER_STEP, discover_per_step: int = 16, confirm_timeout_s: float = 30.0,
                 sweep_interval_s: float = 2.0, sweep_chunks: int = 32) -> None:
        self.store = store
        self.naming = naming
        groups = naming.groups
        first_full = groups.full[0].index if groups.full else 0
        self.ledger = KVEventLedger(block_size=naming.geometry.block_size, group_idx=first_full)
        self.memory_medium = MEDIUM_MEMORY if store.memory_tier is not None else None
        self.shared_medium = shared_medium(store)
        self.clock = clock
        self.confirm_per_step = confirm_per_step
        self.discover_per_step = discover_per_step
        self.confirm_timeout_s = confirm_timeout_s
        self.sweep_interval_s = sweep_interval_s
        self.sweep_chunks = sweep_chunks
        #: chunks whose save was planned, not yet found in the shared tiers: name -> give up at (clock)
        self._unconfirmed: OrderedDict[bytes, float] = OrderedDict()
        self._next_sweep = 0.0
        self._sweep_at = 0
        self._kv_cache_manager: Any = None
        self._prefix_epoch: object | None = None
        self.journal = EventJournal(store, naming, clock, background=True) if self.shared_medium is not None else None
        #: chunks journaled by this engine (the newest ring's worth): a chunk saved again is not journaled twice
        self._journaled: OrderedDict[bytes, None] = OrderedDict()
        #: chunks to ask the shared tiers about again (back from an outage), taken from the end, a batch a step
        self._discovered: list[tuple[bytes, Any]] = []
        #: the shared tiers' questions of a step, answered off the step (tests swap in an inline one); its thread
        #: starts now, not on the scheduling thread's first step
        self.off_step = OffStepJob("tiercache-kv-events")
        self.off_step.start()
        #: bumped by `reset`: an answer to a question asked before it is about names of the old generation
        self._generation = 0
        #: the shared tiers that know whether they answer (Redis): read from memory, never the network
        self._health = [tier for tier in store.tiers
                        if tier.shared_across_processes and isinstance(tier, ReportsHealth)]
        #: chunks withdrawn while a shared tier did not answer: name -> payload, asked again once it does
        self._unreachable: OrderedDict[bytes, Any] = OrderedDict()
        #: the journal's start-up check, started now (the engine is still starting), applied by a step
        self._startup = (StartupDiscovery(self.journal, self._in_shared, self.shared_answering)
                         if self.journal is not None else None)
        self._first_take = True
        #: the start-up check could not read the whole ring (a shared tier down or hung): checked again,
        #: the same way, by the first step that finds every shared tier answering
        self._ring_unread = False

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager
        self._prefix_epoch = prefix_cache_epoch(manager)

    # ---------------------------------------------------------------------------------- what is learned
    def save_planned(self, name: bytes, request: Request, start_block: int, end_block: int) -> None:
        """A step saves the chunk: remember its payload; the shared tiers are asked for it from now on."""
        self.ledger.remember(name, request, start_block, end_block)
        if self.shared_medium is not None:
            self._unconfirmed[name] = self.clock() + self.confirm_timeout_s
            self._unconfirmed.move_to_end(name)
        self._journal(name)

    def _journal(self, name: bytes) -> None:
        """Journal a chunk as its save is planned (the journal's docstring says why not once confirmed)."""
        journal, payload = self.journal, self.ledger.payload(name)
        if journal is None or payload is None or name in self._journaled:
            return
        journal.add(name, payload)
        self._journaled[name] = None
        if len(self._journaled) > SLOTS * PER_SEGMENT:
            self._journaled.popitem(last=False)

    def looked_up(self, request: Request, names: RequestNames, ends: Sequence[int], stored: Sequence[bool],
                  resident: Sequence[bool], asked: Sequence[bool]) -> None:
        """A lookup's findings per chunk (its end block; loadable; in the workers' memory; asked of the shared
        tiers): a stored chunk is announced where it was found, an announced one found gone is withdrawn."""
        geometry = self.naming.geometry
        for end, ok, in_memory, was_asked in zip(ends, stored, resident, asked, strict=True):
            name = names.name(end)
            medium = self.memory_medium if in_memory else self.shared_medium
            if ok and medium is not None:
                self.ledger.remember(name, request, geometry.chunk_start(end), end)
                self.ledger.stored(name, medium)
            elif was_asked and self.shared_medium is not None and not ok:
                self._withdraw_shared(name, answering=self.shared_answering())

    def residency(self, added: Iterable[bytes], evicted: Iterable[bytes]) -> None:
        """The workers' memory tier report of one step."""
        if self.memory_medium is None:
            return
        self.ledger.stored_many(added, self.memory_medium)
        for name in evicted:
            self.ledger.removed(name, self.memory_medium)
            if self.shared_medium is not None and self.ledger.knows(name) and name not in self._unconfirmed \
                    and not self.ledger.holds(name, self.shared_medium):
                # a shared tier exclusive of memory (admission evicted) is written the chunk now: the report
                # comes once its records landed, so it is asked for again (found at once: announced there)
                self._unconfirmed[name] = self.clock() + self.confirm_timeout_s

    def failed(self, names: Iterable[bytes]) -> None:
        """Chunks a load could not use: servable from nowhere until saved again."""
        for name in names:
            self._withdraw(name)

    def reset(self) -> None:
        """A connector reset: every name before it belongs to the old weights generation."""
        self.ledger.cleared()
        self._unconfirmed.clear()
        self._unreachable.clear()
        self._generation += 1
        self._discovered = []
        self._startup = None  # what the journal lists is of the old generation: never announced
        self._ring_unread = False
        # later names carry the new generation's salt, which no restarted engine computes: not journaled
        if self.journal is not None:
            self.journal.abandon()
        self.journal = None

    def close(self) -> None:
        """The engine stops: the question in flight is answered (or given up on after 10 s), then the journal's
        last entries are written (the store's flush then stores them)."""
        self.off_step.close(10.0)
        if self.journal is not None:
            self.journal.close()
        self._startup = None
        self._ring_unread = False

    # ----------------------------------------------------------------------------------- once per step
    def take(self) -> list[KVCacheEvent]:
        """This step's events (vLLM's ``take_events``, called once per step after the workers' reports): the
        shared tiers' last answer applied, their next questions posted, nothing waited for."""
        if self._kv_cache_manager is not None:
            epoch = prefix_cache_epoch(self._kv_cache_manager)
            if epoch is not self._prefix_epoch:
                self._prefix_epoch = epoch
                self.ledger.reannounce()
        if self._ring_unread and self.journal is not None and self.shared_answering():
            self._ring_unread = False  # on a thread of its own, applied by a later step
            self._startup = StartupDiscovery(self.journal, self._in_shared, self.shared_answering)
        if self._startup is not None:
            self._apply_startup()
        if self.shared_medium is not None:
            self.off_step.apply_done()
            if self.off_step.settled and self._questions_due():
                self._post_questions()
        return self.ledger.take()

    def _questions_due(self) -> bool:
        """Whether `_post_questions` would ask anything: a few attribute reads, so that a step with nothing to
        ask (most decode steps) costs no lists, no lock and no clock beyond the sweep's."""
        return bool(self._discovered or self._unconfirmed or (self._unreachable and self.shared_answering())
                    or self.clock() >= self._next_sweep)

    def _post_questions(self) -> None:
        """One batch of what is due: chunks asked again, confirmation and the sweep together; the answer is
        applied by a later `take`."""
        generation = self._generation
        if self._unreachable and self.shared_answering():  # back: asked next, taken from the end a batch a
            # step: parents last, so a batch never comes before its parents' batch
            back = sorted(self._unreachable.items(), key=lambda item: -item[1].start_block)
            self._discovered.extend(back)
            self._unreachable.clear()
        discover = [(name, payload) for name, payload in self._discovered[-self.discover_per_step:]
                    if not self.ledger.holds(name, self.shared_medium)]  # type: ignore[arg-type]
        n_discover = min(self.discover_per_step, len(self._discovered))
        confirm = [name for _, name in zip(range(self.confirm_per_step), self._unconfirmed, strict=False)]
        sweep: list[bytes] = []
        if self.clock() >= self._next_sweep:
            self._next_sweep = self.clock() + self.sweep_interval_s
            sweep = self._sweep_batch()
        if not (n_discover or confirm or sweep):
            return
        discover_names = [name for name, _ in discover]

        def ask() -> tuple[list[bool], list[bool], list[bool], bool]:
            answering = self.shared_answering()
            found = self._in_shared(discover_names), self._confirmed(confirm), self._first_records_held(sweep)
            # a "no" counts as gone only from tiers that answered throughout
            return *found, answering and self.shared_answering()

        def answered(answers: tuple[list[bool], list[bool], list[bool], bool]) -> None:
            if generation != self._generation:
                return  # asked about the names of the weights generation before a reset
            found_discovered, found_confirmed, found_swept, answering = answers
            del self._discovered[len(self._discovered) - n_discover:]  # type: ignore[index]
            if not answering:  # what they did not find is not known to be gone: asked again once they answer
                for (name, payload), ok in zip(discover, found_discovered, strict=True):
                    if not ok:
                        self._keep_unreachable(name, payload)
            self._apply_discovered(discover, found_discovered)
            self._apply_confirmed(confirm, found_confirmed, answering=answering)
            for name, ok in zip(sweep, found_swept, strict=True):
                if not ok:
                    self._withdraw_shared(name, answering=answering)

        self.off_step.submit(ask, answered)

    # --------------------------------------------------------------- off the step: the shared tiers asked
    def _confirmed(self, batch: list[bytes]) -> list[bool]:
        """Chunks waiting for their shared-tier records: first their last-written record (the last layer of
        the last rank: the workers write a chunk's layers in order), then, for those that have it, every one."""
        if not batch:
            return []
        last = self._contains([self._last_key(name) for name in batch])
        whole = iter(self._in_shared([name for name, ok in zip(batch, last, strict=True) if ok]))
        return [ok and next(whole) for ok in last]

    def _first_records_held(self, batch: list[bytes]) -> list[bool]:
        """The sweep's question: each chunk's first-written record (layer 0 of rank 0): `tiercache evict`
        removes every record of a chunk, and the disk's LRU usually drops that one first (written and read
        first). A chunk that lost only later records is withdrawn by the next lookup that asks for it."""
        return self._contains([self._first_key(name) for name in batch]) if batch else []

    def _contains(self, keys: list[StoreKey]) -> list[bool]:
        # waits for the tier's answer on this thread instead of taking the requests' bounded lookup thread
        return self.store.contains_many(keys, shared_only=True, bounded=False)

    # ------------------------------------------------------------------------ on the step: answers applied
    def _apply_confirmed(self, batch: list[bytes], found: list[bool], *, answering: bool = True) -> None:
        now = self.clock()
        found_now: dict[bytes, float] = {}
        for name, ok in zip(batch, found, strict=True):
            give_up_at = self._unconfirmed.pop(name, None)
            if give_up_at is None:
                continue  # withdrawn meanwhile (a failed load)
            if ok:
                found_now[name] = give_up_at
            elif now < give_up_at:
                self._unconfirmed[name] = give_up_at  # asked again after the others
            elif not answering:
                self._keep_unreachable(name)  # its records may have landed before the tier stopped answering
        self.ledger.stored_many(self._after_their_parents(found_now), self.shared_medium)  # type: ignore[arg-type]

    def _after_their_parents(self, found: dict[bytes, float]) -> list[bytes]:
        """Of the chunks just found on the shared tiers, those announced now: a chunk whose parent chunk still
        waits for its own confirmation waits too (asked again), so a router never gets a chunk's blocks before
        its parent's (a consumer may drop a block whose parent it does not know). It happens when the parent's
        records land later than the child's, or the parent was asked again behind it. One dict lookup per
        chunk: the ledger names each chunk's parent chunk."""
        held = []
        for name in self.ledger.parents_first(found):  # a deferred parent is back in _unconfirmed: defers its child
            parent = self.ledger.parent_of(name)
            if parent is not None and parent in self._unconfirmed:
                self._unconfirmed[name] = found[name]
            else:
                held.append(name)
        return held

    def _apply_startup(self) -> None:
        """The journal's start-up check, once done: what the shared tiers hold announced in this step, parents
        first; what they did not find while one of them was not answering, asked again once it answers, and
        a ring they could not read, read and checked again then (`take`). The first step waits for a check
        still running at most `FIRST_STEP_WAIT_S`."""
        assert self._startup is not None
        answer: Discovered | None = self._startup.result(FIRST_STEP_WAIT_S if self._first_take else 0.0)
        self._first_take = False
        if answer is None:
            return
        self._startup = None
        self._ring_unread = not answer.ring_read
        if not answer.answering:
            for (name, payload), ok in zip(answer.entries, answer.held, strict=True):
                if not ok:
                    self._keep_unreachable(name, payload)
        self._apply_discovered(answer.entries, answer.held)

    def _apply_discovered(self, batch: list[tuple[bytes, Any]], found: list[bool]) -> None:
        """Journal entries of an earlier run (or another engine) that the shared tiers hold: announced."""
        for (name, payload), ok in zip(batch, found, strict=True):
            if ok:
                self.ledger.adopt(name, payload)
        self.ledger.stored_many([name for (name, _), ok in zip(batch, found, strict=True) if ok],
                                self.shared_medium)  # type: ignore[arg-type]

    def _sweep_batch(self) -> list[bytes]:
        """``sweep_chunks`` announced chunks in turn."""
        held = self.ledger.held_in(self.shared_medium)  # type: ignore[arg-type]
        if not held:
            return []
        start = self._sweep_at % len(held)
        batch = [held[(start + i) % len(held)] for i in range(min(self.sweep_chunks, len(held)))]
        self._sweep_at = start + len(batch)
        return batch

    def _first_key(self, name: bytes) -> StoreKey:
        first = self.naming.groups.groups[0]
        return self.naming.record_key(name, first.layers[0], 0, first.tag)

    def _last_key(self, name: bytes) -> StoreKey:
        last = self.naming.groups.groups[-1]
        return self.naming.record_key(name, last.layers[-1], len(self.naming.identities) - 1, last.tag)

    def _in_shared(self, names: Sequence[bytes]) -> list[bool]:
        """Does every record of each chunk (every layer of every group on every rank) sit in a shared tier?"""
        groups = self.naming.groups.groups
        per_chunk = [self.naming.group_keys(name, groups) for name in names]
        found = self._contains([key for keys in per_chunk for key in keys])
        result, offset = [], 0
        for keys in per_chunk:
            result.append(all(found[offset:offset + len(keys)]))
            offset += len(keys)
        return result

    def shared_answering(self) -> bool:
        """Every shared tier that knows its health answers in full (no Redis server, no cluster shard down)."""
        return all(tier.up_share >= 1.0 for tier in self._health)

    def _withdraw_shared(self, name: bytes, *, answering: bool) -> None:
        """The shared tiers did not find the chunk: withdrawn; kept aside when they were not all answering."""
        if not answering:
            self._keep_unreachable(name)
        self.ledger.removed(name, self.shared_medium)  # type: ignore[arg-type]

    def _keep_unreachable(self, name: bytes, payload: Any = None) -> None:
        payload = payload if payload is not None else self.ledger.payload(name)
        if payload is None:
            return
        self._unreachable[name] = payload
        self._unreachable.move_to_end(name)
        while len(self._unreachable) > MAX_UNREACHABLE:
            self._unreachable.popitem(last=False)

    def _withdraw(self, name: bytes) -> None:
        self._unconfirmed.pop(name, None)
        for medium in (self.memory_medium, self.shared_medium):
            if medium is not None:
                self.ledger.removed(name, medium)
