"""The object tier's existence cache against a real S3 store (SeaweedFS): lookups answer records seen lately
without a HEAD while no eviction ran, and never promise a record an eviction removed (`existence`)."""

from __future__ import annotations

import pytest
import torch

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import StoreKey
from vllm_tiercache.shared.store.tiers.object.existence import ExistenceCache
from vllm_tiercache.shared.store.tiers.object.tier import ObjectTier

pytestmark = pytest.mark.s3
KIB = 1024


def _k(i: int) -> StoreKey:
    return StoreKey(f"ns|exist|{i}")


def tier_of(s3_bucket, **fields) -> ObjectTier:
    """A tier on the test's bucket with a long request timeout: nothing here hangs the server, and on a loaded
    machine a PUT past the fixture's 2 s marked the writer's tier down, so a record was never written and a
    lookup that must find all of them found 29 of 30."""
    return ObjectTier(StoreConfig.load({"tiers": [s3_bucket.tier_config(**{"timeout_s": 30.0, **fields})]}).tiers[0])


def counting_heads(tier: ObjectTier) -> list[str]:
    """The names of the HEADs ``tier`` sends from now on (its real requests, counted on the way)."""
    sent: list[str] = []
    real = tier._calls.exists

    def head(name: str):
        sent.append(name)
        return real(name)

    tier._calls.exists = head
    return sent


def test_seen_records_are_answered_without_a_head_until_an_eviction(s3_bucket):
    writer, reader = tier_of(s3_bucket, sweep_every_s=3600.0), tier_of(s3_bucket, sweep_every_s=3600.0)
    keys = [_k(i) for i in range(40)]
    writer.put_many([(key, torch.full((256,), float(i)), {"tags": [f"t{i % 2}"]}) for i, key in enumerate(keys)])
    heads = counting_heads(reader)
    assert reader.contains_many([*keys, _k(99)]) == [True] * 40 + [False]  # HEADs (the listing may beat some)
    assert reader.warmed(30.0)
    heads.clear()
    assert reader.contains_many([*keys, _k(99)]) == [True] * 40 + [False]
    assert heads == [reader._names.record(_k(99))]  # the miss is asked again: misses are never cached
    writer.put_many([(_k(99), torch.zeros(4), None)])  # another process writes it: found at the next lookup
    assert reader.contains_many([_k(99)]) == [True]
    # `tiercache evict --tag t1` from a third process: every cache holding its records drops them
    admin = tier_of(s3_bucket, sweep_every_s=3600.0)
    assert admin.delete_stored(lambda rec: "t1" in rec.tags)[0] == 20
    heads.clear()
    assert reader.contains_many(keys) == [i % 2 == 0 for i in range(40)]
    assert len(heads) == 40  # the cache was emptied: every key asked again
    for tier in (writer, reader, admin):
        tier.close()


