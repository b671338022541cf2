"""TieredStore: read/write paths across real tiers, promotion, the write queue, outages, singletons."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.support.waiting import off_this_thread, wait_until
from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import TieredStore, build_store, get_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.records import byte_view


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|tiered|{i}")


def _t(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def _cfg(tmp_path, *, redis_url: str | None = None, mem: str = "1MiB", **top) -> StoreConfig:
    tiers = [{"kind": "memory", "capacity": mem}, {"kind": "disk", "path": str(tmp_path / "d"),
                                                   "capacity": "16MiB"}]
    if redis_url:
        tiers.append({"kind": "redis", "url": redis_url, "retry_after_s": 0.2, "timeout_s": 0.5})
    return StoreConfig.load({"tiers": tiers, **top})


@pytest.fixture
def store(tmp_path):
    s = build_store(_cfg(tmp_path))
    yield s
    s.close()


def test_put_then_get_everywhere(store):
    t = _t(1000)
    store.put(_k(1), t, {"m": 1})
    assert store.flush(10)
    mem, disk = store.tiers
    assert mem.contains_many([_k(1)]) == [True] and disk.contains_many([_k(1)]) == [True]
    rec = store.get(_k(1))
    assert torch.equal(rec.tensor, t) and rec.meta == {"m": 1}
    assert store.get(_k(2)) is None
    stats = store.stats()
    assert stats["tiers"]["memory"]["hits"] == 1 and stats["tiers"]["disk"]["misses"] == 1
    for key in ("hits", "misses", "puts", "bytes_read", "bytes_written", "evictions", "corrupt",
                "dropped_writes", "errors", "read_seconds", "write_seconds", "entries", "bytes_used"):
        assert key in stats["tiers"]["disk"]
    import json

    json.dumps(stats)


def test_put_copies_unless_owned(store):
    t = _t(100)
    store.put(_k(1), t)
    t.zero_()
    assert not torch.equal(store.get(_k(1)).tensor, t)
    u = _t(100)
    store.put(_k(2), u, owned=True)
    assert store.get(_k(2)).tensor.data_ptr() == u.data_ptr()  # kept, not copied
    view = torch.arange(20, dtype=torch.float32).reshape(4, 5)[:, 1]  # non-contiguous
    store.put(_k(3), view, owned=True)
    assert torch.equal(store.get(_k(3)).tensor, view)
    store.flush(10)
    store.tiers[0].clear()
    assert torch.equal(store.get(_k(3)).tensor, view)


def test_promotion_from_disk_to_memory(store):
    store.put_many([(_k(i), _t(100, i), None) for i in range(3)])
    store.flush(10)
    mem, disk = store.tiers
    mem.clear()
    recs = store.get_many([_k(0), _k(1), _k(9)])
    assert recs[2] is None and torch.equal(recs[1].tensor, _t(100, 1))
    assert mem.contains_many([_k(0), _k(1)]) == [True, True]
    assert disk.counters.get("hits") == 2
    store.get_many([_k(0), _k(1)])
    assert mem.counters.get("hits") == 2 and disk.counters.get("hits") == 2


def test_contains_and_shared_only(store):
    keys = [_k(i) for i in range(6)]
    store.put_many([(k, _t(10), None) for k in keys[:3]] + [(keys[4], _t(10), None)])
    assert store.contains_many(keys) == [True, True, True, False, True, False]
    store.flush(10)
    assert store.contains_many(keys, shared_only=True) == [True, True, True, False, True, False]
    store.tiers[1].path_for(keys[0]).unlink()
    store.get_many([keys[0]])  # memory still has it
    assert store.contains_many(keys[:1], shared_only=True) == [True]  # index says so until a disk read


def test_full_write_queue_drops_without_blocking(tmp_path):
    s = build_store(_cfg(tmp_path, write_queue_size=1))
    disk = s.tiers[1]
    gate = threading.Event()
    real_put = disk.put_many
    landed: list[int] = []

    def slow_put(items):  # hold the writer thread so the queue fills up
        gate.wait(60)  # until the test opens it (a minute: only ends a test that would hang)
        real_put(items)
        landed.append(len(items))

    disk.put_many = slow_put
    try:
        # on a thread of its own: a put that blocks fails the wait, not the run
        off_this_thread("the 20 puts to return while the writer is held",
                        lambda: [s.put(_k(i), _t(100, i)) for i in range(20)])
        # they returned with the writer still held: none waited for room in the queue (room comes only
        # when a held write lands)
        assert landed == []
        dropped = disk.counters.get("dropped_writes")
        assert dropped >= 17 and s.stats()["tiers"]["disk"]["dropped_writes"] == dropped
        assert s.tiers[0].contains_many([_k(i) for i in range(20)]) == [True] * 20
        assert s.flush(0.05) is False
        gate.set()
        assert s.flush(10) is True and s.pending_writes == 0
        assert sum(disk.contains_many([_k(i) for i in range(20)])) == 20 - dropped
    finally:
        gate.set()
        s.close()


def test_a_record_evicted_before_its_disk_write_lands_stays_readable(tmp_path):
    """The memory tier evicts records whose disk copies are still queued: no moment where no tier has one,
    and the eviction reaches listeners (residency reports) only once the disk has the record."""
    s = build_store(_cfg(tmp_path, mem="4KiB"))  # room for two 1600-byte records
    disk = s.tiers[1]
    gate = threading.Event()
    real_put = disk.put_many

    def held_put(items):  # the disk is slow: its writes wait for the gate
        gate.wait(10)
        real_put(items)

    disk.put_many = held_put
    evictions: list[tuple[str, bool]] = []
    s.add_eviction_listener(lambda kind, digest: evictions.append(
        (kind, disk.contains_many([next(k for k in keys if k.digest == digest)])[0])))
    keys = [_k(i) for i in range(6)]
    tensors = [_t(800, i) for i in range(6)]
    try:
        for key, tensor in zip(keys, tensors, strict=True):
            s.put(key, tensor)
        assert s.tiers[0].contains_many(keys[:4]) == [False] * 4, "the memory tier must have evicted these"
        assert evictions == [], "an eviction must wait for the record's disk write"
        assert s.contains_many(keys) == [True] * 6
        assert s.contains_many(keys, shared_only=True) == [False] * 6, "other processes can't see the buffer"
        records = s.get_many(keys)
        assert all(r is not None and torch.equal(r.tensor, t) for r, t in zip(records, tensors, strict=True))
        assert s.stats()["write_queue"]["hits"] >= 4
        gate.set()
        assert s.flush(10)
        assert disk.contains_many(keys) == [True] * 6
        assert evictions and all(kind == "memory" and on_disk for kind, on_disk in evictions), evictions
        assert s.contains_many(keys, shared_only=True) == [True] * 6
    finally:
        gate.set()
        s.close()


def test_a_dropped_disk_write_releases_its_record_and_eviction(tmp_path):
    """With the queue full the disk write is dropped: the record leaves the buffer, the eviction is sent."""
    s = build_store(_cfg(tmp_path, mem="2KiB", write_queue_size=1))
    disk = s.tiers[1]
    gate = threading.Event()
    real_put = disk.put_many

    def held_put(items):
        gate.wait(10)
        real_put(items)

    disk.put_many = held_put
    evicted: list[bytes] = []
    s.add_eviction_listener(lambda kind, digest: evicted.append(digest))
    try:
        for i in range(8):
            s.put(_k(i), _t(800, i))
        assert disk.counters.get("dropped_writes") >= 5
        dropped = [k for k in (_k(i) for i in range(8)) if not s.contains_many([k])[0]]
        assert dropped, "a record neither in memory nor queued for disk is gone, and says so"
        assert {k.digest for k in dropped} <= set(evicted)
    finally:
        gate.set()
        s.close()


def test_oversized_for_memory_still_reaches_disk(store):
    big = torch.zeros(2 << 20, dtype=torch.uint8)  # 2 MiB > 1 MiB memory tier
    store.put(_k("big"), big)
    store.flush(10)
    assert store.tiers[0].counters.get("refused") == 1
    assert torch.equal(store.get(_k("big")).tensor, big)


def test_corrupt_disk_record_is_a_miss_through_the_store(store):
    store.put(_k(1), _t(100))
    store.flush(10)
    store.tiers[0].clear()
    p = store.tiers[1].path_for(_k(1))
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF
    p.write_bytes(raw)
    assert store.get(_k(1)) is None
    assert store.stats()["tiers"]["disk"]["corrupt"] == 1 and not p.exists()


@pytest.mark.redis
def test_redis_killed_mid_test_store_keeps_serving(tmp_path, redis_url, redis_server):
    s = build_store(_cfg(tmp_path, redis_url=redis_url))
    mem, disk, red = s.tiers
    try:
        s.put_many([(_k(i), _t(100, i), None) for i in range(4)])
        assert s.flush(10)
        assert red.contains_many([_k(0)]) == [True]
        redis_server.kill()
        mem.clear()
        recs = s.get_many([_k(i) for i in range(5)])  # served by disk, no exception
        assert [r is not None for r in recs] == [True] * 4 + [False]
        s.put(_k(10), _t(100, 10))
        assert s.flush(10)
        assert s.contains_many([_k(10)]) == [True]
        stats = s.stats()["tiers"]["redis"]
        assert stats["down"] is True and stats["dropped_writes"] >= 1 and stats["errors"] >= 1
        redis_server.restart()
        # the prober finds it back (every 0.2 s; a loaded machine may take longer than a fixed sleep)
        wait_until("the prober to find redis back", lambda: not red.down)
        s.put(_k(11), _t(100, 11))
        assert s.flush(10)
        assert red.contains_many([_k(11)]) == [True] and s.stats()["tiers"]["redis"]["down"] is False
        # a record only in redis is promoted into memory and disk
        red.put_many([(_k(20), _t(50, 20), None)])
        assert torch.equal(s.get(_k(20)).tensor, _t(50, 20))
        assert s.flush(10)
        assert mem.contains_many([_k(20)]) == [True] and disk.contains_many([_k(20)]) == [True]
    finally:
        s.close()


def test_get_store_is_a_singleton_per_config(tmp_path):
    cfg = {"tiers": [{"kind": "memory", "capacity": "1MiB"}]}
    a = get_store(cfg)
    b = get_store(StoreConfig.load({**cfg, "namespace": "other"}))
    c = get_store({"tiers": [{"kind": "memory", "capacity": "2MiB"}]})
    try:
        assert a is b and a is not c and isinstance(a, TieredStore)
    finally:
        a.close()
        c.close()
    fresh = get_store(cfg)
    try:
        assert fresh is not a  # a closed singleton is replaced
    finally:
        fresh.close()


def test_threads_hammering_one_store(store):
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            for i in range(50):
                store.put(_k(f"{w}-{i}"), _t(64, i))
                rec = store.get(_k(f"{w}-{i}"))
                assert rec is not None
                store.contains_many([_k(f"{w}-{j}") for j in range(i)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.flush(10)


def test_close_flushes(tmp_path):
    s = build_store(_cfg(tmp_path))
    s.put_many([(_k(i), _t(100, i), None) for i in range(10)])
    s.close()
    s2 = build_store(_cfg(tmp_path))
    try:
        assert s2.tiers[1].contains_many([_k(i) for i in range(10)]) == [True] * 10
    finally:
        s2.close()


def test_a_record_read_in_place_is_promoted_as_a_copy(tmp_path):
    """A disk hit landed in the caller's memory (``into``) goes up to the memory tier as the store's own
    copy: the caller reuses its memory (vLLM its KV blocks) at once, and the next hit must not see that."""
    disk = {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}
    key, value = StoreKey("ns|promote|1"), torch.arange(4096, dtype=torch.float32).reshape(4, 1024)
    with build_store({"tiers": [disk]}) as only_disk:
        only_disk.put(key, value)
        only_disk.flush()
    with build_store({"tiers": [{"kind": "memory", "capacity": "16MiB"}, disk]}) as store:
        place = torch.zeros(4, 1024)
        (record,) = store.get_many([key], into=[[byte_view(place[2:]), byte_view(place[:2])]])  # record's order
        assert record.in_place and torch.equal(torch.cat([place[2:], place[:2]]), value)
        place.fill_(-1)  # the caller reuses its memory
        (again,) = store.get_many([key])
        assert not again.in_place and torch.equal(again.tensor, value)
        assert store.tiers[0].counters.get("hits") == 1


def test_prefetch_reads_ahead_only_what_the_memory_tier_lacks(tmp_path):
    """`TieredStore.prefetch` hands the disk tier the keys the memory tier does not hold (no device reads
    for memory hits); the disk tier advises the kernel of the files it has and skips the ones it lacks."""
    disk = {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}
    with build_store({"tiers": [{"kind": "memory", "capacity": "16MiB"}, disk]}) as store:
        store.put(_k("both"), _t(512))
        store.flush()
        store.tiers[0].clear()  # now only on disk
        store.put(_k("memory"), _t(512))
        asked: list[list[str]] = []
        prefetch_many = store.tiers[1].prefetch_many
        store.tiers[1].prefetch_many = lambda keys: (asked.append([k.text for k in keys]), prefetch_many(keys))
        store.prefetch([_k("both"), _k("memory"), _k("nowhere")])
        assert asked == [[_k("both").text, _k("nowhere").text]]
        (record,) = store.get_many([_k("both")])
        assert torch.equal(record.tensor, _t(512))


def test_the_payload_allocator_reaches_the_tiers_that_take_one(tmp_path):
    """`Store.set_payload_allocator` (a CUDA KV worker's pinned memory) reaches the disk tier, whose reads
    then land in it, and not the GDS tier, whose reads land in GPU memory (or its own buffers without it)."""
    given: list[int] = []

    def allocator(nbytes: int) -> torch.Tensor:
        given.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    tiers = [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"},
             {"kind": "gds", "path": str(tmp_path / "g"), "capacity": "16MiB"}]
    with build_store({"tiers": tiers}) as store:
        disk, gds = store.tiers
        store.set_payload_allocator(allocator)
        assert disk.payload_allocator is allocator and gds.payload_allocator is None
        store.put(_k("alloc"), _t(256))
        (record,) = store.get_many([_k("alloc")])
        assert torch.equal(record.tensor, _t(256)) and given == [record.nbytes]
        store.set_payload_allocator(None)
        assert disk.payload_allocator is None
