"""A request's chunk names and record keys through the one naming call, pinned to the byte.

`KVNaming.request_names` (the scheduler) and `KVNaming.prompt_names` / `prompt_keys` (`tiercache
precompute docs`) apply every salt in one place. The expected values below were produced by the naming
path before that call existed (the scheduler mixing the LoRA adapter digest and the generation salt around
the naming's key functions): a record saved by an older build must keep its name.
"""

from __future__ import annotations

import dataclasses
import hashlib
from types import SimpleNamespace

import pytest

from vllm_tiercache.kvcache.groups import FULL, SLIDING, KVGroup, KVGroups
from vllm_tiercache.kvcache.naming import ChunkGeometry, KVNaming, adapter_chunk_hash, generation_chunk_hash
from vllm_tiercache.shared.naming.hashing import BlockExtraKeys, block_hashes
from vllm_tiercache.shared.naming.keys import KVModelIdentity
from vllm_tiercache.shared.store.api import StoreKey

IDENTITY = KVModelIdentity(model="pin", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_size=64, block_size=16,
                           layout="paged-bhnc", tp_size=2, tp_rank=0)
#: a hybrid model: full attention on layers 0 and 2, a 32-token sliding window on layers 1 and 3
GROUPS = KVGroups((KVGroup(0, FULL, 16, (0, 2)), KVGroup(1, SLIDING, 16, (1, 3), window=32)))
NAMING = KVNaming(namespace="pin", identities=(IDENTITY, dataclasses.replace(IDENTITY, tp_rank=1)),
                  geometry=ChunkGeometry(16, 64), hash_algo="sha256", kv_groups=GROUPS)
TOKENS = [(i * 7) % 250 + 3 for i in range(180)]  # 11 full blocks: chunks end at blocks 4, 8 and 11 (partial)
ADAPTER, SALT = "ab" * 16, bytes(range(16))

#: (adapter, generation) -> per chunk: (end block, name hex, sha256 of its record key texts in order)
EXPECTED = {
    (None, None): [
        (4, "b96615665cf7a997eb13095c52c6669794c0d95687bae812c397f00505e276fd",
         "aea77d9da315d8e5f0291f7b95eaeb4fa265eb0cefe7341db6035c5e32ce79e7"),
        (8, "c13f58a37864a299b544443cb84db97cd9ea527ed3e4d6f984acf02965e3afcf",
         "0a7e6a9d66960cb68698bb56d8a10b7ed3a088d55a086e750d430f65c211f5f2"),
        (11, "69cbe03ac853b7927f6a970b8bed92cac02b2e213b7f645494f08be01382616c",
         "5883f41ef0dbc7641e48fd779e6c8a4bd0f5542b10e27d1acf866f20da9aa829"),
    ],
    (ADAPTER, None): [
        (4, "f30359e269b4f3a6ef7f3722b43ffcc91e78c1e3ee71f4e3f976a08b61b358d0",
         "57efb9957ec44f43db7b3e1bcef80a56d406cf0110f4f44e9e5926cf63db2625"),
        (8, "8c345b4ebfa3084dfa71e93fff083a63e9692d379efae4f54952410d7dc60ab5",
         "0503e4edf0e1274eb9b03bf08e51e9d1b407e9a89d01a3aef795ba5b2e9966d7"),
        (11, "6cb6578e6b7847221dcd05f5ae4aee2c80ce6ae5b823683ffb32df514848a43a",
         "385697b2420a34d7fe48c4481e8b22f9f4e8c2a343417affb9ae0249ee4bd681"),
    ],
    (None, SALT): [
        (4, "7ead0e61295545f178742a382e37e62f34dce5a5646661b906310875bd12093a",
         "bf724251f35e67feb8184a2230ce95780d6bea737ed42b6f9a8be221e1c932ec"),
        (8, "d06e3f2d92ba312d8cbe86cb0a064c91538d44ac5ef868dd8a41cebc3f148860",
         "9a4b410570c325b4d54e425d41bb9f0c855da1d4cb0ef5be39758839800f7c0f"),
        (11, "65f39e2cd28159ba1c81e664328d3e1371efa63b020cecdeed5de5a01d6cf991",
         "d7c4a4c876edc908b42e81d55de322a427087108e3ce050b6651534c39272c32"),
    ],
    (ADAPTER, SALT): [
        (4, "94f8d43ca642573e91d0121e5164ac9702b96af5bd19582d9d416d9e760bb43c",
         "d35764a5fd38ade583e9d6aab32d0e72ecbd80ba8eeab25cbb62dd5f8baeef26"),
        (8, "85f87fce3a433dd620f9a33c0f75a19f653422ffe163e7f853deeecb80cbcacc",
         "69a3752d51da51a6e136ce192a37c67690346bbdac7c21911556dd534e05bd6f"),
        (11, "43d31763678be64672459c72363ae3d24d363ed5e698ef9e52e81d8d363b6b9d",
         "e95fef679e316292c8d5bcee48d8480e4c980ccc847cf2c2d0010613fb1fb805"),
    ],
}


