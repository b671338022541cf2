"""Moving whole blocks between vLLM's paged KV cache and host tensors the store can keep.

CPU: a gather is one slice copy per run of blocks (a private copy the store may keep), a scatter likewise.
CUDA: copies run on the mover's own stream, so they overlap the forward pass; an event per layer tells the
forward stream when a loaded layer is ready. A gather lands straight in a pinned tensor that becomes the
record, so a memory-tier hit is one device copy from it too, and a disk tier reads payloads into pinned
memory the mover gives (`host_bytes`). Pageable records (Redis reads) go through pinned staging buffers
reused from a pool.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from vllm_tiercache.kvcache.blocks.pinned_pool import PinnedPool

log = logging.getLogger(__name__)


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in `block_ids`, first block id, length) of every run of consecutive block ids.

    vLLM usually hands a request consecutive blocks, and one slice copy per run is far cheaper on the CPU
    than `index_select`/`index_copy_` over the same blocks (docs/benchmarks-kv.md has the figures).
    """
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(block_ids):
        if runs and block == runs[-1][1] + runs[-1][2]:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((position, block, 1))
    return runs


def block_spans(block_ids: list[int]) -> list[tuple[int, int, int, int]]:
    """(position in `block_ids`, first block id, length, step) of every run of block ids that go up or down
    by one (step 1 or -1; a single block has step 1).

    Why down too: vLLM frees a request's blocks in reverse order and hands out the longest-free first, so
    once its pool has cycled, a request's blocks mostly come in descending runs. Copied one block at a
    time, a 256-token chunk of a small model was 8 copies of 32 KiB instead of one.
    """
    spans: list[tuple[int, int, int, int]] = []
    for position, block in enumerate(block_ids):
        if spans:
            start, first, length, step = spans[-1]
            if length == 1 and block in (first + 1, first - 1):
                spans[-1] = (start, first, 2, block - first)
                continue
            if block == first + step * length:
                spans[-1] = (start, first, length + 1, step)
                continue
        spans.append((position, block, 1, 1))
    return spans


