"""Disk and GDS tiers: persistence, LRU capacity, corruption, swapped files, ENOSPC, two processes."""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import stat
import threading
import time
from typing import Any

import pytest
import torch

from vllm_tiercache.shared.config import DiskTierConfig, GdsTierConfig
from vllm_tiercache.shared.store import DiskTier, GdsTier, StoreKey, records
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.records import byte_view, joined_copy
from vllm_tiercache.shared.store.tiers.disk.admin import DiskAdmin
from vllm_tiercache.shared.store.tiers.disk.bookkeeping import ReadBookkeeping, adopt_unindexed, rebuild_index
from vllm_tiercache.shared.store.tiers.disk.capacity import evict_over_capacity
from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex
from vllm_tiercache.shared.store.tiers.disk.paths import RecordPaths, key_named_by
from vllm_tiercache.shared.store.tiers.disk.problems import ProblemReporter
from vllm_tiercache.shared.store.tiers.disk.readahead import ReadAhead
from vllm_tiercache.shared.store.tiers.disk.reads import read_payload_apart, read_record_into, read_whole_record
from vllm_tiercache.shared.store.tiers.disk.writes import RecordWriter


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|disk|{i}")


def _t(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(torch.bfloat16)


class _Payloads:
    """A `DiskTier.payload_allocator` that remembers what it gave (a CUDA worker gives pinned memory)."""

    def __init__(self) -> None:
        self.given: list[torch.Tensor] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.given.append(torch.empty(nbytes, dtype=torch.uint8))
        return self.given[-1]


@pytest.fixture(params=["one buffer per file", "payload apart"])
def tier(tmp_path, request):
    """Every test of a tier runs with both whole-record read paths."""
    t = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity=1 << 20))
    if request.param == "payload apart":
        t.payload_allocator = _Payloads()
    yield t
    t.close()


def test_payloads_land_in_the_memory_the_reader_gives(tmp_path):
    """With a `payload_allocator` a record's tensor lies in the memory it gave, headers long or short; a
    file longer or shorter than its header says, or with a flipped payload bit, is a miss, and a foreign
    size never reaches the allocator."""
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity=1 << 20))
    payloads = tier.payload_allocator = _Payloads()
    long_meta = {"note": "x" * 10_000}  # a header longer than the first read
    tier.put_many([(_k("short"), _t(3000, 1), {"tokens": 1}), (_k("long"), _t(700, 2), long_meta),
                   (_k("empty"), torch.empty(0, dtype=torch.bfloat16), None)])
    short, long, empty = tier.get_many([_k("short"), _k("long"), _k("empty")])
    assert torch.equal(short.tensor, _t(3000, 1)) and short.meta == {"tokens": 1}
    assert torch.equal(long.tensor, _t(700, 2)) and long.meta == long_meta
    assert empty.tensor.numel() == 0
    assert [p.numel() for p in payloads.given] == [6000, 1400, 0]
    assert short.tensor.data_ptr() == payloads.given[0].data_ptr()
    assert long.tensor.data_ptr() == payloads.given[1].data_ptr()

    tier.put_many([(_k(n), _t(500, 3), None) for n in ("longer", "shorter", "flip")])
    with open(tier.path_for(_k("longer")), "ab") as f:
        f.write(b"\0" * 64)
    shorter = tier.path_for(_k("shorter"))
    shorter.write_bytes(shorter.read_bytes()[:-64])
    flip = tier.path_for(_k("flip"))
    raw = bytearray(flip.read_bytes())
    raw[-3] ^= 0x10
    flip.write_bytes(raw)
    given = len(payloads.given)
    assert tier.get_many([_k("longer"), _k("shorter"), _k("flip")]) == [None, None, None]
    assert tier.counters.get("corrupt") == 3
    assert len(payloads.given) == given + 1  # only the flipped file's size matched its header
    tier.close()


