"""KV cache events for what the tiers can serve, on vLLM's real `Scheduler` (its own event path: the
connector's ``take_events`` is published right after vLLM's GPU events, in the same `KVEventBatch`).

What these pin down (the real router's view, with Dynamo's indexer and a real server, is in
tests/engine/test_kv_events_engine.py):

- off unless ``kv_events_config`` enables events: no tracker, no events; none either for an engine that
  loads nothing (a ``kv_producer``);
- a chunk the workers' memory tier holds is announced as ``CPU`` with exactly what vLLM announces for the
  same blocks on the GPU (block hashes, parent, token ids, block size, extra keys), parent-linked chunk to
  chunk; one the disk holds as ``DISK`` once every record is there, never before;
- a memory eviction withdraws ``CPU`` only; records deleted behind the engine's back (``tiercache evict``)
  are withdrawn from ``DISK`` by the sweep; a failed load withdraws the chunk everywhere;
- a connector reset publishes `AllBlocksCleared`; vLLM's own prefix-cache reset makes the connector
  announce again what the tiers still hold;
- the ledger: removals reference-counted per block and medium, bursts taken in bounded batches, the
  LoRA name and ``cache_salt`` carried as vLLM carries them.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from tests.support.real_scheduler import cpu_vllm_config, hashed_request, one_group_kv_cache_config, schedule_new
from tests.support.real_scheduler import real_scheduler as real_scheduler_over
from vllm_tiercache.kvcache.connector import TieredKVConnector
from vllm_tiercache.kvcache.events.ledger import MEDIUM_DISK, MEDIUM_MEMORY, MEDIUM_REMOTE, ChunkPayload, KVEventLedger
from vllm_tiercache.kvcache.events.tracker import shared_medium
from vllm_tiercache.kvcache.off_step import OffStepJob
from vllm_tiercache.kvcache.plan import TieredKVMetadata, TieredKVWorkerMetadata
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.tools.redis_server import RedisServer
from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec

BLOCK, CHUNK = 16, 64  # 4 blocks per chunk
PROMPT_LEN = 200  # 12 full blocks: chunks ending at blocks 4, 8, 12


def _config(model: Path, disk: Path | None, *, events: bool = True, role: str = "kv_both",
            shared_tier: dict[str, Any] | None = None) -> VllmConfig:
    """Memory and, behind it, a disk tier at ``disk`` (or ``shared_tier`` instead)."""
    shared = shared_tier or {"kind": "disk", "path": str(disk), "capacity": "64MiB"}
    kv = KVTransferConfig(
        kv_connector="TieredKVConnector", kv_connector_module_path="vllm_tiercache.kvcache.connector",
        kv_role=role,
        kv_connector_extra_config={"namespace": "ev", "chunk_size": CHUNK, "tiers": [
            {"kind": "memory", "capacity": "64MiB"}, shared]},
    )
    return cpu_vllm_config(str(model), kv, block_size=BLOCK, prefix_caching=True, max_num_batched_tokens=512,
                           kv_events=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None)


class Published:
    """vLLM's scheduler with its publisher's batches caught. Every one a test makes is closed after it
    (`close_all`, tests/kv/events/conftest.py): its store's threads must not outlive the test."""

    #: made and not yet closed
    _open: ClassVar[list[Published]] = []

    def __init__(self, vllm_config: VllmConfig, *, inline: bool = True) -> None:
        """``inline``: the tracker's shared-tier questions are answered within the step that asks them, so
        each test can say what one step publishes (`test_the_shared_tiers_are_asked_off_the_step` runs the
        connector's own background thread)."""
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(TinyLlamaSpec().num_layers)]
        kv_cache_config = one_group_kv_cache_config(layers, BLOCK, num_kv_heads=2, num_blocks=128)
        self.scheduler: Scheduler = real_scheduler_over(vllm_config, kv_cache_config=kv_cache_config)
        self.batches: list[KVEventBatch] = []
        self.scheduler.kv_event_publisher.publish = self.batches.append  # type: ignore[method-assign]
        Published._open.append(self)
        tracker = self.connector._scheduler.events if self.connector._scheduler else None  # type: ignore[union-attr]
        if tracker is not None and inline:
            tracker.off_step.close()
            tracker.off_step = OffStepJob("inline", inline=True)

    @property
    def connector(self) -> TieredKVConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, TieredKVConnector)
        return connector

    def events(self, kind: type | None = None, medium: str | None = None) -> list[Any]:
        found = [e for batch in self.batches for e in batch.events]
        self.batches.clear()
        return [e for e in found if (kind is None or isinstance(e, kind))
                and (medium is None or getattr(e, "medium", None) == medium)]

    def finish(self, out: Any, worker_meta: TieredKVWorkerMetadata | None = None) -> None:
        """Feed the step's model output with the workers' report; end every request."""
        req_ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=[[7] for _ in req_ids],
                                   kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=worker_meta))
        self.scheduler.update_from_output(out, runner)
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def close(self) -> None:
        """What the engine's stop would end: the scheduler side's threads (events, far lookups), the store's."""
        if self.connector._scheduler is not None:
            self.connector._scheduler.shutdown()
        self.connector._store.close(5.0)

    @classmethod
    def close_all(cls) -> None:
        while cls._open:
            cls._open.pop().close()

    def report(self, worker_meta: TieredKVWorkerMetadata) -> None:
        """A step with nothing scheduled that carries the workers' report (the events go with it)."""
        out = self.scheduler.schedule()
        runner = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                   kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=worker_meta))
        self.scheduler.update_from_output(out, runner)


