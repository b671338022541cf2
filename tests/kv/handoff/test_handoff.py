"""Prefill/decode hand-off through the store, on vLLM's real `Scheduler` and real worker sides.

A producer (``kv_producer``) and a consumer (``kv_consumer``) share one store (a disk tier here; Redis in
tests/engine/test_pd_handoff_engine.py). What these pin down:

- the producer returns ``kv_transfer_params`` that name what it stores (count, last chunk, namespace,
  producer id) for a ``do_remote_decode`` request, in vLLM's own output, and marks its saves urgent;
- the consumer, given those params, plans an asynchronous load of exactly that prefix (vLLM's
  ``WAITING_FOR_REMOTE_KVS``) without a lookup, even before the records exist; the worker waits for late
  records and loads them; records that never come are failed blocks reported with the finish, and vLLM
  resumes the request from the first missing block (the fallback, counted and logged);
- params for another prompt or namespace are refused (counted, logged) and the prompt is looked up as
  without them; a request without params is looked up as before.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from tests.support.faulty_proxy import FaultyProxy
from tests.support.real_scheduler import cpu_vllm_config, hashed_request, one_group_kv_cache_config
from tests.support.real_scheduler import real_scheduler as real_scheduler_over
from vllm_tiercache.kvcache.connector import TieredKVConnector
from vllm_tiercache.kvcache.handoff.promise import PARAMS_KEY
from vllm_tiercache.kvcache.handoff.wait import wait_for_records
from vllm_tiercache.kvcache.plan import TieredKVMetadata
from vllm_tiercache.kvcache.worker import KVWorkerSide
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.writes.background import BackgroundWriter
from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec

BLOCK, CHUNK = 32, 128  # 4 blocks per chunk
PROMPT_LEN = 600  # 18 full blocks: chunks ending at 4, 8, 12, 16 and the partial one at 18
NUM_BLOCKS = 64
SPEC = TinyLlamaSpec()
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(SPEC.num_layers)]


def _config(model: Path, disk: Path, role: str, **extra: Any) -> VllmConfig:
    kv = KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="vllm_tiercache.kvcache.connector",
        kv_role=role,
        kv_connector_extra_config={"namespace": "pd", "chunk_size": CHUNK, "handoff_wait_ms": 5000,
                                   "tiers": [{"kind": "disk", "path": str(disk), "capacity": "64MiB"}], **extra},
    )
    return cpu_vllm_config(str(model), kv, block_size=BLOCK, prefix_caching=False)


def _scheduler(model: Path, disk: Path, role: str, **extra: Any) -> Scheduler:
    kv_cache_config = one_group_kv_cache_config(LAYERS, BLOCK, SPEC.num_kv_heads, NUM_BLOCKS)
    return real_scheduler_over(_config(model, disk, role, **extra), kv_cache_config=kv_cache_config)


def _connector(scheduler: Scheduler) -> TieredKVConnector:
    connector = scheduler.connector
    assert isinstance(connector, TieredKVConnector)
    return connector


def _request(req_id: str, prompt: list[int], params: dict[str, Any] | None, max_tokens: int = 1) -> Request:
    return hashed_request(req_id, prompt, BLOCK, max_tokens=max_tokens, kv_transfer_params=params)


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    shape = (NUM_BLOCKS, SPEC.num_kv_heads, BLOCK, 2 * 64)
    return {name: (torch.randn(*shape, generator=g) if seed is not None else torch.zeros(*shape)).to(torch.bfloat16)
            for name in LAYERS}


def _save_every_layer(connector: TieredKVConnector, meta: TieredKVMetadata) -> None:
    """A worker side over seeded caches saves every layer of ``meta``'s plans, waits for it, and stops."""
    worker = _worker(connector, _caches(seed=1))
    for layer in LAYERS:
        worker.save_layer(layer, worker.loader.kv_caches[layer], meta)
    worker.wait_for_save()
    worker.saver.flush()
    worker.shutdown()


def _worker(connector: TieredKVConnector, caches: dict[str, torch.Tensor], load_mode: str = "auto") -> KVWorkerSide:
    side = connector._scheduler
    assert side is not None
    worker = KVWorkerSide(store=connector._store, naming=side.naming, rank=0, use_mla=False, load_mode=load_mode)
    worker.register_kv_caches(caches, NUM_BLOCKS)
    return worker


