"""Far tiers never stall the scheduler (`vllm_tiercache.kvcache.lookup`): lookups off its thread, chunks fetched
into host memory before the request's turn, loads that read the near tiers only.

Real parts: vLLM `Request`s hashed as the engine hashes them, a real redis-server (paused with SIGSTOP where a
test needs a store that hangs), a real Redis Cluster and a real SeaweedFS bucket, the real store, the real
`KVSchedulerSide` and the worker's real `Prefetcher` over the same store. The scheduler output and the block
table are the stand-ins of tests/kv/test_kv_scheduler.py; the worker's report is built as the worker builds it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests.kv.test_kv_scheduler import BLOCK, CHUNK, IDENTITY, BlockTable, make_request, step, tokens
from tests.support.waiting import wait_until
from vllm_tiercache.kvcache.load.prefetcher import Prefetcher
from vllm_tiercache.kvcache.load.staging import Staging
from vllm_tiercache.kvcache.lookup import far as far_module
from vllm_tiercache.kvcache.lookup.far import IDLE_WAIT_S
from vllm_tiercache.kvcache.naming import ChunkGeometry, KVNaming
from vllm_tiercache.kvcache.plan import TieredKVMetadata, TieredKVWorkerMetadata
from vllm_tiercache.kvcache.scheduler import KVSchedulerSide
from vllm_tiercache.kvcache.worker_counters import WorkerCounters
from vllm_tiercache.shared.residency import ResidencyReporter
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import Store
from vllm_tiercache.tools.redis_server import RedisServer

if TYPE_CHECKING:
    from vllm.v1.request import Request

pytestmark = [pytest.mark.redis]

NAMING = KVNaming(namespace="far", identities=(IDENTITY,), geometry=ChunkGeometry(BLOCK, CHUNK), hash_algo="sha256",
                  save_partial_chunks=True)
#: a record's blocks: 4 blocks of (2, BLOCK, 128) bf16 values
RECORD = torch.zeros(4, 2, BLOCK, 128, dtype=torch.bfloat16)
#: the chunks of a 330-token prompt: [0,4) [4,8) and the partial [8,10)
PROMPT_TOKENS = 330


class Worker:
    """The worker's side of a prefetch: the real `Prefetcher` over the scheduler's store, and its report."""

    def __init__(self, store: Store, staging_bytes: int = 1 << 30) -> None:
        self.counters = WorkerCounters()
        self.residency: ResidencyReporter[bytes] = ResidencyReporter(store)
        self.staging = Staging(staging_bytes)
        self.prefetcher = Prefetcher(store=store, key=lambda chunk, layer: NAMING.record_key(chunk, layer),
                                     residency=self.residency, staging=self.staging, counters=self.counters,
                                     counters_lock=threading.Lock())
        self.prefetcher.attach(list(range(IDENTITY.num_layers)))

    def play(self, meta: TieredKVMetadata, side: KVSchedulerSide) -> TieredKVWorkerMetadata:
        """Fetch the plan's prefetches, wait for them, and send the scheduler the worker's report."""
        self.prefetcher.submit(meta.prefetches)
        assert self.prefetcher.drain(60.0)
        return self.report(side)

    def report(self, side: KVSchedulerSide) -> TieredKVWorkerMetadata:
        news = self.prefetcher.take()
        changes = self.residency.take()
        added, evicted = (changes.added, changes.evicted) if changes is not None else (set(), set())
        report = TieredKVWorkerMetadata(added=added, evicted=evicted, failed=news.missing,
                                        prefetched=dict.fromkeys(news.staged, 1), prefetch_failed=news.failed,
                                        unstaged=news.unstaged)
        side.update_connector_output(report)
        return report

    def close(self) -> None:
        self.prefetcher.shutdown()


def far_side(store: Store, deadline_s: float = 30.0) -> KVSchedulerSide:
    side = KVSchedulerSide(store=store, naming=NAMING, can_load=True, can_save=True, save_decode=False,
                           lookup_deadline_s=deadline_s)
    side.bind_kv_cache_manager(BlockTable())  # type: ignore[arg-type]
    assert side.far is not None
    return side


def store_chunks(tier: dict[str, Any], chunks: list[bytes], layers: int = IDENTITY.num_layers) -> None:
    """The records of ``chunks`` (of their first ``layers`` layers: every one by default) into the far tier
    alone, as another engine saved them."""
    with build_store({"tiers": [tier]}) as writer:
        for chunk in chunks:
            for layer in range(layers):
                writer.put(NAMING.record_key(chunk, layer), RECORD, {"blocks": 4})
        assert writer.flush(60.0)


def store_with(tier: dict[str, Any], memory: str = "64MiB") -> Store:
    return build_store({"tiers": [{"kind": "memory", "capacity": memory}, tier]})


def probe_done(side: KVSchedulerSide, req_id: str) -> None:
    assert side.far is not None
    assert side.far._tickets[req_id].probe.done.wait(60.0)


@contextlib.contextmanager
def far_scene(tier: dict[str, Any], req_id: str, seed: int = 0, memory: str = "64MiB",
              staging_bytes: int = 1 << 30) -> Iterator[tuple[Request, list[bytes], Store, KVSchedulerSide, Worker]]:
    """A prompt whose two full chunks another engine stored in ``tier`` alone, and the scheduler side and a
    worker over a store of a memory tier (``memory``) and that tier: (request, its full chunks, store, side,
    worker)."""
    request = make_request(req_id, tokens(PROMPT_TOKENS, seed=seed))
    full = [request.block_hashes[3], request.block_hashes[7]]
    store_chunks(tier, full)
    with store_with(tier, memory=memory) as store:
        side, worker = far_side(store), Worker(store, staging_bytes=staging_bytes)
        try:
            yield request, full, store, side, worker
        finally:
            worker.close()
            side.shutdown()


def far_calls(store: Store) -> list[int]:
    """The number of keys of each call the store's far tier answers from now on (the real tier answers)."""
    asked: list[int] = []
    far = store.far_tiers[0]
    real = far.contains_many

    def counting(keys):  # type: ignore[no-untyped-def]
        asked.append(len(keys))
        return real(keys)

    far.contains_many = counting  # type: ignore[method-assign]
    return asked


