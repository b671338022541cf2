"""The disk tier's ``prefix`` order (LRFU as a virtual time, `shared/store/tiers/disk/order.py`) against
``lru``, on real LMDB directories: what each keeps under pressure, ghosts, parents, and a directory shared
with a process that keys by recency (``lru``: the entry layout every older build writes).

Each tier's index gets a clock that the test advances (`DiskIndex.clock`), one minute and a bit per call,
so that every read refreshes its record (`bookkeeping.ATIME_REFRESH_NS`) and no assertion depends on time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_tiercache.shared.config import ConfigError, DiskTierConfig
from vllm_tiercache.shared.eviction.lineage import PARENT_KEY
from vllm_tiercache.shared.store import DiskTier, StoreKey
from vllm_tiercache.shared.store.control import pin_changes
from vllm_tiercache.shared.store.tags import TAGS_KEY
from vllm_tiercache.shared.store.tiers.disk import order
from vllm_tiercache.shared.store.tiers.disk.index import _ATIME, DiskIndex

_RECORD = 1024
_STEP_NS = 61_000_000_000  # more than ATIME_REFRESH_NS: every read refreshes


class _Clock:
    """A shared test clock: each call is one step later."""

    def __init__(self) -> None:
        self.now = 1_700_000_000_000_000_000

    def __call__(self) -> int:
        self.now += _STEP_NS
        return self.now


def _tier(path: Path, records: int, policy: str, clock: _Clock, **extra: object) -> DiskTier:
    """A tier holding about ``records`` records of the test's size, keyed by ``clock``."""
    size = _record_size(path.parent / "probe")
    tier = DiskTier(DiskTierConfig(path=str(path), capacity=records * size + size // 2, fsync=False,
                                   policy=policy, **extra))  # type: ignore[arg-type]
    tier._index.clock = clock
    return tier


def _record_size(path: Path) -> int:
    probe = DiskTier(DiskTierConfig(path=str(path), capacity=1 << 20, fsync=False))
    probe.put_many([(_k("probe|0"), torch.zeros(_RECORD, dtype=torch.uint8), {PARENT_KEY: _k("probe|x").digest})])
    size = probe.usage()["bytes_used"]
    probe.close()
    return size


def _k(name: str) -> StoreKey:
    return StoreKey(f"ns|order|{name}")


def _chain(name: str, n: int = 3) -> list[StoreKey]:
    return [_k(f"{name}|{i}") for i in range(n)]


def _put_chain(tier: DiskTier, keys: list[StoreKey], tags: tuple[str, ...] = ()) -> None:
    """One chain in one commit, each record naming the one before it (as the KV saver writes them)."""
    items, parent = [], None
    for key in keys:
        meta: dict[str, object] = {PARENT_KEY: parent.digest} if parent is not None else {}
        if tags:
            meta[TAGS_KEY] = list(tags)
        items.append((key, torch.zeros(_RECORD, dtype=torch.uint8), meta or None))
        parent = key
    tier.put_many(items)


def _held(tier: DiskTier, keys: list[StoreKey]) -> bool:
    return all(tier.contains_many(keys))


def _consistent(index: DiskIndex) -> None:
    """Every entry's key names exactly one ``atime`` entry, and nothing else is there (what an older build
    relies on when it deletes by the entry's field); the total is the sum of the sizes."""
    with index.env.begin() as txn:
        entries = dict(index.scan(txn))
        atime = [bytes(k) for k in txn.cursor(db=index.by_atime).iternext(keys=True, values=False)]
        assert sorted(atime) == sorted(_ATIME.pack(e.atime_ns) + d for d, e in entries.items())
        assert index.total(txn) == sum(e.size for e in entries.values())


@pytest.mark.parametrize("policy", ["prefix", "lru"])
def test_a_chain_read_again_outlives_newer_one_off_chains(tmp_path, policy):
    clock = _Clock()
    tier = _tier(tmp_path / "d", 9, policy, clock)
    reread = _chain("doc")
    _put_chain(tier, reread)
    for _ in range(3):
        assert all(r is not None for r in tier.get_many(reread))
    for i in range(4):  # 12 one-off records through a tier of 9: LRU's oldest is the re-read chain
        _put_chain(tier, _chain(f"once{i}"))
    assert _held(tier, reread) is (policy == "prefix")
    _consistent(tier._index)
    tier.close()


