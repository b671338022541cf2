"""The step's plan as vLLM's multiproc executor carries it to the workers: pickled (its shm MessageQueue), once
per step, with one load or save per chunk. `vllm_tiercache.kvcache.plan.pickled_by_position` says why its items
pickle by position; here: every field survives, tenant included, and no field name is in the bytes."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import pytest

from vllm_tiercache.kvcache.plan import (
    ChunkLoad,
    ChunkPrefetch,
    ChunkSave,
    RequestPlan,
    TieredKVMetadata,
    pickled_by_position,
)


def _step() -> TieredKVMetadata:
    """Every field of every item set to something other than its default."""
    load = ChunkLoad(b"L" * 32, 4, 5, 8, [40, 41, 42], group=1, tenant="tenant-a")
    save = ChunkSave(b"S" * 32, [7, 8, 9, 10], group=1, first=4, urgent=True, tags=("doc:x", "corpus"),
                     reused_share=0.5, tenant="tenant-b", parent_hash=b"P" * 32)
    prefetch = ChunkPrefetch(b"F" * 32, tenant="tenant-c", urgent=True)
    plan = RequestPlan("req-1", loads=[load], saves=[save], whole_request=True, handoff_wait_s=2.0)
    return TieredKVMetadata(requests=[plan], prefetches=[prefetch], near_loads=True, release=[b"R" * 32])


def test_every_field_survives_the_workers_unpickling() -> None:
    step = _step()
    copy = pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
    assert copy == step
    (plan,) = copy.requests
    assert (plan.loads[0].tenant, plan.saves[0].tenant, copy.prefetches[0].tenant) == ("tenant-a", "tenant-b",
                                                                                         "tenant-c")
    assert plan.loads[0].source_slice == slice(1, 4)


def test_items_pickle_by_position_without_their_field_names() -> None:
    data = pickle.dumps(_step(), protocol=pickle.HIGHEST_PROTOCOL)
    for name in (b"chunk_start", b"block_ids", b"parent_hash", b"reused_share", b"chunk_hash"):
        assert name not in data, name
    assert b"handoff_wait_s" in data  # one per request: left as dataclasses pickle it


def test_a_class_it_cannot_rebuild_by_position_is_refused() -> None:
    @dataclass
    class Derived:
        first: int
        total: int = field(init=False, default=0)

    with pytest.raises(TypeError, match="__init__ argument"):
        pickled_by_position(Derived)



@dataclass
class TracedLoad(ChunkLoad):
    """A subclass with a field of its own (pickle finds it here, at module level)."""

    trace_id: str = "t-1"


def test_a_subclass_with_a_field_of_its_own_keeps_it() -> None:
    load = TracedLoad(b"L" * 32, 0, 0, 4, [1, 2, 3, 4], tenant="t", trace_id="t-9")
    copy = pickle.loads(pickle.dumps(load, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(copy) is TracedLoad and copy == load and copy.trace_id == "t-9"
