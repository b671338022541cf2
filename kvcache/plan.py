"""What the scheduler tells the workers each step: which chunks to load into which blocks, which to save.

These plain dataclasses cross the scheduler -> worker process boundary inside vLLM's
`KVConnectorMetadata`, so they hold only ints, bytes and lists. Chunk geometry lives here too, so the
scheduler and the offline jobs cut prompts into the same chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_tiercache.shared.hashing import chunk_boundaries
from vllm_tiercache.shared.residency import ResidencyChanges


@dataclass(frozen=True)
class ChunkGeometry:
    """How a request's full blocks group into chunks: `chunk_size` tokens = `blocks_per_chunk` blocks."""

    block_size: int
    chunk_size: int

    def __post_init__(self) -> None:
        if self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size={self.chunk_size} must be a positive multiple of the engine's block_size="
                f"{self.block_size}; set kv_connector_extra_config.chunk_size to e.g. "
                f"{max(self.block_size, (self.chunk_size // self.block_size or 1) * self.block_size)}"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    def chunk_start(self, end_block: int) -> int:
        """First block of the chunk that ends at `end_block` (full or the partial last one)."""
        return ((end_block - 1) // self.blocks_per_chunk) * self.blocks_per_chunk

    def chunk_ends(self, num_full_blocks: int) -> list[int]:
        """End block (exclusive) of every chunk over `num_full_blocks`; the last one may be partial."""
        return chunk_boundaries(num_full_blocks, self.blocks_per_chunk)


@dataclass
class ChunkLoad:
    """Copy blocks [first, end) of one stored chunk into `block_ids` (one destination per block)."""

    chunk_hash: bytes
    chunk_start: int
    first: int
    end: int
    block_ids: list[int]

    @property
    def source_slice(self) -> slice:
        return slice(self.first - self.chunk_start, self.end - self.chunk_start)


@dataclass
class ChunkSave:
    """Gather `block_ids` (all blocks of one chunk, in order) and store them under `chunk_hash`."""

    chunk_hash: bytes
    block_ids: list[int]


@dataclass
class RequestPlan:
    req_id: str
    loads: list[ChunkLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """One step's work for every worker."""

    requests: list[RequestPlan] = field(default_factory=list)

    @property
    def has_saves(self) -> bool:
        return any(plan.saves for plan in self.requests)


@dataclass
class TieredKVWorkerMetadata(ResidencyChanges[bytes], KVConnectorWorkerMetadata):
    """Worker -> scheduler: chunk hashes that entered or left the worker's in-process memory tier
    (`vllm_tiercache.shared.residency` says why, and how ranks merge)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TieredKVWorkerMetadata)
        merged = self.merge(other)
        return TieredKVWorkerMetadata(added=merged.added, evicted=merged.evicted)
