"""The checksum a GPU verifies GDS reads with, and the GDS tier's verification logic, run on the CPU.

What runs on a GPU is the same torch code (`_torch_row_sums`) that these tests run on CPU tensors and
compare with the host (numpy) path bit for bit; tests/gpu runs it on CUDA tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_tiercache.shared.config import DiskTierConfig, GdsTierConfig
from vllm_tiercache.shared.store import DiskTier, GdsTier, StoreKey, records
from vllm_tiercache.shared.store.device_checksum import (
    ROW_WORDS,
    _numpy_row_sums,
    _torch_row_sums,
    device_checksum,
    host_checksum,
)


@pytest.mark.parametrize("nbytes", [0, 1, 2, 3, 2 * ROW_WORDS - 1, 2 * ROW_WORDS, 2 * ROW_WORDS + 1,
                                    (5 << 20) + 3])
def test_torch_and_numpy_sums_are_the_same_integers(nbytes):
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    by_torch, by_numpy = _torch_row_sums(payload), _numpy_row_sums(payload.numpy())
    assert by_torch.dtype == by_numpy.dtype == np.int64
    assert np.array_equal(by_torch, by_numpy)


def test_worst_case_row_sums_do_not_overflow():
    """Every word 0xFFFF: each row's sum is at its largest; exact integers match Python's."""
    payload = torch.full((4 * ROW_WORDS,), 0xFF, dtype=torch.uint8)
    sums = _torch_row_sums(payload)
    weights = [((p * 0x9E3779B1 + 0x7F4A7C15) & 0x7FFFFFFF) | 1 for p in range(ROW_WORDS)]
    assert sums.tolist() == [0xFFFF * sum(weights)] * 2
    assert np.array_equal(sums, _numpy_row_sums(payload.numpy()))


def test_damage_changes_the_checksum():
    gen = torch.Generator().manual_seed(1)
    payload = torch.randint(0, 256, (3 * 2 * ROW_WORDS + 100,), dtype=torch.uint8, generator=gen)
    reference = device_checksum(payload)
    assert host_checksum(memoryview(payload.numpy().tobytes())) == reference  # read-only bytes too
    for position in (0, 1, 12345, 2 * ROW_WORDS, payload.numel() - 1):
        for bit in (0, 7):
            damaged = payload.clone()
            damaged[position] ^= 1 << bit
            assert device_checksum(damaged) != reference, (position, bit)
    swapped = torch.cat([payload[2 * ROW_WORDS : 4 * ROW_WORDS], payload[: 2 * ROW_WORDS], payload[4 * ROW_WORDS :]])
    assert device_checksum(swapped) != reference  # whole rows moved
    assert device_checksum(payload[:-1]) != reference  # truncated
    assert device_checksum(torch.cat([payload, payload.new_zeros(1)])) != reference  # a zero appended
    assert device_checksum(torch.zeros(4, dtype=torch.uint8)) != device_checksum(torch.zeros(6, dtype=torch.uint8))


def test_records_for_gpu_readers_carry_it_and_others_ignore_it():
    key = StoreKey("kv/device-checksum")
    tensor = torch.randn(3, 1000)
    plain = records.encode(key, tensor).tobytes()
    for_gpu = records.encode(key, tensor, for_gpu_readers=True).tobytes()
    assert records.decode_header(plain, key).device_checksum is None
    header = records.decode_header(for_gpu, key)
    assert header.device_checksum == device_checksum(tensor.reshape(-1).view(torch.uint8))
    # the usual decode (every reader of this format) is unchanged by the extra field
    assert torch.equal(records.decode(for_gpu, key).tensor, tensor)


class _CpuGdsTier(GdsTier):
    """The GDS tier's device path with the cuFile read replaced by a POSIX read into a CPU tensor: what
    can be checked without a GPU (the header and size checks, verification where the payload landed, the
    host fallback for records without a device checksum)."""

    def __init__(self, config: GdsTierConfig) -> None:
        super().__init__(config)
        self.gpu_direct = True
        self.payload_reads = 0

    def _read_payload(self, path: Path, offset: int, nbytes: int) -> torch.Tensor:
        self.payload_reads += 1
        payload = torch.empty(nbytes, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(offset)
            got = f.readinto(payload.numpy())
        assert got == nbytes
        return payload


def _key(i: int) -> StoreKey:
    return StoreKey(f"kv/gds-{i}")


def test_gds_device_path_verifies_in_place_and_rejects_damage(tmp_path):
    tier = _CpuGdsTier(GdsTierConfig(path=str(tmp_path / "gds"), capacity=1 << 24))
    try:
        tensors = {i: torch.randn(4, 2, 32, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)}
        tier.put_many([(_key(i), t, {"i": i}) for i, t in tensors.items()])
        got = tier.get_many([_key(i) for i in tensors])
        for i, rec in zip(tensors, got, strict=True):
            assert torch.equal(rec.tensor, tensors[i]) and rec.meta == {"i": i}
        assert tier.verified_on_device == 3 and tier.verified_on_host == 0

        path = tier.path_for(_key(1))
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x10  # one bit of the payload
        path.write_bytes(bytes(data))
        assert tier.get_many([_key(1)]) == [None]
        assert tier.counters.get("corrupt") == 1

        path = tier.path_for(_key(2))
        os.truncate(path, path.stat().st_size - 64)
        assert tier.get_many([_key(2)]) == [None]
        assert tier.verified_on_device == 3
    finally:
        tier.close()


def test_gds_device_path_verifies_disk_tier_records_on_the_host(tmp_path):
    directory = str(tmp_path / "shared-dir")
    disk = DiskTier(DiskTierConfig(path=directory, capacity=1 << 24))
    tensor = torch.randn(8, 256)
    disk.put_many([(_key(7), tensor, None)])
    path = disk.path_for(_key(7))
    disk.close()
    tier = _CpuGdsTier(GdsTierConfig(path=directory, capacity=1 << 24))
    try:
        assert torch.equal(tier.get_many([_key(7)])[0].tensor, tensor)
        assert (tier.verified_on_device, tier.verified_on_host) == (0, 1)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        assert tier.get_many([_key(7)]) == [None]
    finally:
        tier.close()
