"""What `tiercache bench gpu` measures of the block movers: throughput against plain copies and the link,
and how much of a layerwise load the forward pass still waits for.

Torch alone (the GPU machines that run this have no vLLM). The KV layer is vLLM's standardized per-layer
view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; records are whole blocks, as the store
keeps them.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_tiercache.kvcache.blocks.transfer import BlockMover, block_spans, make_mover


@dataclass(frozen=True)
class Geometry:
    """A KV layer's shape and how much of it a measurement moves."""

    num_kv_heads: int = 8
    block_size: int = 16
    head_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    #: bytes moved per measurement (records of one size until this many bytes)
    moved_bytes: int = 256 << 20

    @property
    def block_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * 2 * self.head_size * self.dtype.itemsize


#: chunks the worker gathers of one layer at once (`gather_many`): a 2K-token prefill of 256-token chunks
CHUNKS_PER_LAYER_STEP = 8


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, rounds: int, *,
                   before: Callable[[], None] | None = None, warm_up: bool = True) -> float:
    """Median wall time of ``fn`` (after one warm-up call unless ``warm_up`` is false), the device
    synchronized before and after; ``before`` runs ahead of each round, untimed (dropping a file from
    the page cache)."""
    if warm_up:
        fn()
    times = []
    for _ in range(rounds):
        if before is not None:
            before()
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A pinned host buffer where a GPU is the other end (what a plain fast copy_ uses), else ordinary."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def link_limit(device: torch.device, nbytes: int, rounds: int) -> dict[str, float]:
    """GB/s of one large pinned copy each way: the most the link gives a single copy."""
    host = host_buffer(nbytes, device)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    to_device = median_seconds(lambda: on_device.copy_(host, non_blocking=True), device, rounds)
    to_host = median_seconds(lambda: host.copy_(on_device, non_blocking=True), device, rounds)
    return {"h2d_gbps": nbytes / to_device / 1e9, "d2h_gbps": nbytes / to_host / 1e9}


