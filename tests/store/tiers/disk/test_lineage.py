"""Disk tier and prefix chains: a record whose parent goes goes with it (eviction, admin deletes), on one
directory shared by two tiers, on an index rebuilt from the files, and on an index of an older build.

The eviction cases run the ``lru`` order, whose victim is the chain's head (the least recently used), so
that the descendants rule is what they see; the ``prefix`` order's victims are tested in test_order.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import lmdb
import torch

from vllm_tiercache.shared.config import DiskTierConfig
from vllm_tiercache.shared.eviction.lineage import PARENT_KEY
from vllm_tiercache.shared.store import DiskTier, StoreKey
from vllm_tiercache.shared.store.control import pin_changes
from vllm_tiercache.shared.store.tags import TAGS_KEY
from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex

CHAIN = ("parent", "child", "grandchild")


def _k(name: str) -> StoreKey:
    return StoreKey(f"ns|lineage|{name}")


def _t(seed: int) -> torch.Tensor:
    return torch.randn(512, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _meta(parent: str | None) -> dict[str, bytes] | None:
    return {PARENT_KEY: _k(parent).digest} if parent else None


def _put(tier: DiskTier, name: str, parent: str | None = None, seed: int = 0) -> None:
    """One record per call: one commit each, so the LRU order is the order of the calls."""
    tier.put_many([(_k(name), _t(seed), _meta(parent))])


def _put_chain_then_unrelated(tier: DiskTier) -> None:
    _put(tier, "parent")
    _put(tier, "child", "parent", 1)
    _put(tier, "grandchild", "child", 2)
    _put(tier, "unrelated", None, 3)


def _present(tier: DiskTier, names: tuple[str, ...]) -> list[bool]:
    return tier.contains_many([_k(n) for n in names])


def _capacity_for(path: Path, fill: Callable[[DiskTier], object]) -> int:
    """The bytes ``fill`` leaves on a roomy tier at ``path`` (then emptied): a capacity it just fits. In the
    tests' policy: a directory keeps the policy it was first used with."""
    roomy = DiskTier(DiskTierConfig(policy="lru", path=str(path), capacity=1 << 30))
    fill(roomy)
    used = roomy.usage()["bytes_used"]
    roomy.delete_stored(lambda r: True)
    roomy.close()
    return used + 64


def test_evicting_the_oldest_parent_takes_its_chain_and_leaves_the_unrelated(tmp_path):
    """The parent, read before its children by every lookup, is the oldest: it goes, and so do its child
    and grandchild (unreachable without it), counted as evictions; the unrelated record stays."""
    path = tmp_path / "d"
    capacity = _capacity_for(path, _put_chain_then_unrelated)
    tier = DiskTier(DiskTierConfig(policy="lru", path=str(path), capacity=capacity))
    try:
        _put_chain_then_unrelated(tier)
        assert _present(tier, (*CHAIN, "unrelated")) == [True] * 4
        _put(tier, "newcomer", None, 4)  # over capacity by less than one record: LRU alone evicts the parent
        assert _present(tier, (*CHAIN, "unrelated", "newcomer")) == [False, False, False, True, True]
        assert tier.counters.get("evictions") == 3
        assert not any(tier.path_for(_k(n)).exists() for n in CHAIN)
        usage = tier.usage()
        assert usage["entries"] == 2 and usage["bytes_used"] <= capacity
    finally:
        tier.close()


def test_two_tiers_on_one_directory_agree(tmp_path):
    """One tier writes the chain, another on the same directory (another store) fills it: the eviction
    the second one runs takes the chain the first one wrote, and both see the same records."""
    path = tmp_path / "d"
    capacity = _capacity_for(path, _put_chain_then_unrelated)
    writer = DiskTier(DiskTierConfig(policy="lru", path=str(path), capacity=capacity))
    filler = DiskTier(DiskTierConfig(policy="lru", path=str(path), capacity=capacity))
    try:
        _put(writer, "parent")
        _put(writer, "child", "parent", 1)
        _put(writer, "grandchild", "child", 2)
        _put(filler, "unrelated", None, 3)
        _put(filler, "newcomer", None, 4)
        names = (*CHAIN, "unrelated", "newcomer")
        assert _present(writer, names) == _present(filler, names) == [False, False, False, True, True]
        assert filler.counters.get("evictions") == 3 and writer.counters.get("evictions") == 0
        assert writer.usage() == filler.usage()
    finally:
        writer.close()
        filler.close()


def test_admin_delete_takes_descendants_and_counts_them(tmp_path):
    """`tiercache evict` of a parent (its key matched, not its children's) removes the chain, dry run
    and real run counting the same records and bytes; the unrelated record stays."""
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity=1 << 20))
    try:
        _put_chain_then_unrelated(tier)
        sizes = tier.sizes_many([_k(n) for n in CHAIN])
        is_parent = lambda r: r.text == _k("parent").text  # noqa: E731
        assert tier.delete_stored(is_parent, dry_run=True) == (3, sum(sizes))
        assert tier.delete_stored(is_parent) == (3, sum(sizes))
        assert _present(tier, (*CHAIN, "unrelated")) == [False, False, False, True]
        # deleting a middle link takes only what is below it
        _put(tier, "parent")
        _put(tier, "child", "parent", 1)
        _put(tier, "grandchild", "child", 2)
        assert tier.delete_stored(lambda r: r.text == _k("child").text) == (2, sum(sizes[1:]))
        assert _present(tier, (*CHAIN, "unrelated")) == [True, False, False, True]
    finally:
        tier.close()


