"""What the scheduler tells the workers each step: which chunks to load into which blocks, which to save.

These plain dataclasses cross the scheduler -> worker process boundary inside vLLM's
`KVConnectorMetadata`, so they hold only ints, bytes and lists. How prompts are cut into chunks and how
chunks are named: `vllm_tiercache.kvcache.naming`.
"""

from __future__ import annotations

import copyreg
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_tiercache.shared.residency import ResidencyChanges

PlanItem = TypeVar("PlanItem")


def pickled_by_position(cls: type[PlanItem]) -> type[PlanItem]:
    """Pickle ``cls`` as its constructor and its field values in order, instead of its ``__dict__``.

    Why: with vLLM's multiproc executor every step's metadata is pickled on the engine core's thread and
    unpickled on each worker, with one of these per chunk: 32 hits of 2K tokens are 512 loads. A dataclass's
    default pickle is its class and a dict per object; by position 512 loads pickle in 0.46-0.82 ms instead of
    0.84-1.0 and unpickle in 0.38-0.57 ms instead of 0.98-1.14 (tests/kv/test_plan_pickle.py checks the form)."""
    items = fields(cls)  # type: ignore[arg-type]
    names = tuple(f.name for f in items)
    if len(names) < 2 or not all(f.init for f in items):
        raise TypeError(f"{cls.__name__}: pickled by position needs two fields or more, each an __init__ argument")
    values = attrgetter(*names)

    def __reduce__(self: PlanItem) -> tuple[Any, ...]:
        if type(self) is not cls:  # a subclass may have fields of its own: pickled with its __dict__
            return copyreg.__newobj__, (type(self),), self.__dict__
        return cls, values(self)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign,assignment]
    return cls


@pickled_by_position
@dataclass
class ChunkLoad:
    """Copy blocks [first, end) of one stored chunk into `block_ids` (one destination per block).

    `chunk_start` is the first block the record holds (for a sliding-window group, the first block of the
    chunk inside a window: `vllm_tiercache.kvcache.groups`); `group` is the KV cache group whose layers
    and block table the load is for."""

    chunk_hash: bytes
    chunk_start: int
    first: int
    end: int
    block_ids: list[int]
    group: int = 0
    #: the request's tenant salt (vLLM's ``cache_salt``): a sealing store opens the records with its subkey
    #: (never in a repr: a load trace or a log line must not show it)
    tenant: str | None = field(default=None, repr=False)

    @property
    def source_slice(self) -> slice:
        return slice(self.first - self.chunk_start, self.end - self.chunk_start)


@pickled_by_position
@dataclass
class ChunkSave:
    """Gather `block_ids` (all blocks of one chunk, in order) and store them under `chunk_hash`."""

    chunk_hash: bytes
    block_ids: list[int]
    #: the KV cache group whose layers are saved, and the first block of the record
    group: int = 0
    first: int = 0
    #: a prefill/decode hand-off's record: written to the slower tiers ahead of other queued writes
    urgent: bool = False
    #: the request's tags (`vllm_tiercache.shared.request_tags`), written into the records' meta
    tags: tuple[str, ...] = ()
    #: the share of its prompt the request reused (`RequestState.reused_share`): a slower tier whose
    #: admission has ``reused_prompt_share`` may admit the records at once (None: not known)
    reused_share: float | None = None
    #: the request's tenant salt (vLLM's ``cache_salt``): a sealing store seals the records with its subkey
    #: (never in a repr)
    tenant: str | None = field(default=None, repr=False)
    #: the name of the chunk before this one (None for a prompt's first): each record's meta names the same
    #: layer's record of it as its parent (`vllm_tiercache.shared.eviction.lineage`), for prefix-aware eviction
    parent_hash: bytes | None = None


@pickled_by_position
@dataclass
class ChunkPrefetch:
    """Fetch every record of one chunk that this worker's rank reads from the far tiers into its memory tier,
    off the forward pass (`vllm_tiercache.kvcache.load.prefetcher`), for a request still waiting for its turn."""

    chunk_hash: bytes
    #: the request's tenant salt (`ChunkLoad.tenant`); never in a repr
    tenant: str | None = field(default=None, repr=False)
    #: its request's turn came and it waits for this chunk: fetched ahead of the chunks of requests still queued
    urgent: bool = False


@dataclass
class RequestPlan:
    req_id: str
    loads: list[ChunkLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    #: the loads are one whole-request load vLLM waits for (``load_kv_async``): the request is reported
    #: finished, or failed, receiving (a model with several KV cache groups; see `KVSchedulerSide`)
    whole_request: bool = False
    #: a prefill/decode hand-off's load (`vllm_tiercache.kvcache.handoff.promise`): always asynchronous (vLLM waits
    #: for it), waiting at most this long for promised records still in flight; None: not a hand-off
    handoff_wait_s: float | None = None


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """One step's work for every worker."""

    requests: list[RequestPlan] = field(default_factory=list)
    #: chunks found on a far tier for requests still waiting: fetched into host memory in the background
    prefetches: list[ChunkPrefetch] = field(default_factory=list)
    #: this step's loads read only the near tiers (memory, local files): what a far tier holds was fetched
    #: ahead, and a record gone since is a failed load (recomputed), never a network wait in the forward
    near_loads: bool = False
    #: staged chunks (`ChunkPrefetch`) this step's loads read for the last time: the workers drop them once
    #: the step's loads are over (a later request fetches again, from the memory tier if it kept them)
    release: list[bytes] = field(default_factory=list)

    @property
    def has_saves(self) -> bool:
        return any(plan.saves for plan in self.requests)


@dataclass
class TieredKVWorkerMetadata(ResidencyChanges[bytes], KVConnectorWorkerMetadata):
    """Worker -> scheduler: chunk hashes that entered or left the worker's in-process memory tier
    (`vllm_tiercache.shared.residency` says why, and how ranks merge), and chunks a whole-request load
    could not use (missing, corrupt, another layout): the scheduler claims them no more until saved again;
    and the prefetches that are over (`ChunkPrefetch`): staged in host memory (per chunk, how many ranks
    staged it: the scheduler claims a chunk once every rank did), failed, or dropped from staging since."""

    failed: set[bytes] = field(default_factory=set)
    prefetched: dict[bytes, int] = field(default_factory=dict)
    prefetch_failed: set[bytes] = field(default_factory=set)
    unstaged: set[bytes] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TieredKVWorkerMetadata)
        merged = self.merge(other)
        return TieredKVWorkerMetadata(added=merged.added, evicted=merged.evicted, failed=self.failed | other.failed,
                                      prefetched={name: self.prefetched.get(name, 0) + other.prefetched.get(name, 0)
                                                  for name in self.prefetched.keys() | other.prefetched.keys()},
                                      prefetch_failed=self.prefetch_failed | other.prefetch_failed,
                                      unstaged=self.unstaged | other.unstaged)
