"""Hashing helpers only tests need: the extra keys of a real vLLM `Request`, chunk names from block hashes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_tiercache.kvcache.naming import ChunkGeometry
from vllm_tiercache.shared.naming.hashing import BlockExtraKeys, MMInput


def extra_keys_of(request: Any) -> BlockExtraKeys:
    """The `BlockExtraKeys` of a ``vllm.v1.request.Request`` (mm_features, lora_request, cache_salt)."""
    if getattr(request, "prompt_embeds", None) is not None:
        raise ValueError("prompt-embeds requests hash their embeddings per block; not supported here")
    lora = getattr(request, "lora_request", None)
    return BlockExtraKeys(
        mm_inputs=tuple(
            MMInput(f.mm_position.offset, f.mm_position.length, f.identifier)
            for f in (getattr(request, "mm_features", None) or ())
        ),
        lora_name=None if lora is None else lora.lora_name,
        lora_path=None if lora is None else lora.lora_path,
        cache_salt=getattr(request, "cache_salt", None),
    )


def chunk_hashes(block_hashes: Sequence[bytes], blocks_per_chunk: int) -> list[bytes]:
    """The chain hash at the last block of each chunk (how the KV scheduler names a prompt's chunks)."""
    return [block_hashes[end - 1] for end in ChunkGeometry(1, blocks_per_chunk).chunk_ends(len(block_hashes))]
