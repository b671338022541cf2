"""What `tiercache bench gpu` measures of disk-tier hits on their way to the GPU: whole-record reads from
the page cache, then the mover's scatters into a KV layer, with payloads read into one new buffer per file
(pageable, a disk tier's default) against payloads read into pinned memory (what a CUDA KV worker gives
the tier: `DiskTier.payload_allocator`, `CudaBlockMover.host_bytes`)."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_tiercache.kvcache.blocks.transfer import block_spans, make_mover
from vllm_tiercache.shared.config import DiskTierConfig
from vllm_tiercache.shared.store import DiskTier, StoreKey
from vllm_tiercache.tools.bench.gpu.movers import Geometry, median_seconds

#: room in the tier for every record with its header and the index, twice over
_HEADROOM = 64 << 20


def disk_hits(device: torch.device, geometry: Geometry, directory: Path, blocks_per_record: int, rounds: int
              ) -> dict[str, float | int]:
    """GB/s of reading every record of a layer from a disk tier (page cache warm: just written) and
    scattering it into its blocks, with pageable and with pinned payloads; the loaded bytes are checked."""
    record_bytes = blocks_per_record * geometry.block_bytes
    records = max(1, geometry.moved_bytes // record_bytes)
    shape = (records * blocks_per_record, geometry.num_kv_heads, geometry.block_size, 2 * geometry.head_size)
    data = torch.randn(shape).to(geometry.dtype)
    layer = torch.zeros(shape, dtype=geometry.dtype, device=device)
    tier = DiskTier(DiskTierConfig(path=str(directory / "disk-hits"), capacity=2 * records * record_bytes + _HEADROOM))
    try:
        keys = [StoreKey(f"bench|gpu|disk-hits|{blocks_per_record}|{i}") for i in range(records)]
        parts = [slice(i * blocks_per_record, (i + 1) * blocks_per_record) for i in range(records)]
        tier.put_many([(key, data[part], None) for key, part in zip(keys, parts, strict=True)])
        spans = [block_spans(list(range(part.start, part.stop))) for part in parts]
        mover = make_mover(device)

        def hit() -> None:
            found = tier.get_many(keys)
            if any(record is None for record in found):
                raise RuntimeError("bench gpu: a record just written to the disk tier was not read back")
            mover.scatter_spans(layer, [(s, record.tensor) for s, record in zip(spans, found, strict=True)
                                        if record is not None])
            mover.finish_scatters()

        pageable_s = median_seconds(hit, device, rounds)
        host_bytes = getattr(mover, "host_bytes", None)
        tier.set_payload_allocator(host_bytes or (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)))
        layer.zero_()
        pinned_s = median_seconds(hit, device, rounds)
        if not torch.equal(layer.cpu().view(torch.uint8), data.view(torch.uint8)):
            raise RuntimeError("bench gpu: the disk hits loaded other bytes than were stored")
        moved = records * record_bytes
        return {"record_mib": record_bytes / (1 << 20), "records": records,
                "pageable_gbps": moved / pageable_s / 1e9, "pinned_gbps": moved / pinned_s / 1e9,
                "gain": pageable_s / pinned_s}
    finally:
        tier.close()