def empty_step(side: KVSchedulerSide) -> TieredKVMetadata:
    return side.build_connector_meta(step([], [], {}))  # type: ignore[arg-type]


@pytest.fixture
def redis_tier(redis_url: str) -> dict[str, Any]:
    return {"kind": "redis", "url": redis_url, "timeout_s": 2.0, "retry_after_s": 0.2}


@pytest.fixture(params=["redis", "redis-cluster", "object"])
def far_tier(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Every far kind: a redis-server, a Redis Cluster, a SeaweedFS bucket."""
    if request.param == "redis":
        return {"kind": "redis", "url": request.getfixturevalue("redis_url"), "timeout_s": 2.0, "retry_after_s": 0.2}
    if request.param == "redis-cluster":
        return {"kind": "redis", "url": request.getfixturevalue("redis_cluster").url, "timeout_s": 2.0,
                "retry_after_s": 0.2}
    return request.getfixturevalue("s3_bucket").tier_config()


def test_a_far_hit_waits_off_the_thread_is_fetched_ahead_and_loads_from_host_memory(far_tier) -> None:
    with far_scene(far_tier, "a") as (request, full, _store, side, worker):
        side.on_new_request(request)
        # the answer is not known yet: vLLM schedules the others and asks again next step
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)
        probe_done(side, "a")
        meta = empty_step(side)
        assert [p.chunk_hash for p in meta.prefetches] == full and meta.near_loads
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # still on its way
        report = worker.play(meta, side)
        assert report.prefetched == dict.fromkeys(full, 1) and not report.prefetch_failed
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
        assert side._requests["a"].load_chunks == [(4, True), (8, True)]  # both from host memory
        side.update_state_after_alloc(request, 8 * BLOCK)
        plan = side.build_connector_meta(step([("a", 8 * BLOCK)], [], {"a": 74}))  # type: ignore[arg-type]
        assert plan.near_loads and [load.chunk_hash for load in plan.requests[0].loads] == full
        assert not plan.prefetches  # fetched once
        assert plan.release == full  # no other request waits for them: dropped after this step's loads
        # what the forward reads is in host memory: staged for the load
        keys = [NAMING.record_key(c, layer) for c in full for layer in range(IDENTITY.num_layers)]
        assert all(record is not None for record in worker.staging.get_many(keys))
        assert worker.counters.prefetched_chunks == 2 and side.take_counters() == {}


def counted_full_asks(side: KVSchedulerSide, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids of the asks that looked at a request's ticket from now on (the rest were answered by
    `FarLookups.still_waiting` alone)."""
    assert side.far is not None
    full: list[str] = []
    real = side.far._answer_ticket

    def counting(ticket, local_blocks):  # type: ignore[no-untyped-def]
        full.append(ticket.probe.request.request_id)
        return real(ticket, local_blocks)

    monkeypatch.setattr(side.far, "_answer_ticket", counting)
    return full


def test_a_waiting_request_asked_again_with_nothing_changed_is_not_looked_at_again(redis_tier, monkeypatch) -> None:
    """vLLM asks every waiting request at every step. Between two reports of the workers nothing a waiting
    request's answer depends on changes, so the asks in between are answered None from what its last answer
    remembered, without its state or its ticket; each thing that can change the answer makes the next ask look
    again: a report of the workers, a different hit of vLLM's own prefix cache, the deadline (on a clock the
    test moves: no wall-clock bound a loaded machine could miss)."""
    now = [1000.0]
    monkeypatch.setattr(far_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    with far_scene(redis_tier, "sw", seed=21) as (request, _full, _store, side, worker):
        side.on_new_request(request)
        probe_done(side, "sw")
        meta = empty_step(side)
        full = counted_full_asks(side, monkeypatch)
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # its turn: looked at, in flight
        for _ in range(5):  # the next steps, nothing reported
            now[0] += 1.0
            assert side.get_num_new_matched_tokens(request, 0) == (None, False)
        assert full == ["sw"]
        assert side.get_num_new_matched_tokens(request, 4 * BLOCK) == (None, False)  # vLLM's own hit moved
        assert full == ["sw", "sw"]
        worker.prefetcher.submit(meta.prefetches)
        assert worker.prefetcher.drain(60.0)
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # landed, not reported yet
        assert full == ["sw", "sw", "sw"]  # vLLM's hit back to 0: a change too
        worker.report(side)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
        assert full == ["sw"] * 4 and side.take_counters() == {}

    with far_scene(redis_tier, "sd", seed=22) as (request, _full, _store, side, _worker):
        side.far.deadline_s = 0.3  # type: ignore[union-attr]
        side.on_new_request(request)
        probe_done(side, "sd")
        empty_step(side)  # its chunks are named; no worker fetches them
        full = counted_full_asks(side, monkeypatch)
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)
        now[0] += 0.29
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)
        now[0] += 0.02  # past its deadline
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)  # a miss, counted
        assert full == ["sd", "sd"] and side.take_counters() == {"prefetches_late": 2, "found_unused_chunks": 2}
        assert not side.far._waiting  # type: ignore[union-attr]


