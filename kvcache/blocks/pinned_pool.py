"""Reusable pinned (page-locked) host buffers for the CUDA block mover's staging.

Why a pool: only pinned memory copies to and from a GPU asynchronously, and allocating it
(`cudaHostAlloc`) takes milliseconds and pins pages for good. The mover stages the scatters of pageable
records (disk and Redis reads) through buffers taken here and given back once the copy that used them has
finished, so a serving engine allocates staging during its first steps and then reuses it. Saves land in
pinned records from torch's caching host allocator, and use this pool only when pinned records cannot be
had (the fallback: staged, then copied into pageable records).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

#: Buffers are allocated in multiples of this (records of one model differ only by their block count).
GRANULE = 1 << 20
#: Pinned bytes a pool allocates before it waits for busy buffers instead of allocating more.
DEFAULT_LIMIT = 512 << 20


class PinnedPool:
    """Pinned uint8 buffers, handed out by `take` and returned by `give` (or `give_after` an event)."""

    def __init__(self, *, pin: bool = True, limit_bytes: int = DEFAULT_LIMIT,
                 allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        """``pin=False`` (tests on machines without CUDA) makes ordinary host buffers with the same reuse;
        ``limit_bytes``: past this, `take` waits for a busy buffer rather than allocate (one request larger
        than the limit still gets its buffer)."""
        self.limit_bytes = limit_bytes
        self._allocate = allocate or (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))
        #: the mover gathers on the forward thread and scatters on the loader thread, both through here
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        #: buffers whose last copy may still be running, each with the event that says it is over
        self._busy: list[tuple[object, torch.Tensor]] = []
        #: how many buffers were ever allocated, and their bytes (a steady state stops both growing)
        self.allocations = 0
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``: the smallest free one that fits, else a new one while the pool
        is under its limit, else the next busy one to finish (waiting for its copy, outside the lock)."""
        size = max(GRANULE, -(-nbytes // GRANULE) * GRANULE)
        while True:
            with self._lock:
                self._reclaim()
                fitting = [i for i, buf in enumerate(self._free) if buf.numel() >= nbytes]
                if fitting:
                    return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
                if self.allocated_bytes + size <= self.limit_bytes or not self._busy:
                    if self._free and self.allocated_bytes + size > self.limit_bytes:
                        # free buffers too small for this request: let the largest go rather than grow
                        largest = max(range(len(self._free)), key=lambda i: self._free[i].numel())
                        self.allocated_bytes -= self._free.pop(largest).numel()
                    self.allocations += 1
                    self.allocated_bytes += size
                    break
                event, buffer = self._busy.pop(0)
            event.synchronize()  # type: ignore[attr-defined]
            with self._lock:
                self._free.append(buffer)
        return self._allocate(size)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer no copy uses any more."""
        with self._lock:
            self._free.append(buffer)

    def give_after(self, buffer: torch.Tensor, event: object) -> None:
        """Return a buffer once ``event`` (a `torch.cuda.Event` recorded after its last copy) has passed."""
        with self._lock:
            self._busy.append((event, buffer))

    def _reclaim(self) -> None:
        """Move buffers whose copies have finished to the free list (the caller holds the lock)."""
        still = []
        for event, buffer in self._busy:
            if event.query():  # type: ignore[attr-defined]
                self._free.append(buffer)
            else:
                still.append((event, buffer))
        self._busy = still

    @property
    def free_buffers(self) -> int:
        with self._lock:
            self._reclaim()
            return len(self._free)
