"""TieredECConnector's scheduler side driven by vLLM's real `Scheduler` (no model runs here).

What these pin down:
- answers are re-checked when vLLM asks: an item evicted from the store while its request was preempted
  is not promised on resume, vLLM encodes it instead;
- `ensure_cache_available` looks up only what a request still needs (a decoding request costs nothing);
- an `ec_producer` answers from the store, so vLLM does not encode again what is already published;
- the loads carry this step's `scheduled_encoder_inputs` by reference, and that reference survives the
  pickling vLLM's multiproc executor applies to a `SchedulerOutput`;
- the `cacheable` hook keeps an identifier out of lookups, promises, loads and saves;
- the counters reach vLLM's `SchedulerStats.ec_connector_stats` (workers' ones through their reports) and
  `/metrics` series `vllm:tiercache_ec_*` (the real server is in tests/ec/test_ec_metrics_server.py).
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, ECTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from tests.support.real_scheduler import real_scheduler
from vllm_tiercache.eccache.connector import ECCounters, TieredECConnector
from vllm_tiercache.eccache.scheduler import ECSchedulerSide, LoadItem, TieredECMetadata, TieredECWorkerMetadata
from vllm_tiercache.eccache.worker import ECWorkerSide
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey

#: Placeholder tokens (= embeddings) of one image in these requests; the prompt has PROMPT_LEN tokens.
IMAGE_TOKENS = 8
PROMPT_LEN = 24
#: Identifiers shaped like vLLM's content hashes (the connector keeps any other kind out of the store).
IMG_A, IMG_B, IMG_C = (hashlib.sha256(name.encode()).hexdigest() for name in ("img-a", "img-b", "img-c"))


def _ec_config(tmp_path: Path, role: str = "ec_both") -> ECTransferConfig:
    return ECTransferConfig(
        ec_connector="TieredECConnector",
        ec_connector_module_path="vllm_tiercache.eccache.connector",
        ec_role=role,
        ec_connector_extra_config={
            "namespace": "sched",
            "tiers": [{"kind": "disk", "path": str(tmp_path / "ec"), "capacity": "16MiB"}],
        },
    )


def _scheduler(model: Path, ec: ECTransferConfig, num_blocks: int = 64) -> Scheduler:
    """vLLM's own Scheduler over the tiny BLIP-2 config: it builds the EC connector (role SCHEDULER)."""
    block_size = 16
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=256),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=False),
        ec_transfer_config=ec,
        device_config=DeviceConfig("cpu"),
    )
    return real_scheduler(vllm_config, num_blocks)


def _request(req_id: str, identifiers: list[str], max_tokens: int = 4) -> Request:
    """A prompt with one image placeholder range per identifier (images back to back from token 1)."""
    features = [
        MultiModalFeatureSpec(
            data=None, modality="image", identifier=ident,
            mm_position=PlaceholderRange(offset=1 + i * IMAGE_TOKENS, length=IMAGE_TOKENS),
        )
        for i, ident in enumerate(identifiers)
    ]
    return Request(
        request_id=req_id, prompt_token_ids=list(range(10, 10 + PROMPT_LEN)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), pooling_params=None,
        mm_features=features,
    )


def _connector(scheduler: Scheduler) -> TieredECConnector:
    connector = scheduler.ec_connector
    assert isinstance(connector, TieredECConnector)
    return connector


def _store_item(scheduler: Scheduler, identifier: str) -> None:
    """Publish an encoder output for `identifier` as another instance would (disk tier, flushed)."""
    connector = _connector(scheduler)
    connector._store.put(connector._key(identifier), torch.zeros(IMAGE_TOKENS, 128), {"mm_hash": identifier})
    assert connector._store.flush(10.0)


def _evict_all(scheduler: Scheduler) -> int:
    """Evict every record from the shared tiers, as `tiercache evict` does (`delete_where` on disk)."""
    removed = 0
    for tier in _connector(scheduler)._store.tiers:
        if tier.kind == "disk":
            removed += tier.delete_where(lambda text, size, atime: True)[0]
    return removed