def probes_held_at_a_gate(store: Store, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The far tier's lookups (the probes') wait until the returned event is set, then ask the real tier."""
    gate, real = threading.Event(), store.far_tiers[0].contains_many
    monkeypatch.setattr(store.far_tiers[0], "contains_many", lambda keys: gate.wait(60.0) and real(keys))
    return gate


def test_a_waiting_requests_probe_coming_in_makes_the_next_ask_look_again(redis_tier, monkeypatch) -> None:
    """A request asked while its probe is still out is answered None from what it remembered until the probe
    is in, and looked at again then (its chunks named for a fetch); one finished or aborted meanwhile, or a reset
    of the weights generation, leaves nothing remembered."""
    with far_scene(redis_tier, "sp", seed=23) as (request, full, store, side, _worker):
        gate = probes_held_at_a_gate(store, monkeypatch)
        side.on_new_request(request)
        asked = counted_full_asks(side, monkeypatch)
        try:
            for _ in range(3):
                assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # the probe waits at the gate
            assert asked == ["sp"]
        finally:
            gate.set()
        probe_done(side, "sp")
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # looked at: its fetch named
        assert asked == ["sp", "sp"]
        meta = empty_step(side)
        assert [p.chunk_hash for p in meta.prefetches] == full
        assert "sp" in side.far._waiting  # type: ignore[union-attr]
        side.request_finished(request)
        assert not side.far._waiting  # type: ignore[union-attr]
        other = make_request("sr", tokens(PROMPT_TOKENS, seed=24))
        gate.clear()  # its probe held too: its first answer is None, whatever the threads' timing
        try:
            side.on_new_request(other)
            assert side.get_num_new_matched_tokens(other, 0) == (None, False)
            assert "sr" in side.far._waiting  # type: ignore[union-attr]
            assert side.reset_cache()
            assert not side.far._waiting  # type: ignore[union-attr]
        finally:
            gate.set()


def test_a_probe_that_comes_in_while_an_ask_looks_at_it_is_looked_at_by_the_next_ask(redis_tier, monkeypatch) -> None:
    """The probe thread may finish between an ask's look at the probe (still out) and the None it remembers: the
    next ask must look again, not take the probe for one that answer had seen (a miss would wait for its deadline).
    The race is forced: the ask's look lets the probe through and waits until it came in."""
    with far_scene(redis_tier, "sx", seed=25) as (_request, _full, store, side, _worker):
        gate = probes_held_at_a_gate(store, monkeypatch)
        miss = make_request("sx-miss", tokens(PROMPT_TOKENS, seed=26))  # nothing of it is stored
        side.on_new_request(miss)
        probe = side.far._tickets["sx-miss"].probe  # type: ignore[union-attr]
        came_in = probe.done

        class ComesInAsItIsLookedAt:
            """The probe's `done`: the first look says "not yet" once the probe actually came in."""

            looked = False

            def is_set(self) -> bool:
                if not self.looked:
                    self.looked = True
                    gate.set()
                    assert came_in.wait(60.0)
                    return False
                return came_in.is_set()

            def set(self) -> None:
                came_in.set()

            def wait(self, timeout: float | None = None) -> bool:
                return came_in.wait(timeout)

        probe.done = ComesInAsItIsLookedAt()  # type: ignore[assignment]
        try:
            assert side.get_num_new_matched_tokens(miss, 0) == (None, False)  # looked while out
        finally:
            gate.set()
        assert side.get_num_new_matched_tokens(miss, 0) == (0, False)  # the next ask sees the probe's miss


def test_no_thread_is_started_on_the_scheduling_thread_or_the_forwards(redis_tier, monkeypatch) -> None:
    """The lookup and prefetch threads start with the scheduler side and the worker, not on a first lookup or
    prefetch: ``Thread.start`` returns only once the new thread has run, up to half a second on a loaded
    machine, which the step and the forward that paid it spent waiting."""
    with far_scene(redis_tier, "t") as (request, full, _store, side, worker):
        started: list[str] = []
        real_start = threading.Thread.start

        def recording_start(thread: threading.Thread) -> None:
            started.append(f"{thread.name} by {threading.current_thread().name}")
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", recording_start)
        side.on_new_request(request)
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)
        probe_done(side, "t")
        meta = empty_step(side)
        assert [p.chunk_hash for p in meta.prefetches] == full
        worker.prefetcher.submit(meta.prefetches)  # on the forward's thread, in the engine
        assert worker.prefetcher.drain(60.0)
        worker.report(side)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
        assert started == []


