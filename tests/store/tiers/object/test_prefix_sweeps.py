"""The object tier's sweeps under policy ``prefix`` against a real bucket, each case beside ``lru`` (the order
sweeps had before), which fails it: a chain read again outlives newer one-offs, no parent goes while its
child stays, and ledgers of the build before this one still count (and still read this build's); and a
writer's ledger bounded by what its sweeps leave."""

from __future__ import annotations

import itertools
import time

import cbor2
import pytest
import torch

from tests.store.tiers.object.test_capacity import KIB, listed_bytes, tier_of
from vllm_tiercache.shared.eviction.lineage import PARENT_KEY
from vllm_tiercache.shared.store import StoreKey
from vllm_tiercache.shared.store.tiers.object.sweeps import ledger as ledgers
from vllm_tiercache.shared.store.tiers.object.tier import ObjectTier

pytestmark = pytest.mark.s3
#: ten records of 16 KiB (and their headers); a grant of 0.2 of it: sweeps leave eight
CAPACITY = 10 * 17 * KIB


def _k(name: str) -> StoreKey:
    return StoreKey(f"ns|prefix|{name}")


def _rec() -> torch.Tensor:
    return torch.ones(16 * KIB // 4)


def _put_chain(tier: ObjectTier, names: list[str]) -> None:
    """One record at a time (a batch's records share one write time), each naming the one before."""
    for i, name in enumerate(names):
        tier.put_many([(_k(name), _rec(), {PARENT_KEY: _k(names[i - 1]).digest} if i else None)])


def _held(s3_bucket, names: list[str]) -> list[bool]:
    """Which of ``names`` the bucket lists now (no existence cache: what is really there)."""
    client = s3_bucket.server.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket.bucket, Prefix="tiercache/r/")
    listed = {obj["Key"].rsplit("/", 1)[1] for page in pages for obj in page.get("Contents", ())}
    return [_k(name).hex in listed for name in names]


def _held_between_sweeps(tier: ObjectTier, s3_bucket, names: list[str]) -> list[bool]:
    """`_held` while this test holds the janitor lock: no sweep is deleting (its deletes run in parallel)."""
    etag = None
    while etag is None:
        etag = tier.janitor._take_lock()
    try:
        return _held(s3_bucket, names)
    finally:
        tier.janitor._unlock(etag)


@pytest.mark.parametrize(("policy", "chain_kept"), [("lru", False), ("prefix", True)])
def test_a_chain_read_again_outlives_newer_one_off_records(s3_bucket, policy, chain_kept):
    # the chain is 6 of the 11 records, so the sweep's turnover is its age whatever the pace of the test
    tier = tier_of(s3_bucket, capacity=CAPACITY, sweep_every_s=3600.0, sweep_share=0.2, policy=policy)
    chain = [f"c{i}" for i in range(6)]
    _put_chain(tier, chain)
    for _ in range(3):
        assert all(r is not None for r in tier.get_many([_k(n) for n in chain]))
    one_offs = [f"o{i}" for i in range(5)]
    for name in one_offs:  # newer than every read of the chain: lru ranks them above it
        tier.put_many([(_k(name), _rec(), None)])
    result = tier.janitor.sweep_now()
    assert result is not None and result.bytes_used <= tier.capacity
    held = _held_between_sweeps(tier, s3_bucket, chain + one_offs)
    assert held.count(False) >= 3 and listed_bytes(s3_bucket) <= tier.capacity
    assert all(held[:6]) is chain_kept
    if chain_kept:
        assert held[6:] == [False] * 3 + [True] * 2  # the oldest one-offs went
        assert result.half_life_s is not None and tier.janitor._ledger.half_life_s == result.half_life_s
    tier.close()


@pytest.mark.parametrize(("policy", "parent_first"), [("lru", True), ("prefix", False)])
def test_no_parent_is_evicted_while_its_child_is_kept(s3_bucket, policy, parent_first):
    """A chain whose tail alone is read again (a faster tier in front holds its head, as a store's memory tier
    does), then one-offs until the whole chain has gone: lru deletes the head first and keeps the tail,
    which no lookup can reach; prefix raises the head to its tail's rank, so the chain goes tail first."""
    tier = tier_of(s3_bucket, capacity=CAPACITY, sweep_every_s=3600.0, sweep_share=0.2, policy=policy,
                   half_life=0.25)
    chain = [f"c{i}" for i in range(5)]
    _put_chain(tier, chain)
    assert all(r is not None for r in tier.get_many([_k(n) for n in chain[3:]]))
    broken = False
    for i in range(200):
        tier.put_many([(_k(f"o{i}"), _rec(), None)])
        held = _held_between_sweeps(tier, s3_bucket, chain)
        broken |= any(child and not parent for parent, child in itertools.pairwise(held))
        if not any(held):
            break
    assert not any(held)  # the chain aged out in the end
    assert broken is parent_first
    tier.close()


