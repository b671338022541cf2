"""TieredKVConnector after vLLM resets the connector cache (weights changed in place): a new generation.

Before `reset_cache` existed, vLLM's default (``None``, taken as success) left the connector serving KV of
the old weights after ``reset_prefix_cache(reset_connector=True)``: a silently wrong hit. What these pin
down, on vLLM's real `Scheduler` and on the scheduler side alone (the real engine is in
tests/engine/test_kv_generations_engine.py):

- after the reset the prompt that hit is a miss (no load planned, not even from the workers' memory), its
  saves go under names no other engine produces, and a later request hits those new records;
- the records stored before are untouched: another engine (a fresh scheduler on the same disk) still hits;
- a request in flight keeps its KV but saves nothing under the new generation; a waiting one is looked up
  again; a whole-request load already promised to vLLM is renamed, never dropped (vLLM waits for it);
- the reset is counted (``generation_resets`` in the connector's stats) and logged once.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from tests.kv.test_kv_scheduler import make_request, make_side, step, tokens
from tests.support.real_scheduler import hashed_request, schedule_new
from tests.support.real_scheduler import real_scheduler as real_scheduler_over
from vllm_tiercache.kvcache.connector import TieredKVConnector
from vllm_tiercache.kvcache.groups import FULL, SLIDING, KVGroup, KVGroups
from vllm_tiercache.kvcache.naming import generation_chunk_hash
from vllm_tiercache.kvcache.plan import TieredKVMetadata, TieredKVWorkerMetadata
from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec

BLOCK, CHUNK = 16, 64  # 4 blocks per chunk
PROMPT_LEN = 200  # 12 full blocks: chunks ending at blocks 4, 8, 12


# ------------------------------------------------------------------------------- real vLLM Scheduler
def _config(model: Path, disk: Path) -> VllmConfig:
    kv = KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="vllm_tiercache.kvcache.connector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "namespace": "gen",
            "chunk_size": CHUNK,
            "tiers": [{"kind": "disk", "path": str(disk), "capacity": "64MiB"}],
        },
    )
    return VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", seed=0, max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),  # hits: ours only
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
    )


def real_scheduler(vllm_config: VllmConfig, num_blocks: int = 128) -> Scheduler:
    """vLLM's own Scheduler over the tiny Llama's KV cache group (its two layers, named as vLLM names
    them): it builds the connector (role SCHEDULER) as an engine core does."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(TinyLlamaSpec().num_layers)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return real_scheduler_over(vllm_config, kv_cache_config=kv_cache_config)


def _request(req_id: str, prompt: list[int]) -> Request:
    return hashed_request(req_id, prompt, BLOCK)


def _connector(scheduler: Scheduler) -> TieredKVConnector:
    connector = scheduler.connector
    assert isinstance(connector, TieredKVConnector)
    return connector


_schedule = schedule_new


def _finish(scheduler: Scheduler, out: Any) -> dict[str, Any] | None:
    """Feed the step's model output (a token per request), end every request; the step's KV stats."""
    req_ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                               sampled_token_ids=[[7] for _ in req_ids], kv_connector_output=KVConnectorOutput())
    engine_outputs = scheduler.update_from_output(out, runner)
    scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
    stats = next((eco.scheduler_stats for eco in engine_outputs.values() if eco.scheduler_stats), None)
    return stats.kv_connector_stats if stats is not None else None


def _play_saves(connector: TieredKVConnector, meta: TieredKVMetadata) -> int:
    """Do what the worker does with the plan's saves: one record per layer, under the plan's names."""
    naming = connector._scheduler.naming  # type: ignore[union-attr]
    count = 0
    for plan in meta.requests:
        for save in plan.saves:
            for layer in naming.groups.groups[save.group].layers:
                connector._store.put(naming.record_key(save.chunk_hash, layer, 0), torch.zeros(len(save.block_ids), 4),
                                     {"blocks": len(save.block_ids), "start": save.first})
                count += 1
    assert connector._store.flush(10.0)
    return count


