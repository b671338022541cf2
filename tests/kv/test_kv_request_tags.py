"""A serving request's ``kv_transfer_params={"tiercache_tags": [...]}`` reach the records it saves: the real
vLLM scheduler plans the saves with the tags, the real worker side writes them into the records' meta,
and the disk tier indexes them (what `tiercache evict --tag` finds). No engine: the scheduler and the
worker side are driven directly, as in `tests/kv/handoff/test_handoff.py`, whose helpers these are.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tests.kv.handoff.test_handoff import LAYERS, _connector, _request, _save_every_layer, _scheduler, tokens
from vllm_tiercache.kvcache.plan import TieredKVMetadata
from vllm_tiercache.shared import request_tags
from vllm_tiercache.shared.request_tags import TAGS_PARAM
from vllm_tiercache.shared.store.api import StoreKey


def test_a_requests_tags_reach_its_records_and_bad_tags_are_ignored(tiny_llama: Path, tmp_path: Path,
                                                                  caplog, monkeypatch) -> None:
    monkeypatch.setattr(request_tags, "_warned", set())  # warned once per process: not by an earlier test
    producer = _scheduler(tiny_llama, tmp_path / "disk", "kv_producer")
    connector = _connector(producer)
    producer.add_request(_request("tagged", tokens(600, seed=0), {TAGS_PARAM: ["doc:7", "corpus:v3"]}))
    producer.add_request(_request("bad", tokens(600, seed=1), {TAGS_PARAM: ["ok", "bad\ttag"]}))
    with caplog.at_level(logging.WARNING):
        out = producer.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, TieredKVMetadata)
    saves = {plan.req_id: plan.saves for plan in meta.requests}
    assert len(saves["tagged"]) == 5 and all(s.tags == ("doc:7", "corpus:v3") and not s.urgent
                                             for s in saves["tagged"])
    assert saves["bad"] and all(s.tags == () for s in saves["bad"])  # its prefill may be chunked: some saves
    assert "kv_transfer_params.tiercache_tags ignored (invalid tag 'bad\\ttag'" in caplog.text

    _save_every_layer(connector, meta)
    store = connector._store
    assert store.flush(30.0)
    disk = next(tier for tier in store.tiers if tier.shared_across_processes)
    listed = list(disk.iter_stored())
    untagged = len(saves["bad"]) * len(LAYERS)
    assert sorted(r.tags for r in listed) == [()] * untagged + [("doc:7", "corpus:v3")] * 5 * len(LAYERS)
    tagged = next(r for r in listed if r.tags)
    (record,) = disk.get_many([StoreKey(tagged.text)])
    assert record is not None and record.meta["tags"] == ["doc:7", "corpus:v3"] and "layout" in record.meta
    store.close()