def test_put_get_contains_layout(tier, tmp_path):
    t = _t(1000)
    tier.put_many([(_k(1), t, {"tokens": 16})])
    rec = tier.get_many([_k(1), _k(2)])
    assert torch.equal(rec[0].tensor, t) and rec[0].meta == {"tokens": 16} and rec[1] is None
    assert tier.contains_many([_k(1), _k(2)]) == [True, False]
    path = tier.path_for(_k(1))
    h = _k(1).hex
    assert path == tmp_path / "d" / h[:2] / f"{h}.rec"
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o700
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp")]
    usage = tier.usage()
    assert usage["entries"] == 1 and usage["bytes_used"] == path.stat().st_size
    assert [(d, s, txt) for d, s, _, txt in tier.iter_index()] == [(_k(1).digest, usage["bytes_used"],
                                                                     _k(1).text)]


def test_persists_across_restart(tmp_path):
    cfg = DiskTierConfig(path=str(tmp_path / "d"), capacity=1 << 20)
    a = DiskTier(cfg)
    a.put_many([(_k(i), _t(100, i), None) for i in range(5)])
    a.close()
    b = DiskTier(cfg)
    try:
        assert b.contains_many([_k(i) for i in range(6)]) == [True] * 5 + [False]
        assert torch.equal(b.get_many([_k(3)])[0].tensor, _t(100, 3))
        assert b.usage()["entries"] == 5
    finally:
        b.close()


def test_records_a_writer_killed_mid_commit_left_unindexed_are_adopted_when_a_tier_opens(tmp_path):
    """A writer renames its batch into place inside its index write transaction (`RecordWriter.commit`);
    SIGKILLed before that commits, it leaves whole records the index lacks. Lookups ask the index alone, so
    they were never served and lay outside the byte budget for good (the engine fault test's consumer found
    nothing); the next tier to open indexes them, within its capacity."""
    path = str(tmp_path / "d")
    a = DiskTier(DiskTierConfig(path=path, capacity=1 << 20))
    a.put_many([(_k(0), _t(1000, 0), None)])
    for i in (1, 2, 3):  # written and renamed into place, the transaction never committed: a killed writer's
        w = a._writer.write_temp(_k(i), records.encode(_k(i), _t(1000, i)))
        os.replace(w.tmp, w.final)
    assert a.contains_many([_k(i) for i in range(4)]) == [True, False, False, False]
    size = a.path_for(_k(0)).stat().st_size
    a.close()
    b = DiskTier(DiskTierConfig(path=path, capacity=1 << 20))
    try:
        assert b.contains_many([_k(i) for i in range(4)]) == [True] * 4
        assert torch.equal(b.get_many([_k(3)])[0].tensor, _t(1000, 3))
        assert b.usage()["entries"] == 4 and b.usage()["bytes_used"] == 4 * size
    finally:
        b.close()
    c = DiskTier(DiskTierConfig(path=path, capacity=3 * size))  # nothing left to adopt
    try:
        assert c.usage()["entries"] == 4  # opening evicts nothing it did not adopt
    finally:
        c.close()


def test_lru_capacity_and_oversized(tmp_path):
    one = 2048 * 2  # bf16 payload; each file is payload + a small header
    t = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity=3 * one + 3 * 256))
    try:
        for i in range(3):
            t.put_many([(_k(i), _t(2048, i), None)])
        import vllm_tiercache.shared.store.tiers.disk.bookkeeping as bookkeeping

        old = bookkeeping.ATIME_REFRESH_NS
        bookkeeping.ATIME_REFRESH_NS = 0  # make this read refresh the access time right away
        try:
            t.get_many([_k(0)])
        finally:
            bookkeeping.ATIME_REFRESH_NS = old
        t.put_many([(_k(3), _t(2048, 3), None)])
        assert t.contains_many([_k(i) for i in range(4)]) == [True, False, True, True]
        assert not t.path_for(_k(1)).exists()
        assert t.counters.get("evictions") == 1
        assert t.usage()["bytes_used"] <= t.capacity
        t.put_many([(_k(9), _t(10_000), None)])
        assert t.counters.get("refused") == 1 and t.contains_many([_k(9)]) == [False]
    finally:
        t.close()


