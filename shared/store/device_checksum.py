"""A payload checksum a GPU computes on the bytes it holds, bit for bit the one the CPU computes.

Why: the GDS tier reads a record's payload from the file straight into GPU memory. Verifying it with the
record's xxh3 would mean copying the payload back to the host, doubling the traffic GDS exists to avoid.
This checksum is integer arithmetic torch runs the same way on any device, so the GPU checks the bytes
where they landed and only a few dozen bytes come back.

How: the payload is read as little-endian 16-bit words in rows of `ROW_WORDS`. Each row's sum of
``word * weight`` (fixed odd pseudo-random weights below 2**31, one per position in a row) is exact in
int64: 2**16 words * (2**16 - 1) * (2**31 - 1) < 2**63, so no overflow and no dependence on the order
of the additions, on any device. The row sums (and the word count) are then hashed with xxh3-64 on the
host. A change of any one word changes its row's sum (odd weights, exact sums); changes that cancel need
word differences matching pseudo-random weights; moved rows change the order of the hashed sums.

It is not a hash against an adversary, and neither is xxh3: records are guarded against damage and foreign
data, and a record's key digest in its header (checked on every read) guards against a swapped file.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import torch
import xxhash

#: 16-bit words per row: the most for which a row's weighted sum is exact in int64.
ROW_WORDS = 1 << 16
#: Rows a GPU sums at a time, bounding its int64 working copy (8 bytes per word) to 64 MiB.
ROWS_PER_SLAB = 128
_WEIGHT_MULTIPLIER = 0x9E3779B1
_WEIGHT_OFFSET = 0x7F4A7C15

_weights: dict[torch.device, torch.Tensor] = {}
_weights_lock = threading.Lock()


def _row_weights(device: torch.device) -> torch.Tensor:
    """The int64 weight of every position in a row on ``device`` (made once per device)."""
    with _weights_lock:
        weights = _weights.get(device)
        if weights is None:
            position = torch.arange(ROW_WORDS, dtype=torch.int64)
            weights = (((position * _WEIGHT_MULTIPLIER + _WEIGHT_OFFSET) & 0x7FFFFFFF) | 1).to(device)
            _weights[device] = weights
        return weights


def device_checksum(payload: torch.Tensor) -> int:
    """The checksum of a payload's bytes: ``payload`` is a 1-D uint8 tensor on any device (CPU or CUDA).

    On CUDA the work runs on the current stream; the only host transfer is the row sums (8 bytes per
    128 KiB). On the CPU numpy does the same sums (torch's integer kernels ran at 0.14 GB/s there,
    numpy's at 2.7). An odd byte count is padded with one zero byte; the byte count is hashed too, so a
    payload and the same payload with a trailing zero differ.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"device_checksum takes a 1-D uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
    nbytes = payload.numel()
    if payload.device.type == "cpu":
        row_sums = _numpy_row_sums(payload.numpy())
    else:
        row_sums = _torch_row_sums(payload)
    hasher = xxhash.xxh3_64(nbytes.to_bytes(8, "little"))
    hasher.update(row_sums.astype("<i8").tobytes())
    return hasher.intdigest()


def _torch_row_sums(payload: torch.Tensor) -> np.ndarray:
    """Every row's exact weighted sum, computed by torch on the payload's device."""
    if payload.numel() % 2:
        payload = torch.cat([payload, payload.new_zeros(1)])
    words = payload.view(torch.int16)
    weights = _row_weights(payload.device)
    sums: list[torch.Tensor] = []
    full_rows = words.numel() // ROW_WORDS
    for first in range(0, full_rows, ROWS_PER_SLAB):
        rows = min(ROWS_PER_SLAB, full_rows - first)
        slab = words[first * ROW_WORDS : (first + rows) * ROW_WORDS].view(rows, ROW_WORDS)
        sums.append(((slab.to(torch.int64) & 0xFFFF) * weights).sum(dim=1))
    tail = words[full_rows * ROW_WORDS :]
    if tail.numel():
        sums.append(((tail.to(torch.int64) & 0xFFFF) * weights[: tail.numel()]).sum().reshape(1))
    return torch.cat(sums).cpu().numpy() if sums else np.zeros(0, dtype=np.int64)


def _numpy_row_sums(payload: np.ndarray) -> np.ndarray:
    """`_torch_row_sums` on the host: the same exact integer sums (so the same values), by numpy."""
    if payload.size % 2:
        payload = np.concatenate([payload, np.zeros(1, dtype=np.uint8)])
    words = payload.view("<u2")
    weights = _row_weights(torch.device("cpu")).numpy()
    full_rows = words.size // ROW_WORDS
    sums = [np.einsum("ij,j->i", words[: full_rows * ROW_WORDS].reshape(full_rows, ROW_WORDS), weights)]
    tail = words[full_rows * ROW_WORDS :]
    if tail.size:
        sums.append(np.array([np.einsum("j,j->", tail, weights[: tail.size])], dtype=np.int64))
    return np.concatenate(sums).astype(np.int64)


def host_checksum(payload: memoryview) -> int:
    """`device_checksum` of bytes in host memory (what a writer records for a GDS reader)."""
    view = memoryview(payload).cast("B")
    if view.nbytes == 0:
        return device_checksum(torch.zeros(0, dtype=torch.uint8))
    with warnings.catch_warnings():  # a read-only buffer (bytes from Redis): only read here
        warnings.simplefilter("ignore", UserWarning)
        return device_checksum(torch.frombuffer(view, dtype=torch.uint8))