def _play_saves(connector: TieredKVConnector, meta: TieredKVMetadata) -> list[bytes]:
    """What the worker does with the plan's saves: a record per layer into the store (memory, then disk)."""
    return _put_records(connector, [save for plan in meta.requests for save in plan.saves])


def _put_records(connector: TieredKVConnector, saves: list[Any]) -> list[bytes]:
    """Every layer's record of each of ``saves`` into the store, flushed to every tier; their chunk names."""
    naming = connector._scheduler.naming  # type: ignore[union-attr]
    for save in saves:
        for layer in naming.groups.groups[save.group].layers:
            connector._store.put(naming.record_key(save.chunk_hash, layer, 0), torch.zeros(len(save.block_ids), 4))
    assert connector._store.flush(10.0)
    return [save.chunk_hash for save in saves]


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(PROMPT_LEN)]


def _stored_and_announced(tiny_llama: Path, tmp_path: Path) -> tuple[Published, Request, list[bytes]]:
    engine = Published(_config(tiny_llama, tmp_path / "disk"))
    request = hashed_request("a", _prompt(1), BLOCK)
    out, meta = schedule_new(engine.scheduler, request)
    names = _play_saves(engine.connector, meta)
    assert len(names) == 3
    engine.finish(out, TieredKVWorkerMetadata(added=set(names)))
    return engine, request, names


def test_events_are_off_unless_vllm_publishes_them(tiny_llama: Path, tmp_path: Path) -> None:
    engine = Published(_config(tiny_llama, tmp_path / "disk", events=False))
    assert engine.connector._scheduler.events is None  # type: ignore[union-attr]
    out, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(1), BLOCK))
    names = _play_saves(engine.connector, meta)
    engine.finish(out, TieredKVWorkerMetadata(added=set(names)))
    assert list(engine.connector.take_events()) == []
    assert engine.events() == []


def test_an_engine_that_loads_nothing_announces_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    producer = Published(_config(tiny_llama, tmp_path / "disk", role="kv_producer"))
    assert producer.connector._scheduler.events is None  # type: ignore[union-attr]  # a router must not count on it


def test_a_held_chunk_is_announced_per_tier_as_vllm_announces_the_same_blocks(tiny_llama: Path,
                                                                            tmp_path: Path) -> None:
    engine, request, _ = _stored_and_announced(tiny_llama, tmp_path)
    published = engine.events(BlockStored)
    gpu = [e for e in published if e.medium == "GPU"]
    cpu = [e for e in published if e.medium == MEDIUM_MEMORY]
    disk = [e for e in published if e.medium == MEDIUM_DISK]
    assert len(cpu) == 3 and len(disk) == 3
    gpu_hashes = [h for e in gpu for h in e.block_hashes]
    gpu_tokens = [t for e in gpu for t in e.token_ids]
    for medium_events in (cpu, disk):
        # vLLM's own hashes and tokens for the same 12 blocks, parent-linked chunk to chunk
        assert [h for e in medium_events for h in e.block_hashes] == gpu_hashes[:12]
        assert [t for e in medium_events for t in e.token_ids] == gpu_tokens[:12 * BLOCK] == request.prompt_token_ids[
            :12 * BLOCK]
        assert medium_events[0].parent_block_hash is None
        for before, after in itertools.pairwise(medium_events):
            assert after.parent_block_hash == before.block_hashes[-1]
        assert {e.block_size for e in medium_events} == {BLOCK}
        assert {e.group_idx for e in medium_events} == {0}
        assert all(e.lora_name is None for e in medium_events)