def _output(out: Any, kv_output: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[7] for _ in req_ids],
                             kv_connector_output=kv_output or KVConnectorOutput())


def _kv_stats(engine_outputs: dict[int, Any]) -> dict[str, Any]:
    stats = next((eco.scheduler_stats for eco in engine_outputs.values() if eco.scheduler_stats), None)
    return dict(stats.kv_connector_stats or {}) if stats is not None else {}


def _prefill(model: Path, disk: Path, prompt: list[int], req_id: str = "p",
             **extra: Any) -> tuple[dict[str, Any], Scheduler]:
    """Run the producer's side of the proxy flow: schedule, save what the worker saves, finish; returns the
    ``kv_transfer_params`` vLLM puts in the request's output."""
    producer = _scheduler(model, disk, "kv_producer", **extra)
    connector = _connector(producer)
    producer.add_request(_request(req_id, prompt, {"do_remote_decode": True}))
    out = producer.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, TieredKVMetadata)
    saves = [save for plan in meta.requests for save in plan.saves]
    assert saves and all(save.urgent for save in saves)  # a hand-off's records are written first
    _save_every_layer(connector, meta)
    engine_outputs = producer.update_from_output(out, _output(out))
    (finished,) = [o for eco in engine_outputs.values() for o in eco.outputs if o.finished]
    assert finished.kv_transfer_params is not None
    return finished.kv_transfer_params, producer


def test_the_producer_names_what_it_stores(tiny_llama: Path, tmp_path: Path) -> None:
    prompt = tokens(PROMPT_LEN)
    params, producer = _prefill(tiny_llama, tmp_path / "disk", prompt)
    promise = params[PARAMS_KEY]
    naming = _connector(producer)._scheduler.naming  # type: ignore[union-attr]
    request = _request("x", prompt, None)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert promise["chunks"] == 5 and promise["tokens"] == 18 * BLOCK  # 4 full chunks and the partial one
    assert promise["last_chunk"] == request.block_hashes[17].hex()
    assert promise["namespace"] == "pd" and promise["chunk_size"] == CHUNK
    assert promise["producer"] == producer.vllm_config.kv_transfer_config.engine_id
    # the promised records are all in the shared tier
    keys = [key for end in (4, 8, 12, 16, 18) for key in naming.request_names(request.block_hashes).record_keys(
        request.block_hashes[end - 1])]
    assert all(_connector(producer)._store.contains_many(keys, shared_only=True))
    # a request without do_remote_decode gets no params
    producer.add_request(_request("plain", tokens(200, seed=3), None))
    out = producer.schedule()
    engine_outputs = producer.update_from_output(out, _output(out))
    assert [o.kv_transfer_params for eco in engine_outputs.values() for o in eco.outputs] == [None]
    assert _kv_stats(engine_outputs).get("handoffs_offered", 0) == 0  # counted at the first request's step
    _connector(producer)._store.close()


def _consume(model: Path, disk: Path, prompt: list[int], params: dict[str, Any] | None,
             **extra: Any) -> tuple[Scheduler, Request, Any]:
    consumer = _scheduler(model, disk, "kv_consumer", **extra)
    request = _request("d", prompt, params, max_tokens=4)
    consumer.add_request(request)
    return consumer, request, consumer.schedule()


def _run_handoff(consumer: Scheduler, out: Any, caches: dict[str, torch.Tensor], load_mode: str = "auto",
                 polls: int = 2000) -> tuple[KVConnectorOutput, KVWorkerSide]:
    """The worker's side of the consumer's step: start the loads, poll vLLM's results until the hand-off
    is over (liveness only: the wait is bounded by handoff_wait_ms, and by the tier's timeout on a hung
    store). A CPU worker ("auto") loads on the polling thread once the wait is over; "layerwise" (a GPU's
    default) on the hand-off thread."""
    worker = _worker(_connector(consumer), caches, load_mode)
    worker.start_load(out.kv_connector_metadata)
    for _ in range(polls):  # what the worker's connector does each step (get_transfer_results, then the errors)
        finished, _ = worker.loader.take_transfer_results()
        if finished:
            worker.loader.finish_load()
            return KVConnectorOutput(finished_recving=finished,
                                     invalid_block_ids=worker.loader.take_load_errors()), worker
        time.sleep(0.01)
    raise AssertionError("the hand-off load never finished")


