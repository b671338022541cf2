"""The key ring and the sealer alone: what opens, what does not, and that no secret is ever shown.

Why: a sealed record must open only for its key, its tenant and its place (the key it is stored under,
its header); everything else is a rejection with a reason the store turns into a counted miss.
"""

from __future__ import annotations

import base64
import os

import pytest
import torch

from tests.store.sealing.rings import new_key, shares_window, write_ring
from vllm_tiercache.shared.store.api import Record, StoreKey
from vllm_tiercache.shared.store.sealing.ring import KeyRing, load_ring, parse_ring
from vllm_tiercache.shared.store.sealing.sealer import KEY_TAG_PREFIX, SEAL_KEY, Sealer, SealRejected
from vllm_tiercache.shared.store.tier_config import ConfigError


def ring(current: str = "k1", **more: bytes) -> KeyRing:
    keys = {current: os.urandom(32), **more}
    return KeyRing(current, keys)


def test_seal_then_open_gives_the_tensor_and_meta_back_for_every_dtype() -> None:
    sealer = Sealer(ring())
    key = StoreKey("kv|a", tenant="tenant-a")
    for tensor in (torch.randn(3, 5), torch.randn(2, 4).to(torch.bfloat16), torch.arange(7, dtype=torch.int64),
                   torch.empty(0, 4), torch.tensor(1.5)):
        ct, meta = sealer.seal(key, tensor, {"tags": ["doc:1"], "layer": 3})
        assert ct.dtype == torch.uint8 and ct.numel() == tensor.numel() * tensor.element_size() + 16
        assert meta["tags"] == ["doc:1", KEY_TAG_PREFIX + "k1"]
        opened = sealer.open(key, Record(ct, meta))
        assert opened.tensor.dtype == tensor.dtype and torch.equal(opened.tensor, tensor)
        assert opened.meta == {"tags": ["doc:1"], "layer": 3}


def test_the_ciphertext_shares_no_window_with_the_plaintext() -> None:
    tensor = torch.randn(64, 64)
    ct, _ = Sealer(ring()).seal(StoreKey("kv|a"), tensor, None)
    plain = tensor.numpy().tobytes()
    assert shares_window(plain, plain[100:400])  # the helper finds what is there
    assert not shares_window(plain, ct.numpy().tobytes())


def test_another_tenant_or_no_salt_does_not_open_a_tenants_record() -> None:
    sealer = Sealer(ring())
    ct, meta = sealer.seal(StoreKey("kv|a", tenant="A"), torch.randn(16), {})
    for other in ("B", None, ""):
        with pytest.raises(SealRejected) as exc:
            sealer.open(StoreKey("kv|a", tenant=other), Record(ct, meta))
        assert exc.value.reason == "bad_tag" and exc.value.damaged
    ct, meta = sealer.seal(StoreKey("kv|a"), torch.randn(16), {})
    with pytest.raises(SealRejected):
        sealer.open(StoreKey("kv|a", tenant="A"), Record(ct, meta))


def test_a_payload_moved_under_another_key_or_a_header_edit_does_not_open() -> None:
    sealer = Sealer(ring())
    ct, meta = sealer.seal(StoreKey("kv|a"), torch.randn(4, 4), {"tags": ["doc:1"]})
    with pytest.raises(SealRejected, match="bad_tag"):
        sealer.open(StoreKey("kv|b"), Record(ct, meta))
    edits = [
        {**meta, "tags": ["doc:2", KEY_TAG_PREFIX + "k1"]},
        {**meta, SEAL_KEY: {**meta[SEAL_KEY], "shape": [16]}},
        {**meta, SEAL_KEY: {**meta[SEAL_KEY], "dtype": "int32"}},
        {**meta, "extra": 1},
    ]
    for edited in edits:
        with pytest.raises(SealRejected, match="bad_tag"):
            sealer.open(StoreKey("kv|a"), Record(ct, edited))
    flipped = ct.clone()
    flipped[5] ^= 1
    with pytest.raises(SealRejected, match="bad_tag"):
        sealer.open(StoreKey("kv|a"), Record(flipped, meta))


@pytest.mark.parametrize("cut", [1, 16, 17, 80])
def test_a_truncated_ciphertext_is_rejected_as_damaged(cut: int) -> None:
    sealer = Sealer(ring())
    ct, meta = sealer.seal(StoreKey("kv|a"), torch.randn(20), {})
    with pytest.raises(SealRejected) as exc:
        sealer.open(StoreKey("kv|a"), Record(ct[:-cut].clone(), meta))
    assert exc.value.reason == "truncated" and exc.value.damaged


def test_malformed_sealing_entries_are_damaged_plaintext_is_left() -> None:
    sealer = Sealer(ring())
    ct, meta = sealer.seal(StoreKey("kv|a"), torch.randn(20), {})
    head = meta[SEAL_KEY]
    for bad in ({**head, "nonce": b"short"}, {**head, "dtype": "nope"}, {**head, "shape": [-1]},
                {**head, "v": 2}, {**head, "shape": "x"}, {k: v for k, v in head.items() if k != "nonce"}):
        with pytest.raises(SealRejected) as exc:
            sealer.open(StoreKey("kv|a"), Record(ct, {**meta, SEAL_KEY: bad}))
        assert exc.value.reason == "malformed" and exc.value.damaged
    with pytest.raises(SealRejected) as exc:
        sealer.open(StoreKey("kv|a"), Record(torch.randn(20), {}))
    assert exc.value.reason == "unsealed" and not exc.value.damaged


