"""What `tiercache bench gpu` measures of file reads into GPU memory: cuFile (GDS, through kvikio)
against POSIX reads into pinned memory and a copy to the device, from a cold page cache, and the GDS
tier's own verification on the device against verification on the host."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_tiercache.shared.store.device_checksum import device_checksum
from vllm_tiercache.tools.bench.gpu.movers import host_buffer, median_seconds, synchronize

#: bytes per POSIX read (a disk tier reads a record's payload in one call; 8 MiB is a large record)
PIECE = 8 << 20


def drop_from_page_cache(path: Path) -> None:
    """Make the next read of ``path`` come from the device (clean pages are dropped; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cold_seconds(path: Path, read: Callable[[], torch.Tensor], device: torch.device, rounds: int) -> float:
    return median_seconds(read, device, rounds, before=lambda: drop_from_page_cache(path), warm_up=False)


def kvikio_missing() -> str | None:
    try:
        import kvikio  # noqa: F401
    except ImportError as exc:
        return f"kvikio is not importable ({exc})"
    return None


def kvikio_compat_mode() -> bool | None:
    """Whether kvikio falls back to POSIX reads (no GPUDirect driver), where its version says; None if not."""
    import kvikio

    defaults = getattr(kvikio, "defaults", None)
    for name in ("is_compat_mode_preferred", "compat_mode"):
        probe = getattr(defaults, name, None)
        if callable(probe):
            try:
                return bool(probe())
            except Exception:  # an API of another version: unknown, not an error
                return None
    return None


def reads_into_device(device: torch.device, directory: Path, nbytes: int, rounds: int) -> list[dict[str, object]]:
    """Rows: GB/s reading an ``nbytes`` file into device memory, cold, by each path this machine has."""
    path = directory / "bench-gpu-read.bin"
    with open(path, "wb") as f:
        for _ in range(0, nbytes, PIECE):
            f.write(os.urandom(min(PIECE, nbytes - f.tell())))
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    staging = host_buffer(PIECE, device)
    rows: list[dict[str, object]] = []

    def posix() -> torch.Tensor:
        with open(path, "rb", buffering=0) as f:
            offset = 0
            while offset < nbytes:
                got = f.readinto(staging.numpy()[: min(PIECE, nbytes - offset)])
                target[offset : offset + got].copy_(staging[:got], non_blocking=True)
                synchronize(device)  # the staging buffer is reused by the next read
                offset += got
        return target

    posix_s = _cold_seconds(path, posix, device, rounds)
    rows.append({"path": "POSIX read + copy to device", "gbps": nbytes / posix_s / 1e9, "vs_posix": 1.0})
    missing = kvikio_missing() if device.type == "cuda" else "no CUDA device (nothing to read into)"
    if missing is None:
        import kvikio

        def gds() -> torch.Tensor:
            with kvikio.CuFile(str(path), "r") as cufile:
                cufile.read(target, nbytes, 0)
            return target

        gds_s = _cold_seconds(path, gds, device, rounds)
        row: dict[str, object] = {"path": "GDS (kvikio CuFile.read)", "gbps": nbytes / gds_s / 1e9,
                                  "vs_posix": posix_s / gds_s}
        if kvikio_compat_mode():
            row["note"] = "kvikio ran in compatibility mode (POSIX reads underneath: no GPUDirect here)"
        rows.append(row)
    else:
        rows.append({"path": "GDS (kvikio CuFile.read)", "gbps": None, "vs_posix": None, "note": missing})

    verify_device_s = median_seconds(lambda: device_checksum(target), device, rounds)
    verify_host_s = median_seconds(lambda: device_checksum(target.cpu()), device, rounds)
    rows.append({"path": "verify on the device (device_checksum)", "gbps": nbytes / verify_device_s / 1e9,
                 "vs_posix": None})
    rows.append({"path": "verify on the host (copy back + checksum)", "gbps": nbytes / verify_host_s / 1e9,
                 "vs_posix": None})
    path.unlink()
    return rows
