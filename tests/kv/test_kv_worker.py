"""KVWorkerSide on real paged-cache-shaped tensors and a real store: round trip, refusals, layout checks."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from vllm_tiercache.kvcache.blocks.layout import PagedLayout, UnsupportedLayoutError
from vllm_tiercache.kvcache.blocks.transfer import BlockMover
from vllm_tiercache.kvcache.load.loader import KVLoader
from vllm_tiercache.kvcache.load.trace import LOAD_TRACE_ENV, read_load_trace
from vllm_tiercache.kvcache.naming import ChunkGeometry, KVNaming
from vllm_tiercache.kvcache.plan import ChunkLoad, ChunkSave, RequestPlan, TieredKVMetadata
from vllm_tiercache.kvcache.save.saver import MAX_PENDING_SAVES, GatheredRecord, KVSaver
from vllm_tiercache.kvcache.worker import KVWorkerSide
from vllm_tiercache.shared.eviction.lineage import PARENT_KEY
from vllm_tiercache.shared.naming.keys import KVModelIdentity, kv_chunk_key
from vllm_tiercache.shared.store import build_store

BLOCK, HEADS, HEAD = 32, 2, 64
NUM_BLOCKS, LAYERS = 16, 3
IDENTITY = KVModelIdentity(
    model="tiny",
    dtype="bfloat16",
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    head_size=HEAD,
    block_size=BLOCK,
    layout="paged-bhnc",
    tp_size=1,
    tp_rank=0,
)


def paged_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """What vLLM's CPU backend registers: one [blocks, kv_heads, block_size, 2*head] view per layer."""
    g = torch.Generator().manual_seed(seed or 0)
    make = (
        (lambda: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g))
        if seed is not None
        else (lambda: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD))
    )
    return {f"model.layers.{i}.self_attn.attn": make().to(torch.bfloat16) for i in range(LAYERS)}


@pytest.fixture
def store(tmp_path):
    s = build_store(
        {
            "tiers": [
                {"kind": "memory", "capacity": "64MiB"},
                {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "64MiB"},
            ]
        }
    )
    yield s
    s.close()


#: the load mode `worker` builds workers with: every test here runs in both (`_both_load_modes`)
_LOAD_MODE = ["layerwise"]


@pytest.fixture(autouse=True, params=["layerwise", "before_forward"])
def _both_load_modes(request):
    _LOAD_MODE[0] = request.param
    yield request.param
    _LOAD_MODE[0] = "layerwise"


def naming() -> KVNaming:
    return KVNaming(namespace="t", identities=(IDENTITY,), geometry=ChunkGeometry(BLOCK, 4 * BLOCK),
                    hash_algo="sha256")


def worker(store, load_mode: str | None = None) -> KVWorkerSide:
    return KVWorkerSide(store=store, naming=naming(), rank=0, use_mla=False, load_mode=load_mode or _LOAD_MODE[0])


def layout_of(caches: dict[str, torch.Tensor]) -> PagedLayout:
    return PagedLayout.learn(caches, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                             use_mla=False)


def save(side: KVWorkerSide, caches: dict[str, torch.Tensor], chunk: bytes, block_ids: list[int]) -> None:
    meta = TieredKVMetadata([RequestPlan("r", saves=[ChunkSave(chunk, block_ids)])])
    for name, tensor in caches.items():
        side.save_layer(name, tensor, meta)
    side.wait_for_save()
    side.saver.flush()


def load(side: KVWorkerSide, loads: list[ChunkLoad]) -> set[int]:
    side.start_load(TieredKVMetadata([RequestPlan("r", loads=loads)]))
    for name in side.layout.layer_names:  # what the attention layers do, in order
        side.loader.wait_for_layer(name)
    side.loader.finish_load()
    return side.loader.take_load_errors()


def saved_chunk(store, seed: int, chunk: bytes, block_ids: list[int]):
    """(source caches, empty target caches, producer that saved ``chunk`` from ``block_ids``, consumer)."""
    source, target = paged_caches(seed), paged_caches(None)
    producer = worker(store)
    producer.register_kv_caches(source, NUM_BLOCKS)
    save(producer, source, chunk, block_ids)
    consumer = worker(store)
    consumer.register_kv_caches(target, NUM_BLOCKS)
    return source, target, producer, consumer


def test_layerwise_save_then_load_into_other_blocks_is_exact(store) -> None:
    source, target, producer, consumer = saved_chunk(store, 1, b"chunk-a", [3, 7, 1, 9])
    errors = load(consumer, [ChunkLoad(b"chunk-a", chunk_start=0, first=1, end=4, block_ids=[12, 13, 14])])
    assert errors == set()
    for name in source:
        assert torch.equal(target[name][[12, 13, 14]], source[name][[7, 1, 9]])
        assert not target[name][[0, 3, 7, 15]].any()  # nothing else was written
    producer.shutdown()
    consumer.shutdown()


def test_load_trace_accounts_for_each_load(store, tmp_path, monkeypatch) -> None:
    """$TIERCACHE_LOAD_TRACE: one line per step's load with its bytes, reads and copies (`bench kv` splits a
    hit's time with it); a load that fails is traced too, and a trace that cannot be written never fails
    a load."""
    trace = tmp_path / "loads.jsonl"
    monkeypatch.setenv(LOAD_TRACE_ENV, str(trace))
    source, target, producer, consumer = saved_chunk(store, 5, b"traced", [2, 3, 4, 5])
    assert load(consumer, [ChunkLoad(b"traced", chunk_start=0, first=0, end=4, block_ids=[8, 9, 10, 11])]) == set()
    assert load(consumer, [ChunkLoad(b"never-saved", chunk_start=0, first=0, end=4, block_ids=[12, 13, 14, 15])]
                ) == {12, 13, 14, 15}
    lines, _ = read_load_trace(str(trace))
    hit, miss = (line for line in lines if line["pid"] == os.getpid() and line["chunks"] == 1)
    record_bytes = 4 * source["model.layers.0.self_attn.attn"][0].nbytes
    assert hit["bytes"] == LAYERS * record_bytes and hit["failed"] == 0 and hit["device"] == "cpu"
    assert hit["before_forward"] is consumer.loads_before_forward
    assert 0 < hit["fetch_s"] and 0 <= hit["copy_s"] and hit["fetch_s"] + hit["copy_s"] <= hit["load_s"]
    assert miss["bytes"] == 0 and miss["failed"] == 1
    assert torch.equal(target["model.layers.0.self_attn.attn"][8:12], source["model.layers.0.self_attn.attn"][2:6])

    (tmp_path / "gone").mkdir()
    monkeypatch.setenv(LOAD_TRACE_ENV, str(tmp_path / "gone"))  # a directory: every write fails
    unwritable = worker(store)
    unwritable.register_kv_caches(paged_caches(None), NUM_BLOCKS)
    assert load(unwritable, [ChunkLoad(b"traced", chunk_start=0, first=0, end=4, block_ids=[8, 9, 10, 11])]) == set()
    assert unwritable.loader.trace is not None and unwritable.loader.trace.broken
    for side in (producer, consumer, unwritable):
        side.shutdown()


@pytest.mark.parametrize("load_mode, before_forward", [("auto", True), ("before_forward", True),
                                                        ("layerwise", False)])
def test_load_mode_decides_whether_a_step_loads_before_its_forward(store, load_mode, before_forward) -> None:
    """before_forward (and auto, on a CPU): `start_load` returns with every layer loaded, on the calling
    thread; layerwise: the loader thread loads while the forward runs, each layer ready on its own."""
    source, target, producer, unused = saved_chunk(store, 4, b"mode", [2, 3, 4, 5])
    unused.shutdown()  # this test's consumer has its own load mode
    consumer = worker(store, load_mode)
    consumer.register_kv_caches(target, NUM_BLOCKS)
    assert consumer.loads_before_forward is before_forward
    threads: set[str] = set()
    run_load = consumer.loader._run_load

    def run_and_note(job):
        threads.add(threading.current_thread().name)
        run_load(job)

    consumer.loader._run_load = run_and_note  # type: ignore[method-assign]
    consumer.start_load(TieredKVMetadata([RequestPlan("r", loads=[ChunkLoad(b"mode", 0, 0, 4, [8, 9, 10, 11])])]))
    job = consumer.loader._job
    assert job is not None
    if before_forward:
        assert job.done.is_set() and threads == {threading.current_thread().name}
    assert job.done.wait(10)
    consumer.loader.finish_load()
    assert consumer.loader.take_load_errors() == set()
    for name in source:
        assert torch.equal(target[name][[8, 9, 10, 11]], source[name][[2, 3, 4, 5]])
    if not before_forward:
        assert threads == {"tiercache-kv-loader"}
    producer.shutdown()
    consumer.shutdown()


def test_remembered_keys_are_the_namings_keys(store) -> None:
    """`KVWorkerSide.key` remembers keys (a hit rebuilt them per chunk and layer): the same objects the
    second time, and always the naming's own key, layer by layer."""
    side = worker(store)
    first = [side.key(b"chunk-k", layer) for layer in range(LAYERS)]
    assert [side.key(b"chunk-k", layer) for layer in range(LAYERS)] == first
    assert all(a is b for a, b in zip(first, [side.key(b"chunk-k", layer) for layer in range(LAYERS)], strict=True))
    assert first == [side.naming.record_key(b"chunk-k", layer) for layer in range(LAYERS)]
    assert len({key.digest for key in first}) == LAYERS
    assert side.key(b"chunk-j", 0) != first[0]
    side.shutdown()


def test_a_record_of_another_dtype_or_a_missing_layer_is_a_load_error(store) -> None:
    target = paged_caches(None)
    side = worker(store)
    side.register_kv_caches(target, NUM_BLOCKS)
    for layer in range(LAYERS):  # right shape and layout text, wrong dtype: must never reach attention
        store.put(
            kv_chunk_key("t", IDENTITY, b"fp32", layer),
            torch.ones(2, HEADS, BLOCK, 2 * HEAD),
            {"layout": side.layout.describe(), "blocks": 2},
        )
    store.put(
        kv_chunk_key("t", IDENTITY, b"partial", 0),
        torch.ones(2, HEADS, BLOCK, 2 * HEAD).bfloat16(),
        {"layout": side.layout.describe(), "blocks": 2},
    )
    errors = load(side, [ChunkLoad(b"fp32", 0, 0, 2, [4, 5]), ChunkLoad(b"partial", 0, 0, 2, [6, 8])])
    assert errors == {4, 5, 6, 8}
    assert not any(t[[4, 5]].any() for t in target.values())  # the fp32 record never landed anywhere
    assert side.take_counters()["load_errors"] == 2
    side.shutdown()


def test_unknown_layouts_are_refused_with_a_clear_message() -> None:
    bad = {"model.layers.0.attn": torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD)}  # [2, blocks, ...] (K/V first)
    with pytest.raises(UnsupportedLayoutError, match=r"unknown KV cache layout \(2, 16, 32, 2, 64\)"):
        PagedLayout.learn(
            bad, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, use_mla=False
        )
    mixed = {
        "model.layers.0.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD),
        "model.layers.1.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.float16),
    }
    with pytest.raises(UnsupportedLayoutError, match="one shape and dtype"):
        PagedLayout.learn(
            mixed, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, use_mla=False
        )


def test_layers_are_ordered_by_index_not_by_name() -> None:
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for i in (10, 2, 1)}
    layout = PagedLayout.learn(
        caches, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, use_mla=False
    )
    assert layout.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in (1, 2, 10))


def test_memory_evictions_are_reported_to_the_scheduler(tmp_path) -> None:
    small = build_store({"tiers": [{"kind": "memory", "capacity": 3 * 2 * HEADS * BLOCK * 2 * HEAD * 2}]})
    source = paged_caches(2)
    side = worker(small)
    side.register_kv_caches(source, NUM_BLOCKS)
    save(side, source, b"first", [0, 1])
    assert side.worker_meta().added == {b"first"}
    save(side, source, b"second", [2, 3])  # 6 records of 2 blocks each: the first chunk's layers go
    meta = side.worker_meta()
    assert meta.added == {b"second"} and meta.evicted == {b"first"}
    side.shutdown()
    small.close()


def test_a_chunk_the_memory_tier_refused_is_never_reported_resident(tmp_path) -> None:
    tiny = build_store(
        {
            "tiers": [
                {"kind": "memory", "capacity": 1024},  # smaller than one record
                {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "64MiB"},
            ]
        }
    )
    source = paged_caches(3)
    side = worker(tiny)
    side.register_kv_caches(source, NUM_BLOCKS)
    save(side, source, b"too-big", [0, 1])
    assert side.worker_meta() is None  # on disk (shared tiers answer for it), but not in worker memory
    assert tiny.contains_many([kv_chunk_key("t", IDENTITY, b"too-big", 0)], shared_only=True) == [True]
    side.shutdown()
    tiny.close()


def test_block_runs_group_consecutive_ids() -> None:
    from vllm_tiercache.kvcache.blocks.transfer import block_runs

    assert block_runs([]) == []
    assert block_runs([5, 6, 7, 2, 3, 9]) == [(0, 5, 3), (3, 2, 2), (5, 9, 1)]
    assert block_runs([4, 3]) == [(0, 4, 1), (1, 3, 1)]


def test_disk_hits_land_in_the_kv_cache_in_place_and_corrupt_ones_fail_their_blocks(tmp_path) -> None:
    """With a disk tier, a load of a whole record is read straight into its blocks of the paged cache (no
    copy of its own), whatever their order; a corrupt record is a load error for its blocks, and a load of
    part of a record still lands exactly (through a buffer)."""
    tiers = {"tiers": [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "64MiB"}]}
    source, target = paged_caches(2), paged_caches(None)
    with build_store(tiers) as producer_store:
        producer = worker(producer_store)
        producer.register_kv_caches(source, NUM_BLOCKS)
        save(producer, source, b"run", [1, 2, 3, 4])
        save(producer, source, b"bad", [5, 6, 7, 8])
        producer.shutdown()
    with build_store(tiers) as store:
        bad = store.tiers[0].path_for(kv_chunk_key("t", IDENTITY, b"bad", 1))
        raw = bytearray(bad.read_bytes())
        raw[-50] ^= 0x01
        bad.write_bytes(raw)
        consumer = worker(store)
        consumer.register_kv_caches(target, NUM_BLOCKS)
        copied: list[int] = []  # records the loader had to copy itself, per layer
        scatter_spans = consumer.mover.scatter_spans
        consumer.mover.scatter_spans = lambda layer, items: (copied.append(len(items)), scatter_spans(layer, items))
        errors = load(consumer, [ChunkLoad(b"run", 0, 0, 4, [9, 10, 11, 12]),
                                 ChunkLoad(b"bad", 0, 0, 4, [0, 1, 2, 3])])
        assert errors == {0, 1, 2, 3} and copied == [0] * LAYERS
        for name in source:
            assert torch.equal(target[name][9:13], source[name][1:5])
        assert store.tiers[0].counters.get("corrupt") == 1
        errors = load(consumer, [ChunkLoad(b"run", 0, 0, 4, [15, 4, 13, 6])])  # scattered blocks: in place too
        assert errors == set() and copied == [0] * (2 * LAYERS)
        for name in source:
            assert torch.equal(target[name][[15, 4, 13, 6]], source[name][1:5])
        errors = load(consumer, [ChunkLoad(b"run", 0, 1, 4, [2, 3, 5])])  # not from its first block: a buffer
        assert errors == set() and copied == [0] * (2 * LAYERS) + [1] * LAYERS
        for name in source:
            assert torch.equal(target[name][[2, 3, 5]], source[name][2:5])
        consumer.shutdown()


def test_block_spans_follow_ascending_and_descending_ids() -> None:
    from vllm_tiercache.kvcache.blocks.transfer import block_spans

    assert block_spans([]) == []
    assert block_spans([5, 6, 7, 2, 3, 9]) == [(0, 5, 3, 1), (3, 2, 2, 1), (5, 9, 1, 1)]
    assert block_spans([9, 8, 7, 3, 2, 2, 1, 0]) == [(0, 9, 3, -1), (3, 3, 2, -1), (5, 2, 3, -1)]


def test_loads_into_descending_blocks_are_exact(store) -> None:
    """vLLM hands a request blocks in descending runs once its pool has cycled: such loads, from the memory
    tier (strided copies) and from disk (in place, one piece per block), land exactly where asked."""
    source, target, producer, consumer = saved_chunk(store, 3, b"down", [1, 2, 3, 4])
    loads = [ChunkLoad(b"down", 0, 0, 4, [15, 14, 13, 0]), ChunkLoad(b"down", 0, 0, 4, [7, 6, 9, 8])]
    assert load(consumer, loads) == set()
    for name in source:
        assert torch.equal(target[name][[15, 14, 13, 0]], source[name][1:5])
        assert torch.equal(target[name][[7, 6, 9, 8]], source[name][1:5])
    producer.shutdown()
    consumer.shutdown()
    with build_store({"tiers": [{"kind": "disk", "path": str(store.tiers[1].root), "capacity": "64MiB"}]}) as disk:
        again, fresh = worker(disk), paged_caches(None)
        again.register_kv_caches(fresh, NUM_BLOCKS)
        assert load(again, loads) == set()
        for name in source:
            assert torch.equal(fresh[name][[15, 14, 13, 0]], source[name][1:5])
            assert torch.equal(fresh[name][[7, 6, 9, 8]], source[name][1:5])
        again.shutdown()


def test_descending_copies_into_a_strided_layer_land_too() -> None:
    """A layer that is not one contiguous tensor (a view with strides) takes descending spans block by
    block: a numpy view of it would be a copy, and the writes would be lost."""
    from vllm_tiercache.kvcache.blocks.transfer import BlockMover, block_spans

    both = torch.zeros(NUM_BLOCKS, 2, HEADS, BLOCK, HEAD)
    layer = both[:, 0]  # every other half of each block: not contiguous
    blocks = torch.randn(4, HEADS, BLOCK, HEAD)
    BlockMover(torch.device("cpu")).scatter_spans(layer, [(block_spans([9, 8, 7, 2]), blocks)])
    assert torch.equal(layer[[9, 8, 7, 2]], blocks) and not both[:, 1].any()


def test_the_saver_alone_stores_every_layers_record_and_reports_the_chunk_resident(store) -> None:
    """`KVSaver` without a worker: a gather per layer keeps named records (key, blocks, chunk, whether it
    is the chunk's last layer, its first block), the hand-off stores them with their layout and start,
    and the chunk, whole in the memory tier, is reported resident."""
    source = paged_caches(6)
    layout = layout_of(source)
    record_key = naming().record_key
    saver = KVSaver(store=store, key=record_key)
    saver.attach(layout, BlockMover(torch.device("cpu")))
    for layer, name in enumerate(layout.layer_names):
        saver.gather(layer, source[name], [ChunkSave(b"alone", [5, 2], first=1, parent_hash=b"before")])
    assert [record.last_layer for record in saver.gathered] == [False] * (LAYERS - 1) + [True]
    first = saver.gathered[0]
    assert isinstance(first, GatheredRecord)
    assert (first.key, first.chunk_hash, first.first_block) == (record_key(b"alone", 0), b"alone", 1)
    saver.hand_off()
    assert saver.gathered == []
    saver.flush()
    assert saver.queued == 0
    for layer, name in enumerate(layout.layer_names):
        (record,) = store.get_many([record_key(b"alone", layer)])
        assert record is not None and torch.equal(record.tensor, source[name][[5, 2]])
        assert record.meta["layout"] == layout.describe() and record.meta["blocks"] == 2
        assert record.meta["start"] == 1
        assert record.meta[PARENT_KEY] == record_key(b"before", layer).digest  # the same layer's record before
    block_bytes = source[layout.layer_names[0]][0].nbytes
    assert saver.counters.saved_chunks == 1 and saver.counters.saved_bytes == LAYERS * 2 * block_bytes
    changes = saver.residency.take()
    assert changes is not None and changes.added == {b"alone"}
    saver.shutdown()


