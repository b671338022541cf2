"""shared.naming.keys: a key changes exactly when the cached bytes would, and is the same in every process."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

from tests.support.hashing_helpers import chunk_hashes
from vllm_tiercache.shared.naming.hashing import BlockExtraKeys, block_hashes
from vllm_tiercache.shared.naming.keys import (
    EncoderIdentity,
    KVModelIdentity,
    encoder_key,
    kv_chunk_key,
    validate_field,
)
from vllm_tiercache.shared.naming.weights_identity import digest_directory
from vllm_tiercache.shared.store.api import KEY_DIGEST_SIZE, StoreKey

REPO = Path(__file__).resolve().parents[2]

IDENTITY = KVModelIdentity("m", "bfloat16", 2, 2, 64, 32, "nhd", 1, 0)
#: Pinned: a fingerprint that drifts (new field, new encoding) would orphan every cached chunk.
IDENTITY_FINGERPRINT = "99fb276c7f55a263"

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 259,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def make_vllm_config(model_dir: Path, cache_dtype: str = "auto", dtype: str = "bfloat16") -> VllmConfig:
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype)
    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=32, cache_dtype=cache_dtype),  # type: ignore[arg-type]
        parallel_config=ParallelConfig(),
    )


# ---------------------------------------------------------------------------------------------- identity


def test_identity_from_real_vllm_config(tiny_model_dir: Path) -> None:
    ident = KVModelIdentity.from_vllm_config(make_vllm_config(tiny_model_dir), layout="nhd", tp_rank=0)
    weights = digest_directory(tiny_model_dir.resolve())[0]
    # The model is named by its directory and its weights by their content (weights rewritten in place never
    # meet the old weights' records).
    assert ident == KVModelIdentity(tiny_model_dir.name, "bfloat16", 2, 2, 64, 32, "nhd", 1, 0,
                                    weights=f"files:{weights}")
    fp8 = KVModelIdentity.from_vllm_config(make_vllm_config(tiny_model_dir, "fp8"), layout="nhd", tp_rank=0)
    assert fp8.dtype == "fp8" and fp8.fingerprint != ident.fingerprint
    fp16 = KVModelIdentity.from_vllm_config(
        make_vllm_config(tiny_model_dir, dtype="float16"), layout="nhd", tp_rank=0
    )
    assert fp16.dtype == "float16" and fp16.fingerprint != ident.fingerprint


def test_fingerprint_is_pinned_and_short() -> None:
    assert IDENTITY.fingerprint == IDENTITY_FINGERPRINT
    assert len(IDENTITY.fingerprint) == 16 and int(IDENTITY.fingerprint, 16) >= 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "float16"),
        ("num_layers", 3),
        ("num_kv_heads", 1),
        ("head_size", 128),
        ("block_size", 16),
        ("layout", "hnd"),
        ("revision", "abc123"),
        ("quantization", "fp8"),
    ],
)
def test_fingerprint_covers_every_kv_field(field: str, value: Any) -> None:
    assert dataclasses.replace(IDENTITY, **{field: value}).fingerprint != IDENTITY.fingerprint


def test_fingerprint_ignores_what_the_key_text_carries() -> None:
    other = dataclasses.replace(IDENTITY, model="other", tp_size=2, tp_rank=1)
    assert other.fingerprint == IDENTITY.fingerprint


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": "a|b"},
        {"model": "a\nb"},
        {"model": ""},
        {"num_layers": 0},
        {"tp_rank": 1},
        {"layout": "x|y"},
    ],
)
def test_identity_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(IDENTITY, **kwargs)


# ---------------------------------------------------------------------------------------------- kv keys


def test_kv_chunk_key_text_and_digest() -> None:
    h = bytes(range(32))
    key = kv_chunk_key("prod", IDENTITY, h, 1)
    assert isinstance(key, StoreKey)
    assert key.text == f"prod|kv|m|{IDENTITY_FINGERPRINT}|tp1r0|{h.hex()}|L1"
    assert key.digest == hashlib.blake2b(key.text.encode(), digest_size=KEY_DIGEST_SIZE).digest()
    assert key.namespace == "prod"
    assert kv_chunk_key("prod", IDENTITY, h, None).text.endswith("|Lall")
    assert kv_chunk_key("prod", IDENTITY, h, 0) != key
    assert kv_chunk_key("prod", dataclasses.replace(IDENTITY, tp_size=2, tp_rank=1), h, 1) != key


@pytest.mark.parametrize("namespace", ["a|b", "|", "tab\there", "nl\n", "del\x7f", ""])
def test_bad_namespace_is_rejected(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        kv_chunk_key(namespace, IDENTITY, b"\x01" * 16, 0)
    with pytest.raises(ValueError, match="namespace"):
        encoder_key(namespace, EncoderIdentity("m", "ff"), "h")


@pytest.mark.parametrize("layer", [-1, 2, True, "0"])
def test_bad_layer_is_rejected(layer: Any) -> None:
    with pytest.raises(ValueError, match="layer"):
        kv_chunk_key("ns", IDENTITY, b"\x01" * 16, layer)


def test_empty_chunk_hash_is_rejected() -> None:
    with pytest.raises(ValueError, match="chunk_hash"):
        kv_chunk_key("ns", IDENTITY, b"", 0)


def test_validate_field_messages() -> None:
    assert validate_field("namespace", "ok-ns.1") == "ok-ns.1"
    with pytest.raises(ValueError, match="separates the fields"):
        validate_field("namespace", "a|b")
    with pytest.raises(ValueError, match="control characters"):
        validate_field("model", "a\x00b")


@given(ns=st.text(min_size=1, max_size=12), model=st.text(min_size=1, max_size=12))
def test_property_valid_fields_never_alias(ns: str, model: str) -> None:
    """Any accepted (namespace, model) pair can be read back unambiguously from the key text."""
    try:
        ident = dataclasses.replace(IDENTITY, model=model)
        key = kv_chunk_key(ns, ident, b"\xab" * 16, 0)
    except ValueError:
        assert "|" in ns + model or any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in ns + model)
        return
    fields = key.text.split("|")
    assert fields[0] == ns and fields[2] == model and len(fields) == 7


def _chunk_keys(extras: BlockExtraKeys, tokens: list[int]) -> list[StoreKey]:
    hashes = block_hashes(tokens, 16, "sha256", extra_keys_per_block=extras)
    ident = dataclasses.replace(IDENTITY, block_size=16)
    return [kv_chunk_key("ns", ident, h, None) for h in chunk_hashes(hashes, 2)]


def test_salt_lora_and_image_give_different_kv_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = [9] * 64
    image = ((4, 20, "i" * 64),)
    base = _chunk_keys(BlockExtraKeys(mm_inputs=image), tokens)
    variants = [
        _chunk_keys(BlockExtraKeys(mm_inputs=image, cache_salt="s1"), tokens),
        _chunk_keys(BlockExtraKeys(mm_inputs=image, cache_salt="s2"), tokens),
        _chunk_keys(BlockExtraKeys(mm_inputs=image, lora_name="l1", lora_path="/l"), tokens),
        _chunk_keys(BlockExtraKeys(mm_inputs=image, lora_name="l2", lora_path="/l"), tokens),
        _chunk_keys(BlockExtraKeys(mm_inputs=((4, 20, "j" * 64),)), tokens),
    ]
    all_keys = [base, *variants]
    for i, a in enumerate(all_keys):
        for b in all_keys[i + 1 :]:
            assert not set(a) & set(b)


# ---------------------------------------------------------------------------------------------- encoder


def test_encoder_identity_from_real_vllm_config(tiny_model_dir: Path) -> None:
    a = EncoderIdentity.from_vllm_config(make_vllm_config(tiny_model_dir))
    b = EncoderIdentity.from_vllm_config(make_vllm_config(tiny_model_dir))
    assert a == b and a.model == tiny_model_dir.name and len(a.encoder_fingerprint) == 16
    fp16 = EncoderIdentity.from_vllm_config(make_vllm_config(tiny_model_dir, dtype="float16"))
    assert fp16.encoder_fingerprint != a.encoder_fingerprint


def test_encoder_key_carries_the_full_identifier() -> None:
    ident = EncoderIdentity("m", "0123456789abcdef")
    mm_hash = "my-lora:" + "f" * 64
    key = encoder_key("ns", ident, mm_hash)
    assert key.text == f"ns|enc|m|0123456789abcdef|{mm_hash}"
    assert encoder_key("ns", ident, "f" * 64) != key  # same image without the LoRA prefix
    assert encoder_key("ns", ident, "f" * 63 + "e") != encoder_key("ns", ident, "f" * 64)
    with pytest.raises(ValueError, match="mm_hash"):
        encoder_key("ns", ident, "")
    with pytest.raises(ValueError, match="model"):
        EncoderIdentity("a|b", "ff")


# ---------------------------------------------------------------------------------------------- processes

_CHILD = """
import json
from tests.support.hashing_helpers import chunk_hashes
from vllm_tiercache.shared.naming.hashing import HASH_ALGOS, BlockExtraKeys, block_hashes
from vllm_tiercache.shared.naming.keys import KVModelIdentity, kv_chunk_key
ident = KVModelIdentity("m", "bfloat16", 2, 2, 64, 16, "nhd", 1, 0)
extras = BlockExtraKeys(mm_inputs=((3, 30, "img"),), lora_name="l", lora_path="/l", cache_salt="s")
out = {}
for algo in HASH_ALGOS:
    hashes = block_hashes(list(range(100)), 16, algo, extra_keys_per_block=extras)
    out[algo] = [kv_chunk_key("ns", ident, h, 1).hex for h in chunk_hashes(hashes, 4)]
print(json.dumps(out))
"""


def test_two_processes_compute_the_same_keys() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(PYTHONPATH=str(REPO), PYTHONHASHSEED="2024")
    outs = [
        subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
        )
        for _ in range(2)
    ]
    for r in outs:
        assert r.returncode == 0, r.stderr
    a, b = (json.loads(r.stdout) for r in outs)
    assert a == b and len(a) == 4 and all(len(v) == 2 for v in a.values())
    assert len({k for v in a.values() for k in v}) == 8  # algorithms never share keys