def test_disk_is_announced_only_once_every_record_is_there(tiny_llama: Path, tmp_path: Path) -> None:
    engine = Published(_config(tiny_llama, tmp_path / "disk"))
    out, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(2), BLOCK))
    engine.finish(out)  # the plan is made; no record is written yet
    assert engine.events(medium=MEDIUM_DISK) == [] and engine.events(medium=MEDIUM_MEMORY) == []
    connector = engine.connector
    naming = connector._scheduler.naming  # type: ignore[union-attr]
    first = meta.requests[0].saves[0]
    connector._store.put(naming.record_key(first.chunk_hash, 0, 0), torch.zeros(4, 4))  # one layer of two
    assert connector._store.flush(10.0)
    engine.report(TieredKVWorkerMetadata())
    assert engine.events(medium=MEDIUM_DISK) == []
    _play_saves(connector, meta)
    engine.report(TieredKVWorkerMetadata())
    assert len(engine.events(BlockStored, MEDIUM_DISK)) == 3


def test_a_chunk_found_on_disk_before_its_parent_waits_for_it(tiny_llama: Path, tmp_path: Path) -> None:
    """The children's records land first (or the parent was asked again behind them): nothing is announced
    on disk until the parent is, then all of it, parent first."""
    engine = Published(_config(tiny_llama, tmp_path / "disk"))
    out, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(3), BLOCK))
    engine.finish(out)
    connector = engine.connector
    saves = meta.requests[0].saves
    assert len(saves) == 3
    _put_records(connector, saves[1:])  # every record of the second and third chunks, none of the first
    for _ in range(3):
        engine.report(TieredKVWorkerMetadata())
        assert engine.events(BlockStored, MEDIUM_DISK) == []
    _play_saves(connector, meta)
    engine.report(TieredKVWorkerMetadata())
    disk = engine.events(BlockStored, MEDIUM_DISK)
    assert len(disk) == 3 and disk[0].parent_block_hash is None
    assert [e.parent_block_hash for e in disk[1:]] == [e.block_hashes[-1] for e in disk[:-1]]


def test_a_chunk_whose_parent_never_lands_is_announced_once_the_parent_is_given_up(tiny_llama: Path,
                                                                                  tmp_path: Path) -> None:
    """Waiting for a parent is bounded by the parent's own confirmation time: then the children are
    announced (loadable after a prefix vLLM itself holds, which a router matches on its GPU blocks)."""
    engine = Published(_config(tiny_llama, tmp_path / "disk"))
    out, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(5), BLOCK))
    engine.finish(out)
    connector = engine.connector
    tracker = connector._scheduler.events  # type: ignore[union-attr]
    _put_records(connector, meta.requests[0].saves[1:])  # not the first chunk's
    engine.report(TieredKVWorkerMetadata())
    assert engine.events(BlockStored, MEDIUM_DISK) == []
    tracker.clock = lambda: time.monotonic() + tracker.confirm_timeout_s + 1  # the parent's time is up
    engine.report(TieredKVWorkerMetadata())  # the parent is given up, the children wait no more ...
    engine.report(TieredKVWorkerMetadata())  # ... and are found on the next ask
    disk = engine.events(BlockStored, MEDIUM_DISK)
    assert len(disk) == 2 and disk[0].parent_block_hash is not None
    assert disk[1].parent_block_hash == disk[0].block_hashes[-1]


