"""KV cache events for what the store's tiers can serve, in vLLM's own event shape (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`), published by vLLM's own publisher through the connector's
``take_events``.

Why: a cache-aware router (llm-d's precise prefix-cache scorer, Dynamo's KV router) learns what an
instance holds only from these events. vLLM announces its GPU blocks; without ours, a prefix held in this
instance's memory tier or on its disk looks like a miss to the router.

What makes it cheap: a chunk is named by vLLM's own block hash at its last block, so a chunk's events are
exactly the events vLLM would publish for its blocks (`block_hashes`, `parent_block_hash`, `token_ids`,
`lora_name`, `extra_keys`), one medium per tier. The payload is snapshotted from the request while the
scheduler has it (a save planned, a lookup that found the chunk), and published only once the chunk is
servable in a medium (the workers' residency report for memory, a shared-tier lookup for disk/Redis).
Nothing is announced that a resend could not load: a chunk is loadable only from its first block, and
routers match only from a prompt's root, so a chunk whose earlier chunks are not held matches nothing.

One payload may cover the same blocks twice (a partial last chunk, then the full chunk that extends it):
removals are reference-counted per (block, medium), so dropping the partial chunk never withdraws a block
the full chunk still holds.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: What each tier is announced as. Dynamo reads ``CPU`` as host memory and anything else it knows (``DISK``,
#: vLLM's ``STORAGE``) as its lower "disk" tier, case-sensitively; llm-d lower-cases the medium.
MEDIUM_MEMORY = "CPU"
MEDIUM_DISK = "DISK"
#: the shared Redis tier: vLLM's own spelling for storage behind the host (its object-store offloader's)
MEDIUM_REMOTE = "STORAGE"


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """What vLLM's own `BlockStored` for a chunk's blocks says, kept until the chunk leaves every medium."""

    block_hashes: tuple[Any, ...]
    parent_block_hash: Any
    token_ids: array
    lora_name: str | None
    lora_id: int | None
    extra_keys: list[tuple[Any, ...] | None] | None
    #: the chunk's first block: a chunk's parent chunk starts before it, so events sorted by it come parent first
    start_block: int = 0

    @classmethod
    def of(cls, request: Request, start_block: int, end_block: int, block_size: int) -> ChunkPayload:
        """Blocks [start_block, end_block) of ``request``, as `BlockPool.cache_full_blocks` describes them."""
        hashes = request.block_hashes
        extra: list[tuple[Any, ...] | None] = []
        mm_index = 0
        for block in range(start_block, end_block):
            keys, mm_index = generate_block_hash_extra_keys(
                request, block * block_size, (block + 1) * block_size, mm_index)
            extra.append(keys)
        lora = request.lora_request
        return cls(
            block_hashes=tuple(maybe_convert_block_hash(hashes[b]) for b in range(start_block, end_block)),
            parent_block_hash=maybe_convert_block_hash(hashes[start_block - 1]) if start_block else None,
            token_ids=array("q", request.all_token_ids[start_block * block_size:end_block * block_size]),
            lora_name=lora.name if lora is not None else None,
            lora_id=lora.adapter_id if lora is not None else None,
            extra_keys=to_event_extra_keys(extra),
            start_block=start_block,
        )


class KVEventLedger:
    """Which chunks each medium holds, as announced, and the events not yet taken.

    Bounded: at most ``max_chunks`` payloads are kept (the oldest is withdrawn from every medium when more
    come: a router then under-reports, never over-promises), and `take` returns at most
    ``max_blocks_per_take`` blocks' events, leaving the rest of a burst (a re-announcement, a mass
    eviction) for the next steps.
    """

    def __init__(self, *, block_size: int, group_idx: int = 0, max_chunks: int = 131072,
                 max_blocks_per_take: int = 8192) -> None:
        self.block_size = block_size
        self.group_idx = group_idx
        self.max_chunks = max_chunks
        self.max_blocks_per_take = max_blocks_per_take
        #: chunk name -> payload: chunks a save was planned for or a lookup found, announced or not
        self._payloads: OrderedDict[bytes, ChunkPayload] = OrderedDict()
        #: chunk name -> the media it is announced in
        self._held: dict[bytes, set[str]] = {}
        #: (block hash, medium) -> how many held chunks announce that block there
        self._refs: dict[tuple[Any, str], int] = {}
        self._queue: list[KVCacheEvent] = []
        self._queued_blocks = 0
        #: a chunk's last block hash -> its name: a chunk's parent chunk is the one ending at its parent block
        self._ending_at: dict[Any, bytes] = {}

    # ------------------------------------------------------------------------------------------ state
    def remember(self, name: bytes, request: Request, start_block: int, end_block: int) -> None:
        """Snapshot the chunk named ``name`` (blocks [start_block, end_block) of ``request``) for later events."""
        if name in self._payloads:
            self._payloads.move_to_end(name)
            return
        self._add(name, ChunkPayload.of(request, start_block, end_block, self.block_size))
        while len(self._payloads) > self.max_chunks:
            oldest = next(iter(self._payloads))
            for medium in list(self._held.get(oldest, ())):
                self.removed(oldest, medium)
            payload = self._payloads.pop(oldest)
            if self._ending_at.get(payload.block_hashes[-1]) == oldest:
                del self._ending_at[payload.block_hashes[-1]]

    def adopt(self, name: bytes, payload: ChunkPayload) -> None:
        """Remember a payload read back from the journal (`vllm_tiercache.kvcache.events.journal`)."""
        if name not in self._payloads:
            self._add(name, payload)

    def _add(self, name: bytes, payload: ChunkPayload) -> None:
        self._payloads[name] = payload
        if payload.block_hashes:
            self._ending_at[payload.block_hashes[-1]] = name

    def parent_of(self, name: bytes) -> bytes | None:
        """The name of the chunk that ends where ``name`` begins, if this ledger knows it."""
        payload = self._payloads.get(name)
        if payload is None or payload.parent_block_hash is None:
            return None
        return self._ending_at.get(payload.parent_block_hash)

    def payload(self, name: bytes) -> ChunkPayload | None:
        return self._payloads.get(name)

    def knows(self, name: bytes) -> bool:
        return name in self._payloads

    def holds(self, name: bytes, medium: str) -> bool:
        return medium in self._held.get(name, ())

    def held_in(self, medium: str) -> list[bytes]:
        return [name for name, media in self._held.items() if medium in media]

    # ----------------------------------------------------------------------------------------- events
    def stored(self, name: bytes, medium: str) -> bool:
        """The chunk is servable from ``medium`` now; queues its blocks' `BlockStored` unless announced
        there already. False when its payload is unknown (nothing can be announced without its tokens)."""
        payload = self._payloads.get(name)
        if payload is None:
            return False
        media = self._held.setdefault(name, set())
        if medium in media:
            return True
        media.add(medium)
        for block in payload.block_hashes:
            self._refs[(block, medium)] = self._refs.get((block, medium), 0) + 1
        self._queue_stored(payload, medium)
        return True

    def stored_many(self, names: Iterable[bytes], medium: str) -> None:
        """`stored` for each of ``names``, parents first (a consumer drops a block whose parent it does not know)."""
        for name in self.parents_first(names):
            self.stored(name, medium)

    def parents_first(self, names: Iterable[bytes]) -> list[bytes]:
        """``names`` whose payload is known, sorted so that a chunk's parent chunk comes before it."""
        known = [name for name in names if name in self._payloads]
        return sorted(known, key=lambda name: self._payloads[name].start_block)

    def removed(self, name: bytes, medium: str) -> None:
        """The chunk left ``medium``; queues `BlockRemoved` for its blocks no other held chunk announces there."""
        media = self._held.get(name)
        if not media or medium not in media:
            return
        media.discard(medium)
        if not media:
            del self._held[name]
        gone = []
        for block in self._payloads[name].block_hashes:
            left = self._refs.get((block, medium), 0) - 1
            if left > 0:
                self._refs[(block, medium)] = left
            else:
                self._refs.pop((block, medium), None)
                gone.append(block)
        if gone:
            self._queue.append(BlockRemoved(block_hashes=gone, medium=medium, group_idx=self.group_idx))
            self._queued_blocks += len(gone)

    def cleared(self) -> None:
        """Everything announced is void (a connector reset: a new weights generation names new chunks)."""
        self._payloads.clear()
        self._ending_at.clear()
        self._held.clear()
        self._refs.clear()
        self._queue = [AllBlocksCleared()]
        self._queued_blocks = 0

    def reannounce(self) -> None:
        """Queue `BlockStored` again for every held chunk (in the order they were learned, so parents come
        first): a consumer dropped them all, e.g. on vLLM's own `AllBlocksCleared` after a prefix-cache reset."""
        for name in self.parents_first(self._held):
            payload, media = self._payloads[name], self._held[name]
            for medium in sorted(media):
                self._queue_stored(payload, medium)

    def _queue_stored(self, payload: ChunkPayload, medium: str) -> None:
        self._queue.append(BlockStored(
            block_hashes=list(payload.block_hashes), parent_block_hash=payload.parent_block_hash,
            token_ids=payload.token_ids.tolist(), block_size=self.block_size, lora_id=payload.lora_id,
            medium=medium, lora_name=payload.lora_name, extra_keys=payload.extra_keys, group_idx=self.group_idx))
        self._queued_blocks += len(payload.block_hashes)

    def take(self) -> list[KVCacheEvent]:
        """The queued events, at most ``max_blocks_per_take`` blocks' worth (at least one event)."""
        if not self._queue:
            return []
        if self._queued_blocks <= self.max_blocks_per_take:
            taken, self._queue, self._queued_blocks = self._queue, [], 0
            return taken
        count, blocks = 0, 0
        for event in self._queue:
            size = len(event.block_hashes) if isinstance(event, BlockStored | BlockRemoved) else 0
            if count and blocks + size > self.max_blocks_per_take:
                break
            count, blocks = count + 1, blocks + size
        taken, self._queue = self._queue[:count], self._queue[count:]
        self._queued_blocks -= blocks
        return taken

    @property
    def pending(self) -> int:
        return len(self._queue)


def events_enabled(vllm_config: Any) -> bool:
    """Does vLLM publish KV cache events (``--kv-events-config`` with ``enable_kv_cache_events``)?"""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)