def _texts_digest(keys: list[StoreKey]) -> str:
    return hashlib.sha256("\n".join(key.text for key in keys).encode()).hexdigest()


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """vLLM's block hashes of a LoRA request with a cache_salt (the extra keys vLLM hashes itself)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    extra = BlockExtraKeys(lora_name="a", lora_path="/a", cache_salt="tenant")
    return block_hashes(TOKENS, 16, "sha256", extra_keys_per_block=extra)


@pytest.mark.parametrize(("adapter", "generation"), list(EXPECTED))
def test_request_names_and_keys_are_those_of_the_old_path(
    hashes: list[bytes], adapter: str | None, generation: bytes | None
) -> None:
    names = NAMING.request_names(hashes, adapter=adapter, generation=generation)
    chunks = names.chunks(len(hashes))
    got = [(end, name.hex(), _texts_digest(names.record_keys(name))) for end, name in chunks]
    assert got == EXPECTED[(adapter, generation)]
    for end, name in chunks:
        keys = names.record_keys(name)
        assert names.probe_key(name) == keys[0]
        split = names.record_keys(name, GROUPS.full) + names.record_keys(name, GROUPS.sliding)
        assert sorted(key.text for key in split) == sorted(key.text for key in keys)
        assert names.name(end) == name


def test_every_salt_is_mixed_in_by_the_naming_in_one_order(hashes: list[bytes]) -> None:
    """The adapter digest first, then the generation salt: the order the records of earlier builds have."""
    names = NAMING.request_names(hashes, adapter=ADAPTER, generation=SALT)
    assert names.name(4) == generation_chunk_hash(adapter_chunk_hash(hashes[3], ADAPTER), SALT)
    assert names.in_generation(None).name(4) == adapter_chunk_hash(hashes[3], ADAPTER)
    assert NAMING.request_names(hashes).name(4) == hashes[3]  # no salt: vLLM's own hash


def test_the_salted_names_are_those_of_earlier_builds() -> None:
    """Every stored record is found by these bytes: the values the mixing gave when it lived in
    kvcache/adapters.py and shared/generations.py (a build that changes them loses every salted record)."""
    block_hash = bytes(range(32))
    assert adapter_chunk_hash(block_hash, "abc123").hex() == (
        "597500ee0dd5c6a76134137b97d1bcd49179eeffeb20bc43be0dc7aacdb67031")
    assert generation_chunk_hash(block_hash, b"0123456789abcdef").hex() == (
        "1cf8072826b46533401f4a6c2d1a36a0ba9d8cc03a566c2f770fb5fcac74f0cc")


def test_offline_prompt_keys_are_those_of_the_old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tiercache precompute docs` names a prompt with its cache_salt as the engine does, full attention only."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    naming = dataclasses.replace(NAMING, kv_groups=None)
    request = SimpleNamespace(prompt_token_ids=TOKENS, mm_features=None, cache_salt="tenant")
    keys, reusable = naming.prompt_keys(request)
    assert (reusable, len(keys)) == (176, 24)
    assert _texts_digest(keys) == "57b44e4650de728705c5030427f4e89d2146ad25693a1f084f881d75cf25f1e1"
    names = naming.prompt_names(request)
    assert list(names.block_hashes) == naming.prompt_block_hashes(request)
    assert keys == [key for end in (4, 8, 11) for key in names.record_keys(names.name(end))]
