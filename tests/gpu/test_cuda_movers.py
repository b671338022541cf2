"""The CUDA block mover on CUDA tensors in vLLM's GPU KV layouts: bit-for-bit copies, event ordering
with the forward stream, private save copies, reused pinned staging."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.gpu.kv_layouts import LAYOUTS, layer_views
from tests.gpu.mover_checks import bits, check_gather_scatter_bit_for_bit
from vllm_tiercache.kvcache.blocks.transfer import CudaBlockMover, block_spans, make_mover

GEOMETRY = {"num_layers": 3, "num_blocks": 64, "num_kv_heads": 8, "block_size": 16, "head_size": 128}
#: GPU cycles the mover's stream sleeps to keep a copy pending while the test looks (~0.1 s on an H100)
LONG_SLEEP = 200_000_000


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_gathers_and_scatters_bit_for_bit(device, layout, dtype):
    _, layers = layer_views(layout, dtype=dtype, device=device, **GEOMETRY)
    mover = make_mover(device)
    assert isinstance(mover, CudaBlockMover)
    check_gather_scatter_bit_for_bit(mover, layers)


def test_mla_latent_blocks_bit_for_bit(device):
    _, layers = layer_views("LBHNC", dtype=torch.bfloat16, device=device, mla=True,
                            **{**GEOMETRY, "head_size": 576})
    check_gather_scatter_bit_for_bit(make_mover(device), layers)


def test_records_already_in_gpu_memory_are_scattered_device_to_device(device):
    """GDS reads hand the mover CUDA tensors: no host staging, same bytes."""
    _, layers = layer_views("LBNHC", dtype=torch.bfloat16, device=device, **GEOMETRY)
    mover = make_mover(device)
    ids = [5, 6, 7, 1]
    blocks = torch.randn(len(ids), *layers[0].shape[1:], dtype=torch.bfloat16, device=device)
    allocations = mover.pool.allocations
    mover.scatter_spans(layers[0], [(block_spans(ids), blocks)])
    mover.finish_scatters()
    assert torch.equal(bits(layers[0][ids]), bits(blocks))
    assert mover.pool.allocations == allocations


def test_a_loaded_layer_is_visible_to_the_forward_stream_only_after_its_event(device):
    _, layers = layer_views("LBHNC", dtype=torch.float16, device=device, **GEOMETRY)
    layer = layers[0]
    ids = list(range(8, 24))
    old = bits(layer[ids])
    new = torch.randn(len(ids), *layer.shape[1:], dtype=torch.float16)
    mover = make_mover(device)
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(LONG_SLEEP)  # the mover's copy cannot start before this
    mover.scatter_spans(layer, [(block_spans(ids), new)])
    handle = mover.layer_ready()
    forward = torch.cuda.current_stream(device)
    seen_early = layer[ids].clone()  # on the forward stream, without waiting: the copy is still pending
    mover.wait(handle)
    seen_after = layer[ids].clone()  # ordered after the event
    forward.synchronize()
    assert torch.equal(bits(seen_early), old)
    assert torch.equal(bits(seen_after), bits(new))


def test_a_load_does_not_queue_behind_the_forward_or_the_saves(device):
    """The loader thread's own stream is the forward's (the device's default): a load must not wait for
    what the forward queues after the step's loads started, nor for a save that does. Once they did (each
    scatter waited for the thread's current stream), and a layerwise load ran serialized with the forward:
    0% of it hidden."""
    _, layers = layer_views("LBHNC", dtype=torch.bfloat16, device=device, **GEOMETRY)
    ids = list(range(8, 24))
    record = torch.randn(len(ids), *layers[0].shape[1:]).to(torch.bfloat16).pin_memory()
    mover = make_mover(device)
    forward = torch.cuda.current_stream(device)
    mover.order_after_queued_work()  # the step's loads start (`start_load`)
    torch.cuda._sleep(LONG_SLEEP)  # then the forward stream is busy (~0.1 s)
    saved = mover.gather(layers[1], [1, 2, 3])  # a save: ordered after the forward, so pending too
    outcome: dict[str, bool] = {}

    def loader() -> None:
        with mover.loading():
            mover.scatter_spans(layers[0], [(block_spans(ids), record)])
            handle = mover.layer_ready()
        handle.synchronize()  # type: ignore[attr-defined]
        outcome["forward still busy"] = not forward.query()
        outcome["save still pending"] = not mover.save_stream.query()

    thread = threading.Thread(target=loader)
    thread.start()
    thread.join()
    mover.finish_gathers()
    assert outcome == {"forward still busy": True, "save still pending": True}
    assert torch.equal(bits(layers[0][ids]), bits(record))
    assert saved.shape[0] == 3


def test_a_load_lands_after_what_the_forward_stream_queued_before_the_step(device):
    """With async scheduling the previous step may still be running, and write KV into blocks vLLM has
    since handed to a request this step loads into: the load must land after those writes, not before
    (they would overwrite it). On an H100 this passed with `order_after_queued_work` disabled too, in
    this layout and a strided one: the copy waited for the default stream's work anyway, for a reason
    not found (a load issued after only a sleep there does not wait: the test above). So it guards the
    outcome the ordering promises, not the ordering itself."""
    _, layers = layer_views("LBHNC", dtype=torch.bfloat16, device=device, **GEOMETRY)
    layer = layers[0]
    ids = list(range(4, 12))
    record = torch.randn(len(ids), *layer.shape[1:]).to(torch.bfloat16).pin_memory()
    mover = make_mover(device)
    torch.cuda._sleep(LONG_SLEEP)  # the previous step, still running ...
    layer[4:12] = 7.0  # ... and its late KV write into the blocks
    mover.order_after_queued_work()  # this step's loads start

    def loader() -> None:
        with mover.loading():
            mover.scatter_spans(layer, [(block_spans(ids), record)])
        mover.finish_scatters()

    thread = threading.Thread(target=loader)
    thread.start()
    thread.join()
    torch.cuda.synchronize(device)
    assert torch.equal(bits(layer[ids]), bits(record))


def test_a_gather_is_ordered_after_the_forward_streams_writes(device):
    _, layers = layer_views("LBNHC", dtype=torch.bfloat16, device=device, **GEOMETRY)
    layer = layers[1]
    ids = [3, 4, 5, 9]
    mover = make_mover(device)
    torch.cuda._sleep(LONG_SLEEP)  # the forward stream is busy, then writes the blocks
    layer[ids] = 7.0
    host = mover.gather(layer, ids)
    mover.finish_gathers()
    assert bool((host == 7.0).all())


def test_a_saved_copy_survives_its_blocks_being_overwritten_right_after(device):
    _, layers = layer_views("BLHNC", dtype=torch.bfloat16, device=device, **GEOMETRY)
    layer = layers[2]
    ids = [10, 11, 12, 40, 39]
    reference = bits(layer[ids])
    mover = make_mover(device)
    host = mover.gather(layer, ids)
    mover.finish_gathers()  # what the worker does before the step ends and vLLM may reuse the blocks
    layer[ids] = 0.0  # the next step writes other KV into them
    torch.cuda.synchronize(device)
    assert torch.equal(bits(host), reference)
    assert host.is_pinned()  # the record itself: the memory tier keeps it and a hit copies from it directly


def test_a_memory_tier_record_goes_to_its_blocks_without_staging(device):
    """A gather's pinned record, scattered back (a memory-tier hit), is one host-to-device copy: the staging
    pool is never touched."""
    _, layers = layer_views("LBNHC", dtype=torch.bfloat16, device=device, **GEOMETRY)
    mover = make_mover(device)
    record = mover.gather(layers[0], [4, 5, 6, 7])
    mover.finish_gathers()
    layers[0][4:8] = 0.0
    mover.scatter_spans(layers[0], [(block_spans([4, 5, 6, 7]), record)])
    mover.finish_scatters()
    assert torch.equal(bits(layers[0][4:8]), bits(record))
    assert mover.pool.allocations == 0


def test_a_pinned_record_dropped_during_its_copy_is_not_reused_before_the_copy_ends(device):
    """The memory tier may evict (drop) a record while its load is still pending on the mover's stream:
    torch's caching host allocator must not hand its memory out again before the copy has read it."""
    _, layers = layer_views("LBHNC", dtype=torch.float16, device=device, **GEOMETRY)
    layer = layers[0]
    ids = list(range(8, 24))
    record = torch.randn(len(ids), *layer.shape[1:]).to(torch.float16).pin_memory()
    expected = bits(record)
    mover = make_mover(device)
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(LONG_SLEEP)  # the copy stays pending while the record is dropped and reallocated
    mover.scatter_spans(layer, [(block_spans(ids), record)])
    del record
    others = [torch.zeros(len(ids), *layer.shape[1:], dtype=torch.float16, pin_memory=True) for _ in range(4)]
    mover.finish_scatters()
    assert torch.equal(bits(layer[ids]), expected)
    del others  # held until here: the reallocations that would have overwritten a reused record


def test_a_disk_record_read_into_pinned_memory_loads_directly_and_outlives_its_pending_copy(device, tmp_path):
    """A CUDA worker gives its disk tier `host_bytes`: a record read from disk is pinned, so its load is one
    copy (no staging). A load of part of it copies from inside the allocation, which torch's host allocator
    cannot tie to its block, so the mover holds the record until `finish_scatters`: dropping it mid-copy
    and allocating pinned memory again cannot change what lands."""
    from vllm_tiercache.shared.config import DiskTierConfig
    from vllm_tiercache.shared.store import DiskTier, StoreKey

    _, layers = layer_views("LBHNC", dtype=torch.float16, device=device, **GEOMETRY)
    layer = layers[0]
    ids = list(range(8, 24))
    data = torch.randn(4 + len(ids), *layer.shape[1:]).to(torch.float16)  # the load skips its first 4 blocks
    mover = make_mover(device)
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity=64 << 20))
    tier.set_payload_allocator(mover.host_bytes)
    key = StoreKey("gpu|disk|held")
    tier.put_many([(key, data, None)])
    record = tier.get_many([key])[0]
    assert record is not None and record.tensor.is_pinned()
    nbytes = record.tensor.numel() * record.tensor.element_size()
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(LONG_SLEEP)  # the copy stays pending while the record is dropped
    mover.scatter_spans(layer, [(block_spans(ids), record.tensor[4:])])
    del record
    others = [torch.full((nbytes,), 0xAB, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    mover.finish_scatters()
    assert torch.equal(bits(layer[ids]), bits(data[4:]))
    assert mover.pool.allocations == 0
    del others  # held until here: the reallocations that would have overwritten an unheld record
    tier.close()


def test_without_pinned_records_saves_are_staged_into_pageable_memory(device):
    """What gathers fall back to when pinned memory cannot be had: the same bytes, pageable records."""
    from vllm_tiercache.kvcache.blocks.transfer import CudaBlockMover

    _, layers = layer_views("BLNHC", dtype=torch.bfloat16, device=device, **GEOMETRY)
    mover = CudaBlockMover(device, pinned_records=False)
    check_gather_scatter_bit_for_bit(mover, layers)
    host = mover.gather(layers[0], [1, 2, 3])
    mover.finish_gathers()
    assert not host.is_pinned() and mover.pool.allocations > 0


def test_pinned_staging_is_reused_step_after_step(device):
    _, layers = layer_views("LBHNC", dtype=torch.bfloat16, device=device, **GEOMETRY)
    mover = make_mover(device)
    chunks = [list(range(0, 16)), list(range(16, 32)), [40, 39, 38, 37]]
    blocks = [torch.randn(len(ids), *layers[0].shape[1:], dtype=torch.bfloat16) for ids in chunks]

    def one_step() -> None:
        for layer in layers:
            for ids in chunks:
                mover.gather(layer, ids)
        mover.finish_gathers()
        for layer in layers:
            mover.scatter_spans(layer, [(block_spans(ids), b) for ids, b in zip(chunks, blocks, strict=True)])
            mover.layer_ready()
        mover.finish_scatters()

    for _ in range(22):
        one_step()
    # 22 steps made 198 gathers (into pinned records, no staging) and 66 scatter calls of pageable records;
    # at most 3 layers' scatters (3 MiB each) are ever in flight at once, and only those may have needed
    # their own buffer
    assert mover.pool.allocations <= 3 and mover.pool.allocated_bytes <= 9 << 20
    assert mover.pool.take(1).is_pinned()
