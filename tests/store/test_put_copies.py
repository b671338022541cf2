"""How many copies a put and a get make.

A put copies the caller's tensor once (`own_tensor`), unless the caller hands it over (``owned=True``):
then the memory tier keeps that very tensor and the slower tiers write from it. A default put survives
the caller overwriting its buffer right after the call, even while the slower tiers' write is still
queued. The Redis tier hands redis-py memoryviews of the tensor's own memory (no copy of its own); a
multi-part get joins the parts in one copy, checksummed as it copies.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import redis
import torch
import xxhash

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import StoreKey, TieredStore, records, tiered
from vllm_tiercache.shared.store.api import Record
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.registry import make_tier


def _k(i: int | str) -> StoreKey:
    return StoreKey(f"ns|copies|{i}")


def _t(n: int, seed: int = 0, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _address(buf: Any) -> int:
    """Where a buffer's first byte lives (works for read-only buffers too)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class _HeldTier:
    """A slower tier that records what it was handed, and holds the writer until `release` (so a test can
    act while a write is still queued)."""

    kind = "held"
    shared_across_processes = True

    def __init__(self, name: str = "held") -> None:
        self.name = name
        self.counters = TierCounters()
        self.release = threading.Event()
        self.items: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}  # digest -> (tensor, clone at write)

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        return [k.digest in self.items for k in keys]

    def get_many(self, keys: Sequence[StoreKey]) -> list[Record | None]:
        return [Record(self.items[k.digest][1], {}) if k.digest in self.items else None for k in keys]

    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None:
        assert self.release.wait(30)
        for key, tensor, _ in items:
            self.items[key.digest] = (tensor, tensor.clone())

    def usage(self) -> dict[str, Any]:
        return {"entries": len(self.items), "bytes_used": None}

    def close(self) -> None:
        self.release.set()


def _store(held: _HeldTier) -> TieredStore:
    config = StoreConfig.from_dict({"tiers": [{"kind": "memory", "capacity": "16MiB"}]})
    memory = make_tier(config.tiers[0], "memory")  # a memory tier as the store builds it
    return TieredStore(config, tiers=[memory, held])


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the store's private copies (`own_tensor` calls), by the data pointer of the source."""
    calls: list[int] = []
    real = tiered.own_tensor

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.data_ptr())
        return real(tensor)

    monkeypatch.setattr(tiered, "own_tensor", counting)
    return calls


def test_an_owned_put_makes_no_copy_in_any_tier(copies: list[int]) -> None:
    held = _HeldTier()
    store = _store(held)
    try:
        tensor = _t(4096)
        store.put(_k(1), tensor, {"a": 1}, owned=True)
        assert copies == []
        # the memory tier holds the caller's tensor itself, and so does the write-behind buffer
        assert store.tiers[0].get_many([_k(1)])[0].tensor.data_ptr() == tensor.data_ptr()
        assert store.get(_k(1)).tensor.data_ptr() == tensor.data_ptr()
        held.release.set()
        assert store.flush(10)
        assert held.items[_k(1).digest][0].data_ptr() == tensor.data_ptr()  # the slower tier wrote from it
    finally:
        store.close()


def test_an_owned_put_of_a_strided_tensor_is_copied_once(copies: list[int]) -> None:
    held = _HeldTier()
    held.release.set()
    store = _store(held)
    try:
        base = _t(64 * 32).reshape(64, 32)
        view = base.t()  # not contiguous: the tiers need contiguous bytes, so the store copies it, once
        store.put(_k(2), view, owned=True)
        assert copies == [view.data_ptr()]
        got = store.get(_k(2)).tensor
        assert got.is_contiguous() and torch.equal(got, view) and got.data_ptr() != base.data_ptr()
    finally:
        store.close()


def test_a_default_put_copies_once_and_survives_the_caller_reusing_its_buffer(copies: list[int]) -> None:
    held = _HeldTier()  # holds the writer: the slower tier's write is still queued when the caller reuses
    store = _store(held)
    try:
        buffer = _t(8192, seed=3)
        original = buffer.clone()
        store.put_many([(_k(3), buffer, None)])
        buffer.fill_(7)  # the caller reuses its buffer right after the call
        assert copies == [buffer.data_ptr()]
        assert torch.equal(store.tiers[0].get_many([_k(3)])[0].tensor, original)
        assert store.tiers[0].get_many([_k(3)])[0].tensor.data_ptr() != buffer.data_ptr()
        held.release.set()
        assert store.flush(10)
        assert torch.equal(held.items[_k(3).digest][1], original)
    finally:
        store.close()


