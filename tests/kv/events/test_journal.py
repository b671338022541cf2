"""The event journal: what a stopped engine saved is announced by the next one, from its first step.

Why these tests: a restarted instance used to announce only what its journal had been told after the shared
tiers confirmed a chunk, which takes engine steps after the save; an engine that goes idle after its last
answer takes none, so its last chunks were never journaled. Chunks are now journaled as their saves are
planned, written by the journal's own thread (no step needed), and read and checked on a thread started
with the next engine, whose first step announces them all.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from vllm.distributed.kv_events import BlockStored

from tests.kv.events.test_events import BLOCK, Published, _config, _play_saves, _prompt
from tests.support.real_scheduler import hashed_request, schedule_new
from vllm_tiercache.kvcache.events.journal import EventJournal
from vllm_tiercache.kvcache.events.ledger import MEDIUM_DISK, ChunkPayload
from vllm_tiercache.kvcache.plan import TieredKVWorkerMetadata


def _journaled(engine: Published) -> list[bytes]:
    tracker = engine.connector._scheduler.events  # type: ignore[union-attr]
    return [name for name, _ in EventJournal(engine.connector._store, tracker.naming, clock=time.monotonic).read()]


def test_a_chunk_is_journaled_as_its_save_is_planned_and_written_without_a_step(tiny_llama: Path,
                                                                              tmp_path: Path) -> None:
    """No record played, no later step: nothing is confirmed, and the journal holds the chunks all the same."""
    engine = Published(_config(tiny_llama, tmp_path / "disk"))
    tracker = engine.connector._scheduler.events  # type: ignore[union-attr]
    _, meta = schedule_new(engine.scheduler, hashed_request("a", _prompt(1), BLOCK))
    planned = [save.chunk_hash for plan in meta.requests for save in plan.saves]
    assert len(planned) == 3 and set(planned) <= set(tracker._unconfirmed)
    deadline, found = time.monotonic() + 10.0, []
    while time.monotonic() < deadline and found != planned:
        time.sleep(0.1)
        found = _journaled(engine)
    assert found == planned
    tracker.close()


def test_the_first_step_after_a_restart_announces_every_journaled_chunk(tiny_llama: Path, tmp_path: Path) -> None:
    """Seven prompts, 21 chunks: more than the 16 a step used to discover, all announced by the first step."""
    first = Published(_config(tiny_llama, tmp_path / "disk"))
    for seed in range(7):
        out, meta = schedule_new(first.scheduler, hashed_request(f"r{seed}", _prompt(100 + seed), BLOCK))
        names = _play_saves(first.connector, meta)
        first.finish(out, TieredKVWorkerMetadata(added=set(names)))
    first.connector.shutdown()  # vLLM's call as the engine stops: the journal's last write, the store flushed
    first.connector._store.close()
    second = Published(_config(tiny_llama, tmp_path / "disk"))
    second.report(TieredKVWorkerMetadata())  # the first step, no request
    disk = second.events(BlockStored, MEDIUM_DISK)
    assert sum(len(event.block_hashes) for event in disk) == 7 * 12
    second.connector._scheduler.events.close()  # type: ignore[union-attr]


class _Puts:
    """A store that records the journal's puts (slot key, bytes)."""

    def __init__(self) -> None:
        self.puts: list[Any] = []
        self.put_seen = threading.Event()

    def put(self, key: Any, tensor: Any, *args: Any, **kwargs: Any) -> None:
        self.puts.append(key)
        self.put_seen.set()


class _SlotJournal(EventJournal):
    def key(self, slot: int) -> Any:
        return slot


def test_the_background_journal_writes_nothing_before_the_ring_is_read() -> None:
    """A starting engine must not overwrite the ring it is about to announce: its writer waits for the read."""
    from tests.kv.events.test_events import _Request

    store = _Puts()
    journal = _SlotJournal(store, None, clock=time.monotonic, interval_s=0.05, background=True)  # type: ignore[arg-type]
    journal.add(b"x", ChunkPayload.of(_Request(list(range(4 * BLOCK))), 0, 4, BLOCK))  # type: ignore[arg-type]
    assert not store.put_seen.wait(0.5)  # ten intervals: nothing written while the ring is unread
    journal.continue_at(21)  # the newest segment read was 20
    assert store.put_seen.wait(10.0)
    assert store.puts == [21 % 16]
    journal.close()


def test_a_restart_over_the_object_tier_alone_announces_it_as_storage(tiny_llama: Path, tmp_path: Path,
                                                                       s3_bucket: Any) -> None:
    """The journal and the start-up check go through the store's contract, so an S3 bucket as the only shared
    tier works as disk and Redis do: its chunks are announced as ``STORAGE`` (every shared tier remote)."""
    from vllm_tiercache.kvcache.events.ledger import MEDIUM_REMOTE

    bucket = s3_bucket.tier_config()
    first = Published(_config(tiny_llama, tmp_path / "unused", shared_tier=bucket))
    out, meta = schedule_new(first.scheduler, hashed_request("a", _prompt(1), BLOCK))
    names = _play_saves(first.connector, meta)
    first.finish(out, TieredKVWorkerMetadata(added=set(names)))
    first.connector.shutdown()
    first.connector._store.close()
    second = Published(_config(tiny_llama, tmp_path / "unused", shared_tier=bucket))
    second.report(TieredKVWorkerMetadata())
    stored = second.events(BlockStored, MEDIUM_REMOTE)
    assert sum(len(event.block_hashes) for event in stored) == 12
    second.connector._scheduler.events.close()  # type: ignore[union-attr]