@pytest.mark.parametrize("load_mode", ["auto", "layerwise"])
def test_the_consumer_loads_the_promised_prefix_asynchronously(tiny_llama: Path, tmp_path: Path,
                                                              load_mode: str) -> None:
    prompt = tokens(PROMPT_LEN)
    params, producer = _prefill(tiny_llama, tmp_path / "disk", prompt)
    _connector(producer)._store.close()
    consumer, request, out = _consume(tiny_llama, tmp_path / "disk", prompt, params)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not out.scheduled_new_reqs
    assert request.num_computed_tokens == 18 * BLOCK  # the whole promise (the prompt's last token is computed)
    (plan,) = out.kv_connector_metadata.requests
    assert plan.handoff_wait_s == 5.0 and not plan.whole_request
    assert [(load.first, load.end) for load in plan.loads] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 18)]

    caches = _caches(seed=None)
    kv_output, worker = _run_handoff(consumer, out, caches, load_mode)
    assert kv_output.finished_recving == {"d"} and not kv_output.invalid_block_ids
    producer_caches = _caches(seed=1)
    table = consumer.kv_cache_manager.get_block_ids("d")[0]
    for layer in LAYERS:  # the producer's blocks 0..17 (its table is 1..18), now in the consumer's blocks
        assert torch.equal(caches[layer][table[:18]], producer_caches[layer][1:19])
    data = worker.take_counters()
    assert data["handoff_loads"] == 1 and not data["handoff_fallbacks"]

    stats = _kv_stats(consumer.update_from_output(out, _output(out, kv_output)))
    assert stats.get("handoffs_received") == 1  # the scheduler's count, in vLLM's stats
    out = consumer.schedule()  # the request resumes with the whole prefix loaded
    assert out.scheduled_new_reqs[0].req_id == "d" and out.num_scheduled_tokens["d"] == PROMPT_LEN - 18 * BLOCK
    worker.shutdown()
    _connector(consumer)._store.close()


@pytest.mark.s3
def test_a_hand_off_through_the_object_tier_reads_each_chunk_once(tiny_llama: Path, tmp_path: Path,
                                                                   s3_bucket) -> None:
    """A hand-off's load reads a far tier in one batch before its first layer, not layer by layer: the object
    tier keeps a chunk's layers in one object, which a read per layer would fetch once per layer."""
    prompt = tokens(PROMPT_LEN)
    tiers = {"tiers": [s3_bucket.tier_config()]}
    params, producer = _prefill(tiny_llama, tmp_path / "disk", prompt, **tiers)
    _connector(producer).shutdown()  # the scheduler side's far lookup threads too
    _connector(producer)._store.close()
    consumer, request, out = _consume(tiny_llama, tmp_path / "disk", prompt, params, **tiers)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (tier,) = _connector(consumer)._store.tiers
    gets: list[str] = []
    first_range = tier._calls._first_range
    tier._calls._first_range = lambda name, part: gets.append(name) or first_range(name, part)
    caches = _caches(seed=None)
    kv_output, worker = _run_handoff(consumer, out, caches)
    assert kv_output.finished_recving == {"d"} and not kv_output.invalid_block_ids
    producer_caches = _caches(seed=1)
    table = consumer.kv_cache_manager.get_block_ids("d")[0]
    for layer in LAYERS:
        assert torch.equal(caches[layer][table[:18]], producer_caches[layer][1:19])
    assert len(gets) == len(set(gets)) == 5  # one GET per chunk (4 full, 1 partial), for every layer
    worker.shutdown()
    _connector(consumer).shutdown()
    _connector(consumer)._store.close()


