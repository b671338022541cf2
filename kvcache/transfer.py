"""Moving whole blocks between vLLM's paged KV cache and host tensors the store can keep.

CPU: a gather is one `index_select` (a private copy the store may keep), a scatter one `index_copy_`.
CUDA: copies run on the mover's own stream through pinned host buffers reused from a pool, so they
overlap the forward pass; an event per layer tells the forward stream when a loaded layer is ready.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from vllm_tiercache.kvcache.pinned_pool import PinnedPool


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in `block_ids`, first block id, length) of every run of consecutive block ids.

    vLLM usually hands a request consecutive blocks, and one slice copy per run is far cheaper on the CPU
    than `index_select`/`index_copy_` over the same blocks (measured: ~0.01 ms against 0.2-4 ms per chunk).
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
        for position, first, length in block_runs(block_ids):
            out[position : position + length].copy_(kv_layer[first : first + length])
        return out

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


class CudaBlockMover(BlockMover):
    """Copies on the mover's own CUDA stream, staged through reused pinned host buffers (`PinnedPool`).

    Gathers copy a layer's chunk blocks from the KV cache into a pinned buffer (ordered after the forward
    stream's writes, overlapping what it computes next); `finish_gathers` waits for them and moves each
    into a pageable tensor the store may keep, so pinned memory is reused step after step and never held
    by a cache. Scatters copy the records' bytes into a pinned buffer and on to their blocks; the event
    `layer_ready` records tells the forward stream when a layer's blocks have landed.
    """

    def __init__(self, device: torch.device, pool: PinnedPool | None = None, cuda: Any = torch.cuda) -> None:
        """``cuda``: the stream and event API (`torch.cuda`; CPU tests pass a synchronous stand-in to run
        this class's staging and copy logic on CPU tensors)."""
        super().__init__(device)
        self._cuda = cuda
        self.stream = cuda.Stream(device=device)
        self.pool = pool or PinnedPool()
        #: gathers issued and not yet finished: (pinned view being filled, the caller's tensor, its buffer)
        self._staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._staged_bytes = 0

    def gather(self, kv_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        shape = (len(block_ids), *kv_layer.shape[1:])
        nbytes = math.prod(shape) * kv_layer.element_size()
        if self._staged and self._staged_bytes + nbytes > self.pool.limit_bytes:
            self.finish_gathers()  # a step saving more than the pool holds: bound its pinned memory
        buffer = self.pool.take(nbytes)
        staging = buffer[:nbytes].view(kv_layer.dtype).view(shape)
        # The forward stream wrote this layer's KV: order the copies after that, then run them on ours.
        self.stream.wait_stream(self._cuda.current_stream(self.device))
        with self._cuda.stream(self.stream):
            for position, first, length in block_runs(block_ids):
                staging[position : position + length].copy_(kv_layer[first : first + length], non_blocking=True)
        out = torch.empty(shape, dtype=kv_layer.dtype)
        self._staged.append((staging, out, buffer))
        self._staged_bytes += nbytes
        return out

    def finish_gathers(self) -> None:
        if not self._staged:
            return
        self.stream.synchronize()
        for staging, out, buffer in self._staged:
            np.copyto(_host_bytes(out), _host_bytes(staging))
            self.pool.give(buffer)
        self._staged, self._staged_bytes = [], 0

    def scatter(self, kv_layer: torch.Tensor, block_ids: list[int], blocks: torch.Tensor) -> None:
        self.scatter_spans(kv_layer, [(block_spans(block_ids), blocks)])

    def scatter_spans(self, kv_layer: torch.Tensor, items: list[tuple[list[tuple[int, int, int, int]], torch.Tensor]]
                      ) -> None:
        """Host records go through one pinned buffer (a memcpy each, then asynchronous copies to their
        blocks); records already in GPU memory (GDS reads) are copied device to device."""
        if not items:
            return
        host = [(spans, blocks) for spans, blocks in items if not blocks.is_cuda]
        sources = [(spans, blocks) for spans, blocks in items if blocks.is_cuda]
        buffer = None
        if host:
            buffer = self.pool.take(sum(blocks.numel() * blocks.element_size() for _, blocks in host))
            offset = 0
            for spans, blocks in host:
                nbytes = blocks.numel() * blocks.element_size()
                piece = buffer[offset : offset + nbytes]
                np.copyto(_host_bytes(piece), _host_bytes(blocks))
                sources.append((spans, piece.view(blocks.dtype).view(blocks.shape)))
                offset += nbytes
        # device-resident sources were made on this thread's stream (a GDS read and its verification)
        self.stream.wait_stream(self._cuda.current_stream(self.device))
        with self._cuda.stream(self.stream):
            for spans, source in sources:
                if source.is_cuda:
                    source.record_stream(self.stream)
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

    def layer_ready(self) -> object | None:
        event = self._cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, handle: object | None) -> None:
        if handle is not None:
            self._cuda.current_stream(self.device).wait_event(handle)  # type: ignore[arg-type]


def _host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's bytes as a flat numpy array (a view; numpy has no bfloat16)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _block_rows(blocks: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor of blocks as a numpy array of their bytes, one row per block (numpy has no
    bfloat16, bytes copy the same)."""
    return blocks.reshape(blocks.shape[0], -1).view(torch.uint8).numpy()


def make_mover(device: torch.device) -> BlockMover:
    return CudaBlockMover(device) if device.type == "cuda" else BlockMover(device)
