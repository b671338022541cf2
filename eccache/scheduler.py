"""Scheduler side of `TieredECConnector`: decide which encoder outputs the worker loads instead of computing.

vLLM 0.32's scheduler asks, per request and step, `ensure_cache_available(request)` before it schedules
the request, then `has_cache_item(mm_hash)` for each item it would otherwise encode (only after its own
encoder cache missed and space was reserved), then `update_state_after_alloc(request, i)` for every item
it allocated (computed and loaded alike) and finally `build_connector_meta` once per step.

Lookups cost one batched `contains_many` per request, made the first time the request is seen and kept
until it finishes: `ensure_cache_available` runs every step for every running multimodal request, so
anything slower would tax every decode step. A promise can still turn out false at load time (record
evicted or corrupt since); the worker then re-encodes the item in the same step (see `eccache.worker`).

Where the lookup looks: vLLM usually runs the scheduler and the worker in different processes (on CPU,
and with more than one device, its multiproc executor), so the worker's in-process memory tier is
invisible here. The store is then asked only for its shared tiers (disk, GDS, Redis), and what the
worker's memory tier holds is known from the residency reports it sends back every step
(`TieredECWorkerMetadata`, through vLLM's `build_connector_worker_meta` -> `update_connector_output`
channel). When the worker lives in this very process (uniproc executor), the whole store is asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata

from shared.store.api import StoreKey

if TYPE_CHECKING:
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
    """What the scheduler side sends to the worker side each step (plain data: crosses processes)."""

    loads: list[LoadItem] = field(default_factory=list)


@dataclass
class TieredECWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker -> scheduler: mm_hashes whose encoder output entered or left the worker's memory tier.

    With several workers (tensor parallel) an item is resident only when every worker holds it
    (added: intersection, evicted: union), so a promise made from this is true on every rank.
    """

    added: set[str] = field(default_factory=set)
    evicted: set[str] = field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, TieredECWorkerMetadata)
        return TieredECWorkerMetadata(added=self.added & other.added, evicted=self.evicted | other.evicted)


#: An answer known only from the worker's residency reports (re-checked before it becomes a promise).
RESIDENT = "resident"


class ECSchedulerSide:
    """Per-request existence answers from one batched store lookup; the loads promised this step.

    `same_process()` tells whether a worker sharing this process's store exists (then its memory tier is
    visible here); it is asked at every lookup because vLLM builds the scheduler and the workers in an
    order this class should not depend on.
    """

    def __init__(
        self,
        store: Any,
        key_of: Callable[[str], StoreKey],
        *,
        load_enabled: bool,
        same_process: Callable[[], bool],
        counters: Any,
    ) -> None:
        self._store = store
        self._key_of = key_of
        self._load_enabled = load_enabled
        self._same_process = same_process
        self._counters = counters
        #: mm_hashes the worker(s) reported in their memory tier (and not evicted since).
        self.resident: set[str] = set()
        #: req_id -> {mm_hash: stored? (True, False or RESIDENT)}, filled once per request.
        self._answers: dict[str, dict[str, bool | str]] = {}
        #: mm_hash -> stored?, the union of live requests' answers (has_cache_item only gets a hash).
        self._known: dict[str, bool | str] = {}
        self._promised: set[str] = set()
        self._pending: dict[str, LoadItem] = {}

    def _lookup(self, mm_hashes: list[str]) -> list[bool | str]:
        """Per hash: True (in a tier the worker reads and this process sees), RESIDENT, or False."""
        found: list[bool | str] = [False] * len(mm_hashes)
        same_process = self._same_process()
        todo = list(range(len(mm_hashes)))
        if not same_process and self.resident:
            todo = []
            for i, h in enumerate(mm_hashes):
                if h in self.resident:
                    found[i] = RESIDENT
                else:
                    todo.append(i)
        if not todo:
            return found
        keys = [self._key_of(mm_hashes[i]) for i in todo]
        try:
            hits = self._store.contains_many(keys, shared_only=not same_process)
        except Exception:  # a store that cannot answer is a miss, never a scheduling failure
            self._counters.add(lookup_errors=1)
            return found
        for i, hit in zip(todo, hits, strict=True):
            found[i] = bool(hit)
        return found

    def ensure_cache_available(self, request: Request) -> bool:
        """Batch-check every item of a request once; never defers (loads are synchronous)."""
        if not self._load_enabled or request.request_id in self._answers:
            return True
        hashes = [f.identifier for f in request.mm_features]
        found = self._lookup(hashes) if hashes else []
        answers = dict(zip(hashes, found, strict=True))
        self._answers[request.request_id] = answers
        self._known.update(answers)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """True promises the worker can load `identifier`; asked only for items vLLM would encode."""
        if not self._load_enabled:
            return False
        stored = self._known.get(identifier)
        if stored is None or (stored == RESIDENT and identifier not in self.resident):
            # Never asked, or the worker evicted it from memory since: ask again (a shared tier may have it).
            stored = self._lookup([identifier])[0]
            self._known[identifier] = stored
        stored = bool(stored)
        self._counters.add(**({"hits": 1} if stored else {"misses": 1}))
        if stored:
            self._promised.add(identifier)
        return stored

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if mm_hash in self._promised and mm_hash not in self._pending:
            self._pending[mm_hash] = LoadItem(
                mm_hash, request.request_id, index, request.get_num_encoder_embeds(index)
            )

    def build_connector_meta(self) -> TieredECMetadata:
        meta = TieredECMetadata(loads=list(self._pending.values()))
        self._pending.clear()
        self._promised.clear()
        return meta

    def update_connector_output(self, worker_meta: Any) -> None:
        """Apply the workers' residency report of the last step."""
        if isinstance(worker_meta, TieredECWorkerMetadata):
            self.resident -= worker_meta.evicted
            self.resident |= worker_meta.added

    def request_finished(self, request: Request) -> None:
        answers = self._answers.pop(request.request_id, None)
        if not answers:
            return
        live = set()
        for other in self._answers.values():
            live.update(other)
        for mm_hash in answers:
            if mm_hash not in live:
                self._known.pop(mm_hash, None)
