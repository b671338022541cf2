"""A request that reuses most of its prompt writes its new chunks to a ``seen`` tier at once; a fresh prompt
waits for its second use. On vLLM's real `Scheduler` (prefix caching on, so the second prompt's reuse is
vLLM's own cache hit) and the real worker side, over a memory tier and a disk tier whose admission is
``{"policy": "seen", "min_seen": 2}`` (``reused_prompt_share`` at its default, 0.5). No engine: the
scheduler and the worker side are driven directly, as in `tests/kv/handoff/test_handoff.py`, whose helpers
these are.
"""

from __future__ import annotations

from pathlib import Path

from vllm.config import KVTransferConfig
from vllm.v1.outputs import KVConnectorOutput

from tests.kv.handoff.test_handoff import (
    BLOCK,
    CHUNK,
    LAYERS,
    NUM_BLOCKS,
    SPEC,
    _caches,
    _output,
    _request,
    _worker,
    tokens,
)
from tests.support.real_scheduler import cpu_vllm_config, one_group_kv_cache_config, real_scheduler
from vllm_tiercache.kvcache.connector import TieredKVConnector
from vllm_tiercache.kvcache.plan import TieredKVMetadata
from vllm_tiercache.shared.store.admission_config import DEFAULT_REUSED_PROMPT_SHARE


def test_a_turn_that_reuses_its_prompt_is_admitted_at_once_and_a_fresh_prompt_waits(
        tiny_llama: Path, tmp_path: Path) -> None:
    kv = KVTransferConfig(
        kv_connector="TieredKVConnector", kv_connector_module_path="vllm_tiercache.kvcache.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"namespace": "admission", "chunk_size": CHUNK, "tiers": [
            {"kind": "memory", "capacity": "64MiB"},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB",
             "admission": {"policy": "seen", "min_seen": 2}}]})
    scheduler = real_scheduler(cpu_vllm_config(str(tiny_llama), kv, block_size=BLOCK, prefix_caching=True),
                               kv_cache_config=one_group_kv_cache_config(LAYERS, BLOCK, SPEC.num_kv_heads,
                                                                         NUM_BLOCKS))
    connector = scheduler.connector
    assert isinstance(connector, TieredKVConnector)
    first_turn = tokens(520, seed=3)  # 16 full blocks: chunks ending at blocks 4, 8, 12 and 16
    next_turn = first_turn + tokens(280, seed=4)  # 25 blocks: 16 of them vLLM's own prefix cache hit

    worker = _worker(connector, _caches(seed=1))
    saved: dict[str, list[bytes]] = {}
    shares: dict[str, set[float | None]] = {}
    for req_id, prompt in (("first", first_turn), ("next", next_turn)):
        scheduler.add_request(_request(req_id, prompt, None))
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, TieredKVMetadata)
        (plan,) = [plan for plan in meta.requests if plan.req_id == req_id]
        saved[req_id] = [save.chunk_hash for save in plan.saves]
        shares[req_id] = {save.reused_share for save in plan.saves}
        for layer in LAYERS:
            worker.save_layer(layer, worker.loader.kv_caches[layer], meta)
        worker.wait_for_save()
        worker.saver.flush()
        # one token: finished, its blocks stay in vLLM's prefix cache; the worker reports what its memory holds
        residency = KVConnectorOutput(kv_connector_worker_meta=worker.worker_meta())
        scheduler.update_from_output(out, _output(out, residency))
    worker.shutdown()

    assert len(saved["first"]) == 4 and shares["first"] == {0.0}
    assert len(saved["next"]) >= 2 and not set(saved["first"]) & set(saved["next"])
    (share,) = shares["next"]
    assert share is not None and share >= DEFAULT_REUSED_PROMPT_SHARE and share == 16 * BLOCK / len(next_turn)

    store = connector._store
    assert store.flush(30.0)
    disk = next(tier for tier in store.tiers if tier.shared_across_processes)
    on_disk = {record.text.rsplit("|", 2)[-2] for record in disk.iter_stored()}
    assert on_disk == {name.hex() for name in saved["next"]}  # the fresh turn's chunks: memory only
    stats = store.stats()["tiers"]["disk"]
    assert stats["writes_refused"] == 4 * len(LAYERS)
    assert stats["writes_admitted"] == len(saved["next"]) * len(LAYERS)
    store.close()
