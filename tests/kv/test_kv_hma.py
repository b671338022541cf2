"""TieredKVConnector under vLLM's hybrid KV cache manager (HMA), at scheduler level, without an engine.

vLLM's own `Scheduler` and `KVCacheManager` run over a real hybrid `KVCacheConfig` (a full-attention group
and a sliding-window group, as vLLM builds for Gemma 3), with the connector built by the scheduler from a
real `VllmConfig` of the tiny Gemma 3. The worker's saves are played into the real store by hand; the test
then checks what a fresh scheduler (a restart) claims and that every planned load lands exactly in the
blocks vLLM allocated for it (never in the null block, never outside the window).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from tests.support.real_scheduler import cpu_vllm_config, hashed_request, real_scheduler, schedule_new
from vllm_tiercache.kvcache.connector import TieredKVConnector
from vllm_tiercache.kvcache.groups import FULL, SLIDING, KVGroups
from vllm_tiercache.kvcache.plan import TieredKVMetadata
from vllm_tiercache.kvcache.planning import NULL_BLOCK_ID
from vllm_tiercache.tools.tiny_models.gemma3 import TinyGemma3Spec, make_tiny_gemma3

BLOCK, CHUNK, WINDOW = 32, 128, 64  # 4 blocks per chunk; the window keeps 2 blocks below a hit's end
SPEC = TinyGemma3Spec()


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3", SPEC)


def _layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def hybrid_kv_cache_config(num_blocks: int = 200, *, mamba: bool = False) -> KVCacheConfig:
    """The groups vLLM builds for the tiny Gemma 3 (layers 1, 3 global; 0, 2 sliding), optionally plus a
    mamba group."""
    common: dict[str, Any] = dict(block_size=BLOCK, num_kv_heads=SPEC.num_kv_heads, head_size=SPEC.head_dim,
                                  dtype=torch.bfloat16)
    groups = [
        KVCacheGroupSpec([_layer(1), _layer(3)], FullAttentionSpec(**common)),
        KVCacheGroupSpec([_layer(0), _layer(2)], SlidingWindowSpec(sliding_window=WINDOW, **common)),
    ]
    if mamba:
        groups.append(KVCacheGroupSpec(["model.layers.4.mixer"],
                                       MambaSpec(block_size=BLOCK, shapes=((4, 4),), dtypes=(torch.float32,))))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def gemma_config(model: Path, tmp_path: Path) -> VllmConfig:
    kv = KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="vllm_tiercache.kvcache.connector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "namespace": "hma",
            "chunk_size": CHUNK,
            "tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}],
        },
    )
    return cpu_vllm_config(str(model), kv, block_size=BLOCK, prefix_caching=True)


def scheduler_over(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Scheduler:
    return real_scheduler(vllm_config, kv_cache_config=kv_cache_config)


def make_request(req_id: str, prompt: list[int]) -> Request:
    return hashed_request(req_id, prompt, BLOCK)


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def play_saves(connector: TieredKVConnector, meta: TieredKVMetadata, skip: tuple[bytes, int] | None = None) -> int:
    """Do what the workers do with the plan's saves: one record per layer of the save's group (but not
    the save of `skip`: a chunk hash and a group)."""
    naming = connector._scheduler.naming  # type: ignore[union-attr]
    groups = {g.index: g for g in naming.groups.groups}
    count = 0
    for plan in meta.requests:
        for save in plan.saves:
            group = groups[save.group]
            if skip == (save.chunk_hash, save.group):
                continue
            for layer in group.layers:
                blocks = torch.zeros(len(save.block_ids), SPEC.num_kv_heads, BLOCK, 2 * SPEC.head_dim,
                                     dtype=torch.bfloat16)
                connector._store.put(naming.record_key(save.chunk_hash, layer, 0, group.tag), blocks,
                                     {"blocks": len(save.block_ids), "start": save.first})
                count += 1
    connector._store.flush()
    return count


def test_groups_read_from_vllms_kv_cache_config() -> None:
    groups = KVGroups.from_kv_cache_config(hybrid_kv_cache_config(), BLOCK, SPEC.num_layers)
    assert groups.supported and groups.hybrid
    full, sliding = groups.groups
    assert (full.kind, full.layers, full.tag) == (FULL, (1, 3), None)
    assert (sliding.kind, sliding.layers, sliding.tag) == (SLIDING, (0, 2), f"sw{WINDOW}+0b{BLOCK}")
    assert sliding.window_blocks == 2  # cdiv(64 - 1, 32): vLLM keeps blocks [H - 2, H) below a hit end H
    assert sliding.record_start(4, 8) == 5 and full.record_start(4, 8) == 4
    # one full-attention group: the naming of a model without HMA, unchanged
    full_only = hybrid_kv_cache_config().kv_cache_groups[:1]
    single = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=full_only)
    assert KVGroups.from_kv_cache_config(single, BLOCK, 4) == KVGroups.single(4, BLOCK)
    mamba = KVGroups.from_kv_cache_config(hybrid_kv_cache_config(mamba=True), BLOCK, 5)
    assert not mamba.supported and "MambaSpec" in (mamba.unsupported or "")


def test_vllm_keeps_hma_on_with_the_connector(tiny_gemma3: Path, tmp_path: Path) -> None:
    config = gemma_config(tiny_gemma3, tmp_path)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False


_schedule_prompt = schedule_new


@pytest.mark.parametrize("prompt_len", [330, 320])  # 320: block-aligned, so the hit ends one block short
def test_restart_hits_and_loads_only_the_window(tiny_gemma3: Path, tmp_path: Path, prompt_len: int) -> None:
    prompt = tokens(prompt_len)
    first = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config())
    connector = first.connector
    assert isinstance(connector, TieredKVConnector)
    _, meta = _schedule_prompt(first, make_request("a", prompt))
    (plan,) = meta.requests
    assert not plan.loads
    # every chunk is saved for both groups; the sliding-window records hold only the window's blocks
    by_group: dict[int, list[int]] = {}
    for save in plan.saves:
        by_group.setdefault(save.group, []).append(len(save.block_ids))
    assert by_group[0] == [4, 4, 2]  # chunks [0,4) [4,8) and the partial [8,10)
    assert by_group[1] == [3, 3, 2]  # window_blocks + 1 at most, inside the chunk
    table = first.kv_cache_manager.get_block_ids("a")
    for save in plan.saves:
        assert NULL_BLOCK_ID not in save.block_ids
        end = save.first + len(save.block_ids)
        assert save.block_ids == table[save.group][save.first:end]
    assert play_saves(connector, meta) == 2 * 3 + 2 * 3
    connector._store.close()

    # restart: a fresh scheduler over the same store; the same prompt plus a question
    second = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config())
    request = make_request("b", prompt + tokens(40, seed=1))
    hit_blocks = (prompt_len // BLOCK)  # the partial last chunk ends at block 10
    output, meta = _schedule_prompt(second, request)
    # several groups: one whole-request load vLLM waits for (block-level failures are not allowed)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not output.scheduled_new_reqs
    assert request.num_computed_tokens == hit_blocks * BLOCK
    (plan,) = meta.requests
    assert plan.whole_request and not plan.saves
    table = second.kv_cache_manager.get_block_ids("b")
    loaded: dict[int, list[int]] = {0: [], 1: []}
    for load in plan.loads:
        assert load.block_ids == table[load.group][load.first:load.end]
        loaded[load.group].extend(range(load.first, load.end))
    assert loaded[0] == list(range(hit_blocks))
    assert loaded[1] == [hit_blocks - 2, hit_blocks - 1]  # only the window at the hit's end
    # exactly the blocks vLLM allocated for the sliding-window group below the hit: the rest is null
    allocated = [i for i, block in enumerate(table[1][:hit_blocks]) if block != NULL_BLOCK_ID]
    assert allocated == loaded[1]
    second.connector._store.close()  # type: ignore[union-attr]

    # the same prompt alone (block-aligned at 320: the hit stops one block short, at 9)
    third = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config())
    request = make_request("c", prompt)
    output, meta = _schedule_prompt(third, request)
    usable = (prompt_len - 1) // BLOCK
    assert request.num_computed_tokens == usable * BLOCK
    table = third.kv_cache_manager.get_block_ids("c")
    window = [load for load in meta.requests[0].loads if load.group == 1]
    assert [i for load in window for i in range(load.first, load.end)] == [
        i for i, block in enumerate(table[1][:usable]) if block != NULL_BLOCK_ID
    ]
    third.connector._store.close()  # type: ignore[union-attr]


def test_a_missing_window_record_shortens_the_hit(tiny_gemma3: Path, tmp_path: Path) -> None:
    prompt = tokens(330)
    first = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config())
    _, meta = _schedule_prompt(first, make_request("a", prompt))
    connector = first.connector
    # no window record of the last chunk (ends at block 10): the hit ends at the chunk before, block 8
    play_saves(connector, meta, skip=(make_request("x", prompt).block_hashes[9], 1))
    connector._store.close()
    second = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config())
    request = make_request("b", prompt)
    _schedule_prompt(second, request)
    assert request.num_computed_tokens == 8 * BLOCK
    second.connector._store.close()  # type: ignore[union-attr]


def test_unsupported_group_claims_no_hit_and_saves_nothing(tiny_gemma3: Path, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        scheduler = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config(mamba=True))
    assert "MambaSpec" in caplog.text and "hybrid KV cache manager stays on" in caplog.text
    side = scheduler.connector._scheduler  # type: ignore[union-attr]
    request = make_request("a", tokens(330))
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.connector._store.close()  # type: ignore[union-attr]


def test_a_model_whose_only_group_slides(tiny_gemma3: Path, tmp_path: Path) -> None:
    """Every layer in one sliding-window group (a Mistral-7B-v0.1 shape): no full-attention records, the
    hit is the window at a chunk end, loaded as one whole-request load."""
    common: dict[str, Any] = dict(block_size=BLOCK, num_kv_heads=SPEC.num_kv_heads, head_size=SPEC.head_dim,
                                  dtype=torch.bfloat16)
    layers = [_layer(i) for i in range(4)]
    only = KVCacheConfig(num_blocks=200, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layers, SlidingWindowSpec(sliding_window=WINDOW, **common))])
    prompt = tokens(330)
    first = scheduler_over(gemma_config(tiny_gemma3, tmp_path), only)
    _, meta = _schedule_prompt(first, make_request("a", prompt))
    assert [len(s.block_ids) for s in meta.requests[0].saves] == [3, 3, 2]
    play_saves(first.connector, meta)  # type: ignore[arg-type]
    first.connector._store.close()  # type: ignore[union-attr]
    second = scheduler_over(gemma_config(tiny_gemma3, tmp_path), only)
    request = make_request("b", prompt)
    _, meta = _schedule_prompt(second, request)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and request.num_computed_tokens == 10 * BLOCK
    (plan,) = meta.requests
    assert plan.whole_request
    assert [i for load in plan.loads for i in range(load.first, load.end)] == [8, 9]
    table = second.kv_cache_manager.get_block_ids("b")[0]
    assert [i for i, block in enumerate(table[:10]) if block != NULL_BLOCK_ID] == [8, 9]
    second.connector._store.close()  # type: ignore[union-attr]


def test_a_worker_with_layers_in_no_group_fails_the_loads_it_cannot_place(tiny_gemma3: Path, tmp_path: Path
                                                                           ) -> None:
    """A registered KV cache layer outside every group the scheduler knows (vLLM adds KV-sharing layers to
    the groups after it built the connector) leaves the worker idle, and a load planned for it fails: the
    request is recomputed, never run over blocks nothing was loaded into."""
    from vllm_tiercache.kvcache.worker import KVWorkerSide

    first = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config())
    _, meta = _schedule_prompt(first, make_request("a", tokens(320)))
    play_saves(first.connector, meta)  # type: ignore[arg-type]
    first.connector._store.close()  # type: ignore[union-attr]
    second = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config())
    request = make_request("b", tokens(320) + tokens(40, seed=1))
    _, meta = _schedule_prompt(second, request)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and meta.requests[0].loads

    connector = second.connector
    assert isinstance(connector, TieredKVConnector)
    worker = KVWorkerSide(store=connector._store, naming=connector._scheduler.naming,  # type: ignore[union-attr]
                          rank=0, use_mla=False)
    caches = {_layer(i): torch.zeros(200, SPEC.num_kv_heads, BLOCK, 2 * SPEC.head_dim, dtype=torch.bfloat16)
              for i in range(SPEC.num_layers + 1)}  # one layer more than the groups hold
    assert worker.register_kv_caches(caches, 200) is None
    worker.start_load(meta)
    assert worker.loader.take_transfer_results() == ({"b"}, {"b"})
    assert all(not t.any() for t in caches.values()), "nothing was written into the KV cache"
    worker.shutdown()
    connector._store.close()


def test_a_failed_partial_chunk_is_not_claimed_again(tiny_gemma3: Path, tmp_path: Path) -> None:
    """A chunk found by probing the shorter endings (a document's partial last chunk) that a load could
    not use is claimed no more, like a full chunk: under HMA a failed whole-request load sends the request
    back to lookup, so claiming it again would fail and recompute it on every lookup."""
    from vllm_tiercache.kvcache.plan import TieredKVWorkerMetadata

    prompt = tokens(330)
    first = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config())
    _, meta = _schedule_prompt(first, make_request("a", prompt))
    play_saves(first.connector, meta)  # type: ignore[arg-type]
    first.connector._store.close()  # type: ignore[union-attr]

    second = scheduler_over(gemma_config(tiny_gemma3, tmp_path), hybrid_kv_cache_config())
    side = second.connector._scheduler  # type: ignore[union-attr]
    request = make_request("b", prompt + tokens(40, seed=1))
    assert side.get_num_new_matched_tokens(request, 0) == (10 * BLOCK, True)  # the partial chunk ends at 10
    side.update_connector_output(TieredKVWorkerMetadata(added=set(), evicted=set(),
                                                        failed={request.block_hashes[9]}))
    assert side.get_num_new_matched_tokens(request, 0) == (8 * BLOCK, True)  # the full chunks only
    second.connector._store.close()  # type: ignore[union-attr]
