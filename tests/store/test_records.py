"""Record format: round trips for every dtype, and every kind of damage is a RecordError."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.records import RecordError, decode, decode_split, encode

KEY = StoreKey("ns|test|a")
OTHER = StoreKey("ns|test|b")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, torch.float64]


def _tensor(dtype: torch.dtype, shape=(3, 5, 7)) -> torch.Tensor:
    return (torch.randn(shape) * 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype):
    t = _tensor(dtype)
    enc = encode(KEY, t, {"tokens": 7, "model": "x"})
    rec = decode(enc.tobytes(), KEY)
    assert rec.tensor.dtype == dtype and rec.tensor.shape == t.shape
    assert torch.equal(rec.tensor.view(torch.uint8), t.view(torch.uint8))
    assert rec.meta == {"tokens": 7, "model": "x"}


def test_layout_and_alignment():
    enc = encode(KEY, _tensor(torch.float32), None)
    raw = enc.tobytes()
    magic, version, hlen, _ = struct.unpack_from("<4sHII", raw)
    assert magic == b"TCRC" and version == records.VERSION
    assert len(enc.prefix) % records.ALIGN == 0 and len(enc.prefix) >= 14 + hlen
    header = records.decode_header(raw, KEY)
    assert header.key == KEY.digest and header.nbytes == 3 * 5 * 7 * 4


def test_no_copy_on_encode_or_decode():
    t = torch.arange(1024, dtype=torch.float32)
    enc = encode(KEY, t)
    assert torch.frombuffer(enc.payload, dtype=torch.uint8).data_ptr() == t.data_ptr()
    buf = bytearray(enc.tobytes())
    rec = decode(buf, KEY)
    buf[len(enc.prefix)] ^= 0xFF  # the decoded tensor is a view of the buffer, not a copy
    assert rec.tensor[0].item() != 0.0


def test_non_contiguous_scalar_and_empty():
    t = torch.randn(4, 6).t()
    assert torch.equal(decode(encode(KEY, t).tobytes(), KEY).tensor, t)
    s = torch.tensor(3.5, dtype=torch.bfloat16)
    assert decode(encode(KEY, s).tobytes(), KEY).tensor.item() == 3.5
    e = torch.empty(0, 8)
    assert decode(encode(KEY, e).tobytes(), KEY).tensor.shape == (0, 8)


def test_split_decode():
    t = _tensor(torch.float16)
    enc = encode(KEY, t)
    assert torch.equal(decode_split(enc.prefix, enc.payload.tobytes(), KEY).tensor, t)


def _damaged(mutate) -> bytes:
    raw = bytearray(encode(KEY, _tensor(torch.float32), {"m": 1}).tobytes())
    return bytes(mutate(raw))


def _set(raw: bytearray, pos: int, value: bytes) -> bytearray:
    raw[pos:pos + len(value)] = value
    return raw


@pytest.mark.parametrize(("name", "mutate", "match"), [
    ("magic", lambda r: _set(r, 0, b"XXXX"), "magic"),
    ("version", lambda r: _set(r, 4, struct.pack("<H", 99)), "version"),
    ("header bit flip", lambda r: _set(r, 20, bytes([r[20] ^ 1])), "header checksum"),
    ("payload bit flip", lambda r: _set(r, len(r) - 3, bytes([r[-3] ^ 0x10])), "payload checksum"),
    ("truncated payload", lambda r: r[:-1], "truncated"),
    ("truncated header", lambda r: r[:20], "truncated"),
    ("tiny", lambda r: r[:5], "truncated"),
    ("trailing bytes", lambda r: r + b"x", "oversized"),
    ("empty", lambda r: bytearray(), "truncated"),
])
def test_damage_is_detected(name, mutate, match):
    with pytest.raises(RecordError, match=match):
        decode(_damaged(mutate), KEY)


def test_swapped_key_detected():
    raw = encode(KEY, _tensor(torch.float32)).tobytes()
    with pytest.raises(RecordError, match="key mismatch"):
        decode(raw, OTHER)


def _forged(header: dict) -> bytes:
    import cbor2
    import xxhash

    hb = cbor2.dumps(header)
    fixed = struct.pack("<4sHII", b"TCRC", records.VERSION, len(hb), xxhash.xxh32_intdigest(hb))
    pre = fixed + hb
    pre += b"\0" * (records.payload_offset(len(hb)) - len(pre))
    return pre + b"\0" * 8


def test_forged_headers_rejected():
    import xxhash

    base = {"dtype": "float32", "shape": [2], "key": KEY.digest, "nbytes": 8,
            "checksum": xxhash.xxh3_64_intdigest(b"\0" * 8), "meta": {}}
    assert decode(_forged(base), KEY).tensor.tolist() == [0.0, 0.0]
    with pytest.raises(RecordError, match="unknown dtype"):
        decode(_forged({**base, "dtype": "Tensor"}), KEY)
    with pytest.raises(RecordError, match="nbytes"):
        decode(_forged({**base, "shape": [3]}), KEY)
    with pytest.raises(RecordError, match="malformed"):
        decode(_forged({k: v for k, v in base.items() if k != "meta"}), KEY)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_decode(data):
    with pytest.raises(RecordError):
        decode(data, KEY)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=7))
def test_any_single_bit_flip_is_detected(pos, bit):
    raw = bytearray(encode(KEY, torch.arange(200, dtype=torch.int16), {"a": [1, 2]}).tobytes())
    pos %= len(raw)
    header_end = 14 + struct.unpack_from("<I", raw, 6)[0]
    raw[pos] ^= 1 << bit
    if header_end <= pos < records.payload_offset(header_end - 14):
        return  # alignment padding carries no information
    with pytest.raises(RecordError):
        decode(bytes(raw), KEY)