def test_bit_flip_and_truncation_are_counted_misses(tier):
    tier.put_many([(_k("flip"), _t(500), None), (_k("trunc"), _t(500), None)])
    p = tier.path_for(_k("flip"))
    raw = bytearray(p.read_bytes())
    raw[-10] ^= 0x04
    p.write_bytes(raw)
    q = tier.path_for(_k("trunc"))
    q.write_bytes(q.read_bytes()[:-7])
    assert tier.get_many([_k("flip"), _k("trunc")]) == [None, None]
    assert tier.counters.get("corrupt") == 2
    assert not p.exists() and not q.exists()
    assert tier.contains_many([_k("flip"), _k("trunc")]) == [False, False]
    assert tier.usage()["entries"] == 0 and tier.usage()["bytes_used"] == 0


def test_swapped_file_is_a_miss(tier):
    tier.put_many([(_k("A"), _t(100, 1), None), (_k("B"), _t(100, 2), None)])
    os.replace(tier.path_for(_k("A")), tier.path_for(_k("B")))
    assert tier.get_many([_k("B")]) == [None]
    assert tier.counters.get("corrupt") == 1


def test_missing_file_drops_index_entry(tier):
    tier.put_many([(_k(1), _t(100), None)])
    tier.path_for(_k(1)).unlink()
    assert tier.get_many([_k(1)]) == [None]
    assert tier.contains_many([_k(1)]) == [False]


def test_filesystem_full_skips_write(tier, monkeypatch, caplog):
    """ENOSPC is injected at os.write (a real full filesystem needs root); the tier must not raise."""
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with caplog.at_level(logging.WARNING):
        tier.put_many([(_k(1), _t(100), None)])
        tier.put_many([(_k(2), _t(100), None)])
    monkeypatch.setattr(os, "write", real_write)
    assert tier.counters.get("dropped_writes") == 2
    assert sum("filesystem full" in r.message for r in caplog.records) == 1
    assert tier.contains_many([_k(1)]) == [False]
    assert not [p for p in tier.root.rglob(".tmp-*")]
    tier.put_many([(_k(3), _t(100), None)])
    assert tier.contains_many([_k(3)]) == [True]


def _worker(path: str, worker: int, n: int, capacity: int, q) -> None:
    t = DiskTier(DiskTierConfig(path=path, capacity=capacity))
    errors = 0
    for i in range(n):
        t.put_many([(_k(f"w{worker}-{i}"), _t(256, i), {"w": worker})])
        other = 1 - worker
        for rec in t.get_many([_k(f"w{other}-{j}") for j in range(max(0, i - 3), i)]):
            if rec is not None and rec.meta != {"w": other}:
                errors += 1
    t.close()
    q.put(errors)


