"""Scheduler side of TieredKVConnector: how many prompt tokens the store can supply, and each step's plan.

It owns the truth about what a worker can load: chunks in the shared tiers (disk, GDS, Redis) are asked
of the store in one batched call; chunks in a worker's in-process memory tier are known from the
residency reports the workers send back each step (`TieredKVWorkerMetadata`), because vLLM runs the
scheduler and the workers in different processes. A promise that still fails (a record evicted or
corrupted after the lookup) is reported by the worker as invalid blocks, and vLLM recomputes them.

Under vLLM's hybrid KV cache manager the plan is per KV cache group: full-attention groups load and save
whole chunks, sliding-window groups only the blocks inside the window at a hit's end, and a hit is the
longest prefix every group can supply (`vllm_tiercache.kvcache.groups` has the design). A model with a
group the connector cannot load (mamba state, ...) gets no lookups and no saves.

With several groups a hit is loaded as one whole-request load (vLLM's ``load_kv_async``), not layer by
layer: block ids are only unique within a group, so vLLM (0.32) accepts no block-level load failure for
such a model (`invalid_block_ids` stops the engine). A model whose only group slides is loaded the same
way: vLLM's block-level recovery would resume it at the first failed block, whose window it no longer
holds. A request whose load fails is reported as failed
receiving instead, and vLLM recomputes it from scratch (``kv_load_failure_policy=recompute``) or fails
it (``fail``). The chunks that failed are reported back and not claimed again until saved anew.

After vLLM resets the connector cache (``reset_cache``: its weights were changed in place), every chunk
name mixes in a new generation salt (`vllm_tiercache.shared.generations` says why): the records stored
before are never read again by this engine, and stay for the engines still running the old weights.

Chunk names and record keys come from each request's `vllm_tiercache.kvcache.naming.RequestNames`, made
once per request with every salt (LoRA adapter digest, generation): the rule the workers and `tiercache
precompute docs` follow too. Which blocks a step loads and saves: `vllm_tiercache.kvcache.planning`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_tiercache.kvcache.adapters import AdapterDigests
from vllm_tiercache.kvcache.events.tracker import TierEventTracker
from vllm_tiercache.kvcache.handoff.promise import (
    HandoffCounters,
    handoff_hit,
    producer_params,
    remote_prefill_params,
    wants_remote_decode,
)
from vllm_tiercache.kvcache.lookup.far import FarLookups
from vllm_tiercache.kvcache.lookup.pipeline import PromptLookup
from vllm_tiercache.kvcache.naming import ChunkGeometry, KVNaming
from vllm_tiercache.kvcache.plan import RequestPlan, TieredKVMetadata, TieredKVWorkerMetadata
from vllm_tiercache.kvcache.planning import (
    RequestState,
    chunk_saves,
    chunks_to_save,
    group_loads,
    prompt_full_blocks,
)
from vllm_tiercache.shared.generations import Generation
from vllm_tiercache.shared.request_tags import request_tags
from vllm_tiercache.shared.residency import ResidentSet
from vllm_tiercache.shared.store.api import FileTier, Store
from vllm_tiercache.shared.vllm_compat import CacheHitSource, waiting_for_remote_kv

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class UnsaltedRequests:
    """``require_cache_salt``: where tenants share a store, a request without vLLM's ``cache_salt`` is kept
    out of it both ways (no lookup, no save) and counted (``unsalted_requests``); docs/operations.md, the
    trust boundary (the salt is set by the gateway from an authenticated tenant)."""

    def __init__(self, required: bool) -> None:
        self.required = required
        self.unreported = 0

    def refuses(self, request: Request) -> bool:
        """Whether ``request`` must stay out of the store (asked once per request)."""
        if self.required and not getattr(request, "cache_salt", None):
            self.unreported += 1
            return True
        return False

    def take(self) -> dict[str, int]:
        """The refusals since the last call, as the scheduler side's counters."""
        if not self.unreported:
            return {}
        counts, self.unreported = {"unsalted_requests": self.unreported}, 0
        return counts