def test_a_miss_asks_one_record_per_chunk_and_nothing_is_fetched(redis_tier) -> None:
    """A prompt never stored: the far tier is asked for the probe record of each chunk only; the request is
    answered with no hit as soon as the probe is in, without a step for prefetches."""
    request = make_request("m", tokens(PROMPT_TOKENS, seed=1))
    with store_with(redis_tier) as store:
        side = far_side(store)
        asked = far_calls(store)
        try:
            side.on_new_request(request)
            probe_done(side, "m")
            assert side.get_num_new_matched_tokens(request, 0) == (0, False)
            # one call, one round trip: three chunks, one record each (the synchronous lookup asked every layer: 6),
            # and the three shorter endings inside the first chunk (a stored prompt shorter than one chunk)
            assert asked == [6]
            assert empty_step(side).prefetches == []
        finally:
            side.shutdown()


@pytest.fixture(scope="module")
def hanging_redis() -> Iterator[RedisServer]:
    """A redis-server of this module's own, which its tests pause (SIGSTOP): the session's stays answering."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def hang_tier(hanging_redis: RedisServer) -> Iterator[dict[str, Any]]:
    """That server emptied, as a tier whose calls outlast every deadline here; resumed after the test."""
    with hanging_redis.client() as client:
        client.flushall()
    try:
        yield {"kind": "redis", "url": hanging_redis.url, "timeout_s": 30.0, "retry_after_s": 0.2}
    finally:
        hanging_redis.resume()


@pytest.mark.serial  # pauses a redis-server
def test_a_store_that_hangs_during_the_lookup_never_holds_a_call_and_the_request_runs_at_its_deadline(
        hanging_redis: RedisServer, hang_tier: dict[str, Any]) -> None:
    request = make_request("h", tokens(PROMPT_TOKENS, seed=2))
    store_chunks(hang_tier, [request.block_hashes[3]])
    with store_with(hang_tier) as store:
        side = far_side(store, deadline_s=0.3)
        hanging_redis.pause()
        try:
            side.on_new_request(request)
            answers = [side.get_num_new_matched_tokens(request, 0)]
            while answers[-1][0] is None:  # every call returns at once while the probe hangs
                answers.append(side.get_num_new_matched_tokens(request, 0))
                threading.Event().wait(0.01)
            assert answers[0] == (None, False) and answers[-1] == (0, False)  # its deadline passed: a miss
            assert not side.far._tickets["h"].probe.done.is_set()  # type: ignore[union-attr]
            assert side.take_counters() == {"lookups_late": 1}
        finally:
            hanging_redis.resume()
            side.shutdown()


def answer_between_reports(side: KVSchedulerSide, worker: Worker, request: Request) -> tuple[int | None, bool]:
    """vLLM's asks for ``request``, one a step with the worker's report in between, until one is not None."""
    answer = side.get_num_new_matched_tokens(request, 0)
    while answer[0] is None:
        threading.Event().wait(0.01)
        worker.report(side)
        answer = side.get_num_new_matched_tokens(request, 0)
    return answer


@pytest.mark.serial  # pauses a redis-server
def test_a_store_that_hangs_during_the_prefetch_leaves_the_request_a_miss_at_its_deadline(
        hanging_redis: RedisServer, hang_tier: dict[str, Any]) -> None:
    with far_scene(hang_tier, "p", seed=3) as (request, _full, _store, side, worker):
        side.far.deadline_s = 0.3  # type: ignore[union-attr]
        try:
            side.on_new_request(request)
            probe_done(side, "p")
            meta = empty_step(side)
            assert len(meta.prefetches) == 2
            hanging_redis.pause()
            worker.prefetcher.submit(meta.prefetches)  # its reads wait on the stopped server
            assert answer_between_reports(side, worker, request) == (0, False)
            assert side.take_counters() == {"prefetches_late": 2, "found_unused_chunks": 2}
        finally:
            hanging_redis.resume()
            assert worker.prefetcher.drain(60.0)


@pytest.mark.serial  # pauses a redis-server
def test_a_store_that_hangs_after_a_chunk_landed_leaves_the_request_that_chunk_at_the_deadline_after_it(
        hanging_redis: RedisServer, hang_tier: dict[str, Any]) -> None:
    """A chunk that lands restarts the deadline, but a store that then hangs lands no more: the request runs
    a deadline after the last chunk landed, with that chunk, and the rest is counted late."""
    with far_scene(hang_tier, "m", seed=14) as (request, _full, _store, side, worker):
        side.far.deadline_s = 0.3  # type: ignore[union-attr]
        try:
            side.on_new_request(request)
            probe_done(side, "m")
            first, second = empty_step(side).prefetches
            assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # its turn: both in flight
            worker.play(TieredKVMetadata(prefetches=[first]), side)
            hanging_redis.pause()
            worker.prefetcher.submit([second])  # its reads wait on the stopped server
            assert answer_between_reports(side, worker, request) == (4 * BLOCK, False)
            assert side.take_counters() == {"prefetches_late": 1, "found_unused_chunks": 1}
        finally:
            hanging_redis.resume()
            assert worker.prefetcher.drain(60.0)


def test_a_request_whose_turn_comes_after_its_deadline_from_arrival_still_waits_for_its_fetch(redis_tier) -> None:
    """Queued behind other users' prefills, a request reaches its turn later than ``lookup_deadline_ms`` after its
    arrival, its fetch still in flight (slowed by those prefills on the same cores): it waits for the fetch then,
    and is a whole hit, not a miss. Its wait on the store counts from its turn."""
    with far_scene(redis_tier, "q", seed=11) as (request, full, _store, side, worker):
        side.far.deadline_s = 0.3  # type: ignore[union-attr]
        side.on_new_request(request)
        probe_done(side, "q")
        meta = empty_step(side)
        assert sorted(p.chunk_hash for p in meta.prefetches) == sorted(full)
        threading.Event().wait(0.5)  # queued: its deadline counted from its arrival has passed
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # its turn: the fetch is in flight
        worker.play(meta, side)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
        assert side.take_counters() == {}


def test_a_chunk_that_lands_restarts_the_deadline_so_a_slow_and_steady_fetch_is_not_cut(redis_tier) -> None:
    """The deadline is for a store that stalls: each of the request's chunks that lands gives the next one a
    deadline's time again (a hung store lands none: the test above)."""
    with far_scene(redis_tier, "w", seed=13) as (request, full, _store, side, worker):
        side.far.deadline_s = 0.3  # type: ignore[union-attr]
        side.on_new_request(request)
        probe_done(side, "w")
        meta = empty_step(side)
        assert [p.chunk_hash for p in meta.prefetches] == full
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # its turn: both in flight
        first, second = meta.prefetches
        worker.prefetcher.submit([first])  # the first lands; the second is slow
        assert worker.prefetcher.drain(60.0)
        worker.report(side)
        threading.Event().wait(0.5)  # past the deadline counted from its turn
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # a chunk landed: it waits on
        worker.play(TieredKVMetadata(prefetches=[second]), side)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
        assert side.take_counters() == {}