def test_two_processes_share_one_directory(tmp_path):
    path = str(tmp_path / "shared")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    n, capacity = 60, 40 * 700
    procs = [ctx.Process(target=_worker, args=(path, w, n, capacity, q)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [q.get(timeout=5) for _ in procs] == [0, 0]
    t = DiskTier(DiskTierConfig(path=path, capacity=capacity))
    try:
        usage = t.usage()
        files = [p for p in (tmp_path / "shared").glob("??/*.rec")]
        assert usage["bytes_used"] <= capacity
        assert usage["entries"] == len(files)
        assert usage["bytes_used"] == sum(f.stat().st_size for f in files)
        # every indexed record is there and decodes: the index and the files agree
        indexed = [StoreKey(text) for _, _, _, text in t.iter_index()]
        assert len(indexed) > 10
        assert all(r is not None for r in t.get_many(indexed))
        assert t.counters.get("corrupt") == 0
    finally:
        t.close()


def _open_while_this_processs_writer_commits(path: str, q: Any) -> None:
    """A tier's background writer holds the index's write lock while its commit renames files (the GIL
    released and taken back for each), and a second tier opens the same directory in this process (one
    LMDB environment, shared): the open must wait for the lock without the GIL, or neither goes on."""
    first = DiskTier(DiskTierConfig(path=path, capacity=1 << 20))
    committing = threading.Event()
    rename = os.replace

    def slow_rename(src: str, dst: str) -> None:
        committing.set()
        time.sleep(1.0)
        rename(src, dst)

    os.replace = slow_rename
    writer = threading.Thread(target=first.put_many, args=([(_k("w"), _t(64), None)],))
    writer.start()
    assert committing.wait(10)
    second = DiskTier(DiskTierConfig(path=path, capacity=1 << 20))
    writer.join(10)
    os.replace = rename
    q.put(second.get_many([_k("w")])[0] is not None)
    second.close()
    first.close()


def test_a_tier_opens_while_a_writer_in_this_process_holds_the_index(tmp_path):
    """Seen as a hung test: `tiercache evict` (in process) opened a tier while the engine's disk writer
    committed. In a process of its own, so that a deadlock fails this test instead of hanging the run."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_open_while_this_processs_writer_commits, args=(str(tmp_path / "d"), q))
    proc.start()
    proc.join(60)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        pytest.fail("opening a second tier on the directory deadlocked with the first tier's commit")
    assert proc.exitcode == 0 and q.get(timeout=5) is True


def test_gds_falls_back_to_posix_with_one_warning(tmp_path, caplog):
    import vllm_tiercache.shared.store.tiers.gds.tier as gds

    gds._warned_unavailable = False
    with caplog.at_level(logging.WARNING):
        a = GdsTier(GdsTierConfig(path=str(tmp_path / "g1"), capacity=1 << 20))
        b = GdsTier(GdsTierConfig(path=str(tmp_path / "g2"), capacity=1 << 20))
    try:
        warnings = [r for r in caplog.records if "GPUDirect Storage unavailable" in r.message]
        assert len(warnings) == 1 and a.unavailable_reason and not a.gpu_direct
        t = _t(1000)
        a.put_many([(_k(1), t, {"x": 1})])
        assert torch.equal(a.get_many([_k(1)])[0].tensor, t)
        assert a.shared_across_processes and a.kind == "gds"
        # same layout as the disk tier: a disk tier on the same directory reads it (after gds closes)
    finally:
        a.close()
        b.close()
    d = DiskTier(DiskTierConfig(path=str(tmp_path / "g1"), capacity=1 << 20))
    try:
        assert torch.equal(d.get_many([_k(1)])[0].tensor, t)
    finally:
        d.close()


def test_damaged_index_is_rebuilt_from_record_headers(tmp_path):
    """The index commits without fsync; an index an OS crash damaged must not lose the records."""
    path = tmp_path / "d"
    first = DiskTier(DiskTierConfig(path=str(path), capacity=1 << 20))
    tensors = {i: _t(200, seed=i) for i in range(5)}
    first.put_many([(_k(i), t, None) for i, t in tensors.items()])
    bogus = first.path_for(_k(99))
    first.close()
    bogus.parent.mkdir(parents=True, exist_ok=True)
    bogus.write_bytes(b"not a record at all")
    (path / "index.lmdb" / "data.mdb").write_bytes(b"\0garbage" * 512)
    second = DiskTier(DiskTierConfig(path=str(path), capacity=1 << 20))
    try:
        assert second.contains_many([_k(i) for i in range(5)]) == [True] * 5
        for i, t in tensors.items():
            assert torch.equal(second.get_many([_k(i)])[0].tensor, t)
        assert not bogus.exists()
        assert second.usage()["entries"] == 5
    finally:
        second.close()


def test_read_into_a_destination_lands_verified_bytes_in_place(tier):
    """`get_many_into`: a record of the destination's size is read straight into it (no buffer of its
    own), also into several pieces; one of another size comes back as usual, the destination left alone."""
    t, small = _t(4096, 3), _t(1000, 4)
    tier.put_many([(_k("fit"), t.reshape(8, 512), {"blocks": 8}), (_k("other"), small, None)])
    place, spare = torch.zeros(8, 512, dtype=torch.bfloat16), torch.zeros(8, 512, dtype=torch.bfloat16)
    fit, other, missing = tier.get_many_into([_k("fit"), _k("other"), _k("none")],
                                             [[byte_view(place)], [byte_view(spare)], [byte_view(spare)]])
    assert fit.in_place and fit.meta == {"blocks": 8} and torch.equal(place, t.reshape(8, 512))
    assert fit.tensor.shape == (8, 512) and fit.tensor.dtype == torch.bfloat16 and fit.tensor.is_meta
    assert torch.equal(joined_copy(fit), t.reshape(8, 512))
    assert not other.in_place and torch.equal(other.tensor, small) and not spare.any()
    assert missing is None
    # a destination a little larger than a record (the guessed header start falls inside its header) or
    # smaller: read the usual way, never taken for damage
    for extra in (64, -1024):
        wrong = torch.zeros(8 * 512 * 2 + extra, dtype=torch.uint8)
        (again,) = tier.get_many_into([_k("fit")], [[byte_view(wrong)]])
        assert not again.in_place and torch.equal(again.tensor, t.reshape(8, 512))
    assert tier.counters.get("corrupt") == 0
    # several pieces, in the record's order (vLLM's blocks in reverse order): rows 0-2, 3, 4-7 of the record
    cache = torch.zeros(16, 512, dtype=torch.bfloat16)
    rows = byte_view(cache)
    row = 512 * 2
    pieces = [rows[10 * row:13 * row], rows[2 * row:3 * row], rows[5 * row:9 * row]]
    (split,) = tier.get_many_into([_k("fit")], [pieces])
    assert split.in_place and torch.equal(torch.cat([cache[10:13], cache[2:3], cache[5:9]]), t.reshape(8, 512))
    assert not cache[[0, 1, 3, 4, 9, 13, 14, 15]].any()


def test_read_into_a_destination_never_returns_corrupt_bytes(tier):
    """A flipped payload bit is found after the bytes landed: a counted miss, the file dropped; the
    destination then holds garbage the caller was told not to use (the KV connector fails those blocks)."""
    tier.put_many([(_k(name), _t(4096, 5).reshape(8, 512), None) for name in ("flip", "head", "cut")])
    p = tier.path_for(_k("flip"))
    raw = bytearray(p.read_bytes())
    raw[-100] ^= 0x10
    p.write_bytes(raw)
    head = tier.path_for(_k("head"))  # a header bit: the payload lands, the header check refuses it
    raw = bytearray(head.read_bytes())
    raw[20] ^= 0x01
    head.write_bytes(raw)
    cut = tier.path_for(_k("cut"))  # truncated: the payload can no longer start where its size says
    cut.write_bytes(cut.read_bytes()[:-3])
    places = [[byte_view(torch.zeros(8, 512, dtype=torch.bfloat16))] for _ in range(3)]
    assert tier.get_many_into([_k("flip"), _k("head"), _k("cut")], places) == [None, None, None]
    assert tier.counters.get("corrupt") == 3 and not p.exists() and not head.exists() and not cut.exists()


def _drop_from_page_cache(path) -> None:
    """Evict a written (fsynced, so clean) file's pages. Not checked with a ``RWF_NOWAIT`` read: a read
    that misses starts the kernel's read-ahead of the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_ahead_step(tier, names: list[str]) -> dict[str, torch.Tensor]:
    """One KV load of ``names``: `prefetch_many`, then one in-place read
    per key, as the KV loader reads one layer per call; the destinations it filled."""
    places = {name: torch.zeros(8, 512, dtype=torch.bfloat16) for name in names}
    tier.prefetch_many([_k(name) for name in names])
    for name in names:
        (record,) = tier.get_many_into([_k(name)], [[byte_view(places[name])]])
        assert record.in_place
    return places


def _recording_advice(tier) -> list[list[str]]:
    """The keys of each read-ahead advice the tier gives from now on (the advice is still given)."""
    advised: list[list[str]] = []
    advise = tier._read_ahead.advise
    tier._read_ahead.advise = lambda keys: (advised.append([k.text for k in keys]), advise(keys))
    return advised


def test_read_ahead_is_advised_only_when_a_read_finds_a_cold_file(tier, monkeypatch):
    """`prefetch_many` defers its advice: a step whose files are all in the page cache never pays for it;
    the first in-place read that finds a file not in the page cache gives it for every key, once, and the
    bytes still land verified.

    The page cache's answer is played here (a ``RWF_NOWAIT`` read of a cold file would block) because
    the kernel's is a race: a ``RWF_NOWAIT`` read that misses starts the kernel's own read-ahead, which
    on a fast disk may finish before the read looks again (seen in CI under load). The real page cache
    is the next test's."""
    names = [f"r{i}" for i in range(6)]
    values = {name: _t(4096, i).reshape(8, 512) for i, name in enumerate(names)}
    tier.put_many([(_k(name), value, None) for name, value in values.items()])
    cold: set[int] = set()  # inodes a RWF_NOWAIT read finds not (wholly) in the page cache
    preadv = os.preadv

    def page_cache(fd, buffers, offset, flags=0):
        inode = os.fstat(fd).st_ino
        if flags and inode in cold:
            raise BlockingIOError(errno.EAGAIN, "would block")
        cold.discard(inode)  # a plain read brings the file in
        return preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", page_cache)
    advised = _recording_advice(tier)
    assert all(torch.equal(place, values[name]) for name, place in _read_ahead_step(tier, names).items())
    assert advised == []  # every file in the page cache
    cold.update(os.stat(tier.path_for(_k(name))).st_ino for name in names[2:])
    assert all(torch.equal(place, values[name]) for name, place in _read_ahead_step(tier, names).items())
    assert advised == [[_k(name).text for name in names]]  # at the first cold read, for the whole step
    assert not cold
    advised.clear()
    assert all(torch.equal(place, values[name]) for name, place in _read_ahead_step(tier, names).items())
    assert advised == []  # read once, warm again


def test_read_ahead_with_the_real_page_cache_lands_verified_bytes_and_advises_at_most_once(tier):
    """With files really dropped from the page cache, the bytes land verified and the advice, if the
    first read finds a file cold, is given once for the whole step (not when the kernel's own read-ahead,
    started by that ``RWF_NOWAIT`` read, won the race); a step of warm files never advises."""
    names = [f"r{i}" for i in range(6)]
    values = {name: _t(4096, i).reshape(8, 512) for i, name in enumerate(names)}
    tier.put_many([(_k(name), value, None) for name, value in values.items()])
    advised = _recording_advice(tier)
    assert all(torch.equal(place, values[name]) for name, place in _read_ahead_step(tier, names).items())
    assert advised == []  # just written: every file is in the page cache
    for name in names[2:]:
        _drop_from_page_cache(tier.path_for(_k(name)))
    assert all(torch.equal(place, values[name]) for name, place in _read_ahead_step(tier, names).items())
    assert advised in ([], [[_k(name).text for name in names]])
    advised.clear()
    assert all(torch.equal(place, values[name]) for name, place in _read_ahead_step(tier, names).items())
    assert advised == []


def test_read_ahead_is_advised_at_once_where_reads_cannot_tell_a_cold_file(tier, monkeypatch):
    """A filesystem that refuses ``RWF_NOWAIT``: the first read falls back to a plain one, and from then on
    `prefetch_many` advises at once."""
    tier.put_many([(_k(name), _t(4096, 1).reshape(8, 512), None) for name in ("a", "b")])
    preadv = os.preadv

    def refusing(fd, buffers, offset, flags=0):
        if flags:
            raise OSError(errno.EOPNOTSUPP, "not supported")
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refusing)
    advised: list[int] = []
    advise = tier._read_ahead.advise
    tier._read_ahead.advise = lambda keys: (advised.append(len(keys)), advise(keys))
    tier.prefetch_many([_k("a"), _k("b")])
    place = torch.zeros(8, 512, dtype=torch.bfloat16)
    (record,) = tier.get_many_into([_k("a")], [[byte_view(place)]])
    assert record.in_place and torch.equal(place, _t(4096, 1).reshape(8, 512)) and advised == [2]
    tier.prefetch_many([_k("b")])
    assert advised == [2, 1]


