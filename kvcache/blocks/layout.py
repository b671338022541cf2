"""The paged KV tensors the attention backend gave us, checked against what the config predicts.

vLLM 0.32 hands every decoder layer's cache to `register_kv_caches` as a standardized per-layer view
`[num_blocks, num_kv_heads, block_size, head_size_k + head_size_v]` (MLA: one latent tensor,
`[num_blocks, block_size, latent]` or `[num_blocks, 1, block_size, latent]`). Records hold whole blocks
gathered along dim 0 of that *logical* view, so the physical stride order (HND or NHD) never changes
the stored bytes. Anything else is refused at startup with a message naming what we saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_tiercache.kvcache.groups import layer_index

#: Layout tags that enter the model fingerprint, so engines with another layout never share records.
LAYOUT_PAGED = "paged-bhnc"
LAYOUT_MLA = "mla-latent"


class UnsupportedLayoutError(RuntimeError):
    """The attention backend's KV cache tensors are not a layout this connector knows."""


def layout_tag(vllm_config: Any) -> str:
    return LAYOUT_MLA if getattr(vllm_config.model_config, "use_mla", False) else LAYOUT_PAGED


def _layer_index(name: str) -> int:
    """`vllm_tiercache.kvcache.groups.layer_index`, refusing a name without one as a layout we do not know."""
    try:
        return layer_index(name)
    except ValueError as exc:
        raise UnsupportedLayoutError(str(exc)) from None


@dataclass(frozen=True)
class PagedLayout:
    """Layer order, block geometry and dtype of the engine's paged KV cache."""

    layer_names: tuple[str, ...]
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def describe(self) -> str:
        """What a record's metadata says about its bytes; a loader with another answer refuses it."""
        return f"blocks{list(self.block_shape)}:{str(self.dtype).removeprefix('torch.')}"

    @classmethod
    def learn(
        cls,
        kv_caches: dict[str, torch.Tensor],
        *,
        num_blocks: int | None,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        use_mla: bool,
    ) -> PagedLayout:
        if not kv_caches:
            raise UnsupportedLayoutError("register_kv_caches received no KV cache tensors")
        names = sorted(kv_caches, key=_layer_index)
        first = kv_caches[names[0]]
        shapes = {tuple(t.shape) for t in kv_caches.values()}
        dtypes = {t.dtype for t in kv_caches.values()}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise UnsupportedLayoutError(
                f"TieredKVConnector needs every layer's KV cache to have one shape and dtype, got shapes "
                f"{sorted(shapes)} and dtypes {sorted(map(str, dtypes))} (hybrid or per-layer KV layouts "
                "are not supported)"
            )
        shape = tuple(first.shape)
        per_block = math.prod(shape[1:]) if len(shape) > 1 else 0
        expected = block_size * head_size * (num_kv_heads if use_mla else 2 * num_kv_heads)
        plausible = (
            len(shape) in (3, 4)
            and per_block == expected
            and (num_blocks is None or shape[0] == num_blocks)
            and block_size in shape[1:-1]
        )
        if not plausible:
            raise UnsupportedLayoutError(
                f"unknown KV cache layout {shape} (dtype {first.dtype}) for layer {names[0]!r}: expected "
                f"[num_blocks={num_blocks}, num_kv_heads={num_kv_heads}, block_size={block_size}, "
                f"{'head_size' if use_mla else '2*head_size'}={head_size if use_mla else 2 * head_size}]"
                f"{' (MLA latent)' if use_mla else ''}. This attention backend is not supported by "
                "TieredKVConnector; pick another backend or report the layout."
            )
        return cls(
            layer_names=tuple(names),
            num_blocks=shape[0],
            block_shape=shape[1:],
            dtype=first.dtype,
            device=first.device,
        )
