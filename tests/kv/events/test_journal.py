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
from tests.support.waiting import wait_until
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
    wait_until("the planned chunks in the journal", lambda: _journaled(engine) == planned, poll_s=0.1)
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


class _HeldFirstPut:
    """A store whose first put waits until the test releases it (a writer thread inside a slow write);
    every put is recorded as (slot, entries in the segment) once it lands."""

    def __init__(self) -> None:
        self.landed: list[tuple[int, int]] = []
        self.first_entered, self.release, self.later_put = threading.Event(), threading.Event(), threading.Event()
        self._calls = 0

    def put(self, key: Any, tensor: Any, *args: Any, **kwargs: Any) -> None:
        from vllm_tiercache.kvcache.events.journal import decode_segment

        self._calls += 1
        if self._calls == 1:
            self.first_entered.set()
            assert self.release.wait(60.0), "the test never released the first write"
        else:
            self.later_put.set()
        decoded = decode_segment(tensor.numpy().tobytes())
        assert decoded is not None
        self.landed.append((key, len(decoded[1])))


class _SeenLock:
    """The journal's write lock, telling the test when another thread asks for it while it is held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.asked = threading.Event()

    def __enter__(self) -> None:
        if self._lock.locked():
            self.asked.set()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_stop_s_last_write_lands_after_a_slower_write_in_progress() -> None:
    """A writer still inside its write of an older snapshot when the engine stops must not land after the
    stop's newer one (it would overwrite it, and the chunks journaled in between would not be announced).
    Before the write lock, `close` gave the writer 5 s and then wrote regardless; a loaded machine can
    stretch a write past that."""
    from tests.kv.events.test_events import _Request

    store = _HeldFirstPut()
    journal = _SlotJournal(store, None, clock=time.monotonic, interval_s=0.0)  # type: ignore[arg-type]
    journal._write_lock = _SeenLock()  # type: ignore[assignment]
    payload = ChunkPayload.of(_Request(list(range(4 * BLOCK))), 0, 4, BLOCK)  # type: ignore[arg-type]
    journal.add(b"a", payload)
    writer = threading.Thread(target=journal.flush_due)  # the writer thread: snapshot [a], held in its put
    writer.start()
    assert store.first_entered.wait(60.0)
    journal.add(b"b", payload)
    stop = threading.Thread(target=journal.close)  # the stop: snapshot [a, b]
    stop.start()
    # the stop either waits for the write lock (it must) or already wrote (the bug): then the slow write lands
    wait_until("the stop to write or wait for the write lock",
               lambda: journal._write_lock.asked.is_set() or store.later_put.is_set(),  # type: ignore[attr-defined]
               poll_s=0.01)
    store.release.set()
    writer.join(60.0)
    stop.join(60.0)
    assert not writer.is_alive() and not stop.is_alive()
    assert store.landed == [(0, 1), (0, 2)]  # the newest snapshot of the slot landed last


def test_a_restart_over_the_object_tier_alone_announces_it_as_storage(tiny_llama: Path, tmp_path: Path,
                                                                       s3_bucket: Any) -> None:
    """The journal and the start-up check go through the store's contract, so an S3 bucket as the only shared
    tier works as disk and Redis do: its chunks are announced as ``STORAGE`` (every shared tier remote).

    Steps until they are, not just the first: the start-up check HEADs every record, and the first step waits
    for it at most `FIRST_STEP_WAIT_S` (a later step applies it). A loaded machine stretched that check past
    the bucket's 2 s request timeout once (0 announced by the first step); the tier's timeout here is long
    enough that a slow answer is an answer, and the wait follows the announcement, bounded at a minute."""
    from vllm_tiercache.kvcache.events.ledger import MEDIUM_REMOTE

    bucket = s3_bucket.tier_config(timeout_s=30.0)
    first = Published(_config(tiny_llama, tmp_path / "unused", shared_tier=bucket))
    out, meta = schedule_new(first.scheduler, hashed_request("a", _prompt(1), BLOCK))
    names = _play_saves(first.connector, meta)
    first.finish(out, TieredKVWorkerMetadata(added=set(names)))
    first.connector.shutdown()
    first.connector._store.close()
    second = Published(_config(tiny_llama, tmp_path / "unused", shared_tier=bucket))
    announced, deadline = 0, time.monotonic() + 60.0
    while announced < 12 and time.monotonic() < deadline:
        second.report(TieredKVWorkerMetadata())
        announced += sum(len(event.block_hashes) for event in second.events(BlockStored, MEDIUM_REMOTE))
        if announced < 12:
            time.sleep(0.05)  # the check still runs on its thread: the next step applies it
    assert announced == 12
    second.connector._scheduler.events.close()  # type: ignore[union-attr]