@pytest.mark.parametrize("tensor", [
    _t(3000), _t(64 * 48).reshape(64, 48).t(), _t(2048, dtype=torch.bfloat16).reshape(32, 64)[:, ::2],
    torch.tensor([True, False, True]), torch.randn(8, dtype=torch.complex64)[::2],
    torch.randn(6, dtype=torch.complex128), torch.empty(0, 4), torch.tensor(2.5),
    torch.randn(5, dtype=torch.complex64).conj(), torch.arange(40, dtype=torch.int64).reshape(5, 8)[:, 1::3],
], ids=["fp16", "transposed", "bf16-strided", "bool", "complex64-strided", "complex128", "empty", "scalar",
        "conj", "int64-strided"])
def test_own_tensor_is_an_equal_contiguous_private_copy(tensor: torch.Tensor) -> None:
    out = tiered.own_tensor(tensor)
    assert out.is_contiguous() and out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor.resolve_conj())
    if tensor.numel():
        assert out.data_ptr() != tensor.data_ptr()


# ------------------------------------------------------------------------------------------------- redis
@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """(name, value) of every SET queued on a redis-py pipeline (the tier's batches, server or cluster)."""
    calls: list[tuple[str, Any]] = []
    real = redis.client.Pipeline.set

    def spy(self: Any, name: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((name, value))
        return real(self, name, value, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "set", spy)
    return calls


def _redis_store(url: str, part_size: str = "1KiB") -> TieredStore:
    return TieredStore(StoreConfig.from_dict({"tiers": [{"kind": "redis", "url": url, "part_size": part_size}]}))


@pytest.mark.parametrize("deployment", ["server", "cluster"])
def test_the_redis_tier_hands_redis_py_the_tensors_own_memory(request: pytest.FixtureRequest, deployment: str,
                                                              sent: list[tuple[str, Any]],
                                                              copies: list[int]) -> None:
    url = request.getfixturevalue("redis_url") if deployment == "server" else \
        request.getfixturevalue("redis_cluster").url
    store = _redis_store(url)
    try:
        tensor = _t(2000, seed=5)  # 4000 bytes: parts of 1 KiB, 1 KiB, 1 KiB and 928 B
        store.put(_k(4), tensor, owned=True)
        assert copies == []
        parts = [value for name, value in sent if ":" in name.rsplit("}", 1)[-1]]
        assert [memoryview(p).nbytes for p in parts] == [1024, 1024, 1024, 928]
        assert all(isinstance(p, memoryview) for p in parts)
        assert [_address(p) for p in parts] == [tensor.data_ptr() + 1024 * i for i in range(4)]
        got = store.get(_k(4))
        assert got is not None and torch.equal(got.tensor, tensor)
    finally:
        store.close()


def test_a_redis_get_copies_only_to_join_parts(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    joins: list[int] = []
    real = records.join_payload

    def counting(pieces: Sequence[Any]) -> tuple[memoryview, int]:
        joins.append(len(pieces))
        return real(pieces)

    monkeypatch.setattr(records, "join_payload", counting)
    store = _redis_store(redis_url, part_size="4KiB")
    try:
        small, large = _t(1500, seed=6), _t(9000, seed=7)  # 3000 bytes: one part; 18000 bytes: five
        store.put_many([(_k(5), small, None), (_k(6), large, None)])
        got = store.get_many([_k(5), _k(6)])
        assert torch.equal(got[0].tensor, small) and torch.equal(got[1].tensor, large)
        assert joins == [5]  # the one-part record's tensor is the reply itself; the other is joined once
    finally:
        store.close()


def test_a_default_put_to_redis_survives_the_caller_reusing_its_buffer(redis_url: str) -> None:
    config = StoreConfig.from_dict({"tiers": [{"kind": "memory", "capacity": "16MiB"},
                                              {"kind": "redis", "url": redis_url, "part_size": "1KiB"}]})
    store = TieredStore(config)
    redis_tier = store.tiers[1]
    release = threading.Event()
    real_put = redis_tier.put_many

    def held_put(items: Any) -> None:  # the Redis write waits until the caller has reused its buffer
        assert release.wait(30)
        real_put(items)

    redis_tier.put_many = held_put
    try:
        buffer = _t(5000, seed=7)
        original = buffer.clone()
        store.put(_k(6), buffer)
        buffer.zero_()
        release.set()
        assert store.flush(10)
        got = redis_tier.get_many([_k(6)])[0]
        assert got is not None and torch.equal(got.tensor, original)
    finally:
        release.set()
        store.close()


# -------------------------------------------------------------------------------------------- records
@pytest.mark.parametrize("sizes", [[0], [5], [records.JOIN_CHUNK + 3, 0, 17, 2 * records.JOIN_CHUNK],
                                   [1024] * 9], ids=["empty", "one-small", "chunks", "many"])
def test_join_payload_copies_once_and_checksums_what_it_copied(sizes: list[int]) -> None:
    rng = np.random.default_rng(1)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    buf, checksum = records.join_payload(pieces)
    whole = b"".join(pieces)
    assert buf.tobytes() == whole and not buf.readonly
    assert checksum == xxhash.xxh3_64_intdigest(whole)
    assert all(_address(buf) != _address(p) for p in pieces if p)


def test_decode_split_checks_a_checksum_computed_while_joining() -> None:
    key = _k(7)
    tensor = _t(4096, seed=8)
    enc = records.encode(key, tensor)
    payload = enc.payload.tobytes()
    pieces = [payload[:1000], payload[1000:5000], payload[5000:]]
    buf, checksum = records.join_payload(pieces)
    assert torch.equal(records.decode_split(enc.prefix, buf, key, payload_checksum=checksum).tensor, tensor)
    with pytest.raises(records.RecordError, match="checksum"):
        records.decode_split(enc.prefix, buf, key, payload_checksum=checksum ^ 1)
    damaged = bytearray(payload)
    damaged[4000] ^= 0xFF
    buf, checksum = records.join_payload([bytes(damaged)])
    with pytest.raises(records.RecordError, match="checksum"):
        records.decode_split(enc.prefix, buf, key, payload_checksum=checksum)


@pytest.mark.parametrize("deployment", ["server", "cluster"])
def test_the_tiers_connections_send_a_payload_as_it_is(request: pytest.FixtureRequest, deployment: str) -> None:
    """The packer the tier's connections use puts the payload's own memoryview among the buffers it writes
    to the socket (redis-py's hiredis packer would copy it into one bytes object per command); a small
    command is packed as redis-py packs it."""
    from vllm_tiercache.shared.store.tiers.redis.tier import make_client
    from vllm_tiercache.shared.store.tiers.redis.wire import BufferConnection, BufferPacker

    url = request.getfixturevalue("redis_url") if deployment == "server" else \
        request.getfixturevalue("redis_cluster").url
    config = StoreConfig.load({"tiers": [{"kind": "redis", "url": url}]}).tiers[0]
    client = make_client(config)
    try:
        if deployment == "server":
            kwargs = client.connection_pool.connection_kwargs
            assert client.connection_pool.connection_class is BufferConnection
        else:
            node = client.get_default_node()
            assert node.redis_connection.connection_pool.connection_class is BufferConnection
            kwargs = node.redis_connection.connection_pool.connection_kwargs
        assert "command_packer" not in kwargs  # the class supplies it per connection
        payload = memoryview(bytearray(range(256)) * 64)  # 16 KiB
        packed = BufferPacker().pack("SET", "k", payload)
        assert any(isinstance(b, memoryview) and _address(b) == _address(payload) for b in packed)
        assert b"".join(bytes(b) for b in packed).endswith(bytes(payload) + b"\r\n")
        assert b"".join(bytes(b) for b in BufferPacker().pack("GET", "k")) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
        client.set("tiercache:wire", payload)  # a real round trip through the tier's connection class
        assert client.get("tiercache:wire") == bytes(payload)
        client.delete("tiercache:wire")
    finally:
        client.close()
