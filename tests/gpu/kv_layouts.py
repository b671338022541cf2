"""vLLM's paged KV cache layouts, built with torch alone (the GPU machine has no vLLM).

vLLM 0.32 allocates one flat byte buffer and gives every attention layer a logical ``[B, H, N, C]`` view
of it (blocks, KV heads, tokens in a block, K and V bytes of a token), strided in one of the physical
orders of `vllm.v1.kv_cache_layout.KVCacheLayout`: layer-outermost (``LBHNC`` the HND order, ``LBNHC``
the NHD order, ``LHBNC`` with heads outside blocks) or block-outermost (``BLHNC``, ``BLNHC``, ``BHLNC``:
a block holds every layer's page, so one layer's blocks are not contiguous). The connector's movers see
only the per-layer views. `layer_views` mirrors `vllm.v1.kv_cache_interface.create_kv_cache_views` for
unpadded pages; tests/kv/blocks/test_transfer_layouts.py checks it against vLLM's own function on the CPU.
"""

from __future__ import annotations

import math

import torch

#: KVCacheLayout member -> physical order of the logical axes (L, B, H, N, C) = (0, 1, 2, 3, 4)
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides (in the logical axis order) of a dense tensor of logical ``shape`` stored in ``order``."""
    strides = [0] * len(shape)
    current = 1
    for axis in reversed(order):
        strides[axis] = current
        current *= shape[axis]
    return tuple(strides)


def layer_views(layout: str, *, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                head_size: int, dtype: torch.dtype, device: torch.device | str,
                mla: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the backing byte buffer, one ``[B, H, N, C]`` view per layer) as vLLM lays them out.

    C is ``2 * head_size`` elements (K then V); with ``mla`` one latent vector of ``head_size`` per token
    and one head. The buffer is filled with random bytes, so every block differs.
    """
    heads = 1 if mla else num_kv_heads
    content = (head_size if mla else 2 * head_size) * dtype.itemsize
    logical = (num_layers, num_blocks, heads, block_size, content)
    raw = torch.randint(-128, 128, (math.prod(logical),), dtype=torch.int8, device=device)
    view_5d = torch.as_strided(raw, logical, layout_strides(logical, LAYOUTS[layout]))
    return raw, [view_5d[layer].view(dtype) for layer in range(num_layers)]
