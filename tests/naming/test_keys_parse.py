"""`parse_key_text` reads back exactly what `kv_chunk_key` and `encoder_key` wrote, and nothing it should not.

Why it matters: `tiercache stats` groups and `tiercache evict` deletes records by these fields; a field
read wrongly would count records under another model or delete another tenant's records.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_tiercache.shared.naming.keys import (
    EncoderIdentity,
    KeyFields,
    KVModelIdentity,
    encoder_key,
    kv_chunk_key,
    parse_key_text,
)

IDENTITY = KVModelIdentity("org/model-7b", "bfloat16", 4, 2, 64, 32, "nhd", 2, 1)

#: Field text the builders accept: no "|", no control characters, not empty.
_FIELD = st.text(st.characters(blacklist_characters="|", blacklist_categories=("Cc",)), min_size=1, max_size=16)


@pytest.mark.parametrize("layer", [0, 3, None])
def test_kv_key_round_trip(layer: int | None) -> None:
    chunk = bytes(range(16))
    fields = parse_key_text(kv_chunk_key("ns", IDENTITY, chunk, layer).text)
    assert fields == KeyFields("ns", "kv", "org/model-7b", fingerprint=IDENTITY.fingerprint, tp_size=2, tp_rank=1,
                               chunk_hash=chunk, layer=layer)
    assert fields.complete


def test_sliding_window_group_key_round_trip_and_differs_from_full_attention() -> None:
    """A sliding-window group's record carries its group tag; the full-attention key is unchanged."""
    chunk = bytes(range(16))
    tagged = kv_chunk_key("ns", IDENTITY, chunk, 2, "sw1024+0b32")
    plain = kv_chunk_key("ns", IDENTITY, chunk, 2)
    assert tagged.text == plain.text + "|Gsw1024+0b32" and tagged.digest != plain.digest
    assert parse_key_text(tagged.text) == KeyFields("ns", "kv", "org/model-7b", fingerprint=IDENTITY.fingerprint,
                                                    tp_size=2, tp_rank=1, chunk_hash=chunk, layer=2,
                                                    group="sw1024+0b32")
    with pytest.raises(ValueError):
        kv_chunk_key("ns", IDENTITY, chunk, 2, "a|b")


def test_encoder_key_round_trip_keeps_the_whole_identifier() -> None:
    ident = EncoderIdentity("llava", "0123456789abcdef")
    for mm_hash in ("a" * 64, "lora:ad|apter:" + "b" * 64, "user-uuid|with|bars"):
        fields = parse_key_text(encoder_key("tenant", ident, mm_hash).text)
        assert fields == KeyFields("tenant", "enc", "llava", fingerprint="0123456789abcdef", mm_identifier=mm_hash)
        assert fields.complete


@given(ns=_FIELD, model=_FIELD, chunk=st.binary(min_size=1, max_size=40), layer=st.none() | st.integers(0, 3))
def test_property_kv_round_trip(ns: str, model: str, chunk: bytes, layer: int | None) -> None:
    ident = KVModelIdentity(model, "float16", 4, 1, 8, 16, "nhd", 1, 0)
    fields = parse_key_text(kv_chunk_key(ns, ident, chunk, layer).text)
    assert fields is not None
    assert (fields.namespace, fields.kind, fields.model, fields.chunk_hash, fields.layer) == (ns, "kv", model, chunk,
                                                                                              layer)


@given(ns=_FIELD, model=_FIELD, mm_hash=st.text(min_size=1, max_size=40))
def test_property_encoder_round_trip(ns: str, model: str, mm_hash: str) -> None:
    fields = parse_key_text(encoder_key(ns, EncoderIdentity(model, "f" * 16), mm_hash).text)
    assert fields == KeyFields(ns, "enc", model, fingerprint="f" * 16, mm_identifier=mm_hash)


@pytest.mark.parametrize("text", ["", "ns", "ns|kv", "|kv|model|fp|tp1r0|ab|L0"])
def test_texts_that_name_nothing(text: str) -> None:
    assert parse_key_text(text) is None


@pytest.mark.parametrize("text", [
    "bench|tiers|run1|7",  # the benchmarks' keys
    "ns|kv|model",  # too short for a KV key
    "ns|kv|model|fp|tpXr0|ab|L0",  # bad tensor-parallel field
    "ns|kv|model|fp|tp1r0|xyz|L0",  # chunk hash not hex
    "ns|kv|model|fp|tp1r0|ab|L0|extra",  # one field too many
    "ns|enc|model|fp",  # no identifier
])
def test_other_layouts_keep_namespace_kind_and_model(text: str) -> None:
    ns, kind, model = text.split("|")[:3]
    fields = parse_key_text(text)
    assert fields == KeyFields(ns, kind, model)
    assert not fields.complete
