"""vLLM's own `Scheduler` over a config, for scheduler-level tests: it builds the connectors (role SCHEDULER)
exactly as an engine core does, over a KV cache config without tensors (by default one group of
`num_blocks` blocks); and requests whose block hashes vLLM's own hasher computes."""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_tiercache.kvcache.lookup.far import FarLookups
from vllm_tiercache.kvcache.plan import ChunkPrefetch, TieredKVMetadata, TieredKVWorkerMetadata


def cpu_vllm_config(model: str, kv: KVTransferConfig, *, block_size: int, prefix_caching: bool,
                    max_num_batched_tokens: int = 1024, kv_events: KVEventsConfig | None = None) -> VllmConfig:
    """The `VllmConfig` of a CPU engine over ``model`` (bf16, 1,024 tokens, 4 sequences) with ``kv``."""
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", seed=0, max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=1024, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        kv_transfer_config=kv,
        kv_events_config=kv_events,
        device_config=DeviceConfig("cpu"),
    )


def one_group_kv_cache_config(layers: list[str], block_size: int, num_kv_heads: int, num_blocks: int,
                              head_size: int = 64) -> KVCacheConfig:
    """One full-attention bf16 KV cache group over ``layers`` (as vLLM builds it for a plain decoder)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


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


def hashed_request(req_id: str, prompt: list[int], block_size: int, max_tokens: int = 4,
                   kv_transfer_params: dict[str, Any] | None = None) -> Request:
    """A request whose block hashes vLLM's sha256 block hasher computes, as the engine's input path does
    (with ``kv_transfer_params`` where the API server would put them)."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(request_id=req_id, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra_args),
                   pooling_params=None, block_hasher=get_request_block_hasher(block_size, hash_fn))


def schedule_new(scheduler: Scheduler, request: Request) -> tuple[Any, TieredKVMetadata]:
    """Add `request` and schedule until the connector answered its lookup: (vLLM's scheduler output, the KV
    connector's plan for that step). With a far tier the answer comes after the lookup's probe and the
    prefetches, which `play_prefetches` plays as a worker would, in steps of their own."""
    scheduler.add_request(request)
    for _ in range(100):
        output = scheduler.schedule()
        meta = output.kv_connector_metadata
        assert isinstance(meta, TieredKVMetadata)
        far = far_lookups(scheduler)
        ticket = far._tickets.get(request.request_id) if far is not None else None
        if ticket is None or ticket.answered:
            return output, meta
        ticket.probe.done.wait(60.0)
        report = play_prefetches(scheduler, meta.prefetches)
        runner = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                   kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=report))
        scheduler.update_from_output(output, runner)
    raise AssertionError(f"request {request.request_id} never got the connector's answer")


def far_lookups(scheduler: Scheduler) -> FarLookups | None:
    """The KV connector's far lookups in ``scheduler`` (None: synchronous lookups)."""
    connector = scheduler.connector
    side = getattr(connector, "_scheduler", None)
    return getattr(side, "far", None)


def play_prefetches(scheduler: Scheduler, prefetches: list[ChunkPrefetch]) -> TieredKVWorkerMetadata | None:
    """What a worker (rank 0, every layer) does with a step's prefetches: read each chunk's records through the
    connector's store (which promotes them into its memory tier), and report it prefetched and resident."""
    if not prefetches:
        return None
    connector = scheduler.connector
    side = connector._scheduler  # type: ignore[union-attr]
    naming, store = side.naming, side.store
    added, failed = set(), set()
    for prefetch in prefetches:
        keys = [key.for_tenant(prefetch.tenant) for key in naming.group_keys(prefetch.chunk_hash, naming.groups.groups)]
        if all(record is not None for record in store.get_many(keys)):
            added.add(prefetch.chunk_hash)
        else:
            failed.add(prefetch.chunk_hash)
    return TieredKVWorkerMetadata(added=added, prefetched=dict.fromkeys(added, 1), prefetch_failed=failed)