def test_a_filesystem_that_reads_less_per_call_is_not_corruption(tmp_path, monkeypatch):
    """Some filesystems (FUSE, network mounts) return fewer bytes per read than asked: a payload read apart
    keeps reading, and the record is a hit, not a corrupt file to delete."""
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity=1 << 20))
    tier.payload_allocator = _Payloads()
    tier.put_many([(_k("piecewise"), _t(50_000, 4), None)])
    real_preadv = os.preadv
    calls = []

    def at_most_4k(fd, buffers, offset, *flags):
        calls.append(offset)
        return real_preadv(fd, [memoryview(buffers[0])[:4096]], offset, *flags)

    monkeypatch.setattr(os, "preadv", at_most_4k)
    record = tier.get_many([_k("piecewise")])[0]
    assert record is not None and torch.equal(record.tensor, _t(50_000, 4))
    assert len(calls) > 20 and tier.counters.get("corrupt") == 0
    tier.close()


# ------------------------------------------------------------------ the disk tier's parts, each alone
@pytest.fixture
def parts(tmp_path):
    """A directory's paths, index and problem reporter, without a `DiskTier` over them."""
    paths = RecordPaths(tmp_path / "d")
    index, _ = DiskIndex.open(str(tmp_path / "d" / "index.lmdb"))
    counters = TierCounters()
    yield paths, index, ProblemReporter("disk", paths.root, counters, logging.getLogger(__name__)), counters
    index.close()