def test_another_requests_chunk_that_lands_restarts_the_deadline_up_to_its_bound(redis_tier, monkeypatch) -> None:
    """A request's chunks may wait in the workers' fetch queue behind another's: a chunk of any request that
    lands says the store answers, and restarts the deadline, for at most `MAX_WAIT_DEADLINES` deadlines."""
    monkeypatch.setattr(far_module, "MAX_WAIT_DEADLINES", 1000)  # the bound comes last
    ahead, behind = (make_request(f"b{i}", tokens(PROMPT_TOKENS, seed=70 + i)) for i in range(2))
    store_chunks(redis_tier, [r.block_hashes[end] for r in (ahead, behind) for end in (3, 7)])
    with store_with(redis_tier) as store:
        side, worker = far_side(store, deadline_s=0.3), Worker(store)
        try:
            for request in (ahead, behind):
                side.on_new_request(request)
                probe_done(side, request.request_id)
            meta = empty_step(side)
            theirs, ours = meta.prefetches[:2], meta.prefetches[2:]
            assert side.get_num_new_matched_tokens(behind, 0) == (None, False)  # its turn: none of its chunks in
            for landing in theirs:  # the request ahead's chunks land, one per deadline
                threading.Event().wait(0.4)
                worker.play(TieredKVMetadata(prefetches=[landing]), side)
                assert side.get_num_new_matched_tokens(behind, 0) == (None, False)  # the store answers: it waits
            monkeypatch.setattr(far_module, "MAX_WAIT_DEADLINES", 2)  # 0.6 s after its turn: long past
            threading.Event().wait(0.4)  # and past the deadline the last landing gave
            worker.play(TieredKVMetadata(prefetches=[ahead_again := theirs[0]]), side)
            assert ahead_again.chunk_hash in side.far.staged  # type: ignore[union-attr]
            assert side.get_num_new_matched_tokens(behind, 0) == (0, False)
            assert side.take_counters() == {"prefetches_late": 2, "found_unused_chunks": 2}
            assert ours  # never fetched: the bound, not the fetch, ended its wait
        finally:
            worker.close()
            side.shutdown()


def test_chunks_are_named_for_a_fetch_in_the_requests_arrival_order(redis_tier) -> None:
    """vLLM serves its queue first come first served: the first in line is fetched first, whatever order the
    probes came back in."""
    requests = [make_request(f"o{i}", tokens(PROMPT_TOKENS, seed=40 + i)) for i in range(6)]
    store_chunks(redis_tier, [r.block_hashes[end] for r in requests for end in (3, 7)])
    with store_with(redis_tier) as store:
        side = far_side(store)
        try:
            for request in requests:
                side.on_new_request(request)
            for request in reversed(requests):
                probe_done(side, request.request_id)
            named = [p.chunk_hash for p in empty_step(side).prefetches]
            assert named == [r.block_hashes[end] for r in requests for end in (3, 7)]
        finally:
            side.shutdown()


