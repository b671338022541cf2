"""A sealing store over real tiers: a disk directory and a real redis-server with persistence on.

The proof the issue asks of the store: after records are written with encryption on, no 64-byte window of
any stored tensor's raw bytes appears in the Redis dump file (BGSAVE) or in any file of the disk tier,
while the same check finds them after a run without encryption (so the check can fail). Then: another
tenant, a retired key and a damaged record are counted misses (the damaged one deleted), rotation keeps old
records readable, and `tiercache evict --key-id` reclaims a retired key's records.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.store.sealing.rings import new_key, shares_window, write_ring
from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.tiered import TieredStore
from vllm_tiercache.tools.evict_cmd import evict
from vllm_tiercache.tools.redis_server import RedisServer
from vllm_tiercache.tools.stats_cmd import collect


@pytest.fixture(scope="module")
def saving_redis() -> Iterator[RedisServer]:
    """A redis-server of its own with RDB persistence on (and uncompressed, so plaintext would show)."""
    with RedisServer(extra_args=["--save", "3600 1", "--dbfilename", "dump.rdb", "--rdbcompression", "no"]) as s:
        yield s


def tree_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def store_raw(tmp: Path, url: str, ring: Path | None, *, memory: bool = True, disk: bool = True,
              redis: bool = True, namespace: str = "sealed") -> dict[str, Any]:
    """A store config's dict: a memory tier, a disk tier in ``tmp``, a Redis tier at ``url`` (each optional)."""
    tiers: list[dict[str, Any]] = []
    if memory:
        tiers.append({"kind": "memory"})
    if disk:
        tiers.append({"kind": "disk", "path": str(tmp / "disk")})
    if redis:
        tiers.append({"kind": "redis", "url": url, "part_size": 64 << 10})
    raw: dict[str, Any] = {"namespace": namespace, "tiers": tiers}
    if ring is not None:
        raw["encryption"] = {"ring": str(ring)}
    return raw


def store_config(*args: Any, **kwargs: Any) -> StoreConfig:
    return StoreConfig.from_dict(store_raw(*args, **kwargs))


def tensors(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 32, 16, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(n)]


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def redis(saving_redis: RedisServer) -> str:
    with saving_redis.client() as client:
        client.flushall()
    return saving_redis.url


def test_no_window_of_a_stored_tensor_reaches_the_redis_dump_or_the_disk_files(
        tmp_path: Path, redis: str, saving_redis: RedisServer) -> None:
    ring = write_ring(tmp_path / "ring.json", "k1", {"k1": new_key()})
    plain_dir, sealed_dir = tmp_path / "plain", tmp_path / "sealed"
    plain, sealed = tensors(4, seed=1), tensors(4, seed=2)
    with TieredStore(store_config(plain_dir, redis, None, namespace="plain")) as store:
        store.put_many([(StoreKey(f"plain|kv|{i}"), t, None) for i, t in enumerate(plain)])
        assert store.flush(30)
    keys = [StoreKey(f"sealed|kv|{i}", tenant="tenant-a") for i in range(len(sealed))]
    with TieredStore(store_config(sealed_dir, redis, ring)) as store:
        store.put_many([(k, t, {"tags": ["doc:1"]}) for k, t in zip(keys, sealed, strict=True)])
        assert store.flush(30)
    dump = saving_redis.saved_dump(timeout_s=30)
    plain_files, sealed_files = tree_bytes(plain_dir), tree_bytes(sealed_dir)
    for tensor in plain:  # the check finds what a run without encryption leaves
        assert shares_window(raw_bytes(tensor), dump) and shares_window(raw_bytes(tensor), plain_files)
    for tensor in sealed:
        assert not shares_window(raw_bytes(tensor), dump)
        assert not shares_window(raw_bytes(tensor), sealed_files)
    for only in ({"disk": True, "redis": False}, {"disk": False, "redis": True}):  # each tier alone opens them
        with TieredStore(store_config(sealed_dir, redis, ring, memory=False, **only)) as store:
            got = store.get_many(keys)
            assert all(r is not None and torch.equal(r.tensor, t) and r.meta == {"tags": ["doc:1"]}
                       for r, t in zip(got, sealed, strict=True))
            assert store.stats()["tiers"][store.tiers[0].name]["sealed_rejected"] == 0


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_another_tenant_is_a_counted_miss_and_the_record_that_failed_is_deleted(
        tmp_path: Path, redis: str, kind: str) -> None:
    ring = write_ring(tmp_path / "ring.json", "k1", {"k1": new_key()})
    config = store_config(tmp_path, redis, ring, memory=False, disk=kind == "disk", redis=kind == "redis")
    tensor = torch.randn(8, 8)
    with TieredStore(config) as store:
        store.put(StoreKey("sealed|kv|a", tenant="A"), tensor)
        store.put(StoreKey("sealed|kv|b", tenant="A"), tensor)
        assert store.get(StoreKey("sealed|kv|a", tenant="A")) is not None
        for other in ("B", None):  # another salt, and no salt: neither opens tenant A's record
            assert store.get(StoreKey("sealed|kv|b", tenant=other)) is None
        stats = store.stats()["tiers"][kind]
        assert stats["sealed_rejected"] == 1 and stats["hits"] == 1 and stats["misses"] == 2
        # the record that did not open is gone from the tier (as a corrupt one would be)
        assert store.contains_many([StoreKey("sealed|kv|b")]) == [False]
        assert store.contains_many([StoreKey("sealed|kv|a")]) == [True]


