"""Each request's lookup against far tiers, from its arrival to its answer, and the chunks fetched ahead.

vLLM asks the connector, on its one scheduling thread, how much of a waiting request it can supply
(``get_num_new_matched_tokens``); an answer of None means "ask me again next step", and the scheduler
goes on with the other requests. With a far tier (`RemoteTier`: Redis, Redis Cluster, the object tier)
the answer never waits on the network:

1. When a request arrives (``on_new_request``, before the scheduler reaches it), its probe goes to a
   probe thread (`vllm_tiercache.kvcache.lookup.probe`): where each chunk is, up to the first missing one.
2. Once the probe is in, the chunks only a far tier holds are named in the next step's plan
   (`ChunkPrefetch`) and every worker reads them into host memory in the background, where they wait
   for their load (`vllm_tiercache.kvcache.load.prefetcher`, `vllm_tiercache.kvcache.load.staging`),
   while the request waits for its lookup or its turn. A chunk already on its way for another request is
   not asked again, nor one the workers' memory or vLLM's own prefix cache holds; one that vLLM's prefix
   cache dropped while the request queued is asked at the request's turn. From its turn on, a request's
   chunks are fetched ahead of those of requests still queued (``urgent``): the fetches are in arrival
   order otherwise, and a chunk asked at the turn, or of a request vLLM let pass others, waited behind them.
3. The request is answered once every chunk it waits for is staged or failed, or at its deadline
   (``lookup_deadline_ms`` after its turn, vLLM's first ask, or after the last chunk that landed since,
   for any request, up to `MAX_WAIT_DEADLINES` deadlines), whichever comes first: the hit is the prefix of chunks
   the workers hold staged (a chunk of their memory tier is staged too: the memory tier may evict it
   before the load, and its residency report comes a step late) or a near tier holds, and its load in
   the forward pass reads those only (``near_loads``). What the deadline cut
   short is a miss, counted (``lookups_late``, ``prefetches_late``); so is a prefetched chunk dropped from host memory
   before its request ran (``prefetches_evicted``: its staging time passed, or room was needed), or
   one gone between the answer and the load (a failed load, recomputed by vLLM).

Why the deadline runs from the request's turn and not its arrival: it bounds how long a request that could
run waits on the store. A request queued behind other users' prefills waits for its turn anyway; its probe
and fetch started at its arrival and use that time, and a fetch still in flight when its turn comes (the
fetches were slowed by those prefills on the same cores) is worth the deadline's wait. From its arrival,
such a request reached its turn past its deadline and dropped chunks a moment from staged: a recompute.
And why a chunk that lands restarts it: the deadline is for a store that stalls, not one that is slow and
steady. An 8K prompt of a 12-layer model is 96 MiB, which this VM's SeaweedFS serves in 1.3 s of raw GETs;
cut at 1 s, the prompt's last quarter was recomputed (14 s on two cores) for want of 0.3 s more. Any
request's chunk counts, not only its own: with many users, a request's chunks wait in the workers' fetch
queue behind those of requests whose turn came first, and none of its own lands for a while although the
store answers all along. The wait stays bounded: a store that
hangs lands nothing, and one that answers restarts it for at most `MAX_WAIT_DEADLINES` deadlines.

Never more than one probe per request and preemption: after its answer a request that is asked again (no
free blocks yet) is answered at once from what is staged then, so there is no livelock. A request vLLM
preempted since (its KV freed, its loaded chunks released from host memory) is probed and fetched anew,
unless vLLM's own prefix cache still holds its whole prompt.
An aborted request's prefetch still lands in host memory, for the next request that asks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from threading import Event
from typing import TYPE_CHECKING

from vllm_tiercache.kvcache.lookup.probe import Probe, ProbeThreads, Where
from vllm_tiercache.kvcache.options import MAX_WAIT_DEADLINES
from vllm_tiercache.kvcache.plan import ChunkPrefetch
from vllm_tiercache.kvcache.planning import true_prefix
from vllm_tiercache.shared.residency import ResidentSet
from vllm_tiercache.shared.store.api import Store

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_tiercache.kvcache.planning import RequestState

log = logging.getLogger(__name__)

#: A prefetch the workers never reported (a worker restarted) is forgotten after this long, and may be asked again.
FORGET_PREFETCH_S = 60.0
#: How long a step that scheduled nothing while requests wait on far tiers holds the scheduling thread, unless a
#: probe comes in first. Why: vLLM steps again at once when every waiting request's answer is None, and that
#: loop held the interpreter, starving the probe and fetch threads it waits for (in-process, a far0 arm ran
#: 456 such steps, and a cold prompt's first lookup took 300 ms against 23 ms alone). A new request waits at most
#: this long more; a far tier answers in a round trip or more anyway.
IDLE_WAIT_S = 0.002


@dataclass
class FarTicket:
    """One request's lookup: its probe, its deadline, and the chunks it waits for."""

    probe: Probe
    #: when its wait on the store ends: ``lookup_deadline_ms`` after vLLM first asks (None: not asked yet)
    deadline: float | None = None
    #: vLLM's ``cache_salt`` of the request (a sealing store opens its records with its subkey)
    tenant: str | None = field(default=None, repr=False)
    #: names of the far chunks fetched for it, and whether its answer has been given (later asks are at once)
    waits_for: set[bytes] = field(default_factory=set)
    prefetching: bool = False
    #: the blocks vLLM's own prefix cache held when its chunks were last named for a fetch (those were not)
    fetched_past: int = 0
    #: its turn came with chunks still on their way: those were named again, urgent (once)
    hurried: bool = False
    answered: bool = False
    #: vLLM's count of the request's preemptions when it was probed: a preempted request is probed anew
    preemptions: int = 0
    #: when its turn came (vLLM first asked), and the workers' landings (`FarLookups.landings`) at its last ask:
    #: one more since restarts the deadline, up to `MAX_WAIT_DEADLINES` deadlines after its turn
    turn: float = 0.0
    landings_seen: int = 0