def test_rotation_keeps_old_records_readable_and_retirement_makes_them_misses() -> None:
    k1, k2 = os.urandom(32), os.urandom(32)
    old = Sealer(KeyRing("k1", {"k1": k1}))
    ct, meta = old.seal(StoreKey("kv|a", tenant="A"), torch.randn(8), {})
    rotated = Sealer(KeyRing("k2", {"k1": k1, "k2": k2}))
    assert torch.equal(rotated.open(StoreKey("kv|a", tenant="A"), Record(ct, meta)).tensor,
                       old.open(StoreKey("kv|a", tenant="A"), Record(ct, meta)).tensor)
    assert rotated.seal(StoreKey("kv|b"), torch.randn(2), {})[1][SEAL_KEY]["kid"] == "k2"
    retired = Sealer(KeyRing("k2", {"k2": k2}, frozenset({"k1"})))
    with pytest.raises(SealRejected) as exc:
        retired.open(StoreKey("kv|a", tenant="A"), Record(ct, meta))
    assert exc.value.reason == "retired_key" and not exc.value.damaged
    with pytest.raises(SealRejected) as exc:
        Sealer(KeyRing("k3", {"k3": k2})).open(StoreKey("kv|a", tenant="A"), Record(ct, meta))
    assert exc.value.reason == "unknown_key" and not exc.value.damaged


def test_a_ring_file_and_an_env_ring_load(tmp_path, monkeypatch) -> None:
    a, b = new_key(), new_key()
    path = write_ring(tmp_path / "ring.json", "b", {"a": a, "b": b}, retired=["old"])
    loaded = load_ring(str(path))
    assert loaded.current == "b" and loaded.keys["a"] == base64.b64decode(a) and loaded.retired == {"old"}
    monkeypatch.setenv("TC_RING", path.read_text())
    assert load_ring("env:TC_RING").keys == loaded.keys


@pytest.mark.parametrize("text, says", [
    ("not json", "not valid JSON"),
    ("[]", "not a JSON object"),
    ('{"current": "a", "keys": {}}', "no keys"),
    ('{"current": "b", "keys": {"a": "KEY"}}', "current does not name"),
    ('{"current": "a", "keys": {"a": "c2hvcnQ="}}', "is 5 bytes, not 32"),
    ('{"current": "a", "keys": {"a": "not base64!"}}', "not valid base64"),
    ('{"current": "a", "keys": {"a b": "KEY"}}', "not a valid id"),
    ('{"current": "a", "keys": {"a": "KEY"}, "retired": ["a"]}', "also listed as retired"),
    ('{"current": "a", "keys": {"a": "KEY"}, "extra": 1}', "unknown field"),
])
def test_a_bad_ring_is_one_line_naming_the_setting_and_never_a_key(text: str, says: str) -> None:
    key = new_key()
    with pytest.raises(ConfigError) as exc:
        parse_ring(text.replace("KEY", key), "/etc/ring.json")
    message = str(exc.value)
    assert message.startswith("encryption.ring: ") and says in message and "\n" not in message
    assert key not in message and "/etc/ring.json" in message


def test_an_unreadable_ring_file_or_missing_env_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TC_NO_RING", raising=False)
    with pytest.raises(ConfigError, match=r"^encryption.ring: cannot read the ring file .*missing"):
        load_ring(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"^encryption.ring: environment variable 'TC_NO_RING' is not set"):
        load_ring("env:TC_NO_RING")


def test_neither_ring_nor_sealer_shows_a_key() -> None:
    key = os.urandom(32)
    shown = repr(Sealer(KeyRing("k1", {"k1": key})))
    assert "k1" in shown and key.hex() not in shown and base64.b64encode(key).decode() not in shown
    assert repr(StoreKey("kv|a", tenant="secret-salt")).count("secret-salt") == 0


def test_open_into_the_callers_pieces_lands_the_plaintext_there() -> None:
    sealer = Sealer(ring())
    key, tensor = StoreKey("kv|a", tenant="A"), torch.randn(6, 16).to(torch.bfloat16)
    ct, meta = sealer.seal(key, tensor, {"tags": ["doc:1"]})
    destination = torch.zeros(6, 16, dtype=torch.bfloat16)
    view = memoryview(destination.view(torch.uint8).numpy()).cast("B")
    opened = sealer.open(key, Record(ct, meta), [view[:64], view[64:65], view[65:]])
    assert opened.in_place and torch.equal(destination, tensor) and opened.meta == {"tags": ["doc:1"]}
    other = sealer.open(key, Record(ct, meta), [view[:100]])  # pieces of another size: an ordinary record
    assert not other.in_place and torch.equal(other.tensor, tensor)
    with pytest.raises(SealRejected, match="bad_tag"):
        sealer.open(StoreKey("kv|a", tenant="B"), Record(ct, meta), [view])