def test_rotation_retirement_and_evict_by_key_id(tmp_path: Path, redis: str) -> None:
    k1, k2 = new_key(), new_key()
    ring = tmp_path / "ring.json"
    write_ring(ring, "k1", {"k1": k1})
    old, new = StoreKey("sealed|kv|old", tenant="A"), StoreKey("sealed|kv|new", tenant="A")
    tensor = torch.randn(32, 8)
    raw = store_raw(tmp_path, redis, ring, memory=False)
    config = StoreConfig.from_dict(raw)
    with TieredStore(config) as store:
        store.put(old, tensor)
        assert store.flush(30)
    write_ring(ring, "k2", {"k1": k1, "k2": k2})  # rotation: k2 seals, k1 still opens
    with TieredStore(config) as store:
        store.put(new, tensor)
        assert store.flush(30)
        assert all(r is not None and torch.equal(r.tensor, tensor) for r in store.get_many([old, new]))
        tags = {rec.text: rec.tags for tier in store.tiers for rec in tier.iter_stored()}
        assert "sealed-key:k1" in tags[old.text] and "sealed-key:k2" in tags[new.text]
    write_ring(ring, "k2", {"k2": k2}, retired=["k1"])  # retirement: k1's records are misses, left in place
    with TieredStore(store_config(tmp_path, redis, ring, memory=False, redis=False)) as store:
        assert store.get(old) is None and store.get(new) is not None
        assert store.stats()["tiers"]["disk"]["sealed_rejected"] == 1
        assert store.contains_many([old]) == [True]
    dry = evict(raw, key_ids=["k1"], dry_run=True)
    assert dry["records"] == 2 and {t["records"] for t in dry["tiers"]} == {1}
    done = evict(raw, key_ids=["k1"])
    assert done["records"] == 2
    with TieredStore(config) as store:
        assert store.contains_many([old, new]) == [False, True]


def test_stats_and_evict_by_key_id_need_no_ring(tmp_path: Path, redis: str) -> None:
    ring = write_ring(tmp_path / "ring.json", "k1", {"k1": new_key()})
    raw = store_raw(tmp_path, redis, ring, memory=False)
    with TieredStore(StoreConfig.from_dict(raw)) as store:
        store.put(StoreKey("sealed|kv|a"), torch.randn(4))
        assert store.flush(30)
    ring.unlink()
    shown = json.dumps(collect(raw, None, by_tag=True))  # stats by tag: records per key id, no ring needed
    assert "sealed-key:k1" in shown
    assert evict(raw, key_ids=["k1"])["records"] == 2


def test_a_sealing_store_with_an_unreadable_ring_does_not_start(tmp_path: Path) -> None:
    from vllm_tiercache.shared.store.tier_config import ConfigError

    config = StoreConfig.from_dict({"tiers": [{"kind": "disk", "path": str(tmp_path / "d")}],
                                    "encryption": {"ring": str(tmp_path / "absent.json")}})
    with pytest.raises(ConfigError, match=r"^encryption.ring: cannot read the ring file"):
        TieredStore(config)


def test_preflight_refuses_an_unreadable_or_invalid_ring_in_one_line(tmp_path: Path) -> None:
    from vllm_tiercache.preflight import check_encryption
    from vllm_tiercache.shared.store.tier_config import ConfigError

    check_encryption(StoreConfig.from_dict({}))  # no encryption: nothing to read
    good = write_ring(tmp_path / "ring.json", "k1", {"k1": new_key()})
    check_encryption(StoreConfig.from_dict({"encryption": {"ring": str(good)}}))
    (tmp_path / "bad.json").write_text('{"current": "k1", "keys": {"k1": "c2hvcnQ="}}')
    for ring, says in ((tmp_path / "absent.json", "cannot read the ring file"), (tmp_path / "bad.json", "not 32")):
        with pytest.raises(ConfigError) as exc:
            check_encryption(StoreConfig.from_dict({"encryption": {"ring": str(ring)}}))
        assert str(exc.value).startswith("encryption.ring: ") and says in str(exc.value)
        assert "\n" not in str(exc.value)


