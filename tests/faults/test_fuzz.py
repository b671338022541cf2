"""Fuzzing the two parsers that take outside input: the record parser (bytes from disk or Redis, maybe
from another version, host or attacker) and the store config loader (user JSON/YAML).

Why: a cache must turn bad bytes into a clean miss (`RecordError`) and bad config into a clear
`ConfigError` naming the field, the value and what is allowed; any other exception would fail a
request or an engine start, and a hang would stall a worker. Hypothesis runs derandomized (the same
examples on every run, so CI is deterministic) with modest example counts; the deadline is generous
because it only has to catch a hang, not measure speed on a busy CI machine.
"""

from __future__ import annotations

import datetime
import struct
from typing import Any

import cbor2
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_tiercache.eccache.options import ECConnectorOptions
from vllm_tiercache.kvcache.options import KVConnectorOptions
from vllm_tiercache.shared.config import POLICIES, REDIS_SCHEMES, TIER_KINDS, ConfigError, StoreConfig
from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import StoreKey


def _parse_every_part(raw: dict[str, Any]) -> None:
    """Each owner of the one config dict validates its keys: the store, the KV and the EC connector."""
    StoreConfig.from_dict(raw)
    KVConnectorOptions.from_dict(raw)
    ECConnectorOptions.from_dict(raw)

FUZZ = settings(derandomize=True, max_examples=300, deadline=datetime.timedelta(seconds=5),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
KEY = StoreKey("fuzz|kv|m|fp|tp1r0|0|L0")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int64, torch.bool,
          torch.float64, torch.int32]
#: dtype names a forged header may carry: real ones torch can and cannot view bytes as, and junk.
DTYPE_NAMES = [str(d).removeprefix("torch.") for d in (*DTYPES, torch.qint8, torch.quint8, torch.complex64,
                                                      torch.float8_e4m3fn, torch.uint16)] + \
    ["Tensor", "nn", "__class__", "float", "", "float32 ", "cuda"]


def _check_decoded(rec: records.Record, buf: bytes) -> None:
    """A record the parser accepted must be internally consistent (its bytes are the checked payload)."""
    header = records.decode_header(buf, KEY)
    assert rec.tensor.dtype == header.dtype and tuple(rec.tensor.shape) == header.shape
    assert rec.tensor.numel() * rec.tensor.element_size() == header.nbytes == len(buf) - header.payload_offset


# ------------------------------------------------------------------------------------------ records
@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_are_a_clean_miss(buf: bytes) -> None:
    for data in (buf, records.MAGIC + buf, records.MAGIC + struct.pack("<H", records.VERSION) + buf):
        try:
            rec = records.decode(data, KEY)
        except records.RecordError:
            continue
        _check_decoded(rec, data)


@st.composite
def _valid_record(draw: st.DrawFn) -> bytes:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    n = 1
    for s in shape:
        n *= s
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if n else \
        torch.empty(shape, dtype=dtype)
    meta = draw(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3))
    return records.encode(KEY, tensor, meta).tobytes()