@dataclass
class FarAnswer:
    """Where the request's chunks are, as the synchronous lookup says it (`PromptLookup._ask`)."""

    ends: list[int]
    #: chunk index -> loadable now; -> held by the workers' memory tier; -> staged by them for a load
    usable: list[bool]
    resident: list[bool]
    host: list[bool]
    #: a shorter stored chunk after the last usable one, and whether the workers hold it staged
    shorter: tuple[int, bool] | None
    #: chunk index -> some tier holds it (not saved again); -> the shared tiers were asked about it (and answered)
    stored: list[bool]
    asked: list[bool]

    def unused(self) -> int:
        """Chunks of the stored prefix past the loadable one: found in some tier, yet computed (their fetch was
        late, failed, or dropped from host memory before the answer). Counted once per answer as
        ``found_unused_chunks``: where a far tier's hits go missing."""
        return max(0, true_prefix(self.stored) - true_prefix(self.usable))


class FarLookups:
    """The scheduler side's lookups against far tiers (module docstring)."""

    def __init__(self, store: Store, resident: ResidentSet[bytes], deadline_s: float,
                 local_blocks: Callable[[Request], int] | None = None, ranks: int = 1,
                 failed: dict[bytes, None] | None = None) -> None:
        """``local_blocks``: how many of a waiting request's blocks vLLM's own prefix cache holds now (never
        fetched again); ``deadline_s``: how long a request waits at most for the far tiers once its turn came;
        ``ranks``: the workers that each stage their own records of a chunk; ``failed``: the scheduler side's
        chunks a load or a prefetch could not use (never claimed, nor fetched, until saved anew)."""
        self.failed = failed if failed is not None else {}
        self.resident = resident
        self.ranks = ranks
        #: chunks every worker staged (`vllm_tiercache.kvcache.load.staging`), and how many did so far
        self.staged: set[bytes] = set()
        self._staged_by: dict[bytes, int] = {}
        self.local_blocks = local_blocks or (lambda request: 0)
        self.deadline_s = deadline_s
        self._probes = ProbeThreads(store)
        self._tickets: dict[str, FarTicket] = {}
        #: the requests whose chunks are not named for a fetch yet (`take_prefetches` looks at these alone), in
        #: arrival order: vLLM's queue order, so the first in line is fetched first
        self._unfetched: dict[str, None] = {}
        #: chunk name -> when its prefetch was asked (one fetch per chunk at a time, across requests)
        self._in_flight: dict[bytes, float] = {}
        #: chunks a worker reported fetched, for the evicted-before-it-ran count
        self._fetched: set[bytes] = set()
        self._to_send: dict[bytes, ChunkPrefetch] = {}
        #: chunks the workers reported over (staged or failed), ever: the deadline's sign that the store answers
        self.landings = 0
        #: what the workers' reports changed (`worker_report`): a waiting request's answer may have changed since
        self._reports = 0
        #: requests whose last answer was None, with what would change it (`still_waiting`)
        self._waiting: dict[str, tuple[int, float, Event | None, int]] = {}
        self.counters = {"lookups_late": 0, "prefetches_late": 0, "prefetches_evicted": 0, "found_unused_chunks": 0}

    # ------------------------------------------------------------------------------------- a request
    def start(self, state: RequestState) -> None:
        """Probe the request's chunks in the background (once per request and preemption)."""
        if state.request.request_id in self._tickets:
            return
        chunks = state.chunks
        resident = [name in self.resident and name not in self.failed for _, name in chunks]
        probe = Probe(state.request, state.names, chunks, resident)
        self._tickets[state.request.request_id] = FarTicket(
            probe, tenant=getattr(state.request, "cache_salt", None),
            preemptions=getattr(state.request, "num_preemptions", 0))
        self._unfetched[state.request.request_id] = None
        self._probes.submit(probe)

    def still_waiting(self, req_id: str, local_blocks: int) -> bool:
        """The request's answer is None again, known without looking at it: nothing it waits for changed since
        its last answer was None (no report from the workers, its probe still out or already in as then, the
        same blocks held by vLLM's prefix cache, its deadline not passed).

        Why: vLLM asks every waiting request again at every step, and each ask went through the request's state,
        the hand-off check and the ticket, a dozen calls. Between two steps the forward pass evicts all of that
        from the CPU's caches: measured on the 2-core VM, one such ask took 2.8 us warm and 43-99 us cold, so
        eight waiting requests cost a step up to 0.8 ms. This is one dictionary lookup and a few comparisons."""
        seen = self._waiting.get(req_id)
        if seen is None:
            return False
        reports, deadline, probe_out, held = seen
        if (reports == self._reports and held == local_blocks and (probe_out is None or not probe_out.is_set())
                and time.monotonic() < deadline):
            return True
        del self._waiting[req_id]
        return False

    def _waits(self, ticket: FarTicket, local_blocks: int, *, probe_out: bool) -> None:
        """Its answer is None: remember what would change it (`still_waiting`). ``probe_out``: the answer was
        given without the probe's findings, as its caller saw it (read again here, a probe that came in
        meanwhile would pass for one this answer had looked at, and the request would wait for its deadline)."""
        assert ticket.deadline is not None
        self._waiting[ticket.probe.request.request_id] = (
            self._reports, ticket.deadline, ticket.probe.done if probe_out else None, local_blocks)

    def answer(self, state: RequestState, local_blocks: int) -> FarAnswer | None:
        """Where the request's chunks are, or None while its probe or its prefetches are pending and its
        deadline has not passed. ``local_blocks``: the blocks vLLM's own prefix cache holds."""
        ticket = self._tickets.get(state.request.request_id)
        if ticket is not None and ticket.answered and self._preempted(ticket, local_blocks):
            self.forget(state.request.request_id)  # probed and fetched anew
        elif ticket is not None:
            return self._answer_ticket(ticket, local_blocks)
        self.start(state)  # at its first ask (vLLM told of no arrival) or after a preemption: asked next step
        ticket = self._tickets[state.request.request_id]
        self._start_turn(ticket, time.monotonic())
        self._waits(ticket, local_blocks, probe_out=True)
        return None

    def _answer_ticket(self, ticket: FarTicket, local_blocks: int) -> FarAnswer | None:
        """`answer` for a request whose probe was started."""
        now = time.monotonic()
        if ticket.deadline is None:  # its turn: from now on it waits on the store
            self._start_turn(ticket, now)
        late = now >= ticket.deadline
        probe = ticket.probe
        first = not ticket.answered
        if first:
            if not probe.done.is_set():
                if not late:
                    self._waits(ticket, local_blocks, probe_out=True)
                    return None
                self.counters["lookups_late"] += 1
                ticket.answered = True
                self._unfetched.pop(probe.request.request_id, None)
                return self._answer(ticket, local_blocks, probe_in=False)  # the probe's findings are not in
            if not ticket.prefetching or local_blocks < ticket.fetched_past:
                self._prefetch(ticket, local_blocks)  # vLLM evicted some of what it held: fetched after all
            pending = {name for name in ticket.waits_for if name in self._in_flight and name not in self.staged}
            if pending and not ticket.hurried:  # its turn: ahead of the fetches of requests still queued
                ticket.hurried = True
                position = {name: i for i, (_, name) in enumerate(probe.chunks)}
                for name in sorted(pending, key=lambda n: position.get(n, len(position))):  # the prompt's order
                    self._to_send[name] = ChunkPrefetch(chunk_hash=name, tenant=ticket.tenant, urgent=True)
            if pending and self.landings > ticket.landings_seen:  # chunks landed since: the store is answering
                ticket.landings_seen = self.landings
                cap = ticket.turn + MAX_WAIT_DEADLINES * self.deadline_s
                ticket.deadline = min(now + self.deadline_s, max(cap, ticket.deadline))
                late = now >= ticket.deadline
            if pending and not late:
                self._waits(ticket, local_blocks, probe_out=False)
                return None
            self.counters["prefetches_late"] += len(pending)
            # fetched for it, and dropped from the staging before its answer (set operations: no per-chunk Python)
            self.counters["prefetches_evicted"] += len(((ticket.waits_for - pending) & self._fetched) - self.staged)
            ticket.answered = True
        answer = self._answer(ticket, local_blocks, probe_in=probe.done.is_set())
        if first:
            self.counters["found_unused_chunks"] += answer.unused()
        return answer

    def _start_turn(self, ticket: FarTicket, now: float) -> None:
        ticket.turn, ticket.deadline, ticket.landings_seen = now, now + self.deadline_s, self.landings

    @staticmethod
    def _preempted(ticket: FarTicket, local_blocks: int) -> bool:
        """vLLM preempted the request since its answer, and its own prefix cache no longer holds all of the
        probed prompt: the chunks loaded for it were released after their load (and what it computed since
        may have been saved), so it is probed and fetched anew, with a deadline of its own, rather than
        recomputing what a far tier holds."""
        request = ticket.probe.request
        if getattr(request, "num_preemptions", 0) <= ticket.preemptions:
            return False
        ticket.preemptions = request.num_preemptions
        return bool(ticket.probe.chunks) and local_blocks < ticket.probe.chunks[-1][0]

    def forget(self, req_id: str) -> None:
        """The request is over (finished or aborted), or is to be probed anew (preempted); its prefetches, if
        any, still land."""
        self._tickets.pop(req_id, None)
        self._unfetched.pop(req_id, None)
        self._waiting.pop(req_id, None)

    def _prefetch(self, ticket: FarTicket, local_blocks: int) -> None:
        """Name the far chunks of the request's probed prefix past vLLM's ``local_blocks`` for the workers to
        fetch: once when its probe is in, and again at its turn for the chunks vLLM held then and has evicted
        since. Why again: vLLM's prefix cache turns over while a request queues (in `bench serve`, a KV cache
        a quarter of the working set), and the chunks it dropped meanwhile were found stored, yet computed."""
        ticket.prefetching = True
        ticket.fetched_past = local_blocks
        self._unfetched.pop(ticket.probe.request.request_id, None)
        probe = ticket.probe
        # the workers' memory tier's chunks too: staged, they cannot be evicted between this answer and the load
        # (a memory hit for the prefetcher; the residency report of an eviction comes a step late)
        wanted = [(end, name) for (end, name), where in zip(probe.chunks, probe.where, strict=True)
                  if where in (Where.FAR, Where.RESIDENT) and end > local_blocks and name not in self.failed]
        if probe.shorter is not None and probe.shorter[2] == Where.FAR and Where.MISSING in probe.where:
            wanted.append(probe.shorter[:2])
        now = time.monotonic()
        for _, name in wanted:
            if name in ticket.waits_for:
                continue
            ticket.waits_for.add(name)
            if self._held(name) or name in self._in_flight:
                continue
            self._in_flight[name] = now
            # urgent once its turn came (vLLM asked for it): ahead of the chunks of requests still queued
            self._to_send[name] = ChunkPrefetch(chunk_hash=name, tenant=ticket.tenant,
                                                urgent=ticket.deadline is not None)

    def _answer(self, ticket: FarTicket, local_blocks: int, *, probe_in: bool) -> FarAnswer:
        """Loadable: what the workers' memory holds now, what a near tier holds, and what vLLM holds itself
        (never loaded: the hit starts past it). One pass over the chunks: it runs on the scheduling thread for
        every chunk of every request answered, most of them in the step that admits them."""
        probe = ticket.probe
        staged, failed, memory = self.staged, self.failed, self.resident
        ends: list[int] = []
        usable: list[bool] = []
        resident: list[bool] = []
        host: list[bool] = []
        stored: list[bool] = []
        for i, (end, name) in enumerate(probe.chunks):
            bad = name in failed
            in_memory = not bad and name in memory
            held = not bad and name in staged  # staged for a load (`_held`)
            if probe_in:
                where, found = probe.where[i], probe.found[i]
            else:  # the probe's findings are not in: what the workers' memory holds, nothing else
                where = found = Where.RESIDENT if in_memory else Where.MISSING
            ends.append(end)
            resident.append(in_memory)
            host.append(held)
            usable.append(held or end <= local_blocks or (where == Where.NEAR and not bad))
            stored.append(held or (found != Where.MISSING and not bad))
        asked = [probe_in and not r for r in probe.resident]
        shorter = None
        if probe_in and probe.shorter is not None:
            end, name, at = probe.shorter
            held = self._held(name)
            if name not in failed and (held or at == Where.NEAR):
                shorter = (end, held)
        return FarAnswer(ends, usable, resident, host, shorter, stored, asked)

    def _held(self, name: bytes) -> bool:
        """The workers hold the chunk staged for a load (`vllm_tiercache.kvcache.load.staging`): what their
        memory tier holds is claimed only once staged too, since it may be evicted before the load."""
        return name in self.staged

    # ------------------------------------------------------------------------------------ each step
    def take_prefetches(self) -> list[ChunkPrefetch]:
        """The prefetches to name in this step's plan: those asked since the last step, and those of
        requests whose probe came in meanwhile (fetched while the request still waits for its turn)."""
        for req_id in list(self._unfetched):
            ticket = self._tickets[req_id]
            if ticket.probe.done.is_set():
                self._prefetch(ticket, self.local_blocks(ticket.probe.request))
        if not self._to_send:
            return []
        # those that landed or failed since they were named (a chunk named again urgent) are not sent
        out = [p for p in self._to_send.values() if p.chunk_hash in self._in_flight]
        self._to_send = {}
        return out

    def worker_report(self, prefetched: dict[bytes, int], failed: set[bytes], unstaged: set[bytes]) -> None:
        """The workers' prefetches that are over: staged (per chunk, by how many workers), failed; and the
        staged chunks they dropped since."""
        self._reports += 1
        for name in unstaged:
            self.staged.discard(name)
            self._staged_by.pop(name, None)
        self.landings += len(prefetched) + len(failed)
        for name, ranks in prefetched.items():
            count = self._staged_by[name] = self._staged_by.get(name, 0) + ranks
            if count >= self.ranks:
                self.staged.add(name)
                self._in_flight.pop(name, None)
                self._fetched.add(name)
        for name in failed:
            self._in_flight.pop(name, None)
            self._staged_by.pop(name, None)
            self.staged.discard(name)
        if len(self._fetched) > 65536:
            self._fetched.clear()
        if self._in_flight:
            stale = time.monotonic() - FORGET_PREFETCH_S
            for name in [n for n, asked in self._in_flight.items() if asked < stale]:
                del self._in_flight[name]

    def consume(self, names: list[bytes]) -> list[bytes]:
        """This step's loads read these chunks: the staged ones no request still waits for are released (the
        workers drop them after the step's loads: staging is a way in, never a cache that `tiercache evict`
        or a tier's eviction could not reach); the others stay for their waiting requests."""
        if not names:
            return []
        waited = {name for ticket in self._tickets.values() if not ticket.answered for name in ticket.waits_for}
        released = [name for name in dict.fromkeys(names) if name in self.staged and name not in waited]
        for name in released:
            self.staged.discard(name)
            self._staged_by.pop(name, None)
        return released

    def idle(self) -> None:
        """The step scheduled nothing: while some request waits for its answer, give the probe and fetch
        threads the interpreter for up to `IDLE_WAIT_S` (a probe coming in ends the wait)."""
        if any(not ticket.answered for ticket in self._tickets.values()):
            self._probes.wait_for_one(IDLE_WAIT_S)

    def take_counters(self) -> dict[str, int]:
        out = {name: value for name, value in self.counters.items() if value}
        for name in out:
            self.counters[name] = 0
        return out

    def clear(self) -> None:
        """A generation reset: every name asked so far is of the old generation."""
        self._tickets.clear()
        self._unfetched.clear()
        self._waiting.clear()
        self._in_flight.clear()
        self._fetched.clear()
        self.staged.clear()
        self._staged_by.clear()
        self._to_send.clear()

    def close(self) -> None:
        self._probes.close()
