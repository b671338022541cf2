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
from vllm_tiercache.kvcache.blocks.transfer import BlockMover

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


class _SynchronousCuda:
    """`torch.cuda`'s stream and event API, done at once: lets the CUDA mover's own logic (pinned staging,
    copy-out, span copies, buffer reuse) run on CPU tensors. What it cannot show, asynchrony and event
    ordering, tests/gpu checks on a GPU."""

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

        def wait_event(self, event) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class Event:
        def record(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    @staticmethod
    def current_stream(device=None):
        return _SynchronousCuda.Stream()

    @staticmethod
    def stream(stream):
        import contextlib

        return contextlib.nullcontext()


def _cuda_mover_on_cpu():
    from vllm_tiercache.kvcache.blocks.pinned_pool import PinnedPool
    from vllm_tiercache.kvcache.blocks.transfer import CudaBlockMover

    return CudaBlockMover(torch.device("cpu"), PinnedPool(pin=False), cuda=_SynchronousCuda, pinned_records=False)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_mover_logic_moves_blocks_of_every_layout_bit_for_bit(layout, dtype):
    _, layers = layer_views(layout, dtype=dtype, device="cpu", **GEOMETRY)
    check_gather_scatter_bit_for_bit(_cuda_mover_on_cpu(), layers)


def test_cuda_mover_logic_reuses_its_staging_and_hands_out_private_copies():
    from tests.gpu.mover_checks import BLOCK_LISTS
    from vllm_tiercache.kvcache.blocks.transfer import block_spans

    _, layers = layer_views("LBNHC", dtype=torch.bfloat16, device="cpu", **GEOMETRY)
    mover = _cuda_mover_on_cpu()
    blocks = [torch.randn(len(ids), *layers[0].shape[1:]).to(torch.bfloat16) for ids in BLOCK_LISTS]
    for _ in range(10):
        copies = [(layer, ids, mover.gather(layer, ids)) for layer in layers for ids in BLOCK_LISTS]
        mover.finish_gathers()
        for layer, ids, host in copies:
            assert torch.equal(bits(host), bits(layer)[ids])
            assert host.untyped_storage().data_ptr() not in {
                buf.untyped_storage().data_ptr() for buf in mover.pool._free}  # pageable, not staging
        for layer in layers:
            mover.scatter_spans(layer, [(block_spans(ids), b) for ids, b in zip(BLOCK_LISTS, blocks, strict=True)])
        mover.finish_scatters()
    # 15 gathers a step at most in flight; after the first step no step allocates
    assert mover.pool.allocations <= len(layers) * len(BLOCK_LISTS)
    allocations = mover.pool.allocations
    mover.gather(layers[0], [1, 2])
    mover.finish_gathers()
    assert mover.pool.allocations == allocations


def test_cuda_mover_logic_scatters_several_records_in_one_call():
    from vllm_tiercache.kvcache.blocks.transfer import block_spans

    _, layers = layer_views("BLHNC", dtype=torch.float16, device="cpu", **GEOMETRY)
    mover = _cuda_mover_on_cpu()
    lists = [[2, 3, 4, 5], [9, 8, 7, 6], [0, 11, 10]]
    records = [torch.randn(len(ids), *layers[1].shape[1:]).to(torch.float16) for ids in lists]
    mover.scatter_spans(layers[1], [(block_spans(ids), r) for ids, r in zip(lists, records, strict=True)])
    mover.finish_scatters()
    after = bits(layers[1])
    for ids, record in zip(lists, records, strict=True):
        assert torch.equal(after[ids], bits(record)), ids


def test_cuda_mover_logic_falls_back_to_staging_when_pinned_memory_cannot_be_had(caplog):
    """Without pinned memory (here: no CUDA, so `pin_memory=True` raises) gathers warn once and go on
    through staging into pageable records, bit for bit."""
    from vllm_tiercache.kvcache.blocks.pinned_pool import PinnedPool
    from vllm_tiercache.kvcache.blocks.transfer import CudaBlockMover

    _, layers = layer_views("LBHNC", dtype=torch.bfloat16, device="cpu", **GEOMETRY)
    mover = CudaBlockMover(torch.device("cpu"), PinnedPool(pin=False), cuda=_SynchronousCuda)
    assert mover.pinned_records
    with caplog.at_level("WARNING", logger="vllm_tiercache.kvcache.blocks.transfer"):
        check_gather_scatter_bit_for_bit(mover, layers)
    assert not mover.pinned_records
    warnings = [r for r in caplog.records if "no pinned host memory" in r.getMessage()]
    assert len(warnings) == 1
    assert mover.pool.allocations > 0  # the gathers were staged