def _names(meta: TieredKVMetadata, what: str) -> list[bytes]:
    return [item.chunk_hash for plan in meta.requests for item in getattr(plan, what)]


def test_a_reset_turns_the_hit_into_a_miss_and_leaves_the_shared_records(
        tiny_llama: Path, tmp_path: Path, caplog) -> None:
    disk = tmp_path / "disk"
    prompt = [random.Random(5).randrange(3, 250) for _ in range(PROMPT_LEN)]
    first = real_scheduler(_config(tiny_llama, disk), num_blocks=128)
    connector = _connector(first)
    try:
        out, meta = _schedule(first, _request("a", prompt))
        hashes = first.requests["a"].block_hashes
        old_names = [hashes[3], hashes[7], hashes[11]]
        assert _names(meta, "saves") == old_names and not _names(meta, "loads")
        records = _play_saves(connector, meta)
        _finish(first, out)

        out, meta = _schedule(first, _request("b", prompt))
        assert out.num_scheduled_tokens["b"] < PROMPT_LEN  # a hit: vLLM computes only the tail
        assert _names(meta, "loads") == old_names
        _finish(first, out)

        with caplog.at_level(logging.WARNING, logger="vllm_tiercache"):
            assert first.reset_prefix_cache(reset_connector=True) is True
        lines = [r.getMessage() for r in caplog.records if "started weights generation 1" in r.getMessage()]
        assert len(lines) == 1 and "no longer used by this engine" in lines[0], caplog.text
        salt = connector._scheduler.generation.salt  # type: ignore[union-attr]
        assert salt is not None

        out, meta = _schedule(first, _request("c", prompt))
        assert out.num_scheduled_tokens["c"] == PROMPT_LEN  # a miss: the whole prompt is computed
        assert _names(meta, "loads") == []
        new_names = _names(meta, "saves")
        assert new_names == [generation_chunk_hash(h, salt) for h in old_names]
        assert not set(new_names) & set(old_names)
        assert _play_saves(connector, meta) == records
        stats = _finish(first, out)
        assert stats is not None and stats["generation_resets"] == 1, stats

        # the new generation's own records are hits for this engine
        out, meta = _schedule(first, _request("d", prompt))
        assert _names(meta, "loads") == new_names
        _finish(first, out)
    finally:
        connector._store.close()

    # another engine on the same disk, without the reset: the records stored before are all there
    other = real_scheduler(_config(tiny_llama, disk), num_blocks=128)
    try:
        out, meta = _schedule(other, _request("e", prompt))
        assert _names(meta, "loads") == old_names
        assert out.num_scheduled_tokens["e"] < PROMPT_LEN
        _finish(other, out)
    finally:
        _connector(other)._store.close()


