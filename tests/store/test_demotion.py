"""A disk tier exclusive of memory (admission ``evicted``, `shared/store/writes/demotion.py`): real files.

A put stays in memory; what memory evicts is written down to disk, so the two tiers hold different
records; a clean close writes down what memory still holds; an eviction reaches listeners only once the
record is on disk; exempt puts are still written through; capacities hold on both tiers.
"""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_tiercache.shared.config import ConfigError, StoreConfig
from vllm_tiercache.shared.store import build_store, describe_tiers
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.tags import TAGS_KEY

#: one record's tensor: 256 float32 = 1 KiB, so a 4 KiB memory tier holds 4 records
_RECORD = 256


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|demotion|{i}")


def _t(seed: int) -> torch.Tensor:
    return torch.randn(_RECORD, generator=torch.Generator().manual_seed(seed))


def _config(tmp_path, *, mem: str = "4KiB", disk: str = "1MiB", policy: str = "lru") -> StoreConfig:
    return StoreConfig.load({"tiers": [
        {"kind": "memory", "capacity": mem, "policy": policy},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": disk, "admission": {"policy": "evicted"}}]})


def _held(store, keys: list[StoreKey]) -> list[list[bool]]:
    """Per tier, which of ``keys`` it holds, asked of each tier directly once the writer is flushed."""
    assert store.flush(10)
    return [tier.contains_many(keys) for tier in store.tiers]


def test_a_put_stays_in_memory_and_an_evicted_record_is_found_on_disk(tmp_path):
    keys = [_k(i) for i in range(6)]
    with build_store(_config(tmp_path)) as store:
        store.put_many([(keys[i], _t(i), None) for i in range(4)])
        assert _held(store, keys[:4]) == [[True] * 4, [False] * 4]  # not written through
        store.put_many([(keys[i], _t(i), None) for i in (4, 5)])  # memory evicts the two oldest (lru)
        memory, disk = _held(store, keys)
        assert memory == [False, False, True, True, True, True]
        assert disk == [True, True, False, False, False, False]  # exclusive: each record in one tier
        assert store.stats()["tiers"]["disk"]["writes_admitted"] == 2
        for i in (0, 1):  # read back from disk, promoted into memory
            assert torch.equal(store.get(keys[i]).tensor, _t(i))
        assert store.tiers[0].contains_many(keys[:2]) == [True, True]
        memory, disk = _held(store, keys)  # dropped from disk; the promotion evicted two more: written down
        assert memory == [True, True, False, False, True, True]
        assert disk == [False, False, True, True, False, False]


def test_a_clean_close_writes_down_what_only_memory_holds(tmp_path):
    with build_store(_config(tmp_path)) as store:
        store.put_many([(_k(i), _t(i), None) for i in range(3)])
        assert _held(store, [_k(0)]) == [[True], [False]]
    with build_store(_config(tmp_path)) as restarted:  # a new process's store on the same directory
        assert restarted.tiers[1].contains_many([_k(i) for i in range(3)]) == [True] * 3
        for i in range(3):
            assert torch.equal(restarted.get(_k(i)).tensor, _t(i))


def test_an_eviction_reaches_listeners_once_the_record_is_on_disk(tmp_path):
    keys = {_k(i).digest: _k(i) for i in range(12)}
    heard: list[tuple[str, bool]] = []
    with build_store(_config(tmp_path)) as store:
        disk = store.tiers[1]
        store.add_eviction_listener(lambda kind, digest: heard.append((kind, disk.contains_many([keys[digest]])[0])))
        for i in range(12):
            store.put(_k(i), _t(i))
        assert store.flush(10)
        assert len(heard) == 8 and all(kind == "memory" and on_disk for kind, on_disk in heard), heard
        for i in range(8):  # the store still serves every record it told listeners memory dropped
            assert store.contains_many([_k(i)], shared_only=True, bounded=False) == [True]


def test_capacities_hold_on_both_tiers_and_the_pair_holds_their_sum(tmp_path):
    with build_store(_config(tmp_path, disk="24KiB", policy="prefix")) as store:
        for i in range(200):
            store.put(_k(i), _t(i))
            assert store.flush(10)
        usage = {name: tier.usage() for name, tier in zip(("memory", "disk"), store.tiers, strict=True)}
        assert usage["memory"]["bytes_used"] <= 4096
        assert usage["disk"]["bytes_used"] <= 24 * 1024
        memory, disk = _held(store, [_k(i) for i in range(200)])
        assert sum(memory) == 4 and not any(m and d for m, d in zip(memory, disk, strict=True))
        assert sum(memory) + sum(disk) == usage["memory"]["entries"] + usage["disk"]["entries"] > sum(disk)
        assert all(memory[-4:])  # the newest in memory, the ones before them on disk
        assert all(disk[-4 - sum(disk):-4])


@pytest.mark.parametrize("how", [{"always_admit": True}, {"urgent": True}])
def test_exempt_puts_are_written_through(tmp_path, how):
    with build_store(_config(tmp_path)) as store:
        store.put_many([(_k(1), _t(1), None)], **how)
        assert _held(store, [_k(1)]) == [[True], [True]]


def test_an_invalidated_record_is_not_written_down(tmp_path):
    with build_store(_config(tmp_path)) as store:
        store.put(_k("tagged"), _t(1), {TAGS_KEY: ["doc"]})
        assert store.tiers[0].drop_tagged({"doc": float("inf")}) == 1
        assert _held(store, [_k("tagged")]) == [[False], [False]]
    with build_store(_config(tmp_path)) as restarted:
        assert restarted.get(_k("tagged")) is None


def test_a_record_memory_refuses_on_arrival_goes_to_disk(tmp_path):
    with build_store(_config(tmp_path)) as store:
        big = torch.randn(4 * _RECORD + 1)  # more than the memory tier's capacity
        store.put(_k("big"), big)
        assert _held(store, [_k("big")]) == [[False], [True]]
        assert torch.equal(store.get(_k("big")).tensor, big)


def test_the_config_says_the_trade_and_the_start_up_line_names_it(tmp_path):
    cfg = _config(tmp_path)
    assert cfg.tiers[1].admission.evicted
    assert "admits memory's evictions" in describe_tiers(cfg)
    assert StoreConfig.load({"tiers": [{"kind": "memory"}, {"kind": "disk", "path": str(tmp_path)}]}
                            ).tiers[1].admission.policy == "always"  # the default stays write-through


def test_an_exclusive_tier_behind_a_tier_that_cannot_hand_over_evictions_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.admission\.policy: invalid value 'evicted'.*"
                                          "needs a memory tier first"):
        StoreConfig.load({"tiers": [
            {"kind": "disk", "path": str(tmp_path / "a"), "capacity": "1MiB"},
            {"kind": "disk", "path": str(tmp_path / "b"), "capacity": "1MiB", "admission": {"policy": "evicted"}}]})


def test_a_promoted_record_is_dropped_from_disk_off_the_reading_thread(tmp_path):
    """A disk read may be a KV load inside vLLM's forward pass: the drop (an index transaction, file unlinks)
    runs on the demotion's own thread, never on the reader's."""
    keys = [_k(i) for i in range(6)]
    with build_store(_config(tmp_path)) as store:
        store.put_many([(k, _t(i), None) for i, k in enumerate(keys)])
        assert store.flush(10)
        disk = store.tiers[1]
        dropped_on: list[str] = []
        real = disk.drop_many

        def dropping(drop_keys):  # type: ignore[no-untyped-def]
            dropped_on.append(threading.current_thread().name)
            return real(drop_keys)
        disk.drop_many = dropping
        assert torch.equal(store.get(keys[0]).tensor, _t(0))  # from disk, promoted
        assert _held(store, [keys[0]]) == [[True], [False]]
        assert dropped_on and all(name.startswith("tiercache-demotion-drop") for name in dropped_on), dropped_on
