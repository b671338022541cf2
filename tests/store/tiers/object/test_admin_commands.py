"""`tiercache stats [--by-tag]`, `evict --tag/--model/--older-than` and `pin` on the object tier: through the
tier contract only, as on disk and Redis."""

from __future__ import annotations

import json
import time

import pytest
import torch

from vllm_tiercache.shared.naming.keys import KVModelIdentity, kv_chunk_key
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.tools.cli import main as cli_main
from vllm_tiercache.tools.evict_cmd import evict
from vllm_tiercache.tools.stats_cmd import collect

pytestmark = pytest.mark.s3


def _keys(model: str, n: int, salt: str = "") -> list[StoreKey]:
    ident = KVModelIdentity(model=model, dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64, block_size=32,
                            layout="paged-bhnc", tp_size=1, tp_rank=0)
    return [kv_chunk_key("a", ident, f"{salt}{model}{i}".encode(), 0) for i in range(n)]


def _fill(config: dict, keys: list[StoreKey], tags: list[str] | None = None) -> None:
    with build_store(config) as store:
        store.put_many([(k, torch.full((256,), float(i)), {"tags": tags} if tags else None)
                        for i, k in enumerate(keys)])
        assert store.flush(30.0)


def _present(config: dict, keys: list[StoreKey]) -> list[bool]:
    with build_store(config) as store:
        return store.tiers[0].contains_many(keys)


def test_stats_evict_and_pin_work_on_the_object_tier(s3_bucket, capsys):
    config = {"namespace": "a", "tiers": [s3_bucket.tier_config(pin_budget=0.5)]}
    m1, m2 = _keys("m1", 3), _keys("m2", 2)
    _fill(config, m1, ["doc:1"])
    _fill(config, m2, ["doc:2"])
    result = collect(config, None, by_tag=True)
    tier = result["tiers"][0]
    assert tier["entries"] == 5 and tier["bytes"] > 5 * 1024
    assert {t["tag"]: t["entries"] for t in tier["tags"]} == {"doc:1": 3, "doc:2": 2}
    assert evict(config, model="m2")["tiers"][0]["records"] == 2
    assert _present(config, m2) == [False, False] and _present(config, m1) == [True] * 3
    assert cli_main(["evict", "--config", json.dumps(config), "--tag", "doc:1"]) == 0
    assert _present(config, m1) == [False] * 3
    old = _keys("m3", 2, "old")
    _fill(config, old)
    old_written = time.time()
    time.sleep(8.0)
    new = _keys("m3", 2, "new")
    _fill(config, new)
    # the cut just after the old writes, as an age from now. `evict` measures ages when it lists, seconds later on
    # a loaded machine, which moves the cut as much later (a cut 2 s after them once took the new records too, a
    # second's delay); S3 times are whole seconds. A new record's time is at least 7 s past old_written: the
    # cut, 0.5 s past it, may move 6.5 s before the new records count as old
    older_than_s = time.time() - (old_written + 0.5)
    assert evict(config, older_than_s=older_than_s)["tiers"][0]["records"] == 2
    assert _present(config, old) == [False, False] and _present(config, new) == [True, True]
    assert cli_main(["pin", "--config", json.dumps(config), "--tag", "corpus"]) == 0
    with build_store(config) as store:
        assert any(name.startswith("pin:") for name in store.tiers[0].read_control())
    capsys.readouterr()