@pytest.mark.parametrize("policy", ["prefix", "lru"])
def test_a_newcomer_chain_goes_before_an_older_chain_read_several_times(tmp_path, policy):
    clock = _Clock()
    tier = _tier(tmp_path / "d", 6, policy, clock)
    read, new = _chain("read"), _chain("new")
    _put_chain(tier, read)
    for _ in range(3):
        tier.get_many(read)
    _put_chain(tier, new)
    _put_chain(tier, [_k("one-more")])  # 7 records in 6: one chain's tail must go
    if policy == "prefix":
        assert _held(tier, read) and not _held(tier, new)  # part of the newcomer chain, with what is below it
    else:
        assert tier.contains_many(read) == [False, False, False] and _held(tier, new)  # the oldest, its chain too
    tier.close()


def test_a_record_dropped_and_written_again_is_no_newcomer(tmp_path):
    """An exclusive disk drops what memory promoted and is written it again when memory evicts it: its
    count survives the drop (a ghost), so it outranks a newcomer written after it."""
    clock = _Clock()
    tier = _tier(tmp_path / "d", 6, "prefix", clock)
    back, new = _chain("back"), _chain("new")
    _put_chain(tier, back)
    for _ in range(3):
        tier.get_many(back)
    tier.drop_many(back)
    assert not any(tier.contains_many(back))
    _put_chain(tier, back)
    _put_chain(tier, new)
    _put_chain(tier, [_k("one-more")])
    assert _held(tier, back) and not _held(tier, new)
    tier.close()


def test_ghosts_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(order, "MIN_GHOSTS", 4)
    tier = _tier(tmp_path / "d", 3, "prefix", _Clock())
    for i in range(10):
        _put_chain(tier, _chain(f"c{i}"))
    prefix_order = tier._index.order
    assert isinstance(prefix_order, order.PrefixOrder)
    with tier._index.env.begin() as txn:
        held = tier._index.count(txn)
        assert txn.stat(prefix_order.ghosts)["entries"] == max(4, held)
        assert txn.stat(prefix_order.states)["entries"] == held + max(4, held)
    tier.close()


@pytest.mark.parametrize("policy", ["prefix", "lru"])
def test_a_parent_read_only_through_its_child_stays_with_it(tmp_path, policy):
    """With memory in front the disk sees a chain's tail read, not its head: under ``prefix`` the head is
    ranked above its child; under recency it is the oldest and takes the hot child along."""
    clock = _Clock()
    tier = _tier(tmp_path / "d", 6, policy, clock)
    hot = _chain("hot", 2)
    _put_chain(tier, hot)
    for _ in range(3):
        tier.get_many(hot[1:])
    for i in range(2):
        _put_chain(tier, _chain(f"once{i}"))
    _put_chain(tier, [_k("one-more")])
    assert _held(tier, hot) is (policy == "prefix")
    tier.close()


