"""Scheduler side of `TieredECConnector`: decide which encoder outputs the worker loads instead of computing.

vLLM 0.32's scheduler asks, per request and step, `ensure_cache_available(request, num_computed_tokens)`
before it schedules the request, then `has_cache_item(mm_hash)` for each item it would otherwise encode
(only after its own encoder cache missed and space was reserved), then `update_state_after_alloc(request, i)`
for every item it allocated (computed and loaded alike) and finally `build_connector_meta` once per step.

Answers are valid for one step only. `ensure_cache_available` runs every step for every running multimodal
request, so it looks up (one batched `contains_many`) only the items the request still needs (placeholder
range not yet behind `num_computed_tokens`): a decoding request costs nothing. Those answers serve this
step's `has_cache_item` and are dropped in `build_connector_meta`, so a request that comes back after a
preemption is asked about again: an item evicted from the store meanwhile is never promised on resume.
An item `has_cache_item` is asked about without a prefetched answer is looked up then.

A promise can still turn out false at load time (record evicted or corrupt between the lookup and the
load); the worker then re-encodes the item in the same step (see `vllm_tiercache.eccache.worker`). For that,
`TieredECMetadata` carries a reference to this step's `scheduler_output.scheduled_encoder_inputs` (never
modified here).

Every role answers from the store: an `ec_producer` (vLLM then runs the encoder only) that is told an item
is stored skips encoding it, as vLLM's example connector does; only a consumer gets loads to do.

Where the lookup looks: vLLM usually runs the scheduler and the worker in different processes (on CPU,
and with more than one device, its multiproc executor), so the worker's in-process memory tier is
invisible here. The store is then asked only for its shared tiers (disk, GDS, Redis), and what the
worker's memory tier holds is known from the residency reports it sends back every step
(`TieredECWorkerMetadata`, through vLLM's `build_connector_worker_meta` -> `update_connector_output`
channel). When the worker lives in this very process (uniproc executor), the whole store is asked.

Counters for vLLM's stats (`/metrics`): this side's (hits, misses, lookup errors) plus the worker's, which
ride on the same residency reports (the one worker -> scheduler channel both of vLLM's model runners
serve), are handed out by `take_stats()` from `get_ec_connector_stats`. So are the store's numbers that
the workers send on the same reports: what the worker's store counted per tier (``tiers``) and its gauge
report (``gauges``). This process's own store only answers existence lookups, which count no hits or
misses; the KV connector's scheduler side, when there is one, reports its counters.

Weights generations: after vLLM resets its encoder cache (its weights were changed in place; the plugin
makes `Scheduler.reset_encoder_cache` call `reset_cache`), every name this side looks up and every
residency name mixes in a new generation salt (`vllm_tiercache.shared.generations`), and each step's
metadata carries the salt, so the worker loads and saves under the same names. Records stored before
stay in the store for other engines and are never read again by this one.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata

from vllm_tiercache.eccache.metrics import PendingCounts
from vllm_tiercache.shared.generations import Generation, generation_mm_name
from vllm_tiercache.shared.request_tags import request_tags
from vllm_tiercache.shared.residency import ResidencyChanges, ResidentSet
from vllm_tiercache.shared.store.api import Store, StoreKey
from vllm_tiercache.shared.store.counters import add_nested

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class LoadItem:
    """One encoder output to load: `req_id`/`input_id` let the worker re-encode it if the load fails."""

    mm_hash: str
    req_id: str
    input_id: int
    num_embeds: int


@dataclass
class TieredECMetadata(ECConnectorMetadata):
    """What the scheduler side sends to the worker side each step (plain data: crosses processes).

    `scheduled_encoder_inputs` is, when there are loads, the very dict of this step's
    `SchedulerOutput.scheduled_encoder_inputs` (req_id -> input ids vLLM encodes this step), so that the
    worker can add an item whose load failed and have vLLM encode it in the same step. It stays the same
    object on the worker because vLLM ships a `SchedulerOutput` as one object graph: the uniproc executor
    hands over the object itself, the multiproc one a single pickle (`MessageQueue.enqueue`), Ray a single
    cloudpickle, and pickling keeps shared references. Should that ever stop holding, the worker's
    addition is lost and vLLM fails the step loudly ("Encoder cache miss"); it never yields wrong tokens.
    """

    loads: list[LoadItem] = field(default_factory=list)
    scheduled_encoder_inputs: dict[str, list[int]] | None = None
    #: the weights generation's salt (None before the engine's first reset): the worker names the records
    #: it loads and saves with it, from this step on (`vllm_tiercache.shared.generations`)
    generation: bytes | None = None
    #: mm_hash -> the tags its requests give (`vllm_tiercache.shared.request_tags`), for the items vLLM
    #: encodes this step: the worker writes them into the records it saves
    tags: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class TieredECWorkerMetadata(ResidencyChanges[str], ECConnectorWorkerMetadata):
    """Worker -> scheduler: names (`generation_mm_name` of the mm_hash) whose encoder output entered or left
    the worker's memory tier, and the worker's counter increments since its last report (`stats`).

    With several workers (tensor parallel) an item is resident only when every worker holds it
    (added: intersection, evicted: union), so a promise made from this is true on every rank. Counters
    are summed over workers, as vLLM sums connector stats.

    Counters travel here rather than through the worker's `get_ec_connector_stats`: vLLM 0.32's V1 model
    runner never calls that on a worker (only Model Runner V2 does), while both call
    `build_connector_worker_meta` every step. `tiers` ({tier: {counter: increment}}) is what the worker's
    store counted, summed like `stats`; `gauges` ({source: report}, `TieredStore.gauge_report`) are levels,
    one report per store, merged by source.
    """

    stats: dict[str, float] = field(default_factory=dict)
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)
    gauges: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, TieredECWorkerMetadata)
        stats = dict(self.stats)
        for name, value in other.stats.items():
            stats[name] = stats.get(name, 0) + value
        tiers = add_nested(add_nested({}, self.tiers), other.tiers)
        merged = self.merge(other)
        return TieredECWorkerMetadata(added=merged.added, evicted=merged.evicted, stats=stats, tiers=tiers,
                                      gauges={**self.gauges, **other.gauges})


#: An answer known only from the worker's residency reports (re-checked before it becomes a promise).
RESIDENT = "resident"


class ECSchedulerSide:
    """Existence answers for the current step from batched store lookups; the loads promised this step.

    `same_process()` tells whether a worker sharing this process's store exists (then its memory tier is
    visible here); it is asked at every lookup because vLLM builds the scheduler and the workers in an
    order this class should not depend on. `load_enabled` says whether the worker loads what is promised
    (a consumer); a producer-only instance is answered all the same, and a True answer just spares it the
    encoding. `cacheable(identifier)` False keeps an item out of the store entirely: never looked up,
    promised or loaded (the worker side, given the same hook, never saves it).
    """

    def __init__(
        self,
        store: Store,
        key_of: Callable[[str], StoreKey],
        *,
        load_enabled: bool,
        same_process: Callable[[], bool],
        counters: Any,
        cacheable: Callable[[str], bool] | None = None,
    ) -> None:
        self._store = store
        self._key_of = key_of
        self._load_enabled = load_enabled
        self._same_process = same_process
        self._counters = counters
        self._cacheable = cacheable
        #: names (`_name`) the worker(s) reported in their memory tier (and not evicted since).
        self.resident: ResidentSet[str] = ResidentSet()
        #: the weights generation lookups are made in (a new one at each `reset_cache`)
        self.generation = Generation()
        #: mm_hash -> stored? (True, False or RESIDENT), prefetched this step; cleared by build_connector_meta.
        self._step_answers: dict[str, bool | str] = {}
        #: mm_hash -> tags of the requests vLLM encodes it for this step (`TieredECMetadata.tags`)
        self._step_tags: dict[str, tuple[str, ...]] = {}
        self._promised: set[str] = set()
        self._pending: dict[str, LoadItem] = {}
        #: Counter increments not yet handed to vLLM's stats (this side's and the workers' reports).
        self._unreported = PendingCounts()
        #: The stores' per-tier increments and the workers' gauge reports not yet handed to vLLM's stats.
        self._unreported_tiers: dict[str, dict[str, float]] = {}
        self._unreported_write_queue_hits = 0.0
        self._unreported_gauges: dict[str, Any] = {}

    def _count(self, **deltas: float) -> None:
        """Count in the process-wide counters (stats files) and in what `take_stats` hands to vLLM."""
        self._counters.add(**deltas)
        self._unreported.add(deltas)

    def take_stats(self) -> dict[str, Any]:
        """Increments since the last call (this side's and the workers'), vLLM calls it every step: the
        connector's counters by name, ``tiers`` and ``write_queue_hits`` (the stores'), ``gauges`` (the
        workers' latest reports). Only what moved; {} when nothing did."""
        out: dict[str, Any] = dict(self._unreported.take())
        hits = self._unreported_write_queue_hits
        if self._unreported_tiers:
            out["tiers"], self._unreported_tiers = self._unreported_tiers, {}
        if hits:
            out["write_queue_hits"], self._unreported_write_queue_hits = hits, 0.0
        if self._unreported_gauges:
            out["gauges"], self._unreported_gauges = self._unreported_gauges, {}
        return out

    def _is_cacheable(self, identifier: str) -> bool:
        return self._cacheable is None or self._cacheable(identifier)

    def _name(self, mm_hash: str) -> str:
        """The name an item is stored and reported under in the current generation."""
        return generation_mm_name(mm_hash, self.generation.salt)

    def reset_cache(self) -> None:
        """Start a new weights generation (vLLM reset its encoder cache: the weights changed in place).

        Nothing is deleted: the records stay for the engines still running the old weights. This step's
        answers, promises and loads are dropped (vLLM resets between steps, when there are none) and so
        is the residency of the old names; a load of the old generation is never planned again.
        """
        self.generation.advance()
        self.resident.clear()
        self._step_answers.clear()
        self._promised.clear()
        self._pending.clear()
        self._count(generation_resets=1)

    def _lookup(self, mm_hashes: list[str]) -> list[bool | str]:
        """Per hash: True (in a tier the worker reads and this process sees), RESIDENT, or False."""
        found: list[bool | str] = [False] * len(mm_hashes)
        same_process = self._same_process()
        todo = list(range(len(mm_hashes)))
        if not same_process and self.resident:
            todo = []
            for i, h in enumerate(mm_hashes):
                if self._name(h) in self.resident:
                    found[i] = RESIDENT
                else:
                    todo.append(i)
        if not todo:
            return found
        keys = [self._key_of(self._name(mm_hashes[i])) for i in todo]
        try:
            hits = self._store.contains_many(keys, shared_only=not same_process, bounded=True)
        except Exception:  # a store that cannot answer is a miss, never a scheduling failure
            self._count(lookup_errors=1)
            return found
        for i, hit in zip(todo, hits, strict=True):
            found[i] = bool(hit)
        return found

    def ensure_cache_available(self, request: Request, num_computed_tokens: int = 0) -> bool:
        """Prefetch, in one batch, this step's answers for the items the request still needs; never defers.

        An item whose placeholder range lies wholly before `num_computed_tokens` is behind the request (its
        embeddings are in the KV cache) and is not looked up: a decoding request costs no lookup at all.
        """
        hashes = []
        for feature in request.mm_features:
            if num_computed_tokens:  # the position test first: a decode step does nothing else per item
                pos = feature.mm_position
                if pos.offset + pos.length <= num_computed_tokens:
                    continue
            identifier = feature.identifier
            if identifier in self._step_answers or identifier in hashes or not self._is_cacheable(identifier):
                continue
            hashes.append(identifier)
        if hashes:
            self._step_answers.update(zip(hashes, self._lookup(hashes), strict=True))
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """True when the store holds `identifier` now; asked only for items vLLM is about to encode.

        For a consumer True is a promise the worker loads it; for a producer-only instance it means vLLM
        need not encode it (it is published already).
        """
        if not self._is_cacheable(identifier):
            return False
        stored = self._step_answers.get(identifier)
        if stored is None or (stored == RESIDENT and self._name(identifier) not in self.resident):
            # Not prefetched this step, or the worker evicted it from memory since: ask now.
            stored = self._lookup([identifier])[0]
            self._step_answers[identifier] = stored
        stored = bool(stored)
        self._count(**({"hits": 1} if stored else {"misses": 1}))
        if stored:
            self._promised.add(identifier)
        return stored

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if self._load_enabled and mm_hash in self._promised and mm_hash not in self._pending:
            self._pending[mm_hash] = LoadItem(
                mm_hash, request.request_id, index, request.get_num_encoder_embeds(index)
            )
        elif tags := request_tags(request):  # encoded this step: its record carries the request's tags
            self._step_tags[mm_hash] = tuple(dict.fromkeys(self._step_tags.get(mm_hash, ()) + tags))

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None) -> TieredECMetadata:
        """This step's loads; ends the step (its answers and promises are dropped)."""
        meta = TieredECMetadata(loads=list(self._pending.values()), generation=self.generation.salt,
                                tags=self._step_tags)
        self._step_tags = {}
        if meta.loads and scheduler_output is not None:
            # A reference, not a copy, and not modified here (see TieredECMetadata).
            meta.scheduled_encoder_inputs = scheduler_output.scheduled_encoder_inputs
        self._pending.clear()
        self._promised.clear()
        self._step_answers.clear()
        return meta

    def update_connector_output(self, worker_meta: Any) -> None:
        """Apply the workers' residency report of the last step and take over their counters."""
        if isinstance(worker_meta, TieredECWorkerMetadata):
            self.resident.apply(worker_meta.added, worker_meta.evicted)
            stats = dict(worker_meta.stats)
            self._unreported_write_queue_hits += stats.pop("write_queue_hits", 0)
            self._unreported.add(stats)
            add_nested(self._unreported_tiers, worker_meta.tiers)
            self._unreported_gauges.update(worker_meta.gauges)

    def request_finished(self, request: Request) -> None:
        """Nothing is kept per request (answers live for one step)."""