def _write_record(paths: RecordPaths, key: StoreKey, tensor: torch.Tensor) -> int:
    """One record file as a writer leaves it (no index entry); returns its size."""
    path = paths.path(key.digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(records.encode(key, tensor).tobytes())
    return path.stat().st_size


def test_record_paths_name_files_by_digest_only(tmp_path):
    paths = RecordPaths(tmp_path)
    key = _k("../../etc/passwd")
    assert paths.path(key.digest) == tmp_path / key.digest.hex()[:2] / f"{key.digest.hex()}.rec"
    assert paths.path_text(key.digest) == str(paths.path(key.digest))
    assert paths.temp_path(paths.path(key.digest)).parent == paths.path(key.digest).parent
    assert key_named_by(paths.path(key.digest)) == key.digest
    assert key_named_by(tmp_path / "ab" / "nothex.rec") is None and key_named_by(tmp_path / "ab.rec") is None


def test_the_three_reads_of_one_file_agree(parts):
    """Whole, payload apart and in place, with the read-ahead asked first: the same verified tensor."""
    paths, _, _, _ = parts
    value = _t(4096, 3).reshape(8, 512)
    _write_record(paths, _k("r"), value)
    path = paths.path_text(_k("r").digest)
    whole, size = read_whole_record(path, _k("r"))
    apart, apart_size = read_payload_apart(path, _k("r"), lambda n: torch.empty(n, dtype=torch.uint8))
    read_ahead = ReadAhead(paths)
    read_ahead.prefetch([_k("r")])
    place = torch.zeros(8, 512, dtype=torch.bfloat16)
    into, into_size = read_record_into(path, _k("r"), [byte_view(place)], read_ahead, read_whole_record)
    assert size == apart_size == into_size == os.path.getsize(path)
    assert torch.equal(whole.tensor, value) and torch.equal(apart.tensor, value)
    assert into.in_place and torch.equal(place, value)
    wrong_size = torch.zeros(4, 512, dtype=torch.bfloat16)  # read the usual way, not in place
    other, _ = read_record_into(path, _k("r"), [byte_view(wrong_size)], read_ahead, read_whole_record)
    assert not other.in_place and torch.equal(other.tensor, value)
    with pytest.raises(records.RecordError):
        read_whole_record(path, _k("another key"))


def test_eviction_alone_unlinks_the_least_recently_used(parts):
    paths, index, _, _ = parts
    sizes = {}
    with index.env.begin(write=True) as txn:
        for i in range(3):
            sizes[i] = _write_record(paths, _k(i), _t(1000, i))
            index.put(txn, _k(i).digest, sizes[i], _k(i).text, 1_000 + i)
        assert evict_over_capacity(index, txn, sizes[1] + sizes[2], paths) == 1
        assert index.get(txn, _k(0).digest) is None and index.total(txn) == sizes[1] + sizes[2]
        assert evict_over_capacity(index, txn, sizes[1] + sizes[2], paths) == 0
    assert not paths.path(_k(0).digest).exists() and paths.path(_k(1).digest).exists()


def test_bookkeeping_alone_adopts_orphans_and_drops_dead_entries(parts):
    """A hit with no entry is adopted only while its file is there; a missing file's entry is dropped."""
    paths, index, problems, _ = parts
    bookkeeping = ReadBookkeeping(index, paths, problems)
    size = _write_record(paths, _k("orphan"), _t(100))
    bookkeeping.after_read([(_k("orphan").digest, size), (_k("evicted").digest, 123)], [])
    with index.env.begin() as txn:
        assert index.get(txn, _k("orphan").digest).size == size and index.get(txn, _k("evicted").digest) is None
    paths.path(_k("orphan").digest).unlink()
    bookkeeping.after_read([], [(_k("orphan").digest, None)])
    with index.env.begin() as txn:
        assert index.count(txn) == 0 and index.total(txn) == 0
    _write_record(paths, _k("kept"), _t(100))
    assert rebuild_index(index, paths) == 1


def test_adoption_skips_what_the_index_has_and_evicts_to_the_capacity(parts):
    """`adopt_unindexed` indexes only the files the index lacks (a live writer's are indexed once its
    transaction commits, before the lock is ours), skips a file gone meanwhile, and evicts to the budget."""
    paths, index, _, _ = parts
    sizes = [_write_record(paths, _k(i), _t(100, i)) for i in range(3)]
    with index.env.begin(write=True) as txn:
        index.put(txn, _k(0).digest, sizes[0], _k(0).text, 1_000)
    assert adopt_unindexed(index, paths, [_k(i).digest for i in range(4)], 1 << 20) == 2
    with index.env.begin() as txn:
        assert index.get(txn, _k(0).digest).text == _k(0).text  # the indexed one left as it was
        assert index.count(txn) == 3 and index.total(txn) == sum(sizes)
    sizes.append(_write_record(paths, _k(3), _t(100, 3)))
    assert adopt_unindexed(index, paths, [_k(i).digest for i in range(4)], sizes[1] + sizes[2] + sizes[3]) == 1
    with index.env.begin() as txn:  # the oldest went: _k(0), indexed long before the adopted ones
        assert index.get(txn, _k(0).digest) is None and index.total(txn) == sum(sizes[1:])
    assert [paths.path(_k(i).digest).exists() for i in range(4)] == [False, True, True, True]


def test_writer_and_admin_alone(parts):
    paths, index, problems, counters = parts
    writer = RecordWriter(index, paths, 1 << 20, False, counters, problems)
    admin = DiskAdmin(index, paths, 1 << 20, problems)
    writer.put_many([(_k(i), _t(100, i), None) for i in range(4)] + [(_k("huge"), _t(1 << 20), None)],
                    for_gpu_readers=False)
    assert counters.get("puts") == 4 and counters.get("refused") == 1
    sizes = admin.sizes_many([_k(i) for i in range(5)])
    assert sizes[:4] == [paths.path(_k(i).digest).stat().st_size for i in range(4)] and sizes[4] is None
    assert sorted(r.text for r in admin.iter_stored()) == sorted(_k(i).text for i in range(4))
    assert admin.delete_where(lambda text, size, atime: text == _k(0).text, dry_run=True) == (1, sizes[0])
    assert admin.delete_stored(lambda r: r.text == _k(0).text) == (1, sizes[0])
    assert not paths.path(_k(0).digest).exists()
    assert admin.usage() == {"entries": 3, "bytes_used": sum(sizes[1:4]), "capacity": 1 << 20,
                             "path": str(paths.root)}