def test_the_shared_tiers_are_asked_off_the_step(tiny_llama: Path, tmp_path: Path) -> None:
    """The connector's own set-up: confirmation lookups run on the tracker's thread. A step never waits
    for them (here a lookup held until released), and their answer is announced on a later step."""
    engine = Published(_config(tiny_llama, tmp_path / "disk"), inline=False)
    connector = engine.connector
    tracker = connector._scheduler.events  # type: ignore[union-attr]
    assert tracker is not None and not tracker.off_step.inline
    out, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(4), BLOCK))
    engine.finish(out)  # the save is planned
    _play_saves(connector, meta)
    assert tracker.off_step.wait(10.0)
    release, asked = threading.Event(), threading.Event()
    real_contains = connector._store.contains_many

    def held_contains(*args: Any, **kwargs: Any) -> list[bool]:
        asked.set()
        assert release.wait(60.0)
        return real_contains(*args, **kwargs)

    connector._store.contains_many = held_contains  # type: ignore[method-assign]
    try:
        engine.report(TieredKVWorkerMetadata())  # the confirmation posted
        assert asked.wait(10.0)
        for _ in range(3):  # steps go on while the question is out (were one waited for, this would hang)
            engine.report(TieredKVWorkerMetadata())
        assert not tracker.off_step.idle and engine.events(medium=MEDIUM_DISK) == []
    finally:
        release.set()
        connector._store.contains_many = real_contains  # type: ignore[method-assign]
    announced: list[Any] = []
    for _ in range(20):  # a step or two after the answer came
        assert tracker.off_step.wait(10.0)
        engine.report(TieredKVWorkerMetadata())
        announced += engine.events(BlockStored, MEDIUM_DISK)
        if len(announced) == 3:
            break
    assert len(announced) == 3
    tracker.close()


def test_evictions_withdraw_each_tier_on_its_own(tiny_llama: Path, tmp_path: Path) -> None:
    engine, _, names = _stored_and_announced(tiny_llama, tmp_path)
    engine.events()
    tracker = engine.connector._scheduler.events  # type: ignore[union-attr]
    engine.report(TieredKVWorkerMetadata(evicted={names[2]}))  # the memory tier dropped the last chunk
    removed = engine.events(BlockRemoved)
    assert [e.medium for e in removed] == [MEDIUM_MEMORY] and len(removed[0].block_hashes) == 4
    # `tiercache evict` in another process: the sweep finds the records gone
    from vllm_tiercache.tools.evict_cmd import evict

    evict(_store_config(tmp_path), namespace="ev")
    tracker._next_sweep = 0.0
    engine.report(TieredKVWorkerMetadata())
    removed = engine.events(BlockRemoved)
    assert {e.medium for e in removed} == {MEDIUM_DISK}
    assert sum(len(e.block_hashes) for e in removed) == 12
    # a failed load withdraws what memory still announced
    engine.report(TieredKVWorkerMetadata(failed={names[0]}))
    removed = engine.events(BlockRemoved)
    assert [(e.medium, len(e.block_hashes)) for e in removed] == [(MEDIUM_MEMORY, 4)]


def test_a_chunk_memory_demotes_to_an_exclusive_disk_is_announced_there(tiny_llama: Path, tmp_path: Path) -> None:
    """A disk exclusive of memory (admission ``evicted``) is written a chunk only when memory evicts it, long
    after its save's confirmation gave up: the memory tier's eviction report asks the disk again."""
    disk = {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "256MiB", "admission": {"policy": "evicted"}}
    engine = Published(_config(tiny_llama, None, shared_tier=disk))
    tracker = engine.connector._scheduler.events  # type: ignore[union-attr]
    tracker.confirm_timeout_s = 0.0  # the save's confirmation gives up at its first "not there"
    out, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(5), BLOCK))
    names = _play_saves(engine.connector, meta)
    engine.finish(out, TieredKVWorkerMetadata(added=set(names)))
    engine.report(TieredKVWorkerMetadata())
    published = engine.events(BlockStored)
    assert len([e for e in published if e.medium == MEDIUM_MEMORY]) == 3
    assert [e for e in published if e.medium == MEDIUM_DISK] == []  # in memory only: nothing to announce there
    store = engine.connector._store
    store.put_many([(StoreKey(f"ev|filler|{i}"), torch.zeros(256 * 1024), None) for i in range(80)])  # 80 MiB
    assert store.flush(10.0)
    naming = engine.connector._scheduler.naming  # type: ignore[union-attr]
    keys = [naming.record_key(name, layer, 0) for name in names for layer in naming.groups.groups[0].layers]
    assert store.tiers[0].contains_many(keys) == [False] * len(keys)  # evicted: demoted to disk
    assert store.tiers[1].contains_many(keys) == [True] * len(keys)
    engine.report(TieredKVWorkerMetadata(evicted=set(names)))  # the workers' report of that eviction
    engine.report(TieredKVWorkerMetadata())
    published = engine.events()
    removed = [e for e in published if isinstance(e, BlockRemoved)]
    assert {e.medium for e in removed} == {MEDIUM_MEMORY} and sum(len(e.block_hashes) for e in removed) == 12
    assert len([e for e in published if isinstance(e, BlockStored) and e.medium == MEDIUM_DISK]) == 3


