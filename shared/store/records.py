"""The record format every tier stores: a checked header plus the raw tensor bytes. No pickle.

Layout (little endian)::

    b"TCRC" | u16 version | u32 header_len | u32 xxh32(header) | cbor header | zero pad to 64 | payload

The cbor header is ``{dtype, shape, key, nbytes, checksum, meta}``: ``key`` is the 16-byte digest of the
record's StoreKey (so a file copied or renamed to another key's path is rejected), ``checksum`` is the
xxh3_64 of the payload. Records written for GPU readers (the GDS tier) also carry ``device_checksum``
(`vllm_tiercache.shared.store.device_checksum`), which a GPU computes on the payload where it landed;
readers that do not know the field ignore it, so it needs no new format version. The payload starts
at a 64-byte aligned offset so tensors decoded in place from an aligned buffer are aligned for
vectorized kernels.

Why so strict: stores are shared between processes, hosts and versions; any mismatch (foreign data,
truncation, bit flips, a swapped file) must become a cache miss, never wrong KV in a model.

Why in `shared/store`: only the tiers encode and decode records; connectors see `Record`s.
"""

from __future__ import annotations

import struct
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import cbor2
import numpy as np
import torch
import xxhash

from vllm_tiercache.shared.store.api import KEY_DIGEST_SIZE, Record, StoreKey
from vllm_tiercache.shared.store.device_checksum import host_checksum

MAGIC = b"TCRC"
VERSION = 1
ALIGN = 64
_FIXED = struct.Struct("<4sHII")
FIXED_SIZE = _FIXED.size  # 14
#: A header larger than this is treated as corrupt (meta is meant to be small).
MAX_HEADER = 1 << 20
#: Most dimensions a record's tensor may have (torch's own limit).
MAX_DIMS = 64
#: Bytes copied, then hashed, at a time by `join_payload` (well inside a core's L2 cache).
JOIN_CHUNK = 256 << 10

# torch warns once when a tensor is built over a read-only buffer (bytes from Redis). Records are
# read-only by contract (callers never mutate), so that warning carries no information here.
_silenced = [False]
_silence_lock = threading.Lock()


class RecordError(ValueError):
    """The bytes are not a valid record for the expected key (corrupt, truncated, foreign, swapped)."""


class OtherFormatError(RecordError):
    """A well-formed record head of another format version: another build of the product wrote it.

    Why apart from corruption: during a rolling upgrade old and new replicas share one tier. Such a record
    is a miss for this build and is left where it is (the other build still reads it); tiers count it as
    ``other_format``, never ``corrupt``, and eviction ages it out. New formats also name their records in
    a key space of their own (`vllm_tiercache.shared.store.api.KEY_SPACE`), so the builds rarely meet.
    """


class Encoded(NamedTuple):
    """An encoded record as two pieces, so the payload is never copied: write both, in order."""

    prefix: bytes
    payload: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.prefix) + self.payload.nbytes

    def tobytes(self) -> bytes:
        """One contiguous copy (for tests and small values; tiers write the two pieces)."""
        return self.prefix + self.payload.tobytes()


