"""`shared.residency`: the one residency mechanism both connectors use, on a real memory + disk store."""

from __future__ import annotations

import torch

from vllm_tiercache.shared.residency import ResidencyChanges, ResidencyReporter, ResidentSet
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey


def _store(tmp_path, memory: str = "4KiB"):
    return build_store({"tiers": [{"kind": "memory", "capacity": memory},
                                  {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}]})


def test_a_name_is_reported_resident_then_evicted(tmp_path) -> None:
    store = _store(tmp_path)
    try:
        reporter: ResidencyReporter[str] = ResidencyReporter(store)
        resident: ResidentSet[str] = ResidentSet()
        keys = {name: [StoreKey(f"ns|{name}|{layer}") for layer in range(2)] for name in "abc"}
        for name in "ab":
            store.put_many([(k, torch.zeros(200, dtype=torch.float16), None) for k in keys[name]])
            reporter.stored(name, keys[name])
        changes = reporter.take()
        assert changes is not None and changes.added == {"a", "b"} and not changes.evicted
        resident.apply(changes.added, changes.evicted)
        assert "a" in resident and "b" in resident and len(resident) == 2
        assert reporter.take() is None, "nothing changed since the last report"
        store.put_many([(k, torch.zeros(900, dtype=torch.float16), None) for k in keys["c"]])  # evicts a, b
        reporter.stored("c", keys["c"])
        assert store.flush(10)  # evictions of records still queued for disk are reported once written
        changes = reporter.take()
        assert changes is not None and {"a", "b"} <= changes.evicted, changes
        resident.apply(changes.added, changes.evicted)
        assert "a" not in resident and "b" not in resident
    finally:
        store.close()


def test_a_name_missing_one_record_in_memory_is_not_resident(tmp_path) -> None:
    store = _store(tmp_path, memory="1KiB")
    try:
        reporter: ResidencyReporter[bytes] = ResidencyReporter(store)
        keys = [StoreKey(f"ns|big|{layer}") for layer in range(2)]
        store.put_many([(keys[0], torch.zeros(64, dtype=torch.float16), None),
                        (keys[1], torch.zeros(4096, dtype=torch.float16), None)])  # larger than the tier
        reporter.stored(b"chunk", keys)
        assert reporter.take() is None
    finally:
        store.close()


def test_without_a_memory_tier_nothing_is_reported(tmp_path) -> None:
    store = build_store({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}]})
    try:
        reporter: ResidencyReporter[str] = ResidencyReporter(store)
        key = StoreKey("ns|x")
        store.put(key, torch.zeros(8))
        reporter.stored("x", [key])
        assert not reporter.enabled and reporter.take() is None
    finally:
        store.close()


def test_ranks_merge_to_what_every_rank_holds() -> None:
    merged = ResidencyChanges({"a", "b"}, {"x"}).merge(ResidencyChanges({"b", "c"}, {"y"}))
    assert merged.added == {"b"} and merged.evicted == {"x", "y"}