def _store_config(tmp_path: Path) -> dict[str, Any]:
    return {"namespace": "ev", "tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}


def test_resets_clear_or_reannounce(tiny_llama: Path, tmp_path: Path) -> None:
    engine, _, _ = _stored_and_announced(tiny_llama, tmp_path)
    engine.events()
    # vLLM resets its own prefix cache only: it publishes AllBlocksCleared, we announce the tiers again
    assert engine.scheduler.reset_prefix_cache()
    engine.report(TieredKVWorkerMetadata())
    events = engine.events()
    assert isinstance(events[0], AllBlocksCleared)
    again = [e for e in events[1:] if isinstance(e, BlockStored)]
    assert {e.medium for e in again} == {MEDIUM_MEMORY, MEDIUM_DISK} and len(again) == 6
    # a connector reset (a new weights generation): everything the tiers announced is void
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.report(TieredKVWorkerMetadata())
    events = engine.events()
    assert [type(e) for e in events] == [AllBlocksCleared, AllBlocksCleared]


def test_a_connector_reset_before_the_first_step_leaves_the_steps_working(tiny_llama: Path, tmp_path: Path) -> None:
    """A weight update before any request: the start-up journal is never read (its names are of the old
    weights), and later steps announce as usual."""
    engine = Published(_config(tiny_llama, tmp_path / "disk"))
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.report(TieredKVWorkerMetadata())
    engine.report(TieredKVWorkerMetadata())
    out, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(1), BLOCK))
    names = _play_saves(engine.connector, meta)
    engine.finish(out, TieredKVWorkerMetadata(added=set(names)))
    engine.report(TieredKVWorkerMetadata())
    assert len(engine.events(BlockStored, MEDIUM_MEMORY)) == 3


def test_a_lookup_announces_what_a_restarted_engine_finds_on_disk(tiny_llama: Path, tmp_path: Path) -> None:
    first, request, _ = _stored_and_announced(tiny_llama, tmp_path)
    first.connector._store.close()
    second = Published(_config(tiny_llama, tmp_path / "disk"))
    out, _ = schedule_new(second.scheduler, hashed_request("b", list(request.prompt_token_ids), BLOCK))
    second.finish(out)
    disk = second.events(BlockStored, MEDIUM_DISK)
    assert [h for e in disk for h in e.block_hashes] == _external(request.block_hashes[:12])


# -------------------------------------------------------------------------------------- the ledger
def _external(hashes: list[bytes]) -> list[Any]:
    """Block hashes as vLLM's events carry them."""
    return [maybe_convert_block_hash(h) for h in hashes]