@FUZZ
@given(_valid_record(), st.data())
def test_any_change_to_a_valid_record_is_detected(buf: bytes, data: st.DataObject) -> None:
    """Flipped bytes anywhere (header, padding, payload), truncation or appended bytes: never accepted."""
    assert records.decode(buf, KEY) is not None
    how = data.draw(st.sampled_from(["flip", "truncate", "append", "splice"]))
    mutated = bytearray(buf)
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            mutated[data.draw(st.integers(0, len(buf) - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        mutated = mutated[:data.draw(st.integers(0, len(buf) - 1))]
    elif how == "append":
        mutated += data.draw(st.binary(min_size=1, max_size=64))
    else:
        at = data.draw(st.integers(0, len(buf)))
        mutated[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    if bytes(mutated) == buf:
        return
    with pytest.raises(records.RecordError):
        records.decode(bytes(mutated), KEY)


_json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
_json = st.recursive(_json_scalars, lambda kids: st.lists(kids, max_size=4) |
                     st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)


@st.composite
def _forged_record(draw: st.DrawFn) -> bytes:
    """A record whose header checksum is right (so the cbor header is parsed) but whose fields are
    anything: the parser's field checks are then all that stands between the bytes and a tensor."""
    header: dict[Any, Any] = {
        "dtype": draw(st.sampled_from(DTYPE_NAMES) | _json),
        "shape": draw(st.lists(st.integers(-3, 1 << 70) | st.sampled_from([2, 4, 0]), max_size=70)
                      | st.lists(_json_scalars, max_size=4) | _json),
        "key": draw(st.just(KEY.digest) | st.binary(max_size=20) | _json),
        "nbytes": draw(st.integers(-1, 1 << 70) | _json),
        "checksum": draw(st.integers(0, (1 << 64) - 1) | _json),
        "meta": draw(st.dictionaries(st.text(max_size=4), _json, max_size=3) | _json),
    }
    for name in draw(st.lists(st.sampled_from(sorted(header)), max_size=2, unique=True)):
        del header[name]
    payload = draw(st.binary(max_size=512))
    if draw(st.booleans()):  # make nbytes and the payload checksum agree with the payload
        header["nbytes"] = len(payload)
        header["checksum"] = xxhash.xxh3_64_intdigest(payload)
    try:
        hbytes = cbor2.dumps(header)
    except (ValueError, TypeError, OverflowError):
        hbytes = cbor2.dumps({})
    fixed = struct.pack("<4sHII", records.MAGIC, records.VERSION, len(hbytes), xxhash.xxh32_intdigest(hbytes))
    pad = records.payload_offset(len(hbytes)) - records.FIXED_SIZE - len(hbytes)
    return fixed + hbytes + b"\0" * pad + payload


@FUZZ
@given(_forged_record())
def test_forged_headers_with_valid_checksums_are_a_clean_miss(buf: bytes) -> None:
    try:
        rec = records.decode(buf, KEY)
    except records.RecordError:
        pass
    else:
        _check_decoded(rec, buf)
    offset = records.payload_start(buf) or len(buf)
    try:
        records.decode_split(buf[:offset], buf[offset:], KEY)
    except records.RecordError:
        pass


@pytest.mark.parametrize(("dtype", "shape", "why"), [
    ("float16", [1e400], "malformed header"),
    ("float16", [1] * 65 + [2], "rank 66"),
    ("float16", [-2, -2], "negative"),
])
def test_forged_header_regressions(dtype: str, shape: list[Any], why: str) -> None:
    """Headers that once escaped as OverflowError (int(inf)) or would reach torch with 66 dimensions."""
    payload = b"\0" * 4
    header = {"dtype": dtype, "shape": shape, "key": KEY.digest, "nbytes": 4,
              "checksum": xxhash.xxh3_64_intdigest(payload), "meta": {}}
    hbytes = cbor2.dumps(header)
    fixed = struct.pack("<4sHII", records.MAGIC, records.VERSION, len(hbytes), xxhash.xxh32_intdigest(hbytes))
    buf = fixed + hbytes + b"\0" * (records.payload_offset(len(hbytes)) - len(fixed) - len(hbytes)) + payload
    with pytest.raises(records.RecordError, match=why):
        records.decode(buf, KEY)


# ------------------------------------------------------------------------------------------- config
@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TIERCACHE_CONFIG", "TIERCACHE_NAMESPACE", "TIERCACHE_CHUNK_SIZE", "TIERCACHE_MEMORY_CAPACITY",
                 "TIERCACHE_DISK_CAPACITY"):
        monkeypatch.delenv(name, raising=False)


def _assert_clear(exc: ConfigError) -> str:
    msg = str(exc)
    assert msg and ":" in msg, msg
    assert "allowed" in msg or "known keys" in msg, msg
    return msg


_TIER_KEYS = ["kind", "capacity", "policy", "path", "fsync", "url", "password", "ttl_s", "part_size",
              "timeout_s", "retry_after_s", "key_prefix", "ssl_ca_certs", "size"]
_tier = st.dictionaries(st.sampled_from(_TIER_KEYS) | st.text(max_size=6), _json, max_size=5) | \
    st.fixed_dictionaries({"kind": st.sampled_from([*TIER_KINDS, "ssd"])},
                          optional={k: _json for k in _TIER_KEYS[1:]}) | _json
_TOP = ["namespace", "chunk_size", "save_partial_chunks", "save_decode", "write_queue_size",
        "encoder_cache_policy", "tiers", "extra", "x_note", "config_file", "bogus"]
_top = st.dictionaries(st.sampled_from(_TOP) | st.text(max_size=6),
                       _json | st.lists(_tier, max_size=3), max_size=5)


@FUZZ
@given(_top)
def test_arbitrary_configs_are_valid_or_a_clear_error(raw: dict[str, Any]) -> None:
    try:
        _parse_every_part(raw)
    except ConfigError as exc:
        _assert_clear(exc)


VALID: dict[str, Any] = {
    "namespace": "prod", "chunk_size": 256, "save_partial_chunks": True, "save_decode": False,
    "write_queue_size": 64, "encoder_cache_policy": "lfu",
    "tiers": [{"kind": "memory", "capacity": "1GiB", "policy": "lru"},
              {"kind": "disk", "path": "/tmp/tiercache-fuzz", "capacity": "2GiB", "fsync": True, "policy": "lru"},
              {"kind": "redis", "url": "rediss://cache:6380/0", "password": "pw", "ttl_s": 60,
               "part_size": "8MiB", "timeout_s": 1.0, "retry_after_s": 5, "key_prefix": "tc:",
               "ssl_ca_certs": "/etc/ca.pem", "policy": "lru"}],
}
_FIELDS = [(None, k) for k in VALID if k != "tiers"] + [(i, k) for i, t in enumerate(VALID["tiers"]) for k in t]


@FUZZ
@given(st.sampled_from(_FIELDS), _json)
def test_one_bad_field_names_its_path_and_value(field: tuple[int | None, str], value: Any) -> None:
    """A valid config with one field replaced: valid, or an error that starts with that field's path and
    shows the value (URLs with credentials show them masked)."""
    tier, name = field
    raw: dict[str, Any] = {**VALID, "tiers": [dict(t) for t in VALID["tiers"]]}
    if tier is None:
        raw[name] = value
        path = name
    else:
        raw["tiers"][tier][name] = value
        path = f"tiers[{tier}].{name}"
    try:
        _parse_every_part(raw)
    except ConfigError as exc:
        msg = _assert_clear(exc)
        if name == "kind":  # another kind: the first key it does not know is the error
            assert msg.startswith(f"tiers[{tier}]."), msg
            return
        assert msg.startswith(f"{path}:"), msg
        if not (name == "url" and "@" in str(value)):
            assert repr(value) in msg, msg


# One row per field: (config, field path, value as shown, a piece of the allowed values).
_R = "redis://cache:6379/0"
BAD_CONFIGS = [
    ({"namespace": "a|b"}, "namespace", "'a|b'", "without '|'"),
    ({"namespace": 7}, "namespace", "7", "non-empty string"),
    ({"chunk_size": 24}, "chunk_size", "24", "multiple of 16"),
    ({"chunk_size": "256"}, "chunk_size", "'256'", "multiple of 16"),
    ({"save_partial_chunks": "no"}, "save_partial_chunks", "'no'", "true or false"),
    ({"save_decode": None}, "save_decode", "None", "true or false"),
    ({"write_queue_size": -1}, "write_queue_size", "-1", "positive int"),
    ({"encoder_cache_policy": 3}, "encoder_cache_policy", "3", "or null"),
    ({"tiers": {"kind": "memory"}}, "tiers", "{'kind': 'memory'}", "non-empty list"),
    ({"tiers": ["memory"]}, "tiers[0]", "'memory'", "mapping with a 'kind'"),
    ({"tiers": [{"kind": "nvme"}]}, "tiers[0].kind", "'nvme'", ", ".join(TIER_KINDS)),
    ({"tiers": [{"kind": "memory", "policy": "fifo-ish"}]}, "tiers[0].policy", "'fifo-ish'", POLICIES[0]),
    ({"tiers": [{"kind": "memory", "capacity": "12 parsecs"}]}, "tiers[0].capacity", "'12 parsecs'", "8GiB"),
    ({"tiers": [{"kind": "memory", "capacity": -5}]}, "tiers[0].capacity", "-5", "non-negative"),
    ({"tiers": [{"kind": "memory", "capacity": "9" * 400 + "GiB"}]}, "tiers[0].capacity", "'999", "8GiB"),
    ({"tiers": [{"kind": "disk", "path": ""}]}, "tiers[0].path", "''", "non-empty string"),
    ({"tiers": [{"kind": "disk", "capacity": True}]}, "tiers[0].capacity", "True", "8GiB"),
    ({"tiers": [{"kind": "disk", "fsync": 0}]}, "tiers[0].fsync", "0", "true or false"),
    ({"tiers": [{"kind": "disk", "path": "/x"}, {"kind": "gds", "path": "/x"}]}, "tiers[1].path", "'/x'",
     "only one tier"),
    ({"tiers": [{"kind": "redis"}]}, "tiers[0].url", "None", ", ".join(REDIS_SCHEMES)),
    ({"tiers": [{"kind": "redis", "url": "http://cache"}]}, "tiers[0].url", "'http://cache'", "redis://"),
    ({"tiers": [{"kind": "redis", "url": "redis://cache:port/0"}]}, "tiers[0].url", "'redis://cache:port/0'",
     "port 0-65535"),
    ({"tiers": [{"kind": "redis", "url": "redis://u:hunter2@cache:99999/0"}]}, "tiers[0].url",
     "'redis://***@cache:99999/0'", "port 0-65535"),
    ({"tiers": [{"kind": "redis", "url": "redis://a:1,b:2"}]}, "tiers[0].url", "'redis://a:1,b:2'",
     "several hosts only in a redis+cluster://"),
    ({"tiers": [{"kind": "redis", "url": "redis+cluster://u:hunter2@a:1,b:x"}]}, "tiers[0].url",
     "'redis+cluster://***@a:1,b:x'", "host[:port],host[:port],..."),
    ({"tiers": [{"kind": "redis", "url": _R, "password": ""}]}, "tiers[0].password", "''", "non-empty string"),
    ({"tiers": [{"kind": "redis", "url": _R, "ttl_s": 0}]}, "tiers[0].ttl_s", "0", "positive number"),
    ({"tiers": [{"kind": "redis", "url": _R, "part_size": 100}]}, "tiers[0].part_size", "100", "at least 1KiB"),
    ({"tiers": [{"kind": "redis", "url": _R, "part_size": "big"}]}, "tiers[0].part_size", "'big'", "8GiB"),
    ({"tiers": [{"kind": "redis", "url": _R, "timeout_s": float("nan")}]}, "tiers[0].timeout_s", "nan",
     "positive number"),
    ({"tiers": [{"kind": "redis", "url": _R, "retry_after_s": -1}]}, "tiers[0].retry_after_s", "-1",
     "number of seconds"),
    ({"tiers": [{"kind": "redis", "url": _R, "key_prefix": ""}]}, "tiers[0].key_prefix", "''", "non-empty"),
    ({"tiers": [{"kind": "redis", "url": _R, "ssl_ca_certs": "/ca.pem"}]}, "tiers[0].ssl_ca_certs",
     "'/ca.pem'", "rediss://"),
    ({"tiers": [{"kind": "memory", "path": "/x"}]}, "tiers[0].path", "path", "known keys: kind, capacity"),
    ({"chunksize": 16}, "chunksize", "chunksize", "known keys: namespace"),
    ({"extra": {"note": 1}}, "extra.note", "1", "prefixed 'x_'"),
    ({"config_file": "/etc/x.yaml"}, "config_file", "'/etc/x.yaml'", "extra config"),
]


@pytest.mark.parametrize(("raw", "path", "shown", "allowed"), BAD_CONFIGS, ids=[r[1] for r in BAD_CONFIGS])
def test_every_config_error_names_field_value_and_allowed(raw: dict[str, Any], path: str, shown: str,
                                                          allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        _parse_every_part(raw)
    msg = str(info.value)
    assert msg.startswith(f"{path}:") or msg.startswith(f"{path}."), msg
    assert shown in msg, msg
    assert allowed in msg, msg
    assert "hunter2" not in msg


def test_config_file_errors_name_the_file_and_what_is_allowed(tmp_path: Any) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [unclosed")
    for name, what in ((tmp_path / "missing.yaml", "cannot read"), (bad, "not valid YAML")):
        with pytest.raises(ConfigError) as info:
            StoreConfig.load({"config_file": str(name)})
        msg = str(info.value)
        assert msg.startswith("config_file:") and str(name) in msg and what in msg and "allowed" in msg, msg
    listy = tmp_path / "list.json"
    listy.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config_file: invalid .*list\.json.*allowed: a file holding a mapping"):
        StoreConfig.load({"config_file": str(listy)})
