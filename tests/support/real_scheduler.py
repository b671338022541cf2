"""vLLM's own `Scheduler` over a config, for scheduler-level tests: it builds the connectors (role SCHEDULER)
exactly as an engine core does, over a KV cache config without tensors (by default one group of
`num_blocks` blocks); and requests whose block hashes vLLM's own hasher computes."""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_tiercache.kvcache.plan import TieredKVMetadata


def real_scheduler(vllm_config: VllmConfig, num_blocks: int = 64,
                   kv_cache_config: KVCacheConfig | None = None) -> Scheduler:
    block_size = vllm_config.cache_config.block_size
    if kv_cache_config is None:
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                              dtype=torch.float32))
            ],
        )
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )


def hashed_request(req_id: str, prompt: list[int], block_size: int, max_tokens: int = 4) -> Request:
    """A request whose block hashes vLLM's sha256 block hasher computes, as the engine's input path does."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=max_tokens),
                   pooling_params=None, block_hasher=get_request_block_hasher(block_size, hash_fn))


def schedule_new(scheduler: Scheduler, request: Request) -> tuple[Any, TieredKVMetadata]:
    """Add `request` and run one schedule: (vLLM's scheduler output, the KV connector's plan for the step)."""
    scheduler.add_request(request)
    output = scheduler.schedule()
    meta = output.kv_connector_metadata
    assert isinstance(meta, TieredKVMetadata)
    return output, meta