@pytest.mark.parametrize("policy", ["lru", "prefix"])
def test_pins_hold_under_either_order(s3_bucket, policy):
    tier = tier_of(s3_bucket, capacity=CAPACITY, pin_budget=0.5, sweep_every_s=3600.0, sweep_share=0.5,
                   policy=policy)
    tier.put_many([(_k(f"p{i}"), _rec(), {"tags": ["corpus:v1"]}) for i in range(3)])
    from vllm_tiercache.shared.store.control import pin_changes

    tier.write_control(pin_changes(["corpus:v1"], None, True))
    for start in range(0, 40, 4):  # one-offs newer than the pinned records, read again and again
        names = [f"o{i}" for i in range(start, start + 4)]
        tier.put_many([(_k(n), _rec(), None) for n in names])
        assert all(r is not None for r in tier.get_many([_k(n) for n in names]))
        tier.janitor.sweep_now()
    assert _held_between_sweeps(tier, s3_bucket, [f"p{i}" for i in range(3)]) == [True] * 3
    assert listed_bytes(s3_bucket) <= tier.capacity
    tier.close()


def _old_build_reads(body: bytes) -> dict[str, float]:
    """How the build before ``prefix`` read a ledger (`read_ledgers` at commit 9404260, its merge loop)."""
    merged: dict[str, float] = {}
    ledger = cbor2.loads(body)
    for digest, t in (ledger["reads"] if ledger is not None else {}).items():
        h = digest.hex()
        if t > merged.get(h, 0.0):
            merged[h] = float(t)
    return merged


def test_a_ledger_of_the_build_before_counts_beside_this_builds_and_reads_this_builds(s3_bucket):
    tier = tier_of(s3_bucket, capacity=CAPACITY, sweep_every_s=3600.0, sweep_share=0.2)
    names = [f"r{i}" for i in range(6)]
    _put_chain(tier, names[:2])
    for name in names[2:]:
        tier.put_many([(_k(name), _rec(), None)])
    # a writer of the build before read r0 and r1 just now: its ledger holds "reads" alone
    old = {"writer": "old-host-1-0000abcd", "writing_at": None, "largest": 0,
           "reads": {_k("r0").digest: time.time(), _k("r1").digest: time.time()}}
    client = s3_bucket.server.client()
    client.put_object(Bucket=s3_bucket.bucket, Key="tiercache/sys/use/old-host-1-0000abcd", Body=cbor2.dumps(old))
    for i in range(5):
        tier.put_many([(_k(f"n{i}"), _rec(), None)])
    assert tier.janitor.sweep_now() is not None  # sweeps ran meanwhile too: what they left is what counts
    # r0 and r1 count one access each at their read (not newcomers): kept; r2 to r4, newcomers written before
    # the n's, went first
    assert _held_between_sweeps(tier, s3_bucket, names) == [True, True, False, False, False, True]
    assert tier.janitor.flush_ledger()
    body = client.get_object(Bucket=s3_bucket.bucket, Key=f"tiercache/sys/use/{tier.janitor.writer}")["Body"].read()
    ledger = cbor2.loads(body)
    assert ledger["parents"] == {_k("r1").digest: _k("r0").digest}  # the new fields are there
    assert ledger["counts"][_k("r2").digest] == pytest.approx(0.1)
    old_view = _old_build_reads(body)  # and the build before reads this build's ledger as it always did
    assert old_view == {d.hex(): t for d, t in ledger["reads"].items()} and _k("n4").hex in old_view
    usage = cbor2.loads(client.get_object(Bucket=s3_bucket.bucket, Key="tiercache/sys/usage")["Body"].read())
    assert {"entries", "bytes", "listed_at", "grants", "generation"} <= set(usage)  # what it reads of it
    tier.close()


def test_a_ledger_rewritten_after_a_sweep_keeps_the_most_recent_few_times_what_the_sweep_left(s3_bucket, monkeypatch):
    """Not every record the writer touched in the week (the build before wrote all 40 here, rewritten at every
    sweep): `ledger.ledger_bound` of the records the last sweep left, the most recent."""
    monkeypatch.setattr(ledgers, "MIN_LEDGER_ENTRIES", 1)  # a bound of 2 x 8 records, for a bucket of ten
    monkeypatch.setattr(ledgers, "GHOST_FACTOR", 2)
    tier = tier_of(s3_bucket, capacity=CAPACITY, sweep_every_s=3600.0, sweep_share=0.2)
    names = [f"w{i}" for i in range(40)]
    for name in names:
        tier.put_many([(_k(name), _rec(), None)])
    result = tier.janitor.sweep_now()
    assert result is not None and 0 < result.entries <= 10
    bound = ledgers.ledger_bound(result.entries)
    assert bound < len(names) and tier.get_many([_k(names[-1])])[0] is not None  # a read: rewritten
    assert tier.janitor.flush_ledger()
    client = s3_bucket.server.client()
    body = client.get_object(Bucket=s3_bucket.bucket, Key=f"tiercache/sys/use/{tier.janitor.writer}")["Body"].read()
    assert set(cbor2.loads(body)["reads"]) == {_k(n).digest for n in names[-bound:]}
    tier.close()