class KVSchedulerSide:
    """Everything `TieredKVConnector` does in vLLM's scheduler process."""

    def __init__(
        self,
        *,
        store: Store,
        naming: KVNaming,
        can_load: bool,
        can_save: bool,
        save_decode: bool,
        request_cacheable: Callable[[Request], bool] | None = None,
        volatile_decode_tail: bool = False,
        publish_events: bool = False,
        handoff_wait_s: float = 1.0,
        engine_id: str = "",
        require_cache_salt: bool = False,
        lookup_deadline_s: float = 0.0,
    ) -> None:
        """`naming`: how prompts are cut into chunks, how chunks are named, and whether a partial last
        chunk is saved: the rule `tiercache precompute docs` follows too. `request_cacheable`: asked once
        per request; False keeps the request out of the store both ways (no lookup, no save), e.g. when
        its multimodal items carry no trustworthy content identifier, so its block hashes do not name
        its content. `volatile_decode_tail`: an EAGLE/MTP drafter runs, so
        the chunk at the end of a decoding request's computed blocks is not saved yet (its drafter KV may
        be rewritten when draft tokens are rejected; see `vllm_tiercache.shared.vllm_compat.uses_eagle`).
        `publish_events`: vLLM publishes KV cache events; the tiers' holdings are then announced
        (`vllm_tiercache.kvcache.events.tracker`; nothing runs otherwise). `require_cache_salt`: `UnsaltedRequests`.
        `lookup_deadline_s`: > 0 where the store has a far tier, lookups and loads never wait on the network
        here or in a forward pass (`vllm_tiercache.kvcache.lookup.far`), and a request waits at most this
        long for them once its turn came; 0: lookups on this thread, bounded by the store's lookup budget."""
        self.store = store
        self.naming = naming
        #: read on every ask of every waiting request (`get_num_new_matched_tokens`'s first line): one attribute
        self._block_size = naming.geometry.block_size
        self.can_load = can_load
        self.can_save = can_save
        self.save_decode = save_decode
        self.request_cacheable = request_cacheable
        self.volatile_decode_tail = volatile_decode_tail
        self.unsalted = UnsaltedRequests(require_cache_salt)
        shared_tiers = [t for t in store.tiers if t.shared_across_processes]
        #: the kinds of the tiers a consumer can read what this engine stores (named in hand-off promises)
        self.shared_tier_kinds = [t.name for t in shared_tiers]
        self.shared_source = (
            CacheHitSource.DISK
            if shared_tiers and all(isinstance(t, FileTier) for t in shared_tiers)
            else CacheHitSource.EXTERNAL_UNSPECIFIED
        )
        self.resident: ResidentSet[bytes] = ResidentSet()
        self._requests: dict[str, RequestState] = {}
        self._kv_cache_manager: KVCacheManager | None = None
        self._adapters = AdapterDigests()
        self._checked_engine_hashing = False
        #: how long the first request of a newly loaded adapter waits for its digest (once per adapter: a
        #: small adapter is digested well within it; a large or slow one stalls the engine at most this
        #: long, and its requests are computed without the cache until the digest is ready)
        self.adapter_wait_s = 1.0
        groups = naming.groups
        self.groups = groups
        if not groups.supported:
            log.warning("TieredKVConnector: no KV loads or saves for this model: %s (vLLM's hybrid KV cache "
                        "manager stays on)", groups.unsupported)
            self.can_load = self.can_save = False
        elif groups.hybrid:
            log.info("TieredKVConnector: hybrid KV cache groups: %s", groups.describe())
        #: several groups, or any sliding-window group: loads are whole-request loads vLLM waits for (see
        #: the module docstring; vLLM's block-level recovery would restart a sliding-window request from the
        #: first failed block, whose window it no longer holds)
        whole_request_loads = len(groups.groups) > 1 or groups.hybrid
        self._whole_request_pending: list[str] = []
        #: chunks a whole-request load could not use: missing until a request saves them again
        #: (insertion-ordered, at most `max_failed_chunks`: the oldest is forgotten, and claimed once more)
        self._failed_chunks: dict[bytes, None] = {}
        self.max_failed_chunks = 65536
        #: the weights generation chunk names are made in (a new one at each `reset_cache`)
        self.generation = Generation()
        self._unreported_resets = 0
        #: what the tiers can serve, told to routers as KV cache events (None: vLLM publishes none, or this
        #: engine loads nothing: a kv_producer, a model the connector cannot load; a router must not count on it)
        self.events = TierEventTracker(store=store, naming=naming) if publish_events and self.can_load else None
        #: prefill/decode hand-offs (`vllm_tiercache.kvcache.handoff.promise`): how long a consumer's load waits for
        #: promised records, this engine's id in its promises, and their counts
        self.handoff_wait_s = handoff_wait_s
        self.engine_id = engine_id
        self.handoffs = HandoffCounters()
        #: how much of a waiting request's prompt the store supplies: name, ask, plan (`vllm_tiercache.kvcache.lookup`)
        self.lookup = PromptLookup(store=store, naming=naming, resident=self.resident, failed=self._failed_chunks,
                                   events=self.events, can_load=self.can_load,
                                   whole_request_loads=whole_request_loads, deadline_s=lookup_deadline_s)

    @property
    def whole_request_loads(self) -> bool:
        """Several KV cache groups, or any sliding-window group: loads are whole-request loads vLLM waits for."""
        return self.lookup.whole_request_loads

    @property
    def far(self) -> FarLookups | None:
        """The lookups and fetches of far tiers off this thread (None: lookups on it)."""
        return self.lookup.far

    @property
    def geometry(self) -> ChunkGeometry:
        return self.naming.geometry

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager
        self.lookup.kv_cache_manager = manager
        if self.events is not None:
            self.events.bind_kv_cache_manager(manager)

    # ---------------------------------------------------------------------------------------- lookup
    def _state(self, request: Request) -> RequestState:
        """The request's state, created on first sight (when `request_cacheable` is asked, once)."""
        state = self._requests.get(request.request_id)
        if state is None:
            cacheable = self.request_cacheable is None or bool(self.request_cacheable(request))
            cacheable = cacheable and not self.unsalted.refuses(request)
            adapter = None
            lora = getattr(request, "lora_request", None)
            if cacheable and lora is not None:
                adapter = self._adapters.digest(lora, wait_s=self.adapter_wait_s)
                cacheable = adapter is not None  # not ready yet, or not nameable: computed as without us
            if cacheable and self.groups.supported and not self._checked_engine_hashing:
                self._checked_engine_hashing = True  # once: vLLM seeds its hashing only after building the connector
                self.naming.check_engine_hashing(request)
            names = self.naming.request_names(request.block_hashes, adapter=adapter, generation=self.generation.salt)
            chunks = names.prompt_chunks(request.num_prompt_tokens) if cacheable else []
            state = RequestState(request, names, chunks, cacheable=cacheable)
            self._requests[request.request_id] = state
        return state

    def on_new_request(self, request: Request) -> None:
        """A request arrived: with far tiers, its lookup starts now, before the scheduler reaches it (a
        hand-off's request is loaded from its producer's promise instead)."""
        if self.lookup.far is None or remote_prefill_params(request) is not None:
            return
        state = self._state(request)
        if state.cacheable and self.groups.supported:
            self.lookup.far.start(state)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens past vLLM's own hit the store supplies (`PromptLookup`); None: not known yet."""
        far = self.lookup.far
        if far is not None and far.still_waiting(request.request_id, num_computed_tokens // self._block_size):
            return None, False  # vLLM asks every waiting request at every step: the cheap answer first
        state = self._state(request)
        if not state.cacheable or not self.groups.supported:
            return 0, False
        if self.can_load and (hit := handoff_hit(state, self.naming, self.handoffs, resident=self.resident,
                                                 num_computed_tokens=num_computed_tokens)) is not None:
            return hit  # a producer's promise: its chunks are loaded (and not saved again) without a lookup
        return self.lookup.matched(state, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        state = self._state(request)
        if num_external_tokens == 0:
            state.forget_load()
        else:
            first = state.load_end - num_external_tokens // self.geometry.block_size
            state.load_first = max(first, 0)
            if self.whole_request_loads or state.handoff_load:
                self._whole_request_pending.append(request.request_id)
            if state.handoff_load:  # a promise is loaded once: a request sent back to lookup after a
                state.handoff = False  # fallback that kept nothing is looked up as without one
                self.handoffs.handoffs_received += 1

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Split a hit between the workers' memory tier (HOST) and the shared tiers, for vLLM's metrics."""
        state = self._requests.get(request.request_id)
        if not num_external_tokens or state is None:
            return {}
        host_blocks = 0
        for end, in_memory in state.load_chunks:
            first, last = max(self.geometry.chunk_start(end), state.load_first), min(end, state.load_end)
            if in_memory and last > first:
                host_blocks += last - first
        host = min(host_blocks * self.geometry.block_size, num_external_tokens)
        sources = {CacheHitSource.HOST: host, self.shared_source: num_external_tokens - host}
        return {source: tokens for source, tokens in sources.items() if tokens}

    # ------------------------------------------------------------------------------------- step plan
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TieredKVMetadata:
        meta = TieredKVMetadata()
        self.lookup.announce()  # this step's lookups, to the events tracker ahead of the step's saves
        if self.far is not None:
            meta.prefetches, meta.near_loads = self.far.take_prefetches(), True
        pending, self._whole_request_pending = self._whole_request_pending, []
        for req_id in pending:  # not scheduled this step: vLLM waits for their load
            state = self._requests.get(req_id)
            if state is not None and state.load_end > state.load_first:
                block_ids = self._block_ids(req_id)
                plan = RequestPlan(req_id=req_id, whole_request=self.whole_request_loads,
                                   handoff_wait_s=self.handoff_wait_s if state.handoff_load else None)
                for group in self.groups.groups:
                    plan.loads.extend(group_loads(state, group, block_ids[group.index], self.geometry))
                state.forget_load()
                meta.requests.append(plan)
        computed_before: dict[str, int] = {
            new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs
        }
        for req_id, reused in computed_before.items():  # vLLM's prefix cache and our hits, at the first step
            state = self._requests.get(req_id)
            if state is not None and state.reused_share is None:
                state.reused_share = min(1.0, reused / max(1, state.request.num_prompt_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed_before[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed_before.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            plan = self._plan(state, before, before + scheduled)
            if plan is not None:
                meta.requests.append(plan)
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
            if self.far is not None:
                self.far.forget(req_id)
        if self.far is not None and self.far.staged:
            meta.release = self.far.consume([load.chunk_hash for plan in meta.requests for load in plan.loads])
        if self.far is not None and not scheduler_output.num_scheduled_tokens:
            self.far.idle()  # every request waits: not a busy loop against the threads they wait for
        return meta

    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block table of every KV cache group (the null block, id 0, where vLLM keeps none):
        vLLM's own lists, new at each call, read here only by slices."""
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        return tuple(self._kv_cache_manager.get_block_ids(req_id))

    def _plan(self, state: RequestState, computed_before: int, computed_after: int) -> RequestPlan | None:
        """The request's loads and saves this step; None when it has neither (most decode steps, which
        leave after two comparisons: no load planned, and fewer computed blocks than the next chunk
        end that could be saved)."""
        if not state.cacheable:
            return None
        loading = state.load_end > state.load_first
        if not loading and (not self.can_save or computed_after // self.geometry.block_size < state.next_save_block):
            return None
        request = state.request
        plan = RequestPlan(req_id=request.request_id)
        block_ids: tuple[list[int], ...] | None = None
        if loading:
            block_ids = self._block_ids(request.request_id)
            for group in self.groups.groups:
                plan.loads.extend(group_loads(state, group, block_ids[group.index], self.geometry))
            state.forget_load()
        if self.can_save:
            for end in chunks_to_save(state, computed_after, self.naming, save_decode=self.save_decode,
                                      volatile_decode_tail=self.volatile_decode_tail):
                if block_ids is None:
                    block_ids = self._block_ids(request.request_id)
                name = state.names.name(end)
                saves = chunk_saves(name, end, self.groups, self.geometry, block_ids, state.names.parent_name(end))
                if saves is not None:
                    urgent, tags = wants_remote_decode(request), request_tags(request)
                    for save in saves:  # a hand-off: written first
                        save.urgent, save.tags, save.reused_share = urgent, tags, state.reused_share
                        save.tenant = getattr(request, "cache_salt", None)  # a sealing store seals for it
                    plan.saves.extend(saves)
                    self._failed_chunks.pop(name, None)
                    if self.events is not None:
                        self.events.save_planned(name, request, self.geometry.chunk_start(end), end)
        return plan if plan.loads or plan.saves else None

    # ----------------------------------------------------------------------------------------- reset
    def reset_cache(self) -> bool:
        """Start a new weights generation: vLLM reset the connector cache, so everything this engine
        computed or looked up before may be stale (its weights were changed in place). Never deletes a
        record: other engines with the original weights still use them (see
        `vllm_tiercache.shared.generations`). Returns True (vLLM's "reset done").

        What refers to old names is dropped: the workers' residency (names of the old generation), the
        chunks that failed to load, and the lookup results and load plans of requests still known. Those
        requests are handled by what they hold:

        - a request with KV already computed or loaded (running; a whole-request load already with the
          workers) keeps it, as vLLM does, but is neither loaded for nor saved from again: its KV may
          come from the old weights, and must not be published under a new-generation name;
        - a request whose whole-request load is planned but not yet sent (empty between steps: vLLM
          builds the step's metadata at the end of each ``schedule``) keeps its load, renamed into the
          new generation: vLLM waits for it, and it finds only records this generation saved, or fails
          and vLLM recomputes the request (``kv_load_failure_policy``);
        - any other request (waiting; preempted by ``reset_running_requests``: no KV left) is looked up
          again, in the new generation, when vLLM schedules it.
        """
        salt = self.generation.advance()
        self.resident.clear()
        if self.far is not None:
            self.far.clear()
        self._failed_chunks.clear()
        pending = set(self._whole_request_pending)
        kept = 0
        for req_id, state in self._requests.items():
            state.names = state.names.in_generation(salt)
            state.chunks = state.names.prompt_chunks(state.request.num_prompt_tokens) if state.chunks else []
            state.stored, state.resident = [], []
            if req_id in pending:
                continue
            state.forget_load()
            if state.request.num_computed_tokens > 0 or waiting_for_remote_kv(state.request):
                state.cacheable = False
                kept += 1
            else:
                state.saved_until = state.planned_until = state.next_save_block = 0
        self._unreported_resets += 1
        if self.events is not None:
            self.lookup.findings = []  # of the old generation's names
            self.events.reset()
        log.warning("TieredKVConnector: vLLM reset the connector cache (e.g. after a weight update): started "
                    "weights generation %d; records stored before are no longer used by this engine (they stay "
                    "in the store for other engines)%s", self.generation.resets,
                    f"; {kept} request(s) in flight keep their KV and are not saved" if kept else "")
        return True

    def take_counters(self) -> dict[str, int]:
        """This side's counter increments since the last call (vLLM's stats): generation resets, hand-offs."""
        counts: dict[str, int] = self.handoffs.take()
        if self._unreported_resets:
            counts["generation_resets"], self._unreported_resets = self._unreported_resets, 0
        counts.update(self.unsalted.take())
        if self.far is not None:
            counts.update(self.far.take_counters())
        return counts

    # -------------------------------------------------------------------------------- worker reports
    def update_connector_output(self, worker_meta: Any) -> None:
        if isinstance(worker_meta, TieredKVWorkerMetadata):
            self.resident.apply(worker_meta.added, worker_meta.evicted)
            if self.events is not None:
                self.events.residency(worker_meta.added, worker_meta.evicted)
                self.events.failed(worker_meta.failed)
            if self.far is not None and (worker_meta.prefetched or worker_meta.prefetch_failed or worker_meta.unstaged):
                self.far.worker_report(worker_meta.prefetched, worker_meta.prefetch_failed, worker_meta.unstaged)
            if worker_meta.failed:
                log.warning("TieredKVConnector: %d chunk(s) failed to load; they are recomputed and not "
                            "claimed again until saved anew", len(worker_meta.failed))
                self._failed_chunks.update(dict.fromkeys(worker_meta.failed))
                while len(self._failed_chunks) > self.max_failed_chunks:
                    del self._failed_chunks[next(iter(self._failed_chunks))]

    def take_events(self) -> list[KVCacheEvent]:
        """This step's KV cache events for what the tiers hold (vLLM publishes them after its own)."""
        if self.events is None:
            return []
        self.lookup.announce()
        return self.events.take()

    def shutdown(self) -> None:
        """The engine stops: what this side still holds for the store (the event journal's last entries) is
        handed to it, ahead of the connector's flush of the store."""
        if self.events is not None:
            self.events.close()
        if self.far is not None:
            self.far.close()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        # Saves are copied out of the paged buffer within the step that computed them, so vLLM may
        # free the blocks right away: nothing asynchronous still reads them.
        state = self._requests.pop(request.request_id, None)
        if self.far is not None:
            self.far.forget(request.request_id)
        if state is None or not (self.can_save and state.cacheable and wants_remote_decode(request)):
            return False, None
        params = producer_params(state.names, self.naming, prompt_full_blocks(request, self.geometry.block_size),
                                 producer=self.engine_id, tiers=self.shared_tier_kinds)
        self.handoffs.handoffs_offered += params is not None
        return False, params
