"""One disk directory, one eviction policy: the directory records the policy it was first used with, and a
process configured with the other one is refused at start, on real LMDB directories.

Why: ``lru`` keys the one eviction order by wall time (ns), ``prefix`` by a virtual clock that moves with
traffic (`shared/store/tiers/disk/order.py`, "Versions"). The two share a unit, not a scale: on a new
directory the clock advances 1 ns per byte, so a disk that sees less than 1 GB/s falls behind wall time
by most of every second, and every key an ``lru`` process writes ranks above every ``prefix`` key, however
recently read: eviction took the ``prefix`` process's records first (the other way round while the clock
runs ahead). Processes with different settings used to share a directory silently.

An older build records no policy: its directory opens under either policy as before, and is then marked.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from vllm_tiercache.shared.config import ConfigError, DiskTierConfig
from vllm_tiercache.shared.store import DiskTier, StoreKey
from vllm_tiercache.shared.store.tiers.disk import order
from vllm_tiercache.shared.store.tiers.disk.index import _ENVS, DiskIndex

OTHER = {"prefix": "lru", "lru": "prefix"}


def _k(i: int) -> StoreKey:
    return StoreKey(f"ns|policy|{i}")


def _tier(path: Path, policy: str) -> DiskTier:
    return DiskTier(DiskTierConfig(path=str(path), capacity=1 << 20, fsync=False, policy=policy))  # type: ignore[arg-type]


def _put(tier: DiskTier, *ids: int) -> None:
    tier.put_many([(_k(i), torch.full((256,), i, dtype=torch.uint8), None) for i in ids])


def _recorded(path: Path) -> bytes | None:
    index = DiskIndex(str(path / "index.lmdb"))
    try:
        with index.env.begin() as txn:
            raw = txn.get(order._POLICY_KEY, db=index.meta)
            return None if raw is None else bytes(raw)
    finally:
        index.close()


def _as_an_older_build_left_it(path: Path) -> None:
    """The index as a build before the policy marker leaves it: no ``eviction_policy`` in ``meta`` (the
    entries, keys and the prefix clock, if any, as they are)."""
    index = DiskIndex(str(path / "index.lmdb"))
    try:
        with index.env.begin(write=True) as txn:
            txn.delete(order._POLICY_KEY, db=index.meta)
    finally:
        index.close()


@pytest.mark.parametrize("policy", ["prefix", "lru"])
def test_a_process_with_another_policy_than_its_directory_is_refused_at_start(tmp_path: Path, policy: str) -> None:
    """The message names the directory, both policies and the ways out; the first process serves on, the
    refused one leaves no index open, and the refusal holds after every process stopped."""
    directory = tmp_path / "d"
    first = _tier(directory, policy)
    _put(first, 1, 2)
    with pytest.raises(ConfigError) as refused:
        _tier(directory, OTHER[policy])
    assert _recorded(directory) == bytes([order.POLICY_FORMAT]) + policy.encode()
    text = str(refused.value)
    assert str(directory) in text and f"policy {policy!r}" in text and f"policy {OTHER[policy]!r}" in text
    assert f"Set this tier's 'policy' to {policy!r}" in text and "directory of its own ('path')" in text
    assert isinstance(refused.value, order.PolicyConflict)
    same = _tier(directory, policy)  # a process configured alike shares it
    assert same.contains_many([_k(1), _k(2)]) == [True, True]
    _put(first, 3)
    assert same.contains_many([_k(3)]) == [True]
    same.close()
    first.close()
    # the refused tier closed the index it had opened: no environment of this directory left behind (other
    # tests of this worker process may hold theirs)
    assert not [path for path in _ENVS if Path(path).parent == directory.resolve()], _ENVS
    with pytest.raises(order.PolicyConflict):
        _tier(directory, OTHER[policy])


def test_two_new_processes_on_an_empty_directory_the_first_one_decides(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    first = _tier(directory, "lru")  # nothing written yet: the open itself records the policy
    try:
        with pytest.raises(ConfigError, match="is kept in eviction policy 'lru'"):
            _tier(directory, "prefix")
    finally:
        first.close()


@pytest.mark.parametrize("policy", ["prefix", "lru"])
def test_a_directory_an_older_build_keyed_by_recency_opens_under_either_policy_and_is_marked(
        tmp_path: Path, policy: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every older build keys by recency (``lru``'s layout, no policy recorded): ``prefix`` takes such a
    directory over (its clock starts level with the recency keys, `order`), ``lru`` goes on as it was."""
    caplog.set_level(logging.INFO)
    directory = tmp_path / "d"
    old = _tier(directory, "lru")
    _put(old, 1, 2, 3)
    old.close()
    _as_an_older_build_left_it(directory)
    tier = _tier(directory, policy)
    try:
        assert tier.contains_many([_k(1), _k(2), _k(3)]) == [True] * 3
        assert torch.equal(tier.get_many([_k(2)])[0].tensor, torch.full((256,), 2, dtype=torch.uint8))
        assert _recorded(directory) == bytes([order.POLICY_FORMAT]) + policy.encode()
        assert ("keyed by recency" in caplog.text) == (policy == "prefix")
        with pytest.raises(order.PolicyConflict):
            _tier(directory, OTHER[policy])
    finally:
        tier.close()


def test_a_directory_an_earlier_build_kept_in_prefix_is_prefix(tmp_path: Path) -> None:
    """An index with the prefix order's clock and no policy recorded was kept by ``prefix`` (a build of the
    prefix order before the marker): ``lru`` is refused, ``prefix`` opens it and records it."""
    directory = tmp_path / "d"
    earlier = _tier(directory, "prefix")
    _put(earlier, 1)
    earlier.close()
    _as_an_older_build_left_it(directory)
    with pytest.raises(order.PolicyConflict, match="the prefix order's clock, kept by an earlier build"):
        _tier(directory, "lru")
    assert _recorded(directory) is None  # the refused process wrote nothing
    tier = _tier(directory, "prefix")
    assert tier.contains_many([_k(1)]) == [True]
    tier.close()
    assert _recorded(directory) == bytes([order.POLICY_FORMAT]) + b"prefix"


def test_a_policy_recorded_in_an_unknown_format_is_refused_naming_it(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    _tier(directory, "prefix").close()
    index = DiskIndex(str(directory / "index.lmdb"))
    with index.env.begin(write=True) as txn:
        txn.put(order._POLICY_KEY, b"\x07prefix", db=index.meta)
    index.close()
    with pytest.raises(order.PolicyConflict, match=r"unknown format \(07\), written by another build"):
        _tier(directory, "prefix")