@pytest.mark.s3
@pytest.mark.serial  # a hung store's timeouts and the hand-off's 1 s wait decide where the hang lands
@pytest.mark.parametrize("load_mode", ["auto", "layerwise"])
@pytest.mark.parametrize("moment", ["from_the_wait", "at_the_first_get"])
def test_a_store_that_hangs_during_a_hand_off_read_falls_back_to_recompute(tiny_llama: Path, tmp_path: Path,
                                                                           s3_bucket, load_mode: str,
                                                                           moment: str) -> None:
    """The object tier hangs (every request read and never answered, as a SIGSTOPped server or a black-holed
    route) from the moment the consumer's worker starts its hand-off (its wait for the records asks first),
    or from the first GET of a record, once the wait found them all (the read ahead of the first layer):
    either runs into the tier's timeout and the load ends. From the wait: every promised block is reported
    failed and nothing reaches the blocks. From the first GET: that GET's chunk fails; a chunk whose GET the
    store answered before the hang began may load (seen under load: the second chunk), and what loaded is the
    producer's KV exactly. vLLM computes the prompt from the first failed block on."""
    prompt = tokens(PROMPT_LEN)
    with FaultyProxy(s3_bucket.server.ports["s3"]) as proxy:
        # 3 s: the producer's PUTs and the wait's HEADs answer within it on a loaded machine, so the hang
        # lands where it is meant to (asserted below), and a hung request costs that much
        tiers = {"tiers": [s3_bucket.tier_config(endpoint=proxy.endpoint, timeout_s=3.0)]}
        params, producer = _prefill(tiny_llama, tmp_path / "disk", prompt, **tiers)
        _connector(producer).shutdown()
        _connector(producer)._store.close()
        consumer, request, out = _consume(tiny_llama, tmp_path / "disk", prompt, params, handoff_wait_ms=1000,
                                          **tiers)
        worker = None
        try:
            assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            (tier,) = _connector(consumer)._store.tiers
            if moment == "from_the_wait":
                proxy.set_mode("hang")
            else:  # switched on the proxy's thread before that GET goes on: cut, retried, never answered
                proxy.on_request(f"GET /{s3_bucket.bucket}/tiercache/r/".encode(), lambda: proxy.set_mode("hang"))
            caches = _caches(seed=None)
            # liveness only (tier timeout 3 s, wait 1 s): a loaded machine's slowest run is far within 12,000 polls
            kv_output, worker = _run_handoff(consumer, out, caches, load_mode, polls=12000)
            data = worker.take_counters()
            table = consumer.kv_cache_manager.get_block_ids("d")[0]
            failed = kv_output.invalid_block_ids
            seen = f"{moment}, {load_mode}: tier down {tier.down}, proxy {proxy.mode}, failed {sorted(failed)} of " \
                   f"{table[:18]}, counters {data}"
            # the GET reached the proxy (the wait had found every record). From the wait, the tier is down; from
            # the first GET, a GET the store answered after another's failure may have brought it back up
            assert proxy.mode == "hang" and (tier.down or moment == "at_the_first_get"), seen
            assert kv_output.finished_recving == {"d"} and failed and failed <= set(table[:18]), seen
            if moment == "from_the_wait":
                assert failed == set(table[:18]), seen
            producer_caches = _caches(seed=1)
            for position, block in enumerate(table[:18]):  # the producer's block p+1 is the consumer's table[p]
                for layer in LAYERS:
                    expected = torch.zeros_like(caches[layer][block]) if block in failed else \
                        producer_caches[layer][position + 1]
                    assert torch.equal(caches[layer][block], expected), (position, layer, seen)
            assert data["handoff_fallbacks"] == 1 and data["handoff_loads"] == 1, seen
            consumer.update_from_output(out, _output(out, kv_output))
            kept = min(table.index(block) for block in failed)
            # vLLM resumes at the first failed block; with nothing kept it looks the prompt up again (off its
            # thread: a far tier). The proxy still hangs, so that lookup stages nothing (the tier is down, or its
            # requests hang past the lookup's deadline): a miss.
            for _ in range(12000):
                out = consumer.schedule()
                if "d" in out.num_scheduled_tokens:
                    break
                consumer.update_from_output(out, _output(out))
                time.sleep(0.01)
            assert request.status == RequestStatus.RUNNING, seen
            assert out.num_scheduled_tokens["d"] == PROMPT_LEN - kept * BLOCK, (out.num_scheduled_tokens, seen)
        finally:
            proxy.set_mode("forward")  # the closes below wait on nothing hung
            if worker is not None:
                worker.shutdown()
            _connector(consumer).shutdown()
            _connector(consumer)._store.close()