def test_a_request_whose_turn_came_has_its_chunks_fetched_ahead_of_those_still_queued(redis_tier) -> None:
    """vLLM asks for a request whose chunks wait behind another's in the workers' fetch queue (it let the
    later one pass: the earlier one did not fit yet): they are named again, urgent, and a worker fetches them
    next, each once."""
    early, late = (make_request(f"u{i}", tokens(PROMPT_TOKENS, seed=60 + i)) for i in range(2))
    store_chunks(redis_tier, [r.block_hashes[end] for r in (early, late) for end in (3, 7)])
    with store_with(redis_tier) as store:
        side, fetched, gate = far_side(store), [], threading.Event()
        real_get_many = store.get_many

        def get_many(keys, **kwargs):  # type: ignore[no-untyped-def]
            fetched.append(keys[0])
            assert gate.wait(30)  # the worker's one fetch thread is busy until the test lets it go
            return real_get_many(keys, **kwargs)

        store.get_many = get_many  # type: ignore[method-assign]
        worker = Worker(store)
        worker.prefetcher.shutdown()  # replaced by one of a single thread
        worker.prefetcher = Prefetcher(store=store, key=lambda chunk, layer: NAMING.record_key(chunk, layer),
                                       residency=worker.residency, staging=worker.staging,
                                       counters=worker.counters, counters_lock=threading.Lock(), threads=1)
        worker.prefetcher.attach(list(range(IDENTITY.num_layers)))
        try:
            for request in (early, late):
                side.on_new_request(request)
                probe_done(side, request.request_id)
            queued = empty_step(side).prefetches
            assert [p.chunk_hash for p in queued] == [r.block_hashes[e] for r in (early, late) for e in (3, 7)]
            assert not any(p.urgent for p in queued)
            worker.prefetcher.submit(queued)
            # the first is being fetched (its thread holds at the gate), the other three wait: a loaded machine
            # may run the thread only after the urgent ones below came, which would then go first
            wait_until("the fetch thread to take the first chunk", lambda: fetched)
            assert side.get_num_new_matched_tokens(late, 0) == (None, False)  # its turn: still on their way
            hurried = empty_step(side).prefetches
            assert [(p.chunk_hash, p.urgent) for p in hurried] == [(late.block_hashes[3], True),
                                                                     (late.block_hashes[7], True)]
            worker.prefetcher.submit(hurried)
            gate.set()
            assert worker.prefetcher.drain(60.0)
            first_layer = [NAMING.record_key(r.block_hashes[e], 0) for r in (early, late) for e in (3, 7)]
            assert fetched == [first_layer[i] for i in (0, 2, 3, 1)]  # the late request's next, each once
            worker.report(side)
            assert side.get_num_new_matched_tokens(late, 0) == (8 * BLOCK, False)
        finally:
            gate.set()
            worker.close()
            side.shutdown()


def test_a_step_that_scheduled_nothing_while_a_request_waits_yields_to_the_threads_it_waits_for(redis_tier) -> None:
    """vLLM steps again at once while every waiting request's answer is None: such a step gives the probe and
    fetch threads the interpreter for a moment, instead of a busy loop against them; other steps never wait."""
    with far_scene(redis_tier, "i", seed=12) as (request, _full, _store, side, worker):
        assert side.far is not None
        waits: list[float] = []
        real = side.far._probes.wait_for_one

        def waiting(timeout: float) -> None:
            waits.append(timeout)
            real(timeout)
        side.far._probes.wait_for_one = waiting  # type: ignore[method-assign]
        empty_step(side)
        assert waits == []  # no request waits on the store
        side.on_new_request(request)
        named = empty_step(side).prefetches
        assert waits == [IDLE_WAIT_S]
        named += side.build_connector_meta(step([], [], {"other": 16})).prefetches  # a step that computes
        assert waits == [IDLE_WAIT_S]
        probe_done(side, "i")
        if not named:  # the probe came in after those steps: the next one names its chunks
            named = empty_step(side).prefetches
        worker.play(TieredKVMetadata(prefetches=named), side)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
        before = len(waits)
        empty_step(side)
        assert len(waits) == before  # answered: no step waits for it any more


def test_an_aborted_requests_prefetch_lands_for_the_next_request_fetched_once(redis_tier) -> None:
    first, second = make_request("x", tokens(PROMPT_TOKENS, seed=4)), make_request("y", tokens(PROMPT_TOKENS, seed=4))
    full = [first.block_hashes[3], first.block_hashes[7]]
    store_chunks(redis_tier, full)
    with store_with(redis_tier) as store:
        side, worker = far_side(store), Worker(store)
        try:
            side.on_new_request(first)
            side.on_new_request(second)  # the same prompt, arrived together
            probe_done(side, "x")
            probe_done(side, "y")
            meta = empty_step(side)
            assert sorted(p.chunk_hash for p in meta.prefetches) == sorted(full)  # one fetch per chunk
            side.request_finished(first)  # aborted while its prefetch runs
            worker.play(meta, side)
            assert side.get_num_new_matched_tokens(second, 0) == (8 * BLOCK, False)
            third = make_request("z", tokens(PROMPT_TOKENS, seed=4))
            side.on_new_request(third)
            probe_done(side, "z")
            assert empty_step(side).prefetches == []  # resident: not fetched again
            assert side.get_num_new_matched_tokens(third, 0) == (8 * BLOCK, False)
        finally:
            worker.close()
            side.shutdown()


def test_a_prefetched_chunk_dropped_before_its_request_runs_is_recomputed_and_counted(redis_tier) -> None:
    """Staged chunks wait for their load; one dropped before it (its time passed: the scheduler hears it from
    the worker) is not claimed, and counted."""
    # a chunk is 128 KiB: only the staging keeps it
    with far_scene(redis_tier, "e", seed=5, memory="64KiB") as (request, full, _store, side, worker):
        side.on_new_request(request)
        probe_done(side, "e")
        worker.play(empty_step(side), side)
        worker.staging._drop(full[1])  # as its time passing drops it
        worker.report(side)
        assert side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)
        assert side.take_counters() == {"prefetches_evicted": 1, "found_unused_chunks": 1}
        # asked again later (no free blocks yet): answered at once, from what host memory holds then
        assert side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)


