"""The GDS checksum computed by the GPU equals the host's, and the GDS tier verifies in GPU memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_tiercache.shared.config import DiskTierConfig, GdsTierConfig
from vllm_tiercache.shared.store import DiskTier, GdsTier, StoreKey
from vllm_tiercache.shared.store.device_checksum import ROW_WORDS, device_checksum, host_checksum


@pytest.mark.parametrize("nbytes", [0, 1, 3, 2 * ROW_WORDS, 2 * ROW_WORDS + 1, (64 << 20) + 5])
def test_gpu_and_host_compute_the_same_checksum(device, nbytes):
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert device_checksum(payload.to(device)) == host_checksum(memoryview(payload.numpy()))


class _PosixIntoGpu(GdsTier):
    """The GDS tier's device path with a POSIX read into GPU memory (where kvikio is not installed)."""

    def __init__(self, config: GdsTierConfig) -> None:
        super().__init__(config)
        self.gpu_direct, self.device = True, torch.device("cuda")

    def _read_payload(self, path: Path, offset: int, nbytes: int) -> torch.Tensor:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.readinto(host.numpy()) == nbytes
        return host.to(self.device)


def _tiers(tmp_path):
    config = GdsTierConfig(path=str(tmp_path / "gds"), capacity=1 << 28)
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return [_PosixIntoGpu(config)]
    real = GdsTier(config)
    assert real.gpu_direct, real.unavailable_reason
    return [real]


def test_gds_reads_land_in_gpu_memory_verified_there(tmp_path):
    (tier,) = _tiers(tmp_path)
    try:
        tensors = {i: torch.randn(16, 8, 16, 256, dtype=torch.bfloat16) for i in range(4)}
        tier.put_many([(StoreKey(f"kv/g{i}"), t, None) for i, t in tensors.items()])
        records = tier.get_many([StoreKey(f"kv/g{i}") for i in tensors])
        for i, record in zip(tensors, records, strict=True):
            assert record.tensor.is_cuda and torch.equal(record.tensor.cpu(), tensors[i])
        assert (tier.verified_on_device, tier.verified_on_host) == (4, 0)
        path = tier.path_for(StoreKey("kv/g2"))
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
        assert tier.get_many([StoreKey("kv/g2")]) == [None]
    finally:
        tier.close()


def test_disk_tier_records_are_still_verified_on_the_host(tmp_path):
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "gds"), capacity=1 << 28))
    tensor = torch.randn(1024, 64)
    disk.put_many([(StoreKey("kv/plain"), tensor, None)])
    disk.close()
    (tier,) = _tiers(tmp_path)
    try:
        record = tier.get_many([StoreKey("kv/plain")])[0]
        assert record.tensor.is_cuda and torch.equal(record.tensor.cpu(), tensor)
        assert (tier.verified_on_device, tier.verified_on_host) == (0, 1)
    finally:
        tier.close()
