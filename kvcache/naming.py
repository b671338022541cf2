"""Which chunks a prompt gets, and the store key of every record of each: the one naming rule.

Why one module: three places name KV chunks and must agree to the byte, or a precomputed document never
hits and a saved chunk is never found. The connector's scheduler side looks chunks up and plans their
saves, its worker side reads and writes the records, and `tiercache precompute docs` names a prompt's
chunks offline, before any engine runs, to skip what is stored. All three use `KVNaming`.

The rule: a prompt's full blocks are grouped into chunks of `ChunkGeometry.blocks_per_chunk` blocks; the
last chunk may be partial, and is stored only with ``save_partial_chunks``. A chunk is named by vLLM's
chain hash at its last block (the engine's ``request.block_hashes[end - 1]``; offline, the same hash from
`vllm_tiercache.shared.naming.hashing`), which holds the request's extra keys (multimodal identifiers, LoRA name
and path, ``cache_salt``), mixed with the salts vLLM's hash lacks: the LoRA adapter's content digest
(`vllm_tiercache.kvcache.adapters`) and the weights generation after a reset
(`vllm_tiercache.shared.generations`). It is stored as one record per layer and tensor-parallel rank
(`vllm_tiercache.shared.naming.keys.kv_chunk_key`). Under vLLM's hybrid KV cache manager a sliding-window
group's records hold only the chunk's blocks inside a window, and their keys carry the group's tag
(`vllm_tiercache.kvcache.groups`); offline naming knows no groups and names full-attention records.

One call gives a request's names and keys with every salt applied: `KVNaming.request_names` (the
scheduler, from vLLM's block hashes) or `KVNaming.prompt_names` (offline, from the prompt), both a
`RequestNames`. The workers key records from the names in the plan with `KVNaming.record_key`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_tiercache.kvcache.blocks.layout import layout_tag
from vllm_tiercache.kvcache.groups import KVGroup, KVGroups
from vllm_tiercache.kvcache.options import KVConnectorOptions
from vllm_tiercache.shared.config import ConfigError, StoreConfig
from vllm_tiercache.shared.naming.hashing import (
    BlockExtraKeys,
    MMInput,
    assert_engine_seed_matches,
    block_hashes,
    check_seed_is_stable,
)
from vllm_tiercache.shared.naming.keys import KVModelIdentity, kv_chunk_key, weights_of
from vllm_tiercache.shared.store.api import StoreKey

#: the keyed blake2b's ``person`` of each salt a chunk name mixes in (part of every stored name: never change)
_ADAPTER_PERSON = b"tiercache-lora"
_GENERATION_PERSON = b"tiercache-gen"


def adapter_chunk_hash(chunk_hash: bytes, adapter_digest: str) -> bytes:
    """The name of a LoRA request's chunk: vLLM's hash at the chunk's last block, mixed with the adapter's
    content digest (`vllm_tiercache.kvcache.adapters` says why; same length as vLLM's hash, so everything
    downstream treats it alike)."""
    return hashlib.blake2b(chunk_hash + b"|" + adapter_digest.encode(), digest_size=len(chunk_hash),
                           person=_ADAPTER_PERSON).digest()


def generation_chunk_hash(chunk_hash: bytes, salt: bytes | None) -> bytes:
    """A KV chunk's name in the weights generation `salt` (`vllm_tiercache.shared.generations` says why): the
    name itself before any reset (``salt`` None), else the name mixed with the salt."""
    if salt is None:
        return chunk_hash
    return hashlib.blake2b(chunk_hash + b"|" + salt, digest_size=len(chunk_hash),
                           person=_GENERATION_PERSON).digest()


@dataclass(frozen=True)
class ChunkGeometry:
    """How a request's full blocks group into chunks: `chunk_size` tokens = `blocks_per_chunk` blocks."""

    block_size: int
    chunk_size: int

    def __post_init__(self) -> None:
        if self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ConfigError(
                f"chunk_size={self.chunk_size} must be a positive multiple of the engine's block_size="
                f"{self.block_size}; set kv_connector_extra_config.chunk_size to e.g. "
                f"{max(self.block_size, (self.chunk_size // self.block_size or 1) * self.block_size)}"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    def chunk_start(self, end_block: int) -> int:
        """First block of the chunk that ends at `end_block` (full or the partial last one)."""
        per_chunk = self.blocks_per_chunk  # read once: this runs per chunk of every hit
        return (end_block - 1) // per_chunk * per_chunk

    def chunk_ends(self, num_full_blocks: int) -> list[int]:
        """End block (exclusive) of every chunk over `num_full_blocks`: ``10 blocks, 4 per chunk -> [4, 8, 10]``
        (the last one may be partial). A chunk ending at ``e`` covers ``[previous end, e)`` and is named by
        the chain hash of block ``e - 1``, which fingerprints the whole prefix up to it."""
        if num_full_blocks < 0:
            raise ValueError(f"num_full_blocks must be >= 0, got {num_full_blocks}")
        per_chunk = self.blocks_per_chunk
        ends = list(range(per_chunk, num_full_blocks + 1, per_chunk))
        if num_full_blocks % per_chunk:
            ends.append(num_full_blocks)
        return ends

    def next_full_end(self, after_block: int) -> int:
        """End block of the first full chunk that ends past ``after_block``."""
        return (after_block // self.blocks_per_chunk + 1) * self.blocks_per_chunk


@dataclass(frozen=True)
class KVNaming:
    """Everything that names a prompt's chunks in the store, read from the engine's own config."""

    namespace: str
    #: one per tensor-parallel rank (index = rank): a chunk is stored when every rank's records are
    identities: tuple[KVModelIdentity, ...]
    geometry: ChunkGeometry
    #: vLLM's ``prefix_caching_hash_algo``: how block hashes, hence chunk names, are computed
    hash_algo: str
    save_partial_chunks: bool = True
    #: the engine's KV cache groups (None: one full-attention group over every layer)
    kv_groups: KVGroups | None = None

    @property
    def groups(self) -> KVGroups:
        """The KV cache groups a chunk's records are kept for (one full-attention group without HMA)."""
        if self.kv_groups is not None:
            return self.kv_groups
        return KVGroups.single(self.identities[0].num_layers, self.geometry.block_size)

    @classmethod
    def from_configs(
        cls, vllm_config: Any, store: StoreConfig, options: KVConnectorOptions, kv_cache_config: Any = None
    ) -> KVNaming:
        """The naming an engine built from ``vllm_config`` uses, with the connector's store and options.

        Refuses (`check_seed_is_stable`) a hash seed that differs per process: no other process could
        then find a chunk by name.
        """
        cache_config = vllm_config.cache_config
        algo = cache_config.prefix_caching_hash_algo
        check_seed_is_stable(algo)
        block_size = int(cache_config.block_size)
        weights = weights_of(vllm_config, store.model_version)
        first = KVModelIdentity.from_vllm_config(vllm_config, layout_tag(vllm_config), 0, weights=weights)
        groups = None if kv_cache_config is None else KVGroups.from_kv_cache_config(
            kv_cache_config, block_size, first.num_layers)
        chunk_size = options.chunk_size
        if groups is not None and not groups.supported and chunk_size % block_size:
            # nothing is ever chunked for this model (no loads, no saves): any valid geometry names it
            chunk_size = -(-chunk_size // block_size) * block_size
        geometry = ChunkGeometry(block_size=block_size, chunk_size=chunk_size)
        return cls(
            namespace=store.namespace,
            identities=tuple(dataclasses.replace(first, tp_rank=r) for r in range(first.tp_size)),
            geometry=geometry,
            hash_algo=algo,
            save_partial_chunks=options.save_partial_chunks,
            kv_groups=groups,
        )

    # ------------------------------------------------------------------------------------------- keys
    def record_key(self, chunk_hash: bytes, layer: int, rank: int = 0, group: str | None = None) -> StoreKey:
        """The record of one layer of one chunk, written and read by the worker of ``rank``; ``group``:
        the tag of the layer's KV cache group (`KVGroup.tag`, None for full attention)."""
        return kv_chunk_key(self.namespace, self.identities[rank], chunk_hash, layer, group)

    def group_keys(self, chunk_hash: bytes, groups: tuple[KVGroup, ...]) -> list[StoreKey]:
        """The records of one chunk for ``groups``: each of their layers on each rank."""
        return [
            kv_chunk_key(self.namespace, identity, chunk_hash, layer, group.tag)
            for identity in self.identities
            for group in groups
            for layer in group.layers
        ]

    # ----------------------------------------------------------------------------------------- chunks
    def stored_chunk_ends(self, num_full_blocks: int) -> list[int]:
        """End block of every chunk a finished prefill of ``num_full_blocks`` blocks leaves stored: the
        full chunks, and the partial last one only with ``save_partial_chunks``."""
        ends = self.geometry.chunk_ends(num_full_blocks)
        if ends and ends[-1] % self.geometry.blocks_per_chunk and not self.save_partial_chunks:
            ends = ends[:-1]
        return ends

    def stored_partial_end(self, num_full_blocks: int) -> int | None:
        """End block of the partial last chunk `stored_chunk_ends` includes for ``num_full_blocks`` blocks
        (None: the blocks end on a chunk boundary, or partial chunks are not saved); constant time."""
        partial = num_full_blocks % self.geometry.blocks_per_chunk and self.save_partial_chunks
        return num_full_blocks if partial else None

    # ------------------------------------------------------------------------------------------ names
    def request_names(
        self, block_hashes: Sequence[bytes], *, adapter: str | None = None, generation: bytes | None = None
    ) -> RequestNames:
        """The names and keys of a request's chunks: the one call the scheduler names chunks through.

        ``block_hashes``: vLLM's ``request.block_hashes`` (the engine's list, which vLLM only extends as
        the request decodes, so later chunks are named from it too); ``adapter``: the content digest of
        the request's LoRA adapter (`vllm_tiercache.kvcache.adapters.AdapterDigests`); ``generation``: the
        weights generation's salt, None before the engine's first reset.
        """
        return RequestNames(self, block_hashes, adapter, generation)

    def prompt_block_hashes(self, request: Any) -> list[bytes]:
        """vLLM's block hashes of a request's prompt, computed offline as the engine's scheduler does.

        ``request`` is what vLLM's input processor returns (`prompt_token_ids`, `mm_features`,
        `cache_salt`): image identifiers and the salt enter the hashes as vLLM's extra keys.
        """
        features = getattr(request, "mm_features", None) or ()
        extra = BlockExtraKeys(
            mm_inputs=tuple(MMInput(f.mm_position.offset, f.mm_position.length, f.identifier) for f in features),
            cache_salt=getattr(request, "cache_salt", None),
        )
        return block_hashes(list(request.prompt_token_ids), self.geometry.block_size, self.hash_algo,
                            extra_keys_per_block=None if extra.is_empty else extra)

    def prompt_names(self, request: Any) -> RequestNames:
        """`request_names` of a prompt named offline (`prompt_block_hashes`): no adapter, first generation."""
        return self.request_names(self.prompt_block_hashes(request))

    def prompt_keys(self, request: Any) -> tuple[list[StoreKey], int]:
        """(store keys of every chunk a kv_producer saves for this request, prefix tokens a longer prompt reuses).

        A longer serving prompt finds every stored chunk, the partial last one included (the scheduler
        probes the shorter chunk endings after its last full-chunk hit).
        """
        names = self.prompt_names(request)
        ends = self.stored_chunk_ends(len(names.block_hashes))
        tenant = getattr(request, "cache_salt", None)  # a sealing store's tenant (the records' subkey)
        keys = [key.for_tenant(tenant) for end in ends for key in names.record_keys(names.name(end))]
        return keys, (ends[-1] * self.geometry.block_size if ends else 0)

    def check_engine_hashing(self, request: Any) -> None:
        """Refuse an engine whose block hashes are not the ones this naming expects: another hash seed than
        ours (`assert_engine_seed_matches`), or blocks of another size than ``block_size``. Asked at the
        first request: vLLM seeds its hashing only after it builds the connector."""
        assert_engine_seed_matches(self.hash_algo)
        expected = request.num_tokens // self.geometry.block_size
        if len(request.block_hashes) != expected:
            raise RuntimeError(
                f"TieredKVConnector: the engine hashes {len(request.block_hashes)} blocks for a "
                f"{request.num_tokens}-token request, not {expected} blocks of block_size="
                f"{self.geometry.block_size}; hybrid-attention models and decode context parallelism "
                "hash blocks of another size and are not supported"
            )


@dataclass(frozen=True)
class RequestNames:
    """One request's chunks as the store knows them: each chunk's name, and its records' keys.

    Every salt is applied here and nowhere else: vLLM's block hash at the chunk's last block (its extra
    keys already hold the multimodal identifiers, the LoRA name and path and ``cache_salt``), mixed with
    the adapter's content digest for a LoRA request (vLLM's hash names the adapter, not its weights) and
    with the generation's salt after a reset (vLLM's hash does not change when the weights do in place).
    Made by `KVNaming.request_names` or `KVNaming.prompt_names`.
    """

    naming: KVNaming
    block_hashes: Sequence[bytes]
    #: content digest of the request's LoRA adapter; None without one
    adapter: str | None = None
    #: the weights generation's salt; None before the engine's first reset
    generation: bytes | None = None

    def name(self, end: int) -> bytes:
        """The name of the chunk that ends at block ``end`` (any chunk end, full or partial)."""
        block_hash = self.block_hashes[end - 1]
        named = block_hash if self.adapter is None else adapter_chunk_hash(block_hash, self.adapter)
        return generation_chunk_hash(named, self.generation)

    def parent_name(self, end: int) -> bytes | None:
        """The name of the chunk before the one that ends at block ``end`` (None for a prompt's first): its
        records are the parents of this chunk's (`vllm_tiercache.shared.eviction.lineage`)."""
        start = self.naming.geometry.chunk_start(end)
        return self.name(start) if start else None

    def chunks(self, num_full_blocks: int) -> list[tuple[int, bytes]]:
        """(end block, name) of every chunk over the first ``num_full_blocks`` blocks; the last may be partial."""
        return [(end, self.name(end)) for end in self.naming.geometry.chunk_ends(num_full_blocks)]

    def prompt_chunks(self, num_prompt_tokens: int) -> list[tuple[int, bytes]]:
        """(end block, name) of every chunk of a prompt of ``num_prompt_tokens`` tokens: its full blocks vLLM
        hashed (`vllm_tiercache.kvcache.planning.prompt_full_blocks`), the last chunk maybe partial. Named
        once per request: the lookup's first stage."""
        block_size = self.naming.geometry.block_size
        return self.chunks(min(num_prompt_tokens // block_size, len(self.block_hashes)))

    def record_keys(self, name: bytes, groups: tuple[KVGroup, ...] | None = None) -> list[StoreKey]:
        """The keys of the records of the chunk named ``name`` (from `name`): each layer of ``groups``
        (default: every group) on each rank. The chunk is loadable when all of them are stored."""
        return self.naming.group_keys(name, self.naming.groups.groups if groups is None else groups)

    def probe_key(self, name: bytes) -> StoreKey:
        """One record that stands for the chunk named ``name`` in a cheap first look (the first layer of
        the first group, rank 0)."""
        first = self.naming.groups.groups[0]
        return self.naming.record_key(name, first.layers[0], 0, first.tag)

    def in_generation(self, salt: bytes | None) -> RequestNames:
        """The same request's names in the weights generation ``salt`` (after `reset_cache`)."""
        return dataclasses.replace(self, generation=salt)