def test_a_memory_tier_smaller_than_the_prefix_still_serves_it_from_the_staging(redis_tier) -> None:
    """The memory tier cannot hold a chunk: the staging keeps the fetched records for their load."""
    with far_scene(redis_tier, "k", seed=9, memory="64KiB") as (request, full, _store, side, worker):
        side.on_new_request(request)
        probe_done(side, "k")
        report = worker.play(empty_step(side), side)
        assert not report.added and report.prefetched == dict.fromkeys(full, 1)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)


def test_a_staging_budget_too_tight_fails_the_prefetch_and_the_request_runs_as_a_miss(redis_tier) -> None:
    """Host memory too tight for the fetched chunks: the worker says so at once, and the request does not wait
    for its deadline."""
    half_a_chunk = RECORD.numel()
    with far_scene(redis_tier, "t", seed=6, memory="64KiB", staging_bytes=half_a_chunk) as (request, full, _store,
                                                                                            side, worker):
        side.on_new_request(request)
        probe_done(side, "t")
        report = worker.play(empty_step(side), side)
        assert report.prefetch_failed == set(full) and not report.prefetched
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        assert worker.counters.prefetch_failures == 2


@pytest.fixture
def plain_side(redis_tier) -> Iterator[KVSchedulerSide]:
    with store_with(redis_tier) as store:
        side = KVSchedulerSide(store=store, naming=NAMING, can_load=True, can_save=True, save_decode=False)
        yield side


def test_a_deadline_of_zero_keeps_the_synchronous_lookup(plain_side) -> None:
    assert plain_side.far is None
    request = make_request("s", tokens(PROMPT_TOKENS, seed=7))
    assert plain_side.get_num_new_matched_tokens(request, 0) == (0, False)


class HoldingTable(BlockTable):
    """The block table stand-in, and vLLM's prefix cache holding the first ``held_tokens`` of every prompt."""

    def __init__(self, held_tokens: int) -> None:
        super().__init__()
        self.coordinator = SimpleNamespace(find_longest_cache_hit=lambda hashes, max_length: ((), held_tokens, 0))


@contextlib.contextmanager
def first_chunk_held(tier: dict[str, Any], req_id: str, seed: int
                     ) -> Iterator[tuple[Request, list[bytes], KVSchedulerSide, Worker]]:
    """A prompt whose two full chunks ``tier`` holds, probed while vLLM's prefix cache holds its first chunk:
    (request, its full chunks, the scheduler side, a worker); the first plan, which names the second only, is
    played."""
    request = make_request(req_id, tokens(PROMPT_TOKENS, seed=seed))
    full = [request.block_hashes[3], request.block_hashes[7]]
    store_chunks(tier, full)
    with store_with(tier) as store:
        side, worker = far_side(store), Worker(store)
        side.bind_kv_cache_manager(HoldingTable(4 * BLOCK))  # type: ignore[arg-type]
        try:
            side.on_new_request(request)
            probe_done(side, req_id)
            meta = empty_step(side)
            assert [p.chunk_hash for p in meta.prefetches] == [full[1]]  # the first chunk is vLLM's own
            worker.play(meta, side)
            yield request, full, side, worker
        finally:
            worker.close()
            side.shutdown()


def test_nothing_vllm_holds_is_fetched_and_the_hit_starts_past_it(redis_tier) -> None:
    with first_chunk_held(redis_tier, "v", seed=8) as (request, _full, side, _worker):
        assert side.get_num_new_matched_tokens(request, 4 * BLOCK) == (4 * BLOCK, False)
        assert side._requests["v"].load_first == 4 and side._requests["v"].load_end == 8


def test_a_chunk_vllm_evicted_while_the_request_queued_is_fetched_at_its_turn_not_computed(redis_tier) -> None:
    """vLLM held the first chunk when the probe came in (not fetched), and its prefix cache dropped it before
    the request's turn (`bench serve`: a KV cache a quarter of the working set): that chunk is fetched then,
    and the request waits for it within its deadline, rather than computing what the store holds."""
    with first_chunk_held(redis_tier, "q", seed=9) as (request, full, side, worker):
        # its turn: vLLM's prefix cache holds none of it any more
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)
        meta = empty_step(side)
        assert [p.chunk_hash for p in meta.prefetches] == [full[0]]  # fetched now, once
        worker.play(meta, side)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
        assert side.take_counters() == {}  # nothing found went unused


def test_a_chunk_with_a_record_missing_is_never_claimed_and_is_saved_anew(redis_tier) -> None:
    """Its probe record is there, another layer's is not (a writer that died halfway): the fetch fails, the
    chunk is claimed by no request until one saves it again, and the request that computes it does."""
    request = make_request("r", tokens(PROMPT_TOKENS, seed=10))
    first, second = request.block_hashes[3], request.block_hashes[7]
    store_chunks(redis_tier, [first])
    store_chunks(redis_tier, [second], layers=1)
    with store_with(redis_tier) as store:
        side, worker = far_side(store), Worker(store)
        try:
            side.on_new_request(request)
            probe_done(side, "r")
            report = worker.play(empty_step(side), side)
            assert report.failed == {second} and report.prefetch_failed == {second}
            assert worker.counters.prefetch_failures == 1 and worker.counters.prefetched_chunks == 1
            assert all(thread.is_alive() for thread in worker.prefetcher._threads.threads)  # a failure ends no thread
            again = make_request("r2", tokens(PROMPT_TOKENS, seed=10))
            side.on_new_request(again)
            probe_done(side, "r2")
            assert empty_step(side).prefetches == []  # not fetched again before it is saved anew
            assert side.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)
            side.update_state_after_alloc(request, 4 * BLOCK)
            plan = side.build_connector_meta(step([], [("r", 4 * BLOCK)], {"r": 200}))  # type: ignore[arg-type]
            assert [save.chunk_hash for save in plan.requests[0].saves] == [second]  # saved anew
        finally:
            worker.close()
            side.shutdown()