def mover_throughput(device: torch.device, geometry: Geometry, blocks_per_record: int, rounds: int
                     ) -> dict[str, float]:
    """GB/s of the mover's gathers (device to host), its scatters (host to device) of the records gathers
    make (what the memory tier keeps: pinned on CUDA) and of pageable records (what disk and Redis reads
    give), of records of ``blocks_per_record`` blocks, and of plain pinned ``copy_`` calls of the same sizes."""
    record_bytes = blocks_per_record * geometry.block_bytes
    records = max(1, geometry.moved_bytes // record_bytes)
    num_blocks = records * blocks_per_record
    layer = torch.randn(num_blocks, geometry.num_kv_heads, geometry.block_size, 2 * geometry.head_size,
                        device=device).to(geometry.dtype)
    ids = [list(range(r * blocks_per_record, (r + 1) * blocks_per_record)) for r in range(records)]
    mover: BlockMover = make_mover(device)

    def gathers() -> list[torch.Tensor]:
        out = [record for step in range(0, records, CHUNKS_PER_LAYER_STEP)
               for record in mover.gather_many(layer, ids[step : step + CHUNKS_PER_LAYER_STEP])]
        mover.finish_gathers()
        return out

    kept = [(block_spans(block_ids), record) for block_ids, record in zip(ids, gathers(), strict=True)]
    pageable = [(block_spans(block_ids), layer[block_ids[0] : block_ids[-1] + 1].to("cpu", copy=True))
                for block_ids in ids]

    def scatters_of(items: list[tuple[list[tuple[int, int, int, int]], torch.Tensor]]) -> Callable[[], None]:
        def scatters() -> None:
            mover.scatter_spans(layer, items)
            mover.finish_scatters()
        return scatters

    pinned = host_buffer(records * record_bytes, device).view(geometry.dtype).view(layer.shape)

    def plain_to_host() -> None:
        for r in range(records):
            part = slice(r * blocks_per_record, (r + 1) * blocks_per_record)
            pinned[part].copy_(layer[part], non_blocking=True)

    def plain_to_device() -> None:
        for r in range(records):
            part = slice(r * blocks_per_record, (r + 1) * blocks_per_record)
            layer[part].copy_(pinned[part], non_blocking=True)

    moved = records * record_bytes
    result = {
        "record_mib": record_bytes / (1 << 20),
        "records": records,
        "records_pinned": bool(kept[0][1].is_pinned()),
        "gather_gbps": moved / median_seconds(gathers, device, rounds) / 1e9,
        "plain_d2h_gbps": moved / median_seconds(plain_to_host, device, rounds) / 1e9,
        "scatter_gbps": moved / median_seconds(scatters_of(kept), device, rounds) / 1e9,
        "scatter_pageable_gbps": moved / median_seconds(scatters_of(pageable), device, rounds) / 1e9,
        "plain_h2d_gbps": moved / median_seconds(plain_to_device, device, rounds) / 1e9,
    }
    result["gather_share"] = result["gather_gbps"] / result["plain_d2h_gbps"]
    result["scatter_share"] = result["scatter_gbps"] / result["plain_h2d_gbps"]
    result["scatter_pageable_share"] = result["scatter_pageable_gbps"] / result["plain_h2d_gbps"]
    return result


def overlap(device: torch.device, geometry: Geometry, num_layers: int, rounds: int, *, pinned: bool = True
            ) -> dict[str, float]:
    """A fake forward of ``num_layers`` layers (matmuls on the forward stream) with each layer's KV loaded
    by a loader thread, as `kvcache/worker.py` does: the thread scatters layer i's records and marks it
    ready; the forward waits for that mark and the mover's event before layer i. ``pinned``: the records
    are what the memory tier keeps (pinned on CUDA), else pageable (disk and Redis reads). Returns the
    forward alone, the loads alone, both together, the time the forward lost to the loads (exposed), and
    the share of the shorter of the two that ran hidden behind the other."""
    blocks = max(1, geometry.moved_bytes // num_layers // geometry.block_bytes)
    shape = (blocks, geometry.num_kv_heads, geometry.block_size, 2 * geometry.head_size)
    layers = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(num_layers)]
    records = [torch.randn(shape).to(geometry.dtype) for _ in range(num_layers)]
    if pinned and device.type == "cuda":
        records = [record.pin_memory() for record in records]
    spans = block_spans(list(range(blocks)))
    mover = make_mover(device)

    def load(ready: list[threading.Event] | None, handles: list[object | None]) -> None:
        with mover.loading():  # as the worker loads
            for i, layer in enumerate(layers):
                mover.scatter_spans(layer, [(spans, records[i])])
                handles[i] = mover.layer_ready()
                if ready is not None:
                    ready[i].set()

    def loads_alone() -> None:
        load(None, [None] * num_layers)
        mover.finish_scatters()

    load_s = median_seconds(loads_alone, device, rounds)
    size = 2048 if device.type == "cuda" else 256
    weight = torch.randn(size, size, device=device, dtype=geometry.dtype if device.type == "cuda" else torch.float32)
    activations = torch.randn(size, size, device=device, dtype=weight.dtype)
    batch = 50  # timed as a batch: one matmul alone is mostly launch and synchronize

    def calibration() -> None:
        for _ in range(batch):
            activations @ weight

    one = median_seconds(calibration, device, rounds) / batch
    matmuls = max(1, round(load_s / num_layers / max(one, 1e-9)))  # one layer computes about one layer's load

    def compute_layer() -> None:
        x = activations
        for _ in range(matmuls):
            x = x @ weight

    def forward_alone() -> None:
        for _ in range(num_layers):
            compute_layer()

    issued: list[float] = []  # how long the loader thread took to issue every layer's copies, per round

    def timed_load(ready: list[threading.Event], handles: list[object | None]) -> None:
        started = time.perf_counter()
        load(ready, handles)
        issued.append(time.perf_counter() - started)

    def forward_with_loads() -> None:
        ready = [threading.Event() for _ in range(num_layers)]
        handles: list[object | None] = [None] * num_layers
        loader = threading.Thread(target=timed_load, args=(ready, handles), name="bench-gpu-loader")
        loader.start()
        for i in range(num_layers):
            ready[i].wait()
            mover.wait(handles[i])
            compute_layer()
        loader.join()
        mover.finish_scatters()

    def forward_after_issuing() -> None:
        """`load_mode=before_forward`: the forward's own thread issues every layer's copies first (no
        thread, no handoffs); the GPU still overlaps them with the layers, through the events."""
        handles: list[object | None] = [None] * num_layers
        load(None, handles)
        for i in range(num_layers):
            mover.wait(handles[i])
            compute_layer()
        mover.finish_scatters()

    compute_s = median_seconds(forward_alone, device, rounds)
    together_s = median_seconds(forward_with_loads, device, rounds)
    issued_first_s = median_seconds(forward_after_issuing, device, rounds)
    exposed = max(0.0, together_s - compute_s)
    shorter = min(compute_s, load_s)
    hidden = min(1.0, max(0.0, (compute_s + load_s - together_s) / shorter)) if shorter else 0.0
    return {"layers": num_layers, "layer_mib": blocks * geometry.block_bytes / (1 << 20),
            "records_pinned": bool(records[0].is_pinned()), "compute_s": compute_s, "load_s": load_s,
            "together_s": together_s, "exposed_s": exposed, "exposed_share": exposed / load_s if load_s else 0.0,
            "hidden_share": hidden, "loader_issue_s": statistics.median(issued),
            "issued_first_s": issued_first_s,
            "issued_first_exposed_share": max(0.0, issued_first_s - compute_s) / load_s if load_s else 0.0}
