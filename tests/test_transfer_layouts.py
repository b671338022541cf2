"""The KV layouts tests/gpu builds without vLLM are vLLM's own, and the CPU block mover moves blocks of
every one of them bit for bit (the GPU suite runs the same checks on CUDA tensors)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from tests.gpu.kv_layouts import LAYOUTS, layer_views
from tests.gpu.mover_checks import bits, check_gather_scatter_bit_for_bit
from vllm_tiercache.kvcache.transfer import BlockMover

GEOMETRY = {"num_layers": 3, "num_blocks": 12, "num_kv_heads": 2, "block_size": 16, "head_size": 8}


def test_every_vllm_layout_is_known_here():
    assert set(LAYOUTS) == {member.name for member in KVCacheLayout}
    assert all(LAYOUTS[member.name] == member.value for member in KVCacheLayout)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_views_match_vllm_create_kv_cache_views(layout):
    dtype = torch.float16
    raw, ours = layer_views(layout, dtype=dtype, device="cpu", **GEOMETRY)
    spec = FullAttentionSpec(block_size=GEOMETRY["block_size"], num_kv_heads=GEOMETRY["num_kv_heads"],
                             head_size=GEOMETRY["head_size"], dtype=dtype)
    member = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, GEOMETRY["num_blocks"], GEOMETRY["num_layers"],
                                                            member)
    tensor = KVCacheTensor(size=raw.numel(), layers=[f"model.layers.{i}.self_attn.attn" for i in range(3)],
                           layer_stride=layer_stride, block_stride=block_stride)
    theirs = create_kv_cache_views(raw, spec, GEOMETRY["num_blocks"], member, tensor)
    assert len(theirs) == len(ours)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_mover_moves_blocks_of_every_layout_bit_for_bit(layout, dtype):
    _, layers = layer_views(layout, dtype=dtype, device="cpu", **GEOMETRY)
    check_gather_scatter_bit_for_bit(BlockMover(torch.device("cpu")), layers)


def test_cpu_mover_moves_mla_latent_blocks_bit_for_bit():
    _, layers = layer_views("LBHNC", dtype=torch.bfloat16, device="cpu", mla=True, **GEOMETRY)
    assert layers[0].shape == (12, 1, 16, 8)
    check_gather_scatter_bit_for_bit(BlockMover(torch.device("cpu")), layers)