def test_a_connector_reset_while_requests_run_still_starts_a_generation(tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM calls the connector's reset even when its own prefix-cache reset fails (requests hold blocks):
    the request that ran keeps going, but nothing of it is saved under the new generation."""
    prompt = [random.Random(6).randrange(3, 250) for _ in range(PROMPT_LEN)]
    scheduler = real_scheduler(_config(tiny_llama, tmp_path / "disk"), num_blocks=128)
    connector = _connector(scheduler)
    try:
        scheduler.add_request(_request("run", prompt + [9] * 100))  # 300 tokens: two steps of prefill
        scheduler.scheduler_config.max_num_batched_tokens = 160
        first = scheduler.schedule()
        assert first.num_scheduled_tokens["run"] == 160
        assert scheduler.reset_prefix_cache(reset_connector=True) is False  # vLLM's part fails: blocks held
        assert connector._scheduler.generation.resets == 1  # type: ignore[union-attr]
        runner = ModelRunnerOutput(req_ids=["run"], req_id_to_index={"run": 0}, sampled_token_ids=[[]])
        scheduler.update_from_output(first, runner)
        second = scheduler.schedule()
        assert second.num_scheduled_tokens["run"] == 140
        meta = second.kv_connector_metadata
        assert isinstance(meta, TieredKVMetadata) and meta.requests == []  # chunks 3..: not saved
    finally:
        connector._store.close()


# ------------------------------------------------------------------------------- scheduler side alone
def test_worker_memory_and_failed_chunks_of_the_old_generation_are_forgotten(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    try:
        request = make_request("m", tokens(200))
        side.update_connector_output(TieredKVWorkerMetadata(added={request.block_hashes[3]}))
        assert side.get_num_new_matched_tokens(request, 0) == (4 * 32, False)  # from the workers' memory
        side.update_connector_output(TieredKVWorkerMetadata(failed={b"x" * 32}))
        assert side.reset_cache() is True
        assert len(side.resident) == 0 and not side._failed_chunks
        # the request was known (looked up, nothing computed): it is looked up again, in the new generation
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        side.update_state_after_alloc(request, 0)
        meta = side.build_connector_meta(step([("m", 0)], [], {"m": 200}))
        (plan,) = meta.requests
        assert plan.loads == []
        salt = side.generation.salt
        assert [s.chunk_hash for s in plan.saves] == [  # chunk [0, 4) and the partial one [4, 6)
            generation_chunk_hash(request.block_hashes[end - 1], salt) for end in (4, 6)
        ]
        assert side.take_counters() == {"generation_resets": 1} and side.take_counters() == {}
    finally:
        side.store.close()


def test_a_load_planned_before_the_reset_is_not_loaded(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    try:
        request = make_request("p", tokens(200))
        side.update_connector_output(TieredKVWorkerMetadata(added={request.block_hashes[3]}))
        assert side.get_num_new_matched_tokens(request, 0) == (4 * 32, False)
        side.update_state_after_alloc(request, 4 * 32)
        side.reset_cache()
        meta = side.build_connector_meta(step([("p", 128)], [], {"p": 72}))
        assert all(not plan.loads for plan in meta.requests)
    finally:
        side.store.close()


def test_a_promised_whole_request_load_is_renamed_never_dropped(tmp_path: Path) -> None:
    """vLLM waits for a whole-request load it was promised: the plan still goes to the workers, under
    the new generation's names (found only if this generation saved them; else vLLM recomputes)."""
    # a hybrid model (full-attention and sliding-window layers): its hits are whole-request loads
    groups = KVGroups((KVGroup(0, FULL, 32, (0,)), KVGroup(1, SLIDING, 32, (1,), window=64)))
    side = make_side(tmp_path, kv_groups=groups)
    assert side.whole_request_loads
    try:
        request = make_request("w", tokens(200))
        side.update_connector_output(TieredKVWorkerMetadata(added={request.block_hashes[3]}))
        assert side.get_num_new_matched_tokens(request, 0) == (4 * 32, True)
        side.update_state_after_alloc(request, 4 * 32)
        side.reset_cache()
        meta = side.build_connector_meta(step([], [], {}))
        (plan,) = meta.requests
        assert plan.whole_request
        renamed = generation_chunk_hash(request.block_hashes[3], side.generation.salt)
        assert [load.chunk_hash for load in plan.loads] == [renamed, renamed]  # each KV cache group's records
    finally:
        side.store.close()


def test_every_reset_draws_a_new_salt(tmp_path: Path) -> None:
    side = make_side(tmp_path)
    try:
        request = make_request("s", tokens(200))
        names = set()
        for _ in range(3):
            side.reset_cache()
            names.add(side._state(request).names.name(4))
        assert len(names) == 3 and request.block_hashes[3] not in names
        assert all(len(name) == len(request.block_hashes[3]) for name in names)
        assert side.take_counters() == {"generation_resets": 3}
    finally:
        side.store.close()