def _step(scheduler: Scheduler, worker_meta: TieredECWorkerMetadata | None = None) -> tuple[Any, Any]:
    """One schedule + a model output sampling token 7 for every scheduled request; returns (output, stats)."""
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
        ec_connector_output=ECConnectorOutput(ec_connector_worker_meta=worker_meta) if worker_meta else None,
    )
    engine_outputs = scheduler.update_from_output(out, runner)
    stats = next((eco.scheduler_stats for eco in engine_outputs.values() if eco.scheduler_stats), None)
    return out, stats


def _close(scheduler: Scheduler) -> None:
    _connector(scheduler)._store.close()


class _CountingStore:
    """Wraps a store; counts `contains_many` calls and keys (what a lookup costs)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: list[int] = []

    def contains_many(self, keys: list[StoreKey], shared_only: bool = False, bounded: bool | None = None) -> list[bool]:
        self.calls.append(len(keys))
        return self.store.contains_many(keys, shared_only=shared_only)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


# ------------------------------------------------------------------------------------------- re-check


@pytest.mark.parametrize("evicted", [True, False], ids=["evicted-while-preempted", "still-stored"])
def test_resume_after_preemption_asks_the_store_again(tiny_blip2: Path, tmp_path: Path, evicted: bool) -> None:
    scheduler = _scheduler(tiny_blip2, _ec_config(tmp_path))
    try:
        _store_item(scheduler, IMG_A)
        scheduler.add_request(_request("r1", [IMG_A], max_tokens=8))
        out, _ = _step(scheduler)
        meta = out.ec_connector_metadata
        assert isinstance(meta, TieredECMetadata)
        assert "r1" not in out.scheduled_encoder_inputs  # promised: vLLM does not encode it
        assert meta.loads == [LoadItem(IMG_A, "r1", 0, IMAGE_TOKENS)]
        # The loads carry this step's dict itself (the worker adds failed loads to it), not a copy.
        assert meta.scheduled_encoder_inputs is out.scheduled_encoder_inputs

        # Preempt the running request; vLLM's own encoder cache loses the output too (memory pressure:
        # its cache manager alone, not `Scheduler.reset_encoder_cache`, which means new weights and starts
        # a new generation of our records, see tests/ec/test_ec_generations.py).
        assert scheduler.reset_prefix_cache(reset_running_requests=True)
        scheduler.encoder_cache_manager.reset()
        assert scheduler.requests["r1"].num_computed_tokens == 0
        if evicted:
            assert _evict_all(scheduler) == 1

        out, _ = _step(scheduler)
        meta = out.ec_connector_metadata
        assert isinstance(meta, TieredECMetadata)
        if evicted:
            assert out.scheduled_encoder_inputs == {"r1": [0]}  # vLLM encodes it itself
            assert meta.loads == [] and meta.scheduled_encoder_inputs is None
        else:
            assert "r1" not in out.scheduled_encoder_inputs
            assert meta.loads == [LoadItem(IMG_A, "r1", 0, IMAGE_TOKENS)]
    finally:
        _close(scheduler)


def test_lookups_only_for_items_still_needed(tiny_blip2: Path, tmp_path: Path) -> None:
    """`ensure_cache_available` runs every step: a decoding request must cost no store lookup."""
    scheduler = _scheduler(tiny_blip2, _ec_config(tmp_path))
    try:
        _store_item(scheduler, IMG_A)
        sched_side = _connector(scheduler)._sched
        assert sched_side is not None
        spy = _CountingStore(sched_side._store)
        sched_side._store = spy
        scheduler.add_request(_request("r1", [IMG_A, IMG_B], max_tokens=6))
        out, _ = _step(scheduler)  # prefill: both images looked up in one batch, nothing more
        assert spy.calls == [2]
        assert out.scheduled_encoder_inputs == {"r1": [1]}  # img-b is not stored: vLLM encodes it
        assert [it.mm_hash for it in out.ec_connector_metadata.loads] == [IMG_A]
        for _ in range(4):  # decode steps
            out, _ = _step(scheduler)
            assert out.num_scheduled_tokens == {"r1": 1}
        assert spy.calls == [2]
        # Unit level: an image whose placeholders are behind num_computed_tokens is not looked up.
        req = _request("r2", [IMG_A, IMG_C])
        sched_side.ensure_cache_available(req, 1 + IMAGE_TOKENS)
        assert spy.calls == [2, 1]
    finally:
        _close(scheduler)


def test_producer_answers_from_the_store(tiny_blip2: Path, tmp_path: Path) -> None:
    """An encode-only instance does not encode again what is stored, and is given nothing to load."""
    scheduler = _scheduler(tiny_blip2, _ec_config(tmp_path, role="ec_producer"))
    try:
        connector = _connector(scheduler)
        assert connector.is_producer and not connector.is_consumer
        _store_item(scheduler, IMG_A)
        scheduler.add_request(_request("stored", [IMG_A]))
        scheduler.add_request(_request("fresh", [IMG_B]))
        out, stats = _step(scheduler)
        assert out.scheduled_encoder_inputs == {"fresh": [0]}  # only the unpublished image is encoded
        meta = out.ec_connector_metadata
        assert isinstance(meta, TieredECMetadata) and meta.loads == []  # a producer never loads
        assert stats.ec_connector_stats == {"hits": 1, "misses": 1}
    finally:
        _close(scheduler)


def test_metadata_reference_survives_the_multiproc_pickle(tiny_blip2: Path, tmp_path: Path) -> None:
    """vLLM's multiproc executor pickles a SchedulerOutput in one go (shm MessageQueue): identity holds."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    scheduler = _scheduler(tiny_blip2, _ec_config(tmp_path))
    try:
        _store_item(scheduler, IMG_A)
        scheduler.add_request(_request("r1", [IMG_A, IMG_B]))
        out = scheduler.schedule()
        assert out.ec_connector_metadata.scheduled_encoder_inputs is out.scheduled_encoder_inputs
        copy = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        assert copy.ec_connector_metadata.scheduled_encoder_inputs is copy.scheduled_encoder_inputs
        # vLLM's own queue, as its multiproc executor uses it to broadcast execute_model's arguments.
        queue = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 20)
        reader = MessageQueue.create_from_handle(queue.export_handle(), 0)
        try:
            queue.wait_until_ready()
            reader.wait_until_ready()
            queue.enqueue(("execute_model", (out,), {}, None))
            _, (received,), _, _ = reader.dequeue()
            assert received.ec_connector_metadata.scheduled_encoder_inputs is received.scheduled_encoder_inputs
            assert received.scheduled_encoder_inputs == {"r1": [1]}
        finally:
            for mq in (reader, queue):
                if hasattr(mq, "shutdown"):
                    mq.shutdown()
    finally:
        _close(scheduler)


