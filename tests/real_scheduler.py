"""vLLM's own `Scheduler` over a config, for scheduler-level tests: it builds the connectors (role SCHEDULER)
exactly as an engine core does, with a one-group KV cache of `num_blocks` blocks and no tensors."""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager


def real_scheduler(vllm_config: VllmConfig, num_blocks: int = 64) -> Scheduler:
    block_size = vllm_config.cache_config.block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                          dtype=torch.float32))
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )
