"""`tiercache stats` and `tiercache evict` on a real disk tier and a real redis-server (no engine needed).

Records are named with the real key builders (`kv_chunk_key`, `encoder_key`) for two namespaces and two
models, so the filters are tested on the key texts the connectors write.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from vllm_tiercache.shared.keys import EncoderIdentity, KVModelIdentity, encoder_key, kv_chunk_key
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.tools.cli import main as cli_main
from vllm_tiercache.tools.evict_cmd import evict
from vllm_tiercache.tools.stats_cmd import collect


def _identity(model: str) -> KVModelIdentity:
    return KVModelIdentity(model=model, dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
                           block_size=32, layout="paged-bhnc", tp_size=1, tp_rank=0)


def _keys(namespace: str, model: str, n: int, salt: str = "") -> list[StoreKey]:
    ident = _identity(model)
    keys = [kv_chunk_key(namespace, ident, f"{salt}{model}{i}".encode(), layer) for i in range(n) for layer in (0, 1)]
    keys.append(encoder_key(namespace, EncoderIdentity(model, "f" * 16), f"{salt}mm{model}{n}"))
    return keys


def _config(tmp_path: Path, redis_url: str) -> dict:
    return {"namespace": "a", "tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"},
                                        {"kind": "redis", "url": redis_url}]}


def _fill(config: dict, keys: list[StoreKey]) -> None:
    with build_store(config) as store:
        store.put_many([(k, torch.full((256,), float(i)), None) for i, k in enumerate(keys)])
        assert store.flush(30.0)


def _present(config: dict, keys: list[StoreKey]) -> dict[str, list[bool]]:
    with build_store(config) as store:
        return {tier.name: tier.contains_many(keys) for tier in store.tiers}


@pytest.fixture
def filled(tmp_path: Path, redis_url: str) -> dict:
    config = _config(tmp_path, redis_url)
    groups = {
        ("a", "m1"): _keys("a", "m1", 3),
        ("a", "m2"): _keys("a", "m2", 2),
        ("b", "m1"): _keys("b", "m1", 4),
    }
    _fill(config, [k for keys in groups.values() for k in keys])
    return {"config": config, "groups": groups}


def test_stats_counts_entries_and_bytes_per_tier_and_namespace(filled: dict, tmp_path: Path) -> None:
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    (stats_dir / "kv-worker-123.json").write_text(json.dumps(
        {"pid": 123, "counters": {"loaded_blocks": 7}, "store": {"tiers": {"disk": {"hits": 5, "misses": 1}}}}))
    result = collect(filled["config"], str(stats_dir))
    by_tier = {t["name"]: t for t in result["tiers"]}
    for name in ("disk", "redis"):
        tier = by_tier[name]
        per_ns: dict[str, int] = {}
        for g in tier["groups"]:
            per_ns[g["namespace"]] = per_ns.get(g["namespace"], 0) + g["entries"]
            assert g["bytes"] > g["entries"] * 1024  # 256 float32 payload + header per record
        assert per_ns == {"a": 7 + 5, "b": 9}, name
        assert tier["entries"] == 21
        kinds = {(g["namespace"], g["kind"], g["model"]): g["entries"] for g in tier["groups"]}
        assert kinds[("a", "kv", "m1")] == 6 and kinds[("a", "enc", "m1")] == 1 and kinds[("b", "kv", "m1")] == 8
    assert by_tier["disk"]["bytes"] == by_tier["redis"]["bytes"]
    assert result["processes"][0]["file"] == "kv-worker-123.json"


def test_stats_cli_prints_tiers_and_hit_counters(filled: dict, tmp_path: Path, capsys) -> None:
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    (stats_dir / "ec-9.json").write_text(json.dumps({"connector": {"hits": 3}, "store": {"tiers": {}}}))
    assert cli_main(["stats", "--config", json.dumps(filled["config"]), "--stats-dir", str(stats_dir)]) == 0
    out = capsys.readouterr().out
    assert "tier disk (disk): 21 entries" in out and "tier redis (redis): 21 entries" in out
    assert "ec-9.json" in out and "'hits': 3" in out


@pytest.mark.parametrize(("flt", "removed"), [
    ({"namespace": "a"}, [("a", "m1"), ("a", "m2")]),
    ({"model": "m1"}, [("a", "m1"), ("b", "m1")]),
    ({"namespace": "a", "model": "m2"}, [("a", "m2")]),
])
def test_evict_removes_exactly_the_matching_records(filled: dict, flt: dict, removed: list) -> None:
    config, groups = filled["config"], filled["groups"]
    dry = evict(config, dry_run=True, **flt)
    expected = sum(len(groups[g]) for g in removed)
    assert [t["records"] for t in dry["tiers"]] == [expected, expected]
    assert all(_present(config, k) == {"disk": [True] * len(k), "redis": [True] * len(k)} for k in groups.values())

    result = evict(config, **flt)
    assert [t["records"] for t in result["tiers"]] == [expected, expected]
    assert result["bytes"] == dry["bytes"] > 0
    for group, keys in groups.items():
        want = [group not in removed] * len(keys)
        assert _present(config, keys) == {"disk": want, "redis": want}, group
    # What is left still reads back intact.
    kept = [k for g, keys in groups.items() if g not in removed for k in keys]
    with build_store(config) as store:
        assert all(rec is not None for rec in store.get_many(kept))
    assert evict(config, **flt)["records"] == 0


def test_evict_older_than_removes_only_old_records(tmp_path: Path, redis_url: str) -> None:
    config = _config(tmp_path, redis_url)
    old, new = _keys("a", "m1", 2, "old"), _keys("a", "m1", 2, "new")
    _fill(config, old)
    time.sleep(3.2)
    _fill(config, new)
    result = evict(config, older_than_s=2.0)
    assert [t["records"] for t in result["tiers"]] == [len(old), len(old)]
    assert _present(config, old) == {"disk": [False] * len(old), "redis": [False] * len(old)}
    assert _present(config, new) == {"disk": [True] * len(new), "redis": [True] * len(new)}


def test_evict_cli_output_and_errors(filled: dict, capsys) -> None:
    cfg = json.dumps(filled["config"])
    assert cli_main(["evict", "--config", cfg, "--namespace", "b", "--dry-run"]) == 0
    assert "total: would remove 18 records" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli_main(["evict", "--config", cfg, "--older-than", "5x"])
    assert exc.value.code == 2
    assert "invalid duration '5x'; use e.g. 30m, 12h, 7d" in capsys.readouterr().err
    assert cli_main(["evict", "--config", cfg]) == 2
    assert "give at least one of --namespace, --model, --older-than" in capsys.readouterr().err