def test_a_chunk_of_the_workers_memory_is_staged_before_it_is_claimed(redis_tier) -> None:
    """The memory tier may evict a chunk between the answer and the load, and its residency report comes a
    step late: a resident chunk is staged too (a memory read for the worker), and claimed once staged."""
    with far_scene(redis_tier, "m2", seed=11) as (request, full, _store, side, worker):
        side.update_connector_output(TieredKVWorkerMetadata(added=set(full)))  # the workers' memory holds them
        side.on_new_request(request)
        probe_done(side, "m2")
        meta = empty_step(side)
        assert [p.chunk_hash for p in meta.prefetches] == full
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # not claimed before staged
        worker.play(meta, side)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)


def test_a_request_preempted_after_its_load_is_probed_and_fetched_anew(redis_tier) -> None:
    """Its loaded chunks were released from host memory after their load, and vLLM freed its KV: asked again,
    it is probed and fetched anew (not recomputed), and vLLM's prefix cache holding the whole prompt spares it
    the wait."""
    with far_scene(redis_tier, "pre", seed=12) as (request, full, _store, side, worker):
        side.on_new_request(request)
        probe_done(side, "pre")
        worker.play(empty_step(side), side)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
        side.update_state_after_alloc(request, 8 * BLOCK)
        plan = side.build_connector_meta(step([("pre", 8 * BLOCK)], [], {"pre": 74}))  # type: ignore[arg-type]
        assert plan.release == full and not side.far.staged  # type: ignore[union-attr]
        worker.staging.release(plan.release)
        request.num_preemptions += 1  # as vLLM's _preempt_request does, with its blocks freed
        request.num_computed_tokens = 0
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # a new probe, off the thread
        probe_done(side, "pre")
        meta = empty_step(side)
        assert [p.chunk_hash for p in meta.prefetches] == full  # fetched again
        worker.play(meta, side)
        assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, False)
        assert side._requests["pre"].load_chunks == [(4, True), (8, True)]
        # preempted once more while vLLM's prefix cache still holds the prompt: answered at once
        side.bind_kv_cache_manager(HoldingTable(PROMPT_TOKENS))  # type: ignore[arg-type]
        request.num_preemptions += 1
        assert side.get_num_new_matched_tokens(request, 10 * BLOCK) == (0, False)


def test_a_reset_during_a_prefetch_claims_nothing_of_the_old_generation(redis_tier) -> None:
    """vLLM resets the connector cache (weights changed in place) while a request's chunks are on their way:
    what lands is of the old names and is never claimed; the request is probed anew in the new generation,
    where nothing is stored yet, and computes its prompt."""
    with far_scene(redis_tier, "g", seed=13) as (request, full, _store, side, worker):
        side.on_new_request(request)
        probe_done(side, "g")
        meta = empty_step(side)
        assert [p.chunk_hash for p in meta.prefetches] == full
        assert side.reset_cache()
        worker.play(meta, side)  # the old generation's chunks land after the reset
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # probed anew
        probe_done(side, "g")
        assert empty_step(side).prefetches == []  # the new names are stored nowhere
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        side.update_state_after_alloc(request, 0)
        plan = side.build_connector_meta(step([("g", 0)], [], {"g": PROMPT_TOKENS}))  # type: ignore[arg-type]
        saved = [save.chunk_hash for save in plan.requests[0].saves]
        assert saved and not set(saved) & set(full)  # saved under the new generation's names


def test_a_prompt_extending_a_stored_one_finds_its_partial_chunk_in_one_round_trip(redis_tier) -> None:
    """A stored prompt of two blocks (its partial chunk ends at block 2), then a longer prompt that starts
    with it (a question after a document): the far tier is asked once, for the chunks and the shorter endings
    inside the first one together, and the partial chunk is fetched and hit."""
    request = make_request("d", tokens(PROMPT_TOKENS, seed=14))
    partial = request.block_hashes[1]
    store_chunks(redis_tier, [partial])
    with store_with(redis_tier) as store:
        side, worker = far_side(store), Worker(store)
        asked = far_calls(store)
        try:
            side.on_new_request(request)
            probe_done(side, "d")
            assert asked == [6]  # 3 chunks + the 3 shorter endings inside the first: one round trip
            meta = empty_step(side)
            assert [p.chunk_hash for p in meta.prefetches] == [partial]
            worker.play(meta, side)
            assert side.get_num_new_matched_tokens(request, 0) == (2 * BLOCK, False)
            assert side._requests["d"].load_chunks == [(2, True)]
        finally:
            worker.close()
            side.shutdown()
