"""The object tier's bound on capacity across writers, with no server of ours: usage ledgers, the janitor
lock taken by conditional PUT, LRU by last use, pins; four writer processes against one small capacity."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.support.store_workers import expected_tensor, fault_key
from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import StoreKey
from vllm_tiercache.shared.store.control import pin_changes
from vllm_tiercache.shared.store.tiers.object.sweeps import evictions
from vllm_tiercache.shared.store.tiers.object.tier import ObjectTier

pytestmark = pytest.mark.s3
REPO = Path(__file__).resolve().parents[4]
KIB = 1024


def _k(i: int) -> StoreKey:
    return StoreKey(f"ns|cap|{i}")


def _rec(i: int) -> torch.Tensor:
    return torch.full((16 * KIB // 4,), float(i))  # 16 KiB of payload


#: The request timeout of the four writers' test: it hangs nothing, and on a loaded 2-core machine SeaweedFS,
#: serving five processes, answered past the fixture's 2 s now and then (5 and 18 errors in two writers of
#: one run, where a few racing 500s are all the test allows)
PATIENT_TIMEOUT_S = 10.0
#: every tier `tier_of` built in the running test, closed after it (a failed assertion left one open, and
#: the module's thread guard then failed the next test too)
_OPEN: list[ObjectTier] = []


@pytest.fixture(autouse=True)
def _close_tiers():
    yield
    while _OPEN:
        _OPEN.pop().close()  # a second close of a tier the test closed is a no-op


def tier_of(s3_bucket, **fields) -> ObjectTier:
    tier = ObjectTier(StoreConfig.load({"tiers": [s3_bucket.tier_config(**fields)]}).tiers[0])
    _OPEN.append(tier)
    return tier


def listed_bytes(s3_bucket, prefix: str = "tiercache/r/") -> int:
    client = s3_bucket.server.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket.bucket, Prefix=prefix)
    return sum(obj["Size"] for page in pages for obj in page.get("Contents", ()))


def test_a_sweep_evicts_by_last_use_read_from_the_ledgers(s3_bucket):
    # a sweep leaves 0.8 of capacity (the one writer's grant is 0.2 of it): the 8 most recently used of 14
    writer = tier_of(s3_bucket, capacity=10 * 17 * KIB, sweep_every_s=3600.0, sweep_share=0.2)
    reader = tier_of(s3_bucket, capacity=10 * 17 * KIB, sweep_every_s=3600.0, sweep_share=0.2)
    for i in range(8):  # one at a time: a batch's records share one write time
        writer.put_many([(_k(i), _rec(i), None)])
    assert all(r is not None for r in reader.get_many([_k(0), _k(1)]))  # another process reads the oldest
    assert reader.janitor.flush_ledger()
    for i in range(8, 14):
        writer.put_many([(_k(i), _rec(i), None)])
    result = writer.janitor.sweep_now()  # its thread may have swept already: this one waits its turn
    assert result is not None and result.bytes_used <= writer.capacity
    alive = writer.contains_many([_k(i) for i in range(14)])
    evicted = alive.count(False)
    assert evicted >= 4 and alive[0] and alive[1]  # read lately: kept
    assert alive[2:] == [False] * evicted + [True] * (12 - evicted)  # the least recently used went first
    assert listed_bytes(s3_bucket) == result.bytes_used <= writer.capacity
    assert writer.counters.get("evictions") == evicted
    assert reader.janitor.sweep_now().bytes_used == result.bytes_used
    writer.close()
    reader.close()


def test_one_writer_at_a_time_holds_the_janitor_lock(s3_bucket, monkeypatch):
    a, b = tier_of(s3_bucket, sweep_every_s=3600.0), tier_of(s3_bucket, sweep_every_s=3600.0)
    held = a.janitor._take_lock()
    assert held is not None
    assert b.janitor._take_lock() is None and b.janitor.sweep() is None  # held by a
    monkeypatch.setattr(evictions, "LOCK_STALE_S", 0.0)  # a's holder "died": b takes the lock over
    taken = b.janitor._take_lock()
    assert taken is not None and taken != held
    assert a.janitor._take_lock() is None or True  # a may take over b's in turn (also stale at 0 s)
    a.close()
    b.close()


def test_racing_writers_get_the_lock_exactly_once(s3_bucket):
    tiers = [tier_of(s3_bucket, sweep_every_s=3600.0) for _ in range(6)]
    got: list[str | None] = []
    barrier = threading.Barrier(len(tiers))

    def race(tier: ObjectTier) -> None:
        barrier.wait()
        got.append(tier.janitor._take_lock())

    threads = [threading.Thread(target=race, args=(t,)) for t in tiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(g is not None for g in got) == 1
    for tier in tiers:
        tier.close()


def test_pinned_records_survive_sweeps_within_the_pin_budget(s3_bucket):
    tier = tier_of(s3_bucket, capacity=10 * 17 * KIB, pin_budget=0.5, sweep_every_s=3600.0, sweep_share=0.5)
    tier.put_many([(_k(i), _rec(i), {"tags": ["corpus:v1"]}) for i in range(3)])
    tier.write_control(pin_changes(["corpus:v1"], None, True))
    for start in range(3, 40, 4):
        tier.put_many([(_k(i), _rec(i), None) for i in range(start, start + 4)])
        tier.janitor.sweep_now()
    assert tier.contains_many([_k(i) for i in range(3)]) == [True] * 3
    assert listed_bytes(s3_bucket) <= tier.capacity
    tier.close()


def test_four_writer_processes_stay_bounded_and_a_pinned_corpus_keeps_every_hit(s3_bucket):
    capacity, share, writers, batch = 1 << 20, 0.02, 4, 4
    fields = {"capacity": capacity, "sweep_share": share, "sweep_every_s": 0.5, "pin_budget": 0.3,
              "timeout_s": PATIENT_TIMEOUT_S}
    corpus = list(range(100_000, 100_008))
    expected_meta_of = {i: {"i": i, "tags": ["corpus:v1"]} for i in corpus}  # about 130 KiB, within the pin budget
    tier = tier_of(s3_bucket, **fields)
    tier.put_many([(fault_key(i), expected_tensor(i), expected_meta_of[i]) for i in corpus])
    tier.write_control(pin_changes(["corpus:v1"], None, True))
    # each writer puts 2.6 MiB or so (writing on past what its grants dropped): ten times capacity in all
    per_writer = 160
    tier_item = s3_bucket.tier_config(**fields)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.support.store_workers", "object_writer",
         json.dumps({"tier": tier_item, "start": w * 10_000, "count": per_writer, "batch": batch, "until_put": True})],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(writers)]
    peak = 0
    while any(p.poll() is None for p in procs):
        peak = max(peak, listed_bytes(s3_bucket))
    results = []
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    final = listed_bytes(s3_bucket)  # as the writers left it: no sweep after them
    written = sum(r["puts"] for r in results)
    print(f"\ncapacity {capacity}, written {written} records, dropped {sum(r['dropped'] for r in results)}, "
          f"evicted {sum(r['evictions'] for r in results)}, peak usage {peak} ({peak / capacity:.3f}x), "
          f"final {final} ({final / capacity:.3f}x)")
    assert written * 16 * KIB > 5 * capacity  # the writers really wrote several capacities' worth
    # the design holds usage at capacity at every instant (janitor's docstring); the issue allows 5% above, for
    # what the design leaves approximate (a listing taken while records come and go)
    assert peak <= 1.05 * capacity and final <= capacity
    got = tier.get_many([fault_key(i) for i in corpus])
    assert all(rec is not None and torch.equal(rec.tensor, expected_tensor(i)) and rec.meta == expected_meta_of[i]
               for i, rec in zip(corpus, got, strict=True))  # every byte
    assert not [r for r in results if r["errors"] > 2]  # SeaweedFS answers a few racing requests with 500
    tier.close()


def test_a_writer_writes_within_the_grant_a_sweep_gave_it_and_drops_a_record_no_grant_holds(s3_bucket, caplog):
    capacity = 100 * KIB
    tier = tier_of(s3_bucket, capacity=capacity, sweep_share=0.2, sweep_every_s=3600.0)
    assert tier.janitor.grant is None  # new: it writes nothing before a sweep that saw its ledger
    tier.put_many([(_k(0), _rec(0), None)])
    assert tier.contains_many([_k(0)]) == [True]
    size = tier.sizes_many([_k(0)])[0]
    grant = max(int(0.2 * capacity), 2 * size)  # its share, and two of the largest records at least
    assert tier.janitor.grant == grant and tier.janitor.last.low_water == capacity - grant
    big = torch.zeros(60 * KIB // 4)  # larger than any grant of one writer: half of capacity at most
    tier.put_many([(_k(1), big, None)])
    assert tier.contains_many([_k(1)]) == [False] and tier.counters.get("dropped_writes") == 1
    assert "larger than this writer's grant" in caplog.text
    assert tier.janitor.grant == capacity // 2  # the sweep read of the large record in its ledger
    tier.close()


def test_a_writer_no_sweep_reaches_falls_back_to_its_allowance_instead_of_dropping_everything(s3_bucket, caplog):
    """The janitor lock held by a sweeper that died (until it is stale, `LOCK_STALE_S`): a new writer waits
    for a grant its wait's length, then writes within `FALLBACK_SHARES` x sweep_share of capacity; past that
    its puts are dropped, and it does not wait again until a sweep comes."""
    caplog.set_level(logging.WARNING)
    dead = tier_of(s3_bucket, sweep_every_s=3600.0)
    assert dead.janitor._take_lock() is not None  # never given back
    capacity = 1024 * KIB  # allowance: 2 x 0.02 x 1 MiB = 41.9 KB, two records of 16 KiB (and their headers)
    writer = tier_of(s3_bucket, capacity=capacity, sweep_share=0.02, timeout_s=0.25, sweep_every_s=3600.0)
    writer.put_many([(_k(i), _rec(i), None) for i in range(5)])
    assert writer.janitor.grant is None  # no sweep could run
    assert writer.counters.get("puts") == 2 and writer.counters.get("dropped_writes") == 3
    assert writer.contains_many([_k(0), _k(1)]) == [True, True]
    assert caplog.text.count("no capacity sweep came") == 1
    writer.put_many([(_k(9), _rec(9), None)])  # the allowance is spent: dropped, without a second wait
    assert writer.counters.get("dropped_writes") == 4
    writer.close()
    dead.close()


def test_past_half_its_grant_a_writer_wakes_its_janitor_once_the_batch_landed_not_when_admitted(s3_bucket):
    """A sweep woken at admission listed the batch while its PUTs landed: its records were listed before the
    ledger (flushed first) had them, roots as new as the end of their LastModified second, and those that
    landed after the listing stayed counted in the grant (another sweep soon after)."""
    tier = tier_of(s3_bucket, capacity=1000 * KIB, sweep_share=0.1, sweep_every_s=3600.0)
    janitor = tier.janitor
    janitor._thread = threading.current_thread()  # no janitor thread: this test watches its wake-up call
    with janitor._lock:
        janitor._grant, janitor._epoch, janitor._flushed_at = 100 * KIB, 1.0, time.time()
    assert janitor.admit([30 * KIB, 30 * KIB]) == 2  # past half of the grant once written
    assert not janitor._wake.is_set()
    janitor.wrote(60 * KIB, 60 * KIB, [("aa" * 16, None), ("bb" * 16, "aa" * 16)])
    assert janitor._wake.is_set()
    tier.close()