# ---------------------------------------------------------------------------------------------- stats


def test_worker_and_scheduler_counters_reach_scheduler_stats(tiny_blip2: Path, tmp_path: Path) -> None:
    """Scheduler-side hits and worker-reported loads land in `SchedulerStats.ec_connector_stats`, once."""
    scheduler = _scheduler(tiny_blip2, _ec_config(tmp_path))
    try:
        _store_item(scheduler, IMG_A)
        scheduler.add_request(_request("r1", [IMG_A, IMG_B]))
        report = TieredECWorkerMetadata(stats={"loads": 1, "bytes_loaded": 4096, "saves": 1, "bytes_saved": 4096})
        _, stats = _step(scheduler, worker_meta=report)
        assert stats.ec_connector_stats == {
            "hits": 1, "misses": 1, "loads": 1, "bytes_loaded": 4096, "saves": 1, "bytes_saved": 4096,
        }
        _, stats = _step(scheduler)  # a decode step: nothing new, nothing repeated
        assert not stats.ec_connector_stats
    finally:
        _close(scheduler)


def test_prom_metrics_export_the_counters(tiny_blip2: Path, tmp_path: Path) -> None:
    """vLLM's ECConnectorProm builds our metrics; observe() adds a step's data to `vllm:tiercache_ec_*`."""
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm

    registry = CollectorRegistry()

    class Prom(ECConnectorProm):
        _gauge_cls = partial(Gauge, registry=registry)  # type: ignore[assignment]
        _counter_cls = partial(Counter, registry=registry)  # type: ignore[assignment]
        _histogram_cls = partial(Histogram, registry=registry)  # type: ignore[assignment]

    scheduler = _scheduler(tiny_blip2, _ec_config(tmp_path))
    try:
        prom = Prom(scheduler.vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
        assert prom.prom_metrics is not None

        def value(name: str) -> float | None:
            return registry.get_sample_value(f"vllm:tiercache_ec_{name}_total", {"model_name": "m", "engine": "0"})

        assert value("hits") == 0 and value("bytes_loaded") == 0  # series exist before any image
        prom.observe({"hits": 2, "misses": 1, "loads": 2, "bytes_loaded": 8192, "load_seconds": 0.5}, 0)
        prom.observe({"hits": 1, "loads": 1, "bytes_loaded": 4096}, 0)
        assert (value("hits"), value("misses"), value("loads"), value("bytes_loaded")) == (3, 1, 3, 12288)
        assert value("load_seconds") == 0.5 and value("load_failures") == 0
    finally:
        _close(scheduler)


# ------------------------------------------------------------------------------------------- unit level


def _key_of(identifier: str) -> StoreKey:
    return StoreKey(f"unit|enc|m|f|{identifier}")


def test_cacheable_hook_keeps_an_identifier_out_of_the_store(tmp_path: Path) -> None:
    store = build_store({"tiers": [{"kind": "disk", "path": str(tmp_path / "ec"), "capacity": "16MiB"}]})
    try:
        for ident in ("ok", "private"):
            store.put(_key_of(ident), torch.zeros(IMAGE_TOKENS, 128), {})
        assert store.flush(10.0)
        counters = ECCounters()
        spy = _CountingStore(store)
        cacheable = lambda ident: ident != "private"  # noqa: E731
        sched = ECSchedulerSide(spy, _key_of, load_enabled=True, same_process=lambda: False, counters=counters,
                                cacheable=cacheable)
        req = _request("r", ["private", "ok"])
        sched.ensure_cache_available(req, 0)
        assert spy.calls == [1]  # only "ok" looked up
        assert not sched.has_cache_item("private") and sched.has_cache_item("ok")
        assert spy.calls == [1]
        sched.update_state_after_alloc(req, 0)
        sched.update_state_after_alloc(req, 1)
        meta = sched.build_connector_meta()
        assert [it.mm_hash for it in meta.loads] == ["ok"]

        worker = ECWorkerSide(spy, _key_of, device=torch.device("cpu"), dtype=torch.float32, hidden_size=128,
                              save_enabled=True, counters=counters, cacheable=cacheable)
        before = store.stats()
        worker.save_caches({"private": torch.ones(IMAGE_TOKENS, 128)}, "private-new")  # absent: no-op
        worker.save_caches({"private": torch.ones(IMAGE_TOKENS, 128)}, "private")
        assert store.flush(10.0)
        assert store.stats() == before  # nothing written
        # A load for a non-cacheable item (never promised by the scheduler side) is encoded, never read.
        scheduled: dict[str, list[int]] = {}
        encoder_cache: dict[str, torch.Tensor] = {}
        worker.start_load_caches(encoder_cache, TieredECMetadata(
            loads=[LoadItem("private", "r", 0, IMAGE_TOKENS)], scheduled_encoder_inputs=scheduled))
        assert encoder_cache == {} and scheduled == {"r": [0]}
    finally:
        store.close()


def test_failed_load_is_added_to_the_steps_scheduled_inputs(tmp_path: Path) -> None:
    """No frame walk: the worker adds a failed item to the dict the metadata carries; counters say so."""
    store = build_store({"tiers": [{"kind": "disk", "path": str(tmp_path / "ec"), "capacity": "16MiB"}]})
    try:
        store.put(_key_of("good"), torch.full((IMAGE_TOKENS, 128), 2.0), {})
        store.put(_key_of("narrow"), torch.zeros(IMAGE_TOKENS, 64), {})  # wrong width: unusable
        assert store.flush(10.0)
        # the store's usage snapshot taken now, so the first report carries the gauges: otherwise the
        # background refresh that report starts can land before the second one (a race seen under load)
        store.usage_refresh.refresh()
        worker = ECWorkerSide(store, _key_of, device=torch.device("cpu"), dtype=torch.float32, hidden_size=128,
                              save_enabled=False, counters=ECCounters())
        scheduled = {"other": [0], "r": [2]}
        encoder_cache: dict[str, torch.Tensor] = {}
        loads = [LoadItem("good", "r", 0, IMAGE_TOKENS), LoadItem("narrow", "r", 1, IMAGE_TOKENS),
                 LoadItem("gone", "s", 0, IMAGE_TOKENS)]
        worker.start_load_caches(encoder_cache, TieredECMetadata(loads=loads, scheduled_encoder_inputs=scheduled))
        assert list(encoder_cache) == ["good"] and float(encoder_cache["good"][0, 0]) == 2.0
        assert scheduled == {"other": [0], "r": [2, 1], "s": [0]}
        report = worker.worker_meta()
        assert report is not None
        assert report.stats["loads"] == 1 and report.stats["load_failures"] == 2 and report.stats["recomputed"] == 2
        assert report.stats["bytes_loaded"] == IMAGE_TOKENS * 128 * 4
        assert worker.worker_meta() is None  # sent once
        both = TieredECWorkerMetadata(stats={"loads": 1}).aggregate(TieredECWorkerMetadata(stats={"loads": 2}))
        assert both.stats == {"loads": 3}
    finally:
        store.close()


def test_no_frame_walk_left() -> None:
    source = (Path(__file__).resolve().parents[2] / "eccache" / "worker.py").read_text()
    assert "_getframe" not in source and "f_locals" not in source


# ----------------------------------------------------------------------------------------------- tags


def test_a_requests_tags_reach_the_encoder_outputs_it_computes(tiny_blip2: Path, tmp_path: Path, caplog,
                                                               monkeypatch) -> None:
    """``kv_transfer_params={"tiercache_tags": [...]}`` on a request: the real scheduler's metadata carries
    them for the items vLLM encodes this step (not for one it loads), the worker writes them into the
    records, and the disk tier indexes them (what `tiercache evict --tag` finds). Bad tags are ignored."""
    from vllm_tiercache.shared import request_tags

    monkeypatch.setattr(request_tags, "_warned", set())  # warned once per process: not by an earlier test
    import logging

    from vllm_tiercache.shared.request_tags import TAGS_PARAM

    def tagged(req_id: str, identifiers: list[str], tags: list[str]) -> Request:
        request = _request(req_id, identifiers)
        request.kv_transfer_params = {TAGS_PARAM: tags}  # what vLLM takes from sampling_params.extra_args
        return request

    scheduler = _scheduler(tiny_blip2, _ec_config(tmp_path))
    try:
        _store_item(scheduler, IMG_B)
        scheduler.add_request(tagged("doc", [IMG_A, IMG_B], ["doc:7", "corpus:v3"]))
        scheduler.add_request(tagged("also", [IMG_A], ["tenant:a"]))
        scheduler.add_request(tagged("bad", [IMG_C], ["ok", "bad\ttag"]))
        with caplog.at_level(logging.WARNING):
            out = scheduler.schedule()
        meta = out.ec_connector_metadata
        assert isinstance(meta, TieredECMetadata)
        assert [item.mm_hash for item in meta.loads] == [IMG_B]
        # "also" shares IMG_A, which vLLM encodes once, for "doc": the record carries the encoding request's
        # tags. IMG_C's tags were bad: none.
        assert meta.tags == {IMG_A: ("doc:7", "corpus:v3")}
        assert "kv_transfer_params.tiercache_tags ignored" in caplog.text

        connector = _connector(scheduler)
        worker = ECWorkerSide(connector._store, connector._key, device=torch.device("cpu"), dtype=torch.float32,
                              hidden_size=128, save_enabled=True, counters=ECCounters())
        worker.set_generation(meta)
        for ident in (IMG_A, IMG_C):
            worker.save_caches({ident: torch.ones(IMAGE_TOKENS, 128)}, ident)
        assert connector._store.flush(10.0)
        (disk,) = connector._store.tiers
        tags = {record.text: record.tags for record in disk.iter_stored()}
        assert tags == {connector._key(IMG_A).text: ("doc:7", "corpus:v3"),
                        connector._key(IMG_B).text: (), connector._key(IMG_C).text: ()}
        assert scheduler.schedule().ec_connector_metadata.tags == {}  # per step
    finally:
        _close(scheduler)