def test_the_memory_tier_keeps_plaintext_and_promotions_are_sealed_again(tmp_path: Path, redis: str) -> None:
    ring = write_ring(tmp_path / "ring.json", "k1", {"k1": new_key()})
    key, tensor = StoreKey("sealed|kv|p", tenant="A"), torch.randn(64, 16)
    with TieredStore(store_config(tmp_path, redis, ring, disk=False)) as store:
        store.put(key, tensor)
        assert store.flush(30)
    # a store whose disk tier sits between memory and redis: the redis hit is promoted into the disk tier
    with TieredStore(store_config(tmp_path, redis, ring)) as store:
        got = store.get(key)
        assert got is not None and torch.equal(got.tensor, tensor)
        assert store.flush(30)
        assert not shares_window(raw_bytes(tensor), tree_bytes(tmp_path / "disk"))
        held = store.tiers[0].get_many([key])[0]
        assert held is not None and torch.equal(held.tensor, tensor)  # plaintext inside the process
    with TieredStore(store_config(tmp_path, redis, ring, memory=False, redis=False)) as store:
        assert torch.equal(store.get(key).tensor, tensor)


def test_sealed_records_open_straight_into_the_callers_memory(tmp_path: Path, redis: str) -> None:
    """`get_many(into=...)`: the plaintext is decrypted into the caller's pieces (the KV cache's blocks), from
    disk and from Redis alike; another tenant's read is a miss whose destination the caller discards."""
    ring = write_ring(tmp_path / "ring.json", "k1", {"k1": new_key()})
    key, tensor = StoreKey("sealed|kv|i", tenant="A"), torch.randn(128)
    for only in ({"disk": True, "redis": False}, {"disk": False, "redis": True}):
        with TieredStore(store_config(tmp_path, redis, ring, memory=False, **only)) as store:
            assert store.reads_into
            store.put(key, tensor)
            destination = torch.zeros(128)
            view = memoryview(destination.numpy()).cast("B")
            pieces = [view[:100], view[100:104], view[104:]]  # three runs of blocks, as the KV loader gives
            got = store.get_many([key], into=[pieces])[0]
            assert got is not None and got.in_place and torch.equal(destination, tensor)
            assert got.tensor.shape == tensor.shape and got.tensor.device.type == "meta"
            store.put(key, tensor)  # the other tenant's read below deletes it (it does not open)
            assert store.get_many([StoreKey(key.text, tenant="B")], into=[[view]]) == [None]


def test_a_plaintext_record_is_a_counted_miss_left_in_place_then_replaced_sealed(tmp_path: Path, redis: str) -> None:
    """Encryption turned on over a store that has plaintext records: they are misses (counted, not
    deleted: a plaintext store may still share the tier), and the next save replaces them sealed."""
    ring = write_ring(tmp_path / "ring.json", "k1", {"k1": new_key()})
    key, tensor = StoreKey("sealed|kv|old"), torch.randn(32, 32)
    with TieredStore(store_config(tmp_path, redis, None, memory=False)) as store:
        store.put(key, tensor)
        assert store.flush(30)
    with TieredStore(store_config(tmp_path, redis, ring, memory=False)) as store:
        assert store.get(key) is None
        assert store.stats()["tiers"]["disk"]["sealed_rejected"] == 1
        assert store.contains_many([key]) == [True]  # left in place
        store.put(key, tensor)
        assert store.flush(30)
        assert torch.equal(store.get(key).tensor, tensor)
    assert not shares_window(raw_bytes(tensor), tree_bytes(tmp_path / "disk"))


def test_a_batch_that_cannot_be_sealed_is_dropped_never_written_in_plaintext(tmp_path: Path, redis: str,
                                                                             monkeypatch) -> None:
    ring = write_ring(tmp_path / "ring.json", "k1", {"k1": new_key()})
    tensor = torch.randn(64, 64)
    with TieredStore(store_config(tmp_path, redis, ring)) as store:
        def broken(*_args: Any) -> None:
            raise RuntimeError("sealing failed")

        monkeypatch.setattr(store._sealed.sealer, "seal", broken)
        store.put(StoreKey("sealed|kv|x"), tensor)
        assert store.flush(30)
        stats = store.stats()["tiers"]
        assert stats["disk"]["dropped_writes"] == 1 and stats["redis"]["dropped_writes"] == 1
        assert store.get(StoreKey("sealed|kv|x")) is not None  # the memory tier still has it, in-process
    with TieredStore(store_config(tmp_path, redis, ring, memory=False)) as store:
        assert store.contains_many([StoreKey("sealed|kv|x")]) == [False]
    assert not shares_window(raw_bytes(tensor), tree_bytes(tmp_path / "disk"))
