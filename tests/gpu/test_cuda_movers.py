"""The CUDA block mover on CUDA tensors in vLLM's GPU KV layouts: bit-for-bit copies, event ordering
with the forward stream, private save copies, reused pinned staging."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.kv_layouts import LAYOUTS, layer_views
from tests.gpu.mover_checks import bits, check_gather_scatter_bit_for_bit
from vllm_tiercache.kvcache.transfer import CudaBlockMover, block_spans, make_mover

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
    assert not host.is_pinned()  # the store keeps pageable memory; pinned staging goes back to the pool


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
    # 22 steps made 198 gathers and 66 scatter calls; at most 9 gathers (1 MiB buffers each) and 3 layers'
    # scatters (3 MiB each) are ever in flight at once, and only those may have needed their own buffer
    assert mover.pool.allocations <= 12 and mover.pool.allocated_bytes <= 18 << 20
    assert mover.pool.take(1).is_pinned()