class _Request:
    """What `ChunkPayload.of` reads of a vLLM request."""

    def __init__(self, tokens: list[int], lora: LoRARequest | None = None, salt: str | None = None) -> None:
        self.all_token_ids = tokens
        self.block_hashes = [bytes([i]) * 32 for i in range(len(tokens) // BLOCK)]
        self.lora_request = lora
        self.cache_salt = salt
        self.mm_features: list[Any] = []
        self.prompt_embeds = None
        self.num_tokens = len(tokens)


def test_the_payload_carries_lora_and_cache_salt_as_vllm_does() -> None:
    request = _Request(list(range(4 * BLOCK)), LoRARequest("sql", 3, "/adapters/sql"), salt="tenant-a")
    first = ChunkPayload.of(request, 0, 2, BLOCK)  # type: ignore[arg-type]
    assert first.lora_name == "sql" and first.lora_id == 3 and first.parent_block_hash is None
    assert first.extra_keys is not None and "tenant-a" in first.extra_keys[0] and "sql" in first.extra_keys[0]
    second = ChunkPayload.of(request, 2, 4, BLOCK)  # type: ignore[arg-type]
    assert second.parent_block_hash == _external(request.block_hashes[1:2])[0]
    assert second.extra_keys is not None and "tenant-a" not in second.extra_keys[0]  # the salt: first block only


def test_removals_are_counted_per_block_and_bursts_are_bounded() -> None:
    ledger = KVEventLedger(block_size=BLOCK, max_blocks_per_take=6)
    request = _Request(list(range(8 * BLOCK)))
    ledger.remember(b"partial", request, 0, 2)  # type: ignore[arg-type]
    ledger.remember(b"full", request, 0, 4)  # type: ignore[arg-type]  # extends the partial chunk
    ledger.remember(b"next", request, 4, 8)  # type: ignore[arg-type]
    for name in (b"partial", b"full", b"next"):
        assert ledger.stored(name, MEDIUM_MEMORY)
    assert not ledger.stored(b"unknown", MEDIUM_MEMORY)  # no payload, nothing to announce
    assert [len(e.block_hashes) for e in ledger.take()] == [2, 4]  # at most 6 blocks per take
    assert [len(e.block_hashes) for e in ledger.take()] == [4]
    ledger.removed(b"partial", MEDIUM_MEMORY)
    assert ledger.take() == []  # "full" still holds both blocks
    ledger.removed(b"full", MEDIUM_MEMORY)
    assert [e.block_hashes for e in ledger.take()] == [_external(request.block_hashes[:4])]


def test_the_ledger_is_bounded_and_withdraws_what_it_forgets() -> None:
    ledger = KVEventLedger(block_size=BLOCK, max_chunks=2)
    request = _Request(list(range(6 * BLOCK)))
    for i in range(3):
        ledger.remember(bytes([i]), request, 2 * i, 2 * i + 2)  # type: ignore[arg-type]
        ledger.stored(bytes([i]), MEDIUM_MEMORY)
    removed = [e for e in ledger.take() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [_external(request.block_hashes[:2])]
    assert not ledger.knows(b"\x00") and ledger.knows(b"\x02")


def test_a_restarted_engine_announces_the_journaled_disk_before_any_request(tiny_llama: Path,
                                                                           tmp_path: Path) -> None:
    first, request, _ = _stored_and_announced(tiny_llama, tmp_path)
    first.connector.shutdown()  # what vLLM calls as the engine stops: the journal written, the store flushed
    first.connector._store.close()
    second = Published(_config(tiny_llama, tmp_path / "disk"))
    second.report(TieredKVWorkerMetadata())  # the first step: no request yet
    disk = second.events(BlockStored, MEDIUM_DISK)
    assert [h for e in disk for h in e.block_hashes] == _external(request.block_hashes[:12])
    assert [t for e in disk for t in e.token_ids] == request.prompt_token_ids[:12 * BLOCK]
    assert disk[0].parent_block_hash is None and disk[1].parent_block_hash == disk[0].block_hashes[-1]


def test_a_stopping_engine_writes_what_it_journaled_since_the_last_interval(tiny_llama: Path,
                                                                           tmp_path: Path) -> None:
    """The journal is written at most every ``interval_s``, on a step; what came after the last write is
    written when the engine stops (`EventJournal.close`), else a restart would not announce it."""
    from vllm_tiercache.kvcache.events.journal import EventJournal

    engine, request, _ = _stored_and_announced(tiny_llama, tmp_path)
    tracker = engine.connector._scheduler.events  # type: ignore[union-attr]
    store, naming = engine.connector._store, tracker.naming
    journal = EventJournal(store, naming, clock=lambda: 0.0, interval_s=3600)
    payloads = [ChunkPayload.of(request, 4 * i, 4 * i + 4, BLOCK) for i in range(2)]  # type: ignore[arg-type]
    journal.add(b"first", payloads[0])
    journal.flush_due()  # the first write is due at once
    journal.add(b"second", payloads[1])
    journal.flush_due()  # within the interval: not written
    assert [name for name, _ in EventJournal(store, naming, clock=lambda: 0.0).read()] == [b"first"]
    journal.close()
    assert [name for name, _ in EventJournal(store, naming, clock=lambda: 0.0).read()] == [b"first", b"second"]
    journal.close()  # nothing new: no second write of the same segment's entries
    assert [name for name, _ in EventJournal(store, naming, clock=lambda: 0.0).read()] == [b"first", b"second"]


def test_the_journal_hands_out_full_segments_and_the_open_one_when_due() -> None:
    """`due` is what the tracker's background thread writes: copies, so entries added meanwhile are safe."""
    from vllm_tiercache.kvcache.events.journal import PER_SEGMENT, EventJournal

    request = _Request(list(range(4 * BLOCK)))
    payload = ChunkPayload.of(request, 0, 4, BLOCK)  # type: ignore[arg-type]
    journal = EventJournal(None, None, clock=lambda: 0.0, interval_s=3600)  # type: ignore[arg-type]
    for i in range(PER_SEGMENT):
        journal.add(b"%04d" % i, payload)
    full = journal.due()
    assert [(seq, len(entries)) for seq, entries in full] == [(0, PER_SEGMENT)]
    journal.add(b"next", payload)
    opened = journal.due()  # the first write of the open segment is due at once
    assert [(seq, [name for name, _ in entries]) for seq, entries in opened] == [(1, [b"next"])]
    journal.add(b"later", payload)
    assert journal.due() == [] and opened[0][1] == [(b"next", payload)]  # within the interval; the copy kept
    assert [(seq, [name for name, _ in entries]) for seq, entries in journal.due(force=True)] == [
        (1, [b"next", b"later"])]
    assert journal.due(force=True) == []


def test_the_journal_reads_back_what_it_wrote_and_ignores_foreign_records() -> None:
    from vllm_tiercache.kvcache.events.journal import decode_segment, encode_segment

    request = _Request(list(range(4 * BLOCK)), LoRARequest("sql", 3, "/adapters/sql"), salt="tenant-a")
    payload = ChunkPayload.of(request, 0, 4, BLOCK)  # type: ignore[arg-type]
    seq, entries = decode_segment(encode_segment(7, [(b"name", payload)]))  # type: ignore[misc]
    assert seq == 7 and entries == [(b"name", payload)]
    assert decode_segment(b"\x00not cbor") is None and decode_segment(encode_segment(1, [])[:-1] + b"\xff") is None


@pytest.mark.redis
def test_the_shared_medium_names_disk_when_a_file_tier_serves_and_storage_for_redis_alone(
        tmp_path: Path, redis_url: str) -> None:
    from vllm_tiercache.shared.store import build_store

    memory = {"kind": "memory", "capacity": "1MiB"}
    disk = {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB"}
    redis = {"kind": "redis", "url": redis_url}
    for tiers, expected in (([memory], None), ([memory, redis], MEDIUM_REMOTE), ([memory, disk, redis], MEDIUM_DISK)):
        with build_store({"namespace": "ev", "tiers": tiers}) as store:
            assert shared_medium(store) == expected, tiers


def test_an_image_prompts_blocks_carry_its_identifier_as_vllm_announces_it() -> None:
    from types import SimpleNamespace

    request = _Request(list(range(4 * BLOCK)))
    request.mm_features = [SimpleNamespace(identifier="img-digest", mm_position=SimpleNamespace(offset=20, length=30))]
    later = ChunkPayload.of(request, 2, 4, BLOCK)  # type: ignore[arg-type]  # a chunk that starts inside the image
    whole = ChunkPayload.of(request, 0, 4, BLOCK)  # type: ignore[arg-type]
    assert whole.extra_keys is not None and later.extra_keys == whole.extra_keys[2:]
    carries = ["img-digest" in repr(keys) for keys in whole.extra_keys]
    assert carries == [False, True, True, True]  # tokens 20..49: blocks 1 to 3


def _steps_until(engine: Published, wanted: int, kind: type, medium: str, seconds: float = 30.0) -> list[Any]:
    """Empty steps (each one takes the tracker's last answer and posts its next questions) until ``wanted``
    chunks' events of ``kind`` on ``medium`` came, or ``seconds`` passed."""
    got: list[Any] = []
    give_up = time.monotonic() + seconds
    while len(got) < wanted and time.monotonic() < give_up:
        engine.report(TieredKVWorkerMetadata())
        got += engine.events(kind, medium)
        time.sleep(0.02)
    return got


@pytest.mark.redis
def test_a_hung_redis_holds_no_step_and_what_it_held_is_announced_again_once_it_answers(
        tiny_llama: Path, tmp_path: Path) -> None:
    """A real redis-server stopped with SIGSTOP (its sockets open, nothing answered): the steps go on while
    the tracker's question waits on it; what it held is withdrawn once its calls time out (a resend could
    not load from it), the memory tier's events stay; after SIGCONT the same chunks are announced again."""
    with RedisServer() as redis_srv:
        # Redis's calls give up after half a second: the pause below outlasts them
        redis = {"kind": "redis", "url": redis_srv.url, "timeout_s": 0.5, "retry_after_s": 0.1}
        engine = Published(_config(tiny_llama, None, shared_tier=redis), inline=False)
        connector = engine.connector
        tracker = connector._scheduler.events  # type: ignore[union-attr]
        assert tracker is not None and tracker.shared_medium == MEDIUM_REMOTE
        out, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(5), BLOCK))
        names = _play_saves(connector, meta)  # every layer in memory and, flushed, in Redis
        engine.finish(out, TieredKVWorkerMetadata(added=set(names)))
        assert len(engine.events(BlockStored, MEDIUM_MEMORY)) == 3
        announced = _steps_until(engine, 3, BlockStored, MEDIUM_REMOTE)  # confirmed off the step
        assert len(announced) == 3
        assert tracker.off_step.wait(10.0)

        redis_srv.pause()
        try:
            tracker._next_sweep = 0.0  # the sweep asks Redis for every announced chunk now
            engine.report(TieredKVWorkerMetadata())  # posts the sweep, which waits on the stopped server
            in_flight_steps = 0
            while not tracker.off_step.idle and in_flight_steps < 5:
                engine.report(TieredKVWorkerMetadata())  # were a step to wait for Redis, this would hang here
                in_flight_steps += 1
            assert in_flight_steps == 5, "the sweep never waited on the stopped server"
            removed = _steps_until(engine, 3, BlockRemoved, MEDIUM_REMOTE)
            assert sum(len(e.block_hashes) for e in removed) == 12  # withdrawn: it cannot serve them now
            assert not tracker.shared_answering()
            assert engine.events(BlockRemoved, MEDIUM_MEMORY) == []  # the memory tier still serves them
            tracker.discover_per_step = 1  # asked again one chunk per batch: the batches' order shows
        finally:
            redis_srv.resume()
        back = _steps_until(engine, 3, BlockStored, MEDIUM_REMOTE)
        assert tracker.shared_answering()
        # every block announced again, as it was the first time, and each chunk after its parent
        assert sorted(h for e in back for h in e.block_hashes) == sorted(h for e in announced for h in e.block_hashes)
        assert sum(len(e.block_hashes) for e in back) == 12
        assert back[0].parent_block_hash is None
        assert [e.parent_block_hash for e in back[1:]] == [e.block_hashes[-1] for e in back[:-1]]
        tracker.close()


@pytest.mark.redis
@pytest.mark.serial  # a pause shorter than the cluster's 5 s node timeout: no second engine beside it
def test_a_cluster_shard_that_hangs_withdraws_only_what_it_may_hold_and_its_chunks_come_back(
        tiny_llama: Path, redis_cluster: Any) -> None:
    """One master of a real Redis Cluster stopped with SIGSTOP (the other shards answer; the tier's
    ``up_share`` drops to 2/3): the chunks whose records that shard holds are withdrawn from the shared
    medium and kept aside, the memory tier's events stay; after SIGCONT every withdrawn chunk is announced
    again, so the router ends with what it had before."""
    cluster = redis_cluster
    redis = {"kind": "redis", "url": cluster.url, "timeout_s": 0.5, "retry_after_s": 0.1}
    engine = Published(_config(tiny_llama, None, shared_tier=redis), inline=False)
    tracker = engine.connector._scheduler.events  # type: ignore[union-attr]
    assert tracker is not None and tracker.shared_medium == MEDIUM_REMOTE
    out, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(5), BLOCK))
    names = _play_saves(engine.connector, meta)
    engine.finish(out, TieredKVWorkerMetadata(added=set(names)))
    announced = _steps_until(engine, 3, BlockStored, MEDIUM_REMOTE)
    assert sum(len(e.block_hashes) for e in announced) == 12
    assert tracker.off_step.wait(10.0)
    cluster.wait_replicated()
    sizes = {}
    for i in cluster.master_nodes():
        with cluster.node_client(i) as client:
            sizes[i] = client.dbsize()
    victim = max(sizes, key=sizes.__getitem__)  # the master holding the most records: some chunk needs it
    assert sizes[victim] > 0
    cluster.pause(victim)
    try:
        tracker._next_sweep = 0.0
        # within the node timeout (no failover meanwhile); then a few more steps, for any later removal
        removed = _steps_until(engine, 1, BlockRemoved, MEDIUM_REMOTE, seconds=4.0)
        removed += _steps_until(engine, 1, BlockRemoved, MEDIUM_REMOTE, seconds=0.3)
        withdrawn = sorted(h for e in removed for h in e.block_hashes)
        assert 0 < len(withdrawn) <= 12  # the chunks with a record on the stopped shard, not necessarily all
        assert not tracker.shared_answering()
        assert engine.events(BlockRemoved, MEDIUM_MEMORY) == []  # the memory tier still serves them
    finally:
        cluster.resume(victim)
    back = _steps_until(engine, len(removed), BlockStored, MEDIUM_REMOTE)
    assert sorted(h for e in back for h in e.block_hashes) == withdrawn  # each withdrawn chunk, once
    assert tracker.shared_answering()
    tracker.close()
