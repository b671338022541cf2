"""vLLM's own prefix cache in front of the store, simulated: a GPU block pool of a fixed size.

What it keeps of vLLM (`vllm.v1.core.block_pool`): a block a running request holds is referenced and
never evicted; when a request finishes its blocks are freed tail first (so a prompt's tail goes before
its head), and a new block takes the least recently freed cached block. A request finds the leading run
of its blocks that the pool still holds; the connector asks the store only for the blocks after it.

What it simplifies: a request runs from its arrival for ``output_length`` x `DECODE_MS` (no prefill
time, no scheduling queue), and a request that finds no free block caches no more of its prompt (vLLM
would preempt). Good enough to see how much a GPU cache of a given size takes off the store's traffic.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from vllm_tiercache.tools.bench.trace.mooncake import TraceRequest

#: milliseconds per generated token: how long a request holds its blocks
DECODE_MS = 20.0


class GpuPrefixCache:
    """A pool of ``num_blocks`` blocks with vLLM's eviction order (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._refs: dict[int, int] = {}  # cached block id -> running requests holding it
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: eviction order, oldest first
        self._running: list[tuple[float, int, tuple[int, ...]]] = []  # (finish ms, seq, blocks held)
        self._seq = 0

    def serve(self, request: TraceRequest) -> int:
        """Admit ``request``: returns how many of its leading blocks the pool held (the store is asked for
        the rest), then caches as many of its blocks as the pool can."""
        self._finish_until(request.timestamp_ms)
        if self.num_blocks <= 0:
            return 0
        ids = request.hash_ids
        hit = 0
        while hit < len(ids) and ids[hit] in self._refs:
            hit += 1
        held: list[int] = []
        for block in ids:
            if block not in self._refs and not self._allocate(block):
                break
            self._refs[block] += 1
            self._free.pop(block, None)
            held.append(block)
        self._seq += 1
        heapq.heappush(self._running, (request.timestamp_ms + request.output_length * DECODE_MS, self._seq,
                                       tuple(held)))
        return hit

    def _allocate(self, block: int) -> bool:
        if len(self._refs) >= self.num_blocks:
            if not self._free:
                return False  # every block is referenced by a running request
            victim, _ = self._free.popitem(last=False)
            del self._refs[victim]
        self._refs[block] = 0
        return True

    def _finish_until(self, now_ms: float) -> None:
        while self._running and self._running[0][0] <= now_ms:
            _, _, held = heapq.heappop(self._running)
            for block in reversed(held):  # vLLM frees tail first: the tail is evicted before the head
                refs = self._refs.get(block)
                if refs is None:
                    continue
                self._refs[block] = refs - 1
                if refs == 1:
                    self._free[block] = None