def test_links_come_back_when_the_index_is_rebuilt_from_the_files(tmp_path):
    """A damaged index is rebuilt from the record headers, parent links included."""
    path = tmp_path / "d"
    first = DiskTier(DiskTierConfig(path=str(path), capacity=1 << 20))
    _put_chain_then_unrelated(first)
    first.close()
    (path / "index.lmdb" / "data.mdb").write_bytes(b"\0garbage" * 512)
    DiskTier(DiskTierConfig(path=str(path), capacity=1 << 20)).close()  # rebuilds the index
    index, rebuilt = DiskIndex.open(str(path / "index.lmdb"))
    try:
        assert not rebuilt
        with index.env.begin() as txn:
            assert index.count(txn) == 4
            assert index.descendants(txn, _k("parent").digest) == [_k("child").digest, _k("grandchild").digest]
            assert index.descendants(txn, _k("unrelated").digest) == []
    finally:
        index.close()


def _drop_lineage(index_dir: Path) -> None:
    """Make ``index_dir`` what a build before parent links left: no lineage dbs, no marker in ``meta``
    (the other dbs are laid out as that build wrote them)."""
    env = lmdb.open(str(index_dir), max_dbs=8, subdir=True)
    with env.begin(write=True) as txn:
        for name in (b"parents", b"children"):
            txn.drop(env.open_db(name, txn=txn, dupsort=name == b"children"), delete=True)
        txn.delete(b"lineage_version", db=env.open_db(b"meta", txn=txn))
    with env.begin() as txn:
        names = {bytes(k) for k in txn.cursor().iternext(keys=True, values=False)}
    env.close()
    assert names == {b"entries", b"atime", b"meta", b"tags", b"control"}


def test_an_index_of_an_older_build_opens_says_so_and_still_evicts(tmp_path, caplog):
    """Records indexed without links are roots (evicted by recency alone, a warning says so once);
    records written after the upgrade are linked and go with their parents."""
    path = tmp_path / "d"
    old = DiskTier(DiskTierConfig(policy="lru", path=str(path), capacity=1 << 20))
    _put(old, "old-a", None, 5)
    _put(old, "old-b", "old-a", 6)  # its link is lost with the lineage dbs: a root to the new build
    old.close()
    _drop_lineage(path / "index.lmdb")
    capacity = _capacity_for(tmp_path / "sizing", lambda t: [_put(t, "old-a", None, 5), _put(t, "old-b", "old-a", 6),
                                                           _put_chain_then_unrelated(t)])
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(DiskTierConfig(policy="lru", path=str(path), capacity=capacity))
    try:
        assert [r.message for r in caplog.records if "without parent links" in r.message] != []
        assert "2 records are roots" in caplog.text
        _put_chain_then_unrelated(tier)
        assert _present(tier, ("old-a", "old-b", *CHAIN, "unrelated")) == [True] * 6
        _put(tier, "newcomer", None, 4)  # evicts old-a alone: old-b is not known as its child
        assert _present(tier, ("old-a", "old-b", *CHAIN)) == [False, True, True, True, True]
        _put(tier, "newcomer-2", None, 7)  # old-b, then the parent with its chain
        _put(tier, "newcomer-3", None, 8)
        assert _present(tier, ("old-b", *CHAIN, "unrelated")) == [False, False, False, False, True]
        assert tier.counters.get("evictions") == 5
    finally:
        tier.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        DiskTier(DiskTierConfig(policy="lru", path=str(path), capacity=capacity)).close()
    assert "without parent links" not in caplog.text  # said once: the marker is written


def test_a_pinned_descendant_stays_with_what_is_below_it(tmp_path):
    """The pin rule outranks reachability: when an unpinned parent goes, a pinned child (within the pin
    budget) stays, and so does its own child; an unpinned sibling goes with the parent."""
    path = tmp_path / "d"

    def fill(tier: DiskTier) -> None:
        _put(tier, "parent")
        tier.put_many([(_k("pinned"), _t(1), {PARENT_KEY: _k("parent").digest, TAGS_KEY: ["doc"]})])
        _put(tier, "below-pinned", "pinned", 2)
        _put(tier, "sibling", "parent", 3)

    capacity = _capacity_for(path, fill)
    tier = DiskTier(DiskTierConfig(policy="lru", path=str(path), capacity=capacity, pin_budget=0.5))
    try:
        fill(tier)
        tier.write_control(pin_changes(["doc"], None, True))
        _put(tier, "newcomer", None, 4)
        assert _present(tier, ("parent", "pinned", "below-pinned", "sibling", "newcomer")) == [
            False, True, True, False, True]
        assert tier.counters.get("evictions") == 2
    finally:
        tier.close()
