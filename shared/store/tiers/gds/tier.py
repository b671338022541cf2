"""GDS tier: the disk layout, read through NVIDIA GPUDirect Storage (cuFile via kvikio) into GPU memory.

Why a subclass of the disk tier: files, index, eviction and multi-process safety are identical, so a
directory written by a disk tier can be served by a GDS tier and vice versa. Only the payload read
differs: with CUDA and kvikio present, the payload goes straight from the file into a GPU buffer.
Without them this tier runs the POSIX path of the disk tier and says so once in the log.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.api import PayloadAllocator, Record, StoreKey
from vllm_tiercache.shared.store.device_checksum import device_checksum
from vllm_tiercache.shared.store.tiers.disk.tier import DiskTier
from vllm_tiercache.shared.store.tiers.gds.config import GdsTierConfig

log = logging.getLogger(__name__)
_warned_unavailable = False


def gds_unavailable_reason() -> str | None:
    """None when cuFile reads into GPU memory are possible here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device is available to torch"
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return "the kvikio package is not installed (pip install 'vllm-tiercache[gds]')"
    return None


class GdsTier(DiskTier):
    """Disk tier whose reads land in GPU memory through cuFile when possible (POSIX otherwise).

    Its records carry the checksum a GPU computes (`records.encode`'s ``for_gpu_readers``), so a payload
    read into GPU memory is verified there; only a record written by a plain disk tier (which lacks it)
    is copied back to the host for its xxh3.
    """

    kind = "gds"
    writes_for_gpu_readers = True

    def __init__(self, config: GdsTierConfig, name: str = "gds") -> None:
        super().__init__(config, name)
        global _warned_unavailable
        self.unavailable_reason = gds_unavailable_reason()
        self.gpu_direct = self.unavailable_reason is None
        self.device = torch.device("cuda") if self.gpu_direct else torch.device("cpu")
        #: payloads read into GPU memory and verified there, and those copied back to the host to verify
        self.verified_on_device = 0
        self.verified_on_host = 0
        if not self.gpu_direct and not _warned_unavailable:
            _warned_unavailable = True
            log.warning("tiercache gds tier: GPUDirect Storage unavailable (%s); using POSIX file I/O "
                        "under %s", self.unavailable_reason, self.root)

    def set_payload_allocator(self, allocator: PayloadAllocator | None) -> None:
        """Declined: its payloads land in GPU memory through cuFile, where host memory offered for a record's
        way to the GPU has no use; the POSIX fallback (no GPUDirect here) keeps the disk tier's default, a
        buffer of its own per record."""

    def _read_record(self, path: str | Path, key: StoreKey) -> tuple[Record, int]:
        if not self.gpu_direct:
            return super()._read_record(path, key)
        return self._read_to_device(Path(path), key)

    def _read_to_device(self, path: Path, key: StoreKey) -> tuple[Record, int]:
        """Read the header with POSIX I/O and the payload into device memory (`_read_payload`), and verify
        the payload there. A record that fails any check raises `records.RecordError` (a miss) before its
        tensor is returned, so corrupt data never reaches the model."""
        size = os.stat(path).st_size
        with open(path, "rb", buffering=0) as f:
            head = f.read(records.FIXED_SIZE)
            if len(head) == records.FIXED_SIZE:
                hlen = min(int.from_bytes(head[6:10], "little"), records.MAX_HEADER)
                head += f.read(records.payload_offset(hlen) - records.FIXED_SIZE)
        header = records.decode_header(head, key)
        if header.payload_offset + header.nbytes != size:
            raise records.RecordError(f"truncated or oversized file: {size} bytes, header says "
                                      f"{header.payload_offset + header.nbytes}")
        payload = self._read_payload(path, header.payload_offset, header.nbytes)
        if header.device_checksum is not None:
            if device_checksum(payload) != header.device_checksum:
                raise records.RecordError("payload checksum mismatch (verified in device memory)")
            self.verified_on_device += 1
            record = Record(payload.view(header.dtype).reshape(header.shape) if header.nbytes
                            else torch.empty(header.shape, dtype=header.dtype, device=payload.device), header.meta)
            return record, size
        # written by a plain disk tier: no device checksum, so the payload's xxh3 is checked on the host
        rec = records.decode_split(head[: header.payload_offset], payload.cpu().numpy(), key)
        self.verified_on_host += 1
        tensor: Any = payload.view(header.dtype).reshape(header.shape) if header.nbytes else rec.tensor
        return Record(tensor, rec.meta), size

    def _read_payload(self, path: Path, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the file from ``offset``, read by cuFile straight into a new uint8 tensor in GPU
        memory."""
        import kvikio

        payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if nbytes:
            with kvikio.CuFile(str(path), "r") as cf:
                got = cf.read(payload, nbytes, offset)
            if got != nbytes:
                raise records.RecordError(f"short cuFile read: {got} of {nbytes} bytes")
        return payload