def test_late_records_are_waited_for(tiny_llama: Path, tmp_path: Path) -> None:
    """The decode request arrives before the producer's records: the load waits for them (bounded)."""
    prompt = tokens(PROMPT_LEN)
    early = tmp_path / "early"
    params, producer = _prefill(tiny_llama, early, prompt)  # into another disk: the params, no records yet
    _connector(producer)._store.close()
    consumer, request, out = _consume(tiny_llama, tmp_path / "disk", prompt, params)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def late_producer() -> None:
        time.sleep(0.2)
        _prefill(tiny_llama, tmp_path / "disk", prompt, req_id="p2")  # the process's store is the consumer's

    writer = threading.Thread(target=late_producer)
    writer.start()
    kv_output, worker = _run_handoff(consumer, out, _caches(seed=None))
    writer.join()
    assert kv_output.finished_recving == {"d"} and not kv_output.invalid_block_ids
    data = worker.take_counters()
    assert data["handoff_records_waited"] == 5 * SPEC.num_layers and not data["handoff_fallbacks"]
    worker.shutdown()
    _connector(consumer)._store.close()


def test_records_that_never_come_fall_back_within_the_bound(tiny_llama: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    prompt = tokens(PROMPT_LEN)
    params, producer = _prefill(tiny_llama, tmp_path / "disk", prompt)
    store = _connector(producer)._store
    naming = _connector(producer)._scheduler.naming  # type: ignore[union-attr]
    # the producer's write of the third chunk failed: its records are gone from the shared tier
    lost = _request("x", prompt, None).block_hashes[11]
    keys = naming.group_keys(lost, naming.groups.groups)
    for tier in store.tiers:  # as a failed write leaves it: the chunks after it stay (`tiercache evict` of a
        tier.drop_many(keys)  # record takes the records after it too, a disk tier's descendants)
    store.close()
    consumer, _, out = _consume(tiny_llama, tmp_path / "disk", prompt, params, handoff_wait_ms=100)
    with caplog.at_level(logging.WARNING):
        kv_output, worker = _run_handoff(consumer, out, _caches(seed=None))
    table = consumer.kv_cache_manager.get_block_ids("d")[0]
    assert kv_output.finished_recving == {"d"}
    assert kv_output.invalid_block_ids == set(table[8:18])  # the lost chunk and everything after it
    assert "hand-off of request d fell back to recompute" in caplog.text
    data = worker.take_counters()
    assert data["handoff_fallbacks"] == 1 and data["handoff_missing_records"] == SPEC.num_layers

    consumer.update_from_output(out, _output(out, kv_output))
    out = consumer.schedule()  # vLLM resumes at the first missing block: 8 blocks loaded, the rest computed
    assert out.num_scheduled_tokens["d"] == PROMPT_LEN - 8 * BLOCK
    worker.shutdown()
    _connector(consumer)._store.close()


def test_a_fallback_that_kept_nothing_is_looked_up_once_more_not_waited_for_again(tiny_llama: Path,
                                                                                    tmp_path: Path) -> None:
    """Nothing arrived: vLLM sends the request back to lookup with no computed tokens; the promise was used,
    so this lookup is the plain one (it finds what came meanwhile), never a second wait."""
    prompt = tokens(PROMPT_LEN)
    params, producer = _prefill(tiny_llama, tmp_path / "elsewhere", prompt)  # records where the consumer can't see
    _connector(producer)._store.close()
    consumer, request, out = _consume(tiny_llama, tmp_path / "disk", prompt, params, handoff_wait_ms=0)
    kv_output, worker = _run_handoff(consumer, out, _caches(seed=None))
    table = consumer.kv_cache_manager.get_block_ids("d")[0]
    assert kv_output.invalid_block_ids == set(table[:18])
    consumer.update_from_output(out, _output(out, kv_output))
    out = consumer.schedule()
    assert request.status == RequestStatus.RUNNING and out.num_scheduled_tokens["d"] == PROMPT_LEN
    assert not out.kv_connector_metadata.requests or out.kv_connector_metadata.requests[0].handoff_wait_s is None
    worker.shutdown()
    _connector(consumer)._store.close()


@pytest.mark.parametrize("tamper", ["namespace", "prompt", "format"])
def test_params_for_something_else_are_refused(tiny_llama: Path, tmp_path: Path, tamper: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    prompt = tokens(PROMPT_LEN)
    params, producer = _prefill(tiny_llama, tmp_path / "disk", prompt)
    _connector(producer)._store.close()
    if tamper == "namespace":
        params[PARAMS_KEY]["namespace"] = "other"
    elif tamper == "format":
        params[PARAMS_KEY]["v"] = 99
    else:
        prompt = prompt[:-40] + tokens(40, seed=9)  # the same first chunks, another last one
    with caplog.at_level(logging.WARNING):
        consumer, request, out = _consume(tiny_llama, tmp_path / "disk", prompt, params)
    assert "request d: the producer's kv_transfer_params are not usable" in caplog.text
    # looked up as without params: a synchronous hit on what is stored, no hand-off
    assert request.status == RequestStatus.RUNNING
    (plan,) = out.kv_connector_metadata.requests
    assert plan.handoff_wait_s is None
    assert _connector(consumer)._scheduler.handoffs.handoffs_rejected == 1  # type: ignore[union-attr]
    _connector(consumer)._store.close()


def test_without_params_the_lookup_is_unchanged(tiny_llama: Path, tmp_path: Path) -> None:
    prompt = tokens(PROMPT_LEN)
    _connector(_prefill(tiny_llama, tmp_path / "disk", prompt)[1])._store.close()
    consumer, request, out = _consume(tiny_llama, tmp_path / "disk", prompt, None)
    assert request.status == RequestStatus.RUNNING and out.num_scheduled_tokens["d"] == PROMPT_LEN - 18 * BLOCK
    (plan,) = out.kv_connector_metadata.requests
    assert plan.handoff_wait_s is None and plan.loads
    _connector(consumer)._store.close()


def test_wait_for_records_polls_until_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock of its own, which only the wait's pauses move: a loaded machine's stall between two polls
    cannot shorten a pause (``min(pause, time left)``)."""
    import vllm_tiercache.kvcache.handoff.wait as wait_module

    clock = [0.0]
    monkeypatch.setattr(wait_module, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    store = build_store({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}]})
    from vllm_tiercache.shared.naming.keys import KVModelIdentity, kv_chunk_key

    identity = KVModelIdentity(model="m", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_size=64,
                               block_size=BLOCK, layout="paged-bhnc", tp_size=1, tp_rank=0)
    keys = [[kv_chunk_key("t", identity, bytes([i]) * 32, 0)] for i in range(3)]
    store.put(keys[0][0], torch.zeros(1, 4))
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:  # the second chunk lands during the third poll's pause
        sleeps.append(seconds)
        clock[0] += seconds
        if len(sleeps) == 3:
            store.put(keys[1][0], torch.zeros(1, 4))

    present, waited = wait_for_records(store, keys, 0.5, sleep=sleep)
    assert present == [True, True, False] and waited == 1
    assert sleeps[:4] == [0.002, 0.004, 0.008, 0.016]  # the polls back off
    assert clock[0] == pytest.approx(0.5)  # and the last pause ends at the deadline
    store.close()


def test_urgent_writes_go_ahead_of_the_queue() -> None:
    """The store's writer takes an urgent job before the jobs already queued."""
    order: list[str] = []
    gate = threading.Event()

    class Tier:
        name = "slow"
        counters = type("C", (), {"add": staticmethod(lambda **_: None)})()

        def put_many(self, items: Any) -> None:
            gate.wait(10)
            order.extend(key for key, _, _ in items)

    writer = BackgroundWriter(maxsize=64)
    tier = Tier()
    writer.submit([tier], [("first", None, None)])  # type: ignore[list-item]
    time.sleep(0.05)  # the writer holds "first" (blocked in the tier)
    for i in range(3):
        writer.submit([tier], [(f"queued{i}", None, None)])  # type: ignore[list-item]
    writer.submit([tier], [("urgent", None, None)], urgent=True)  # type: ignore[list-item]
    gate.set()
    assert writer.flush(10)
    assert order == ["first", "urgent", "queued0", "queued1", "queued2"]
    writer.close(5)