@dataclass(frozen=True)
class Header:
    dtype: torch.dtype
    shape: tuple[int, ...]
    key: bytes
    nbytes: int
    checksum: int
    meta: dict[str, Any]
    payload_offset: int
    #: `device_checksum` of the payload, in records written for GPU readers (None in others)
    device_checksum: int | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise RecordError(f"unknown dtype {name!r}")
    return dt


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor's data (copying only if it is not contiguous or not on the CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def payload_offset(header_len: int) -> int:
    return -(-(FIXED_SIZE + header_len) // ALIGN) * ALIGN


def encode(key: StoreKey, tensor: torch.Tensor, meta: dict[str, Any] | None = None, *,
           for_gpu_readers: bool = False) -> Encoded:
    """Encode without copying the tensor data: returns (header bytes, memoryview of the payload).

    ``for_gpu_readers``: also record the payload's `device_checksum` (about 0.4 ms per MiB on a CPU core),
    so a GDS reader verifies the payload in GPU memory instead of copying it back to the host.
    """
    payload = tensor_bytes(tensor)
    fields: dict[str, Any] = {
        "dtype": _dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "key": key.digest,
        "nbytes": payload.nbytes,
        "checksum": xxhash.xxh3_64_intdigest(payload),
        "meta": meta or {},
    }
    if for_gpu_readers:
        fields["device_checksum"] = host_checksum(payload)
    header = cbor2.dumps(fields)
    fixed = _FIXED.pack(MAGIC, VERSION, len(header), xxhash.xxh32_intdigest(header))
    pad = payload_offset(len(header)) - FIXED_SIZE - len(header)
    return Encoded(fixed + header + b"\0" * pad, payload)


def decode_header(buf: Any, expected_key: StoreKey | None = None) -> Header:
    """Parse and check the fixed part and the cbor header (not the payload)."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else memoryview(buf)
    if mv.nbytes < FIXED_SIZE:
        raise RecordError(f"truncated: {mv.nbytes} bytes, less than the {FIXED_SIZE}-byte fixed header")
    magic, version, hlen, hsum = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise RecordError(f"bad magic {bytes(magic)!r} (not a tiercache record)")
    if version != VERSION:
        raise OtherFormatError(f"format version {version}, this build reads version {VERSION}")
    if hlen > MAX_HEADER or FIXED_SIZE + hlen > mv.nbytes:
        raise RecordError(f"truncated or corrupt header (length {hlen}, buffer {mv.nbytes})")
    hbytes = mv[FIXED_SIZE:FIXED_SIZE + hlen]
    if xxhash.xxh32_intdigest(hbytes) != hsum:
        raise RecordError("header checksum mismatch")
    try:
        h = cbor2.loads(hbytes)
    except Exception as exc:  # cbor2 raises several types; all mean corrupt
        raise RecordError(f"undecodable header: {exc}") from exc
    try:
        dtype = _dtype_from_name(h["dtype"])
        shape = tuple(int(s) for s in h["shape"])
        key, nbytes, checksum, meta = h["key"], int(h["nbytes"]), int(h["checksum"]), h["meta"]
        device_sum = h.get("device_checksum")
        device_sum = None if device_sum is None else int(device_sum)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(inf)
        raise RecordError(f"malformed header: {exc!r}") from exc
    if not isinstance(key, bytes) or len(key) != KEY_DIGEST_SIZE or not isinstance(meta, dict):
        raise RecordError("malformed header: key or meta of the wrong type")
    if expected_key is not None and key != expected_key.digest:
        raise RecordError(f"key mismatch: record of {key.hex()} found where {expected_key.hex} was expected")
    if len(shape) > MAX_DIMS:  # torch's own limit; also keeps a forged header from costing big-int work
        raise RecordError(f"shape of rank {len(shape)}, more than {MAX_DIMS} dimensions")
    numel = 1
    for s in shape:
        if s < 0:
            raise RecordError(f"negative dimension in shape {shape}")
        numel *= s
    itemsize = dtype.itemsize
    if numel * itemsize != nbytes:
        raise RecordError(f"nbytes {nbytes} does not match shape {shape} x {itemsize}-byte {dtype}")
    offset = payload_offset(hlen)
    # The pad between header and payload is covered by neither checksum: require it to be zeros, so a
    # flipped bit anywhere in a record is detected (and the record dropped), not silently tolerated.
    if any(mv[FIXED_SIZE + hlen:min(offset, mv.nbytes)].tobytes()):
        raise RecordError("corrupt padding after the header")
    return Header(dtype, shape, key, nbytes, checksum, meta, offset, device_sum)


def payload_start(head: Any) -> int | None:
    """Offset of the payload given the first bytes of a record, or None if they don't say yet.

    Only a hint for streaming readers: `decode` checks everything again.
    """
    mv = memoryview(head).cast("B")
    if mv.nbytes < FIXED_SIZE:
        return None
    _, _, hlen, _ = _FIXED.unpack_from(mv, 0)
    if hlen > MAX_HEADER:
        return None
    return payload_offset(hlen)


def decode_into(header: Header, pieces: Sequence[memoryview], checksum: int) -> Record:
    """The record whose payload the caller read into ``pieces`` (writable byte views, one after the other)
    after checking ``header`` with `decode_header`; ``checksum``: the xxh3-64 of those bytes. The record is
    ``in_place``: its tensor is a data-less ("meta") tensor of the header's dtype and shape, its data the
    pieces (`vllm_tiercache.shared.store.api.Record`)."""
    nbytes = sum(piece.nbytes for piece in pieces)
    if nbytes != header.nbytes:
        raise RecordError(f"payload of {header.nbytes} bytes read into a destination of {nbytes}")
    if checksum != header.checksum:
        raise RecordError("payload checksum mismatch")
    return Record(torch.empty(header.shape, dtype=header.dtype, device="meta"), header.meta, in_place=True,
                  pieces=tuple(pieces))


def decode_payload(header: Header, payload: memoryview, checksum: int) -> Record:
    """The record whose payload the caller read into ``payload`` (the byte view of memory it gave, e.g.
    pinned: `byte_view`) after checking ``header`` with `decode_header`; ``checksum``: the xxh3-64 of those
    bytes. The record's tensor shares that memory."""
    return Record(_tensor_from(header, payload, checksum), header.meta)


def joined_copy(record: Record) -> torch.Tensor:
    """A new contiguous tensor with a record's data, also when it lies in the caller's pieces (``in_place``):
    what a store keeps of a record the caller will reuse the memory of."""
    if not record.in_place:
        return record.tensor.clone()
    flat = np.concatenate([np.frombuffer(piece, dtype=np.uint8) for piece in record.pieces])
    return torch.from_numpy(flat).view(record.tensor.dtype).reshape(record.tensor.shape)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (destinations of in-place reads are
    slices of one)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _tensor_from(header: Header, payload: memoryview, checksum: int | None = None) -> torch.Tensor:
    if payload.nbytes != header.nbytes:
        raise RecordError(f"truncated or oversized payload: {payload.nbytes} bytes, "
                          f"header says {header.nbytes}")
    if checksum is None:
        checksum = xxhash.xxh3_64_intdigest(payload)
    if checksum != header.checksum:
        raise RecordError("payload checksum mismatch")
    try:
        if header.nbytes == 0:
            return torch.empty(header.shape, dtype=header.dtype)
        if payload.readonly and not _silenced[0]:
            # torch warns once per process about read-only buffers; swallow that single warning here.
            with _silence_lock, warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(payload, dtype=header.dtype)
                _silenced[0] = True
        else:
            flat = torch.frombuffer(payload, dtype=header.dtype)
        return flat.reshape(header.shape)
    except (RuntimeError, TypeError, ValueError) as exc:
        # A well-formed header naming a dtype or shape torch cannot build over raw bytes (quantized,
        # sparse-only dtypes, an absurd rank): foreign data, so a miss like any other.
        raise RecordError(f"cannot build a {header.dtype} tensor of shape {header.shape}: {exc}") from exc


def decode(buf: Any, expected_key: StoreKey, *, payload_checksum: int | None = None) -> Record:
    """Check and decode one contiguous record; the tensor shares memory with ``buf`` (no copy).

    ``payload_checksum``: the xxh3-64 of the bytes after the header, when the caller already computed it
    while reading (it is still compared with the header's).
    """
    mv = memoryview(buf).cast("B")
    header = decode_header(mv, expected_key)
    if mv.nbytes < header.payload_offset:  # cut inside the padding: an empty payload would still "match"
        raise RecordError(f"truncated: {mv.nbytes} bytes, the payload starts at {header.payload_offset}")
    if payload_checksum is not None and header.payload_offset != payload_start(mv):
        payload_checksum = None
    return Record(_tensor_from(header, mv[header.payload_offset:], payload_checksum), header.meta)


def join_payload(pieces: Sequence[Any]) -> tuple[memoryview, int]:
    """The pieces of a payload (Redis parts) copied into one new writable buffer, and its xxh3-64.

    One pass over the bytes: each `JOIN_CHUNK` is hashed right after it is copied, while it is still in
    the CPU cache, instead of hashing the whole buffer again afterwards.
    """
    views = [memoryview(piece).cast("B") for piece in pieces]
    buf = memoryview(np.empty(sum(v.nbytes for v in views), dtype=np.uint8))
    hasher = xxhash.xxh3_64()
    off = 0
    for view in views:
        for start in range(0, view.nbytes, JOIN_CHUNK):
            chunk = view[start:start + JOIN_CHUNK]
            end = off + chunk.nbytes
            buf[off:end] = chunk
            hasher.update(buf[off:end])
            off = end
    return buf, hasher.intdigest()


def decode_split(prefix: Any, payload: Any, expected_key: StoreKey, *, payload_checksum: int | None = None) -> Record:
    """Decode a record stored as two pieces (Redis keeps the header and the payload parts apart); the
    tensor shares memory with ``payload`` (no copy).

    ``payload_checksum``: the xxh3-64 of ``payload``, when the caller computed it while assembling the
    payload (it is still compared with the header's).
    """
    header = decode_header(prefix, expected_key)
    if memoryview(prefix).nbytes != header.payload_offset:
        raise RecordError("corrupt record head: header length does not match its piece")
    return Record(_tensor_from(header, memoryview(payload).cast("B"), payload_checksum), header.meta)