def _raises(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The digests the index moves in the order from now on (`DiskIndex.rekey`: a parent raised), in order."""
    raised: list[bytes] = []
    rekey = DiskIndex.rekey

    def counting(self: DiskIndex, txn: object, digest: bytes, *args: object) -> None:
        raised.append(digest)
        rekey(self, txn, digest, *args)

    monkeypatch.setattr(DiskIndex, "rekey", counting)
    return raised


def test_a_chain_put_in_one_commit_has_one_key_and_each_record_raises_no_parent(tmp_path, monkeypatch):
    """A commit is one time: a long prompt's chain put at once gets one key, so no record's put walks up its
    chain raising ancestors (which made a put cost grow with its depth: docs/benchmarks-kv.md, "2026-11-30:
    the disk's `prefix` order on long prompts"). The next commit of the same chain raises the chain once, to
    its own time, not once per record."""
    clock = _Clock()
    tier = _tier(tmp_path / "d", 1000, "prefix", clock)
    raised = _raises(monkeypatch)
    chain = _chain("long", 200)
    _put_chain(tier, chain[:100])
    assert raised == []
    with tier._index.env.begin() as txn:
        first = {e.atime_ns for d, e in tier._index.scan(txn)}
    assert len(first) == 1, first
    # the chain's next part, as a later save of the same prompt: its head raises the stored part once
    items = [(key, torch.zeros(_RECORD, dtype=torch.uint8), {PARENT_KEY: chain[i - 1].digest})
             for i, key in enumerate(chain) if i >= 100]
    tier.put_many(items)
    assert sorted(raised) == sorted(k.digest for k in chain[:100])
    with tier._index.env.begin() as txn:
        keys = {e.atime_ns for d, e in tier._index.scan(txn)}
    assert len(keys) == 1 and min(keys) > max(first), (keys, first)
    _consistent(tier._index)
    tier.close()


def test_a_chain_saved_one_record_per_commit_raises_no_parent_within_a_step_of_the_grid(tmp_path, monkeypatch):
    """A long prompt saved a chunk per commit: the commits within one step of the key grid (1/64 of a
    half-life of traffic, here 17 MB) share a key, so none raises the chain stored before it (each did:
    4,950 raises for these 100 records)."""
    clock = _Clock()
    tier = _tier(tmp_path / "d", 1_000_000, "prefix", clock)
    raised = _raises(monkeypatch)
    chain = _chain("saved", 100)
    for i, key in enumerate(chain):
        tier.put_many([(key, torch.zeros(_RECORD, dtype=torch.uint8),
                        {PARENT_KEY: chain[i - 1].digest} if i else None)])
    assert raised == []
    with tier._index.env.begin() as txn:
        assert len({e.atime_ns for _, e in tier._index.scan(txn)}) == 1
    _consistent(tier._index)
    tier.close()


def test_pinned_records_stay_under_prefix(tmp_path):
    clock = _Clock()
    tier = _tier(tmp_path / "d", 6, "prefix", clock, pin_budget=0.6)
    corpus = _chain("corpus")
    _put_chain(tier, corpus, tags=("corpus",))
    tier.write_control(pin_changes(["corpus"], None, True))
    for i in range(5):
        _put_chain(tier, _chain(f"once{i}"))
    assert _held(tier, corpus)
    _consistent(tier._index)
    tier.close()


def test_stats_show_the_last_access_not_the_order_key(tmp_path):
    clock = _Clock()
    tier = _tier(tmp_path / "d", 6, "prefix", clock)
    keys = _chain("seen")
    _put_chain(tier, keys)
    tier.get_many(keys)
    read_at = clock.now
    with tier._index.env.begin() as txn:
        keyed = {d: e.atime_ns for d, e in tier._index.scan(txn)}
    assert any(v != read_at for v in keyed.values())  # the keys are virtual times
    assert {d: round(t * 1e9, -3) for d, _, t, _ in tier.iter_index()} == dict.fromkeys(keyed, read_at)
    tier.close()


def test_a_directory_shared_with_an_older_build_orders_sensibly_both_ways(tmp_path):
    """``lru`` writes the entry layout of every older build (key = time of the last access, no state), and
    stands for one here: the policy it recorded is removed, as an older build records none (a process of
    this build configured ``lru`` is refused: test_policy_marker.py). Its records read as one access at
    that time under ``prefix``; ``prefix``'s records, evicted and touched by it, keep the index consistent
    for both. (The test's clock keys both; on wall time the two scales drift apart: `order`, "Versions".)"""
    clock = _Clock()
    size = _record_size(tmp_path / "probe")
    old = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity=9 * size + size // 2, fsync=False,
                                  policy="lru"))
    old._index.clock = clock
    with old._index.env.begin(write=True) as txn:
        txn.delete(order._POLICY_KEY, db=old._index.meta)
    legacy = _chain("legacy")
    _put_chain(old, legacy)
    old.get_many(legacy)
    new = _tier(tmp_path / "d", 9, "prefix", clock)
    assert new._index is not old._index and new._index.env is old._index.env
    for i in range(2):  # newer one-off chains, each a tenth of an access: below the legacy records' one
        _put_chain(new, _chain(f"once{i}"))
    _put_chain(new, [_k("one-more")])
    assert _held(new, legacy) and new.usage()["entries"] == 9  # a newcomer's tail went (recency: the legacy head)
    _consistent(new._index)
    # the reverse: the recency process reads, writes and evicts among records keyed by `prefix`
    old.get_many(_chain("once1"))
    for i in range(4):
        _put_chain(old, _chain(f"old{i}"))
    _consistent(old._index)
    assert _held(old, _chain("old3"))
    new.get_many(_chain("old3"))  # its records, touched by recency, are read as one access by `prefix`
    with new._index.env.begin() as txn:
        entry = new._index.get(txn, _chain("old3")[0].digest)
        assert entry is not None and new._index.last_access_ns(txn, _chain("old3")[0].digest, entry) == clock.now
    _consistent(new._index)
    new.close()
    old.close()


def test_half_life_is_checked():
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.half_life: invalid value 0; allowed: a positive number"):
        DiskTierConfig.from_raw({"kind": "disk", "path": "/tmp/x", "half_life": 0}, "tiers[1]")
    assert DiskTierConfig.from_raw({"kind": "disk", "path": "/tmp/x"}, "tiers[1]").policy == "prefix"