class BlockMover:
    """CPU (and any device without streams): synchronous block copies, one slice copy per run of blocks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def gather(self, kv_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """A host tensor [len(block_ids), *block_shape] the caller owns."""
        out = torch.empty((len(block_ids), *kv_layer.shape[1:]), dtype=kv_layer.dtype, device=kv_layer.device)
        _copy_runs(out, kv_layer, block_ids)
        return out

    def gather_many(self, kv_layer: torch.Tensor, block_id_lists: list[list[int]]) -> list[torch.Tensor]:
        """`gather` of several chunks of one layer (a step saves all of a layer's chunks at once)."""
        return [self.gather(kv_layer, block_ids) for block_ids in block_id_lists]

    def finish_gathers(self) -> None:
        """Block until every gather issued so far has landed in host memory."""

    def scatter(self, kv_layer: torch.Tensor, block_ids: list[int], blocks: torch.Tensor) -> None:
        blocks = blocks.to(kv_layer.device)
        for position, first, length in block_runs(block_ids):
            kv_layer[first : first + length].copy_(blocks[position : position + length])

    def scatter_spans(self, kv_layer: torch.Tensor, items: list[tuple[list[tuple[int, int, int, int]], torch.Tensor]]
                      ) -> None:
        """Several scatters into one layer, each given as its `block_spans` and its blocks: one batched copy
        call for all their ascending spans (per-call overhead, not bytes, dominated a hit of many small
        records), one strided numpy copy per descending span (torch views cannot step backwards)."""
        if not items:
            return
        destinations, sources = [], []
        # the layer as numpy rows of block bytes, for descending spans (a view only of a contiguous layer)
        rows = _block_rows(kv_layer) if kv_layer.is_contiguous() else None
        for spans, blocks in items:
            blocks = blocks.to(kv_layer.device)
            for position, first, length, step in spans:
                if step == 1:
                    destinations.append(kv_layer[first : first + length])
                    sources.append(blocks[position : position + length])
                elif rows is not None:
                    stop = first - length
                    np.copyto(rows[first : stop if stop >= 0 else None : -1],
                              _block_rows(blocks[position : position + length]))
                else:
                    destinations.extend(kv_layer[first - k] for k in range(length))
                    sources.extend(blocks[position + k] for k in range(length))
        if destinations:
            torch._foreach_copy_(destinations, sources)

    def finish_scatters(self) -> None:
        """Block until every scatter issued so far has landed in the KV cache."""

    def layer_ready(self) -> object | None:
        """A handle the forward waits on before reading the layer just scattered (None: already done)."""
        return None

    def wait(self, handle: object | None) -> None:
        """Make the forward pass wait for `handle`."""

    def loading(self) -> contextlib.AbstractContextManager[object]:
        """The context the loader thread reads and scatters in (CUDA: on the load stream, so GDS reads and
        their checks never queue behind the forward pass)."""
        return contextlib.nullcontext()

    def order_after_queued_work(self) -> None:
        """Order the loads issued from now on after the work already queued on the calling thread's stream
        (called on the forward's thread when a step's loads start, before its forward is queued)."""


class CudaBlockMover(BlockMover):
    """Copies on the mover's own CUDA streams (`stream` loads, `save_stream` saves), so they overlap the
    forward pass and each other (a GPU has a copy engine each way).

    Gathers copy a layer's chunk blocks straight into a new pinned tensor (ordered after the forward
    stream's writes) that becomes the store's record; `finish_gathers` only waits for them. Scatters copy
    pinned records (what gathers made, kept by the memory tier) straight to their blocks, and other host
    records (disk and Redis reads) through a pinned staging buffer reused from `pool`; the event
    `layer_ready` records tells the forward stream when a layer's blocks have landed.

    Why records are pinned: only pinned memory moves at the link's speed. Staging through a pooled buffer
    adds a host memcpy on one thread, several times slower than the link, and gathers into pageable
    records are slower still (fresh pages fault in on the copy); `tiercache bench gpu` measures both
    (figures in docs/gpu.md). Pinned records come from torch's caching host allocator, which reuses what
    evicted records free and never unpins it (docs/gpu.md: how much stays pinned). If pinned memory cannot
    be had, gathers fall back to staging and pageable records, with one warning.
    """

    def __init__(self, device: torch.device, pool: PinnedPool | None = None, cuda: Any = torch.cuda, *,
                 pinned_records: bool = True) -> None:
        """``cuda``: the stream and event API (`torch.cuda`; CPU tests pass a synchronous stand-in to run
        this class's staging and copy logic on CPU tensors). ``pinned_records=False``: gathers stage through
        the pool into pageable records (what they fall back to when pinned memory runs out)."""
        super().__init__(device)
        self._cuda = cuda
        #: loads (host to device); `layer_ready` events are recorded here
        self.stream = cuda.Stream(device=device)
        #: saves (device to host): each gather waits for the forward's writes, which loads must not do
        self.save_stream = cuda.Stream(device=device)
        self.pool = pool or PinnedPool()
        self.pinned_records = pinned_records
        #: staged gathers not yet finished: (pinned view being filled, the caller's tensor, its buffer)
        self._staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._staged_bytes = 0
        #: gathers issued straight into pinned records since the last `finish_gathers`
        self._direct = 0
        #: records (pinned or in GPU memory) whose loads were issued since the last `finish_scatters`,
        #: held so that their memory outlives the copies even if the memory tier drops them meanwhile
        self._held: list[torch.Tensor] = []
        #: per thread: inside `loading`, where the load stream is already the current one
        self._on_load_stream = threading.local()

    def gather(self, kv_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        return self.gather_many(kv_layer, [block_ids])[0]

    def gather_many(self, kv_layer: torch.Tensor, block_id_lists: list[list[int]]) -> list[torch.Tensor]:
        """One stream switch for all of a layer's chunks (per call, it cost more than a 1 MiB copy)."""
        out: list[torch.Tensor] = []
        # The forward stream wrote this layer's KV: order the copies after that, then run them on ours.
        self.save_stream.wait_stream(self._cuda.current_stream(self.device))
        with self._cuda.stream(self.save_stream):
            for block_ids in block_id_lists:
                out.append(self._gather_one(kv_layer, block_ids))
        return out

    def _gather_one(self, kv_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """Issue one chunk's copies on the current (save) stream into its record, pinned or staged."""
        shape = (len(block_ids), *kv_layer.shape[1:])
        record = self._pinned_record(shape, kv_layer.dtype)
        if record is not None:
            _copy_runs(record, kv_layer, block_ids)
            self._direct += 1
            return record
        nbytes = math.prod(shape) * kv_layer.element_size()
        if self._staged and self._staged_bytes + nbytes > self.pool.limit_bytes:
            self.finish_gathers()  # a step saving more than the pool holds: bound its pinned memory
        buffer = self.pool.take(nbytes)
        staging = buffer[:nbytes].view(kv_layer.dtype).view(shape)
        _copy_runs(staging, kv_layer, block_ids)
        out = torch.empty(shape, dtype=kv_layer.dtype)
        self._staged.append((staging, out, buffer))
        self._staged_bytes += nbytes
        return out

    def _pinned_record(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A new pinned tensor for a gather, or None once pinned memory could not be had."""
        if not self.pinned_records:
            return None
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as error:  # cudaHostAlloc refused (the host's pinnable memory is spent)
            self.pinned_records = False
            log.warning("TieredKVConnector: no pinned host memory for records (%s); saves are staged into "
                        "pageable memory from now on, disk reads land in pageable memory, and their loads "
                        "go through a staging copy", error)
            return None

    def host_bytes(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory for a record read on its way to the GPU (`DiskTier.payload_allocator`):
        pinned while it can be had, so its load is one copy and, promoted, the memory tier keeps it."""
        pinned = self._pinned_record((nbytes,), torch.uint8)
        return pinned if pinned is not None else torch.empty(nbytes, dtype=torch.uint8)

    def finish_gathers(self) -> None:
        if not self._staged and not self._direct:
            return
        self.save_stream.synchronize()
        for staging, out, buffer in self._staged:
            np.copyto(_host_bytes(out), _host_bytes(staging))
            self.pool.give(buffer)
        self._staged, self._staged_bytes, self._direct = [], 0, 0

    def scatter(self, kv_layer: torch.Tensor, block_ids: list[int], blocks: torch.Tensor) -> None:
        self.scatter_spans(kv_layer, [(block_spans(block_ids), blocks)])

    def scatter_spans(self, kv_layer: torch.Tensor, items: list[tuple[list[tuple[int, int, int, int]], torch.Tensor]]
                      ) -> None:
        """Records already in GPU memory (GDS reads) are copied device to device and pinned records (the
        memory tier's) host to device as they are; other host records go through one pinned buffer (a
        memcpy each, then asynchronous copies to their blocks)."""
        if not items:
            return
        staged: list[tuple[list[tuple[int, int, int, int]], torch.Tensor]] = []
        sources: list[tuple[list[tuple[int, int, int, int]], torch.Tensor]] = []
        for item in items:  # is_pinned asks the driver: once per record
            (sources if item[1].is_cuda or item[1].is_pinned() else staged).append(item)
        # held until `finish_scatters`, even if the memory tier drops them meanwhile: pinned records (a
        # disk payload's tensor is a view torch's host allocator cannot track) and GPU-memory records (a
        # GDS read allocated on this stream: `record_stream` would not keep the next read out of it)
        self._held.extend(blocks for _, blocks in sources)
        buffer = None
        if staged:
            buffer = self.pool.take(sum(blocks.numel() * blocks.element_size() for _, blocks in staged))
            offset = 0
            for spans, blocks in staged:
                nbytes = blocks.numel() * blocks.element_size()
                piece = buffer[offset : offset + nbytes]
                np.copyto(_host_bytes(piece), _host_bytes(blocks))
                sources.append((spans, piece.view(blocks.dtype).view(blocks.shape)))
                offset += nbytes
        if any(source.is_cuda for _, source in sources):
            # made on this thread's stream (a GDS read and its check); not waited for otherwise: the loader
            # thread's stream may be the forward's, and waiting would queue each load behind the forward
            self.stream.wait_stream(self._cuda.current_stream(self.device))
        with self._load_stream_context():
            for spans, source in sources:
                for position, first, length, step in spans:
                    if step == 1:
                        kv_layer[first : first + length].copy_(source[position : position + length], non_blocking=True)
                    else:
                        for k in range(length):
                            kv_layer[first - k].copy_(source[position + k], non_blocking=True)
        if buffer is not None:
            done = self._cuda.Event()
            done.record(self.stream)
            self.pool.give_after(buffer, done)

    def finish_scatters(self) -> None:
        self.stream.synchronize()
        self._held.clear()

    def layer_ready(self) -> object | None:
        event = self._cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, handle: object | None) -> None:
        if handle is not None:
            self._cuda.current_stream(self.device).wait_event(handle)  # type: ignore[arg-type]

    def order_after_queued_work(self) -> None:
        # once per step: what the forward stream already holds (the previous step, still running with
        # async scheduling, may write KV into blocks this step loads into), not the forward queued later
        self.stream.wait_stream(self._cuda.current_stream(self.device))

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        with self._cuda.stream(self.stream):
            self._on_load_stream.active = True
            try:
                yield
            finally:
                self._on_load_stream.active = False

    def _load_stream_context(self) -> contextlib.AbstractContextManager[object]:
        """The load stream for this call's copies: already current inside `loading` (switching streams
        costs about as much as issuing the copy itself, docs/gpu.md), else entered now."""
        if getattr(self._on_load_stream, "active", False):
            return contextlib.nullcontext()
        return self._cuda.stream(self.stream)  # type: ignore[no-any-return]


def _copy_runs(destination: torch.Tensor, kv_layer: torch.Tensor, block_ids: list[int]) -> None:
    """Copy the blocks into ``destination`` (asynchronous where it is pinned), one copy per run of ids."""
    for position, first, length in block_runs(block_ids):
        destination[position : position + length].copy_(kv_layer[first : first + length], non_blocking=True)


def _host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's bytes as a flat numpy array (a view; numpy has no bfloat16)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _block_rows(blocks: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor of blocks as a numpy array of their bytes, one row per block (numpy has no
    bfloat16, bytes copy the same)."""
    return blocks.reshape(blocks.shape[0], -1).view(torch.uint8).numpy()


def make_mover(device: torch.device) -> BlockMover:
    return CudaBlockMover(device) if device.type == "cuda" else BlockMover(device)
