"""TieredECConnector after vLLM resets its encoder cache (weights changed in place): a new generation.

vLLM 0.32's `Scheduler.reset_encoder_cache` ("called when model weights are updated") drops vLLM's own
encoder outputs but had no way to reach an EC connector, which went on serving encoder outputs of the old
weights. The plugin now wraps it (`vllm_tiercache.eccache.encoder_reset`). What these pin down:

- vLLM's real Scheduler: after its reset the item that was loaded is encoded by vLLM instead (no load,
  counted as a miss and as ``generation_resets``), the metadata tells the worker the new salt, an item
  stored in the new generation is a hit again, and another scheduler (an engine with the old weights)
  still loads the old record;
- the worker names what it saves, loads and reports resident with the salt of the last bound metadata
  (`save_caches` gets only the mm_hash), through the real connector's `bind_connector_metadata`;
- the wrapper never breaks vLLM (a scheduler without an EC connector, or without the attribute, or a
  failing reset); that the plugin installs it wherever vLLM's scheduler module is loaded is checked in a
  fresh process by tests/config/test_plugin.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from vllm.config import DeviceConfig, ECTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from tests.ec.test_ec_scheduler import (
    IMAGE_TOKENS,
    IMG_A,
    IMG_B,
    _close,
    _connector,
    _ec_config,
    _request,
    _scheduler,
    _step,
    _store_item,
)
from vllm_tiercache.eccache import encoder_reset
from vllm_tiercache.eccache.connector import ECCounters, TieredECConnector
from vllm_tiercache.eccache.scheduler import LoadItem, TieredECMetadata
from vllm_tiercache.eccache.worker import ECWorkerSide
from vllm_tiercache.shared.generations import generation_mm_name
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey


def test_vllms_encoder_reset_starts_a_generation(tiny_blip2: Path, tmp_path: Path, caplog) -> None:
    scheduler = _scheduler(tiny_blip2, _ec_config(tmp_path))
    connector = _connector(scheduler)
    try:
        _store_item(scheduler, IMG_A)
        scheduler.add_request(_request("r1", [IMG_A]))
        out, _ = _step(scheduler)
        assert out.ec_connector_metadata.loads == [LoadItem(IMG_A, "r1", 0, IMAGE_TOKENS)]
        assert out.ec_connector_metadata.generation is None
        scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)

        with caplog.at_level(logging.WARNING, logger="vllm_tiercache"):
            scheduler.reset_encoder_cache()  # vLLM's own method: the plugin's wrapper calls reset_cache
        assert "TieredECConnector: vLLM reset the encoder cache" in caplog.text
        assert connector._sched is not None
        salt = connector._sched.generation.salt
        assert salt is not None and connector._sched.generation.resets == 1

        scheduler.add_request(_request("r2", [IMG_A]))
        out, stats = _step(scheduler)
        meta = out.ec_connector_metadata
        assert out.scheduled_encoder_inputs == {"r2": [0]}  # vLLM encodes it: the old record is not used
        assert meta.loads == [] and meta.generation == salt
        assert stats is not None and stats.ec_connector_stats["generation_resets"] == 1
        assert stats.ec_connector_stats["misses"] == 1 and "hits" not in stats.ec_connector_stats
        scheduler.finish_requests("r2", RequestStatus.FINISHED_ABORTED)

        # what the worker saves in the new generation is a hit again
        connector._store.put(connector._key(generation_mm_name(IMG_B, salt)), torch.zeros(IMAGE_TOKENS, 128), {})
        assert connector._store.flush(10.0)
        scheduler.add_request(_request("r3", [IMG_B]))
        out, _ = _step(scheduler)
        assert out.ec_connector_metadata.loads == [LoadItem(IMG_B, "r3", 0, IMAGE_TOKENS)]
        assert out.ec_connector_metadata.generation == salt
    finally:
        _close(scheduler)

    # another engine (no reset) on the same store: the old record is there, the new one invisible
    other = _scheduler(tiny_blip2, _ec_config(tmp_path))
    try:
        other.add_request(_request("r4", [IMG_A, IMG_B]))
        out, _ = _step(other)
        assert out.ec_connector_metadata.loads == [LoadItem(IMG_A, "r4", 0, IMAGE_TOKENS)]
        assert out.scheduled_encoder_inputs == {"r4": [1]}
    finally:
        _close(other)


def test_worker_names_saves_loads_and_residency_with_the_bound_generation(tiny_blip2: Path, tmp_path: Path) -> None:
    tiers = [{"kind": "memory", "capacity": "16MiB"},
             {"kind": "disk", "path": str(tmp_path / "ec"), "capacity": "16MiB"}]
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_blip2), dtype="float32", seed=0, max_model_len=256),
        ec_transfer_config=ECTransferConfig(ec_connector="TieredECConnector", ec_role="ec_both",
                                            ec_connector_extra_config={"namespace": "gen", "tiers": tiers}),
        device_config=DeviceConfig("cpu"),
    )
    connector = TieredECConnector(vllm_config, ECConnectorRole.WORKER)
    worker, store = connector._worker, connector._store
    assert worker is not None
    hidden = vllm_config.model_config.get_hidden_size()
    try:
        salt = b"\x01" * 16
        connector.bind_connector_metadata(TieredECMetadata(generation=salt))
        connector.clear_connector_metadata()  # vLLM clears after the step: the salt stays for later saves
        connector.save_caches({IMG_B: torch.ones(IMAGE_TOKENS, hidden)}, IMG_B)
        assert store.flush(10.0)
        new, old = connector._key(generation_mm_name(IMG_B, salt)), connector._key(IMG_B)
        assert store.contains_many([new, old]) == [True, False]
        report = worker.worker_meta()
        assert report is not None and report.added == {generation_mm_name(IMG_B, salt)}

        store.put(connector._key(IMG_A), torch.zeros(IMAGE_TOKENS, hidden), {})  # an old generation's record
        assert store.flush(10.0)
        scheduled: dict[str, list[int]] = {"r": []}
        meta = TieredECMetadata(loads=[LoadItem(IMG_A, "r", 0, IMAGE_TOKENS), LoadItem(IMG_B, "r", 1, IMAGE_TOKENS)],
                                scheduled_encoder_inputs=scheduled, generation=salt)
        connector.bind_connector_metadata(meta)
        encoder_cache: dict[str, torch.Tensor] = {}
        connector.start_load_caches(encoder_cache)
        assert list(encoder_cache) == [IMG_B] and float(encoder_cache[IMG_B][0, 0]) == 1.0
        assert scheduled == {"r": [0]}  # the old record is not read: vLLM encodes IMG_A in this step

        # metadata from before any reset names records as they always were
        connector.bind_connector_metadata(TieredECMetadata())
        connector.save_caches({IMG_A: torch.full((IMAGE_TOKENS, hidden), 3.0)}, IMG_A)
        assert worker.generation is None and store.flush(10.0)
        assert float(store.get_many([connector._key(IMG_A)])[0].tensor[0, 0]) == 3.0
    finally:
        connector.shutdown()
        store.close()


def test_the_unit_level_worker_keeps_the_salt_between_steps(tmp_path: Path) -> None:
    store = build_store({"tiers": [{"kind": "disk", "path": str(tmp_path / "ec"), "capacity": "16MiB"}]})
    try:
        key_of = lambda ident: StoreKey(f"unit|enc|m|f|{ident}")  # noqa: E731
        worker = ECWorkerSide(store, key_of, device=torch.device("cpu"), dtype=torch.float32, hidden_size=8,
                              save_enabled=True, counters=ECCounters())
        names = set()
        for salt in (b"a" * 16, b"b" * 16):
            worker.set_generation(TieredECMetadata(generation=salt))
            worker.save_caches({"x": torch.ones(2, 8)}, "x")
            names.add(generation_mm_name("x", salt))
        assert store.flush(10.0)
        assert len(names) == 2 and all(store.contains_many([key_of(n) for n in names]))
        assert store.contains_many([key_of("x")]) == [False]
    finally:
        store.close()


# ------------------------------------------------------------------------------------------- the hook
class _Resettable:
    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail = 0, fail

    def reset_cache(self) -> bool:
        self.calls += 1
        if self.fail:
            raise RuntimeError("boom")
        return True


def test_the_wrapper_is_installed_once_and_never_breaks_vllm(caplog) -> None:
    assert encoder_reset.install() and encoder_reset.install()
    method = Scheduler.reset_encoder_cache
    assert getattr(method, "_vllm_tiercache_encoder_reset", False)
    assert not getattr(method.__wrapped__, "_vllm_tiercache_encoder_reset", False)  # wrapped once

    ours = _Resettable()
    assert encoder_reset.reset_ec_connector(type("S", (), {"ec_connector": ours})()) and ours.calls == 1
    assert not encoder_reset.reset_ec_connector(type("S", (), {"ec_connector": None})())
    assert not encoder_reset.reset_ec_connector(type("S", (), {"ec_connector": object()})())  # not ours
    with caplog.at_level(logging.WARNING, logger="vllm_tiercache"):
        assert not encoder_reset.reset_ec_connector(object())  # a vLLM keeping it elsewhere
        assert not encoder_reset.reset_ec_connector(object())
        assert caplog.text.count("cannot find the scheduler's EC connector") == 1  # said once
        failing = _Resettable(fail=True)
        assert not encoder_reset.reset_ec_connector(type("S", (), {"ec_connector": failing})())
        assert "reset_cache failed" in caplog.text
