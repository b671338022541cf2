"""Tenants in the KV connector: the request's cache_salt reaches the store with every load and save, and
``require_cache_salt`` keeps a request without one out of the store both ways (counted).

Real parts: vLLM `Request`s with and without ``cache_salt``, a real disk store sealing with a real key ring,
the real `KVSaver` and `KVLoader` over paged CPU caches. No engine.
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from tests.kv.test_kv_scheduler import BLOCK, IDENTITY, BlockTable, step, store_chunk, tokens
from tests.kv.test_kv_worker import LAYERS, layout_of, naming, paged_caches
from tests.store.sealing.rings import new_key, write_ring
from vllm_tiercache.kvcache.blocks.transfer import BlockMover
from vllm_tiercache.kvcache.load.loader import KVLoader
from vllm_tiercache.kvcache.naming import ChunkGeometry, KVNaming
from vllm_tiercache.kvcache.plan import ChunkLoad, ChunkSave
from vllm_tiercache.kvcache.save.saver import KVSaver
from vllm_tiercache.kvcache.scheduler import KVSchedulerSide
from vllm_tiercache.shared.store import build_store


def salted(req_id: str, prompt: list[int], salt: str | None) -> Request:
    """A real vLLM request with ``cache_salt`` (None: without one), hashed as the engine hashes it."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=64),
                   pooling_params=None, cache_salt=salt, block_hasher=get_request_block_hasher(BLOCK, hash_fn))


def scheduler(tmp_path, require_cache_salt: bool) -> KVSchedulerSide:
    store = build_store({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "64MiB"}]})
    kv_naming = KVNaming(namespace="t", identities=(IDENTITY,), geometry=ChunkGeometry(BLOCK, 4 * BLOCK),
                         hash_algo="sha256", save_partial_chunks=True)
    side = KVSchedulerSide(store=store, naming=kv_naming, can_load=True, can_save=True, save_decode=False,
                           require_cache_salt=require_cache_salt)
    side.bind_kv_cache_manager(BlockTable())  # type: ignore[arg-type]
    return side


def test_require_cache_salt_keeps_an_unsalted_request_out_both_ways_and_counts_it(tmp_path) -> None:
    side = scheduler(tmp_path, require_cache_salt=True)
    prompt = tokens(300)
    bare, tenant = salted("bare", prompt, None), salted("tenant", prompt, "tenant-a")
    assert bare.block_hashes != tenant.block_hashes  # the salt is in vLLM's hashes, hence in the keys
    store_chunk(side, bare.block_hashes[3], 4)
    store_chunk(side, tenant.block_hashes[3], 4)
    assert side.get_num_new_matched_tokens(bare, 0) == (0, False)  # stored, but not looked up
    side.update_state_after_alloc(bare, 0)
    assert side.build_connector_meta(step([("bare", 0)], [], {"bare": 300})).requests == []  # nor saved
    assert side.get_num_new_matched_tokens(tenant, 0) == (4 * BLOCK, False)
    side.update_state_after_alloc(tenant, 4 * BLOCK)
    (plan,) = side.build_connector_meta(step([("tenant", 128)], [], {"tenant": 172})).requests
    assert plan.loads and plan.saves
    assert {load.tenant for load in plan.loads} == {save.tenant for save in plan.saves} == {"tenant-a"}
    assert "tenant-a" not in repr(plan)  # the salt travels, but no log line or load trace shows it
    assert side.take_counters() == {"unsalted_requests": 1}
    assert side.take_counters() == {}
    side.store.close()


def test_without_the_option_an_unsalted_request_is_cached_with_no_tenant(tmp_path) -> None:
    side = scheduler(tmp_path, require_cache_salt=False)
    bare = salted("bare", tokens(300), None)
    assert side.get_num_new_matched_tokens(bare, 0) == (0, False)
    side.update_state_after_alloc(bare, 0)
    (plan,) = side.build_connector_meta(step([("bare", 0)], [], {"bare": 300})).requests
    assert plan.saves and all(save.tenant is None for save in plan.saves)
    assert "unsalted_requests" not in side.take_counters()
    side.store.close()


@pytest.fixture
def sealed_store(tmp_path):
    ring = write_ring(tmp_path / "ring.json", "k1", {"k1": new_key()})
    store = build_store({"tiers": [{"kind": "disk", "path": str(tmp_path / "sealed")}],
                         "encryption": {"ring": str(ring)}})
    yield store
    store.close()


@pytest.mark.parametrize("before_forward", [True, False])
def test_a_tenants_saved_chunk_loads_for_that_tenant_only(sealed_store, before_forward: bool) -> None:
    """The saver seals each layer's record for the save's tenant; the loader opens them for the load's
    tenant: the same chunk loaded for another tenant (or none) fails its blocks, which vLLM recomputes."""
    source = paged_caches(3)
    layout = layout_of(source)
    record_key = naming().record_key
    saver = KVSaver(store=sealed_store, key=record_key)
    saver.attach(layout, BlockMover(torch.device("cpu")))
    for layer, name in enumerate(layout.layer_names):
        saver.gather(layer, source[name], [ChunkSave(b"doc", [4, 5, 6], tenant="A"),
                                           ChunkSave(b"doc2", [4, 5, 6], tenant="A")])
    saver.hand_off()
    saver.flush()
    saver.shutdown()
    assert sealed_store.flush(30)
    for tenant, chunk, lands in (("A", b"doc", True), ("B", b"doc2", False), (None, b"doc2", False)):
        target = paged_caches(None)
        loader = KVLoader(store=sealed_store, key=record_key, group_of_layer=dict.fromkeys(range(LAYERS), 0),
                          counted_layer=0)
        loader.attach(layout, target, {name: i for i, name in enumerate(layout.layer_names)},
                      BlockMover(torch.device("cpu")), before_forward=before_forward)
        loader.start([ChunkLoad(chunk, 0, 0, 3, [10, 11, 12], tenant=tenant)], ["r"], set())
        for name in layout.layer_names:
            loader.wait_for_layer(name)
        loader.finish_load()
        errors = loader.take_load_errors()
        if lands:
            assert errors == set()
            assert all(torch.equal(target[n][[10, 11, 12]], source[n][[4, 5, 6]]) for n in layout.layer_names)
        else:
            assert errors == {10, 11, 12}
        loader.shutdown()
    disk = sealed_store.stats()["tiers"]["disk"]
    assert disk["sealed_rejected"] >= 1