def test_a_sweep_that_evicts_empties_the_caches_and_one_in_progress_turns_them_off(s3_bucket):
    capacity = 64 * KIB
    writer = tier_of(s3_bucket, capacity=capacity, sweep_every_s=3600.0, sweep_share=0.5)
    reader = tier_of(s3_bucket, sweep_every_s=3600.0)
    keys = [_k(i) for i in range(6)]
    writer.put_many([(key, torch.zeros(4 * KIB // 4), None) for key in keys])  # 6 records of about 5 KiB
    assert reader.contains_many(keys) == [True] * 6
    assert reader.warmed(30.0)  # the listing this first lookup started: the records are cached
    generation = reader.existence.generation
    heads = counting_heads(reader)
    assert reader.contains_many(keys) == [True] * 6 and not heads
    writer.janitor.marks.mark_evicting(writer.janitor.marks.previous_usage())  # a sweep deletes now: no cached answer
    assert reader.contains_many(keys) == [True] * 6 and len(heads) == 6
    for i in range(6, 30):  # past capacity: the writer's sweeps evict the least recently used
        writer.put_many([(_k(i), torch.zeros(4 * KIB // 4), None)])
    assert writer.janitor.sweep_now() is not None
    heads.clear()
    alive = reader.contains_many(keys)
    # the old records went, and none was promised (several sweeps came between: the cache was emptied)
    assert alive.count(False) >= 1 and {reader._names.record(keys[i]) for i, ok in enumerate(alive) if not ok} \
        <= set(heads)
    assert reader.existence.generation not in (None, generation)
    for tier in (writer, reader):
        tier.close()


def test_after_one_sweep_a_cache_drops_only_what_it_evicted(s3_bucket):
    writer, reader = tier_of(s3_bucket, sweep_every_s=3600.0), tier_of(s3_bucket, sweep_every_s=3600.0)
    keys = [_k(i) for i in range(6)]
    writer.put_many([(key, torch.zeros(4 * KIB // 4), None) for key in keys])
    assert reader.contains_many(keys) == [True] * 6 and reader.warmed(30.0)
    # one sweep by a process whose capacity holds about four of them (less the writer's grant): it evicts two
    # and lists them in sys/evicted before its new generation
    sweeper = tier_of(s3_bucket, capacity=40 * KIB, sweep_share=0.5, sweep_every_s=3600.0)
    result = sweeper.janitor.sweep_now()
    assert result is not None and result.evicted == 2
    heads = counting_heads(reader)
    alive = reader.contains_many(keys)
    assert alive.count(False) == 2
    # only the two evicted were asked again; the kept four came from the cache
    assert sorted(heads) == sorted(reader._names.record(key) for key, ok in zip(keys, alive, strict=True) if not ok)
    for tier in (writer, reader, sweeper):
        tier.close()


def test_a_new_process_lists_the_records_once_and_then_asks_no_head(s3_bucket):
    writer, reader = tier_of(s3_bucket, sweep_every_s=3600.0), tier_of(s3_bucket, sweep_every_s=3600.0)
    keys = [_k(i) for i in range(30)]
    writer.put_many([(key, torch.zeros(16), None) for key in keys])
    assert reader.contains_many([]) == []  # the first lookup starts the listing
    assert reader.warmed(30.0)
    heads = counting_heads(reader)
    assert reader.contains_many(keys) == [True] * 30 and not heads
    for tier in (writer, reader):
        tier.close()


def test_a_record_deleted_behind_the_evictions_back_is_a_miss_at_load_then_never_promised(s3_bucket):
    """A delete the evictions do not bracket (another tool, a bucket lifecycle rule) is the one way the cache
    promises a missing record: the load misses (the KV connector counts a load error and vLLM recomputes the
    blocks), and the key leaves the cache."""
    tier = tier_of(s3_bucket, sweep_every_s=3600.0)
    tier.put_many([(_k(1), torch.ones(64), None)])
    assert tier.contains_many([_k(1)]) == [True]
    assert tier.warmed(30.0) and len(tier.existence) == 1  # the listing this first lookup started cached it
    s3_bucket.server.client().delete_object(Bucket=s3_bucket.bucket, Key=tier._names.record(_k(1)))
    assert tier.contains_many([_k(1)]) == [True]  # the documented over-promise
    assert tier.get_many([_k(1)]) == [None]
    assert tier.contains_many([_k(1)]) == [False]
    tier.close()


def test_the_cache_keeps_only_what_was_seen_under_the_generation_it_holds():
    cache = ExistenceCache(max_entries=3)
    cache.add(["a"], None)
    assert len(cache) == 0  # never validated: nothing cached
    assert not cache.validate("g1")
    cache.add(["a", "b"], "g1")
    cache.add(["c"], "g0")  # seen by a request sent under an older generation: not cached
    assert cache.known(["a", "b", "c"]) == [True, True, False]
    cache.add(["c", "d"], "g1")
    assert cache.known(["a", "b", "c", "d"]) == [False, True, True, True]  # the oldest went first
    assert cache.validate("g1")
    assert not cache.validate(None) and len(cache) == 3  # an eviction in progress: nothing answered, kept
    # the one eviction from g1 to g2 deleted "c": the rest holds
    assert cache.validate("g2", lambda: ("g1", "g2", ["c"]))
    assert cache.known(["b", "c", "d"]) == [True, False, True]
    assert not cache.validate("g4", lambda: ("g3", "g4", ["b"])) and len(cache) == 0  # evictions missed: emptied
    cache.add(["a"], "g4")
    assert not cache.validate("g5", lambda: ("g4", "g5", None)) and len(cache) == 0  # not listed: emptied
