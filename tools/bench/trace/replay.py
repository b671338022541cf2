"""Replaying a trace's store traffic: through the real memory tier, and through a plain LRU for reference.

The connector's traffic, per request (after vLLM's own prefix cache, `gpu_pool`): `contains_many` over
the blocks asked, in order (the hit is the leading run found), `get_many` of that prefix, `put_many` of
the rest. Each block is one record of ``record_bytes`` whose meta names the block before it as its
parent (`vllm_tiercache.shared.eviction.lineage`), as the KV saver writes them. Hit ratio = blocks found /
blocks asked.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_tiercache.tools.bench.trace.gpu_pool import GpuPrefixCache
from vllm_tiercache.tools.bench.trace.mooncake import TraceRequest


@dataclass(frozen=True)
class Asked:
    """What the store is asked for by one request: its blocks after vLLM's hit, and the block before them."""

    blocks: tuple[int, ...]
    parent: int | None
    #: when the request came (the trace's clock): the disk tier's order decays by it (`tiers.TraceClock`)
    timestamp_ms: float = 0.0


def store_traffic(requests: Sequence[TraceRequest], gpu_blocks: int) -> list[Asked]:
    """Per request, the blocks the store is asked for behind a GPU prefix cache of ``gpu_blocks`` (0: none)."""
    pool = GpuPrefixCache(gpu_blocks)
    out = []
    for request in requests:
        hit = pool.serve(request)
        ids = request.hash_ids
        out.append(Asked(ids[hit:], ids[hit - 1] if hit else None, request.timestamp_ms))
    return out


@dataclass
class ReplayResult:
    found: int
    asked: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.found / self.asked if self.asked else 0.0


def replay_memory_tier(traffic: Sequence[Asked], policy: str, capacity_bytes: int, record_bytes: int,
                       progress: Callable[[int], None] | None = None) -> ReplayResult:
    """``traffic`` through a real `MemoryTier` of ``capacity_bytes`` with ``policy``."""
    import torch

    from vllm_tiercache.shared.store.tiers.memory.config import MemoryTierConfig
    from vllm_tiercache.shared.store.tiers.memory.tier import MemoryTier

    tier = MemoryTier(MemoryTierConfig(capacity=capacity_bytes, policy=policy))
    record = torch.empty(record_bytes, dtype=torch.uint8)  # the tier keeps the object: one serves every block
    key = BlockKeys()
    found = asked = 0
    started = time.perf_counter()
    for done, request in enumerate(traffic, 1):
        found += serve(tier, request, key, record, tier.put_many)
        asked += len(request.blocks)
        if progress is not None and done % 256 == 0:
            progress(256)
    if progress is not None:
        progress(len(traffic) % 256)
    return ReplayResult(found, asked, time.perf_counter() - started)


class BlockKeys:
    """A trace block's store key, made once per block (``trace|<id>``)."""

    def __init__(self) -> None:
        self._keys: dict[int, Any] = {}

    def __call__(self, block: int) -> Any:
        key = self._keys.get(block)
        if key is None:
            from vllm_tiercache.shared.store.api import StoreKey

            key = self._keys[block] = StoreKey(f"trace|{block}")
        return key


def serve(cache: Any, request: Asked, key: BlockKeys, record: Any, put: Callable[[list[Any]], None]) -> int:
    """One request's traffic through ``cache`` (a tier or a store): the leading run of its blocks found, read;
    the rest put with ``put``, each record naming the block before it as its parent. Returns the blocks found."""
    from vllm_tiercache.shared.eviction.lineage import PARENT_KEY

    blocks = [key(b) for b in request.blocks]
    present = cache.contains_many(blocks)
    hit = present.index(False) if False in present else len(present)
    if hit:
        cache.get_many(blocks[:hit])
    parent = blocks[hit - 1] if hit else (key(request.parent) if request.parent is not None else None)
    items = []
    for k in blocks[hit:]:
        items.append((k, record, {PARENT_KEY: parent.digest} if parent is not None else None))
        parent = k
    if items:
        put(items)
    return hit


def plain_lru_hits(traffic: Sequence[Asked], capacity: int) -> int:
    """Blocks found by a plain LRU of ``capacity`` blocks (no store code: the reference the store's lru
    column must match), with the same traffic rules."""
    held: OrderedDict[int, None] = OrderedDict()
    found = 0
    for request in traffic:
        blocks = request.blocks
        hit = 0
        while hit < len(blocks) and blocks[hit] in held:
            hit += 1
        found += hit
        for block in blocks[:hit]:
            held.move_to_end(block)
        for block in blocks[hit:]:
            held[block] = None
            if len(held) > capacity:
                held.popitem(last=False)
    return found