def test_the_saver_drops_a_hand_off_past_its_backlog(store) -> None:
    """A saver thread that is MAX_PENDING_SAVES records behind gets no more: the step's records are dropped
    and counted, and the step never waits."""
    source = paged_caches(7)
    layout = layout_of(source)
    saver = KVSaver(store=store, key=naming().record_key)
    saver.attach(layout, BlockMover(torch.device("cpu")))
    saver.gather(0, source[layout.layer_names[0]], [ChunkSave(b"late", [1, 2]), ChunkSave(b"later", [3])])
    saver.queued = MAX_PENDING_SAVES - 1  # as if the thread were that far behind
    saver.hand_off()
    assert saver.gathered == [] and saver.counters.dropped_saves == 2 and saver.queued == MAX_PENDING_SAVES - 1
    saver.queued = 0
    saver.shutdown()
    assert store.get_many([naming().record_key(b"late", 0)]) == [None]


def test_the_loader_alone_lands_what_is_stored_and_fails_what_is_not(store) -> None:
    """`KVLoader` without a worker, in either load mode: a stored chunk lands in the blocks it is given,
    layer by layer; a missing one fails its blocks, which vLLM then recomputes."""
    source, target = paged_caches(8), paged_caches(None)
    layout = layout_of(target)
    record_key = naming().record_key
    for layer, name in enumerate(layout.layer_names):
        store.put(record_key(b"kept", layer), source[name][[4, 5, 6]].clone(),
                  {"layout": layout.describe(), "blocks": 3})
    loader = KVLoader(store=store, key=record_key, group_of_layer=dict.fromkeys(range(LAYERS), 0), counted_layer=0)
    loader.attach(layout, target, {name: i for i, name in enumerate(layout.layer_names)},
                  BlockMover(torch.device("cpu")), before_forward=_LOAD_MODE[0] == "before_forward")
    loader.start([ChunkLoad(b"kept", 0, 0, 3, [10, 11, 12]), ChunkLoad(b"gone", 0, 0, 2, [1, 2])], ["r", "r"], set())
    for name in layout.layer_names:
        loader.wait_for_layer(name)
        assert torch.equal(target[name][[10, 11, 12]], source[name][[4, 5, 6]])
    loader.finish_load()
    assert loader.take_load_errors() == {1, 2} and loader.take_transfer_results() == (set(), set())
    assert not any(t[[1, 2]].any() for t in target.values())
    assert loader.counters.loaded_blocks == 3 and loader.counters.load_errors == 1
    loader.shutdown()


def test_an_idle_loader_fails_every_load_it_is_given(store) -> None:
    """A loader never attached to KV caches (an idle worker) fails its loads: whole-request loads as failed
    receiving, their chunks reported to the scheduler, the other loads' blocks as load errors."""
    loader = KVLoader(store=store, key=naming().record_key, group_of_layer={}, counted_layer=0)
    loader.start([ChunkLoad(b"a", 0, 0, 2, [3, 4]), ChunkLoad(b"b", 0, 0, 1, [7])], ["part", "whole"], {"whole"})
    loader.finish_load()
    assert loader.take_transfer_results() == ({"whole"}, {"whole"})
    assert loader.take_load_errors() == {3, 4}
    assert loader.take_failed_chunks() == set()  # idle: no job ran, so no chunk was found unusable
    loader.shutdown()
