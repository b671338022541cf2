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

from vllm_tiercache.shared.naming.keys import EncoderIdentity, KVModelIdentity, encoder_key, kv_chunk_key
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey, TierAdminUnsupported
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
    old_written = time.time()
    time.sleep(8.0)
    _fill(config, new)
    # the cut 2 s after the old writes (Redis counts idle time in whole seconds), as an age from now. `evict`
    # measures ages when it lists, later on a loaded machine, which moves the cut as much later: with the new
    # records written 8 s after the old, it may move 5 s before they count as old (4 s gave it 1 s)
    result = evict(config, older_than_s=time.time() - (old_written + 2.0))
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


# ------------------------------------------------------------------------------- the tier admin contract
def test_every_tier_lists_and_deletes_through_the_contract(filled: dict) -> None:
    """`iter_stored` / `delete_stored` / `sizes_many` on the real disk and Redis tiers agree."""
    groups = filled["groups"]
    with build_store(filled["config"]) as store:
        for tier in store.tiers:
            listed = list(tier.iter_stored())
            assert sorted(r.text for r in listed) == sorted(k.text for keys in groups.values() for k in keys)
            assert all(r.nbytes and r.nbytes > 1024 and r.idle_s is not None and r.idle_s >= 0 for r in listed)
            keys = groups[("b", "m1")]
            sizes = tier.sizes_many(keys)
            assert sizes == [r.nbytes for k in keys for r in listed if r.text == k.text], tier.name
            wanted = {k.text for k in keys}
            dry = tier.delete_stored(lambda r, wanted=wanted: r.text in wanted, dry_run=True)
            assert dry == (len(keys), sum(sizes)), tier.name
            assert tier.contains_many(keys) == [True] * len(keys)
            assert tier.delete_stored(lambda r, wanted=wanted: r.text in wanted) == dry, tier.name
            assert tier.contains_many(keys) == [False] * len(keys)
            assert tier.sizes_many(keys) == [None] * len(keys)


def test_a_memory_tier_says_it_cannot_be_listed_and_the_commands_note_it(tmp_path: Path, capsys) -> None:
    config = {"tiers": [{"kind": "memory", "capacity": "1MiB"},
                        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"}]}
    keys = _keys("a", "m1", 1)
    with build_store(config) as store:
        store.put_many([(k, torch.ones(16), None) for k in keys])
        assert store.flush(30.0)
        memory = store.tiers[0]
        with pytest.raises(TierAdminUnsupported, match="inside each serving process"):
            memory.iter_stored()
        with pytest.raises(TierAdminUnsupported):
            memory.delete_stored(lambda r: True)
        assert memory.sizes_many([*keys, StoreKey("a|kv|other")]) == [64] * len(keys) + [None]
    stats = collect(config, None)["tiers"]
    assert stats[0] == {"name": "memory", "kind": "memory", "entries": 0, "bytes": 0,
                        "note": "per process: empty in this process; see the stats files"}
    assert stats[1]["entries"] == len(keys)
    assert cli_main(["evict", "--config", json.dumps(config), "--namespace", "a"]) == 0
    out = capsys.readouterr().out
    assert "tier memory (memory): skipped (per process: not reachable from here (see docs/jobs.md))" in out
    assert f"tier disk (disk): removed {len(keys)} records" in out


def test_an_unreachable_tier_is_an_error_for_the_commands(tmp_path: Path, capsys) -> None:
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"},
                        {"kind": "redis", "url": "redis://127.0.0.1:1", "timeout_s": 0.2}]}
    redis_stats = collect(config, None)["tiers"][1]
    assert redis_stats["entries"] is None and redis_stats["error"]
    assert cli_main(["evict", "--config", json.dumps(config), "--model", "m1"]) == 1
    assert "tier redis (redis): FAILED: " in capsys.readouterr().out


def test_stats_exits_1_when_a_tier_is_unreachable_and_prints_the_others(tmp_path: Path, capsys) -> None:
    """It used to exit 0 with an unreachable Redis: scripts could not tell a partial answer from a whole one."""
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"},
                        {"kind": "redis", "url": "redis://127.0.0.1:1", "timeout_s": 0.2}]}
    _fill({"tiers": config["tiers"][:1]}, _keys("a", "m1", 1))
    assert cli_main(["stats", "--config", json.dumps(config)]) == 1
    out = capsys.readouterr().out
    assert "tier disk (disk): 3 entries" in out and "tier redis (redis): unavailable: " in out
    assert cli_main(["stats", "--config", json.dumps(config), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["tiers"][0]["entries"] == 3
    assert cli_main(["stats", "--config", json.dumps({"tiers": config["tiers"][:1]})]) == 0


def test_the_commands_never_ask_a_tier_for_its_kind() -> None:
    """The admin commands work through the tier contract only: a new tier kind needs no line in them."""
    import ast
    import inspect

    from vllm_tiercache.tools import evict_cmd, jobs, stats_cmd

    for module in (stats_cmd, evict_cmd, jobs):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                assert not any(isinstance(o, ast.Attribute) and o.attr == "kind" for o in operands), \
                    f"{module.__name__}:{node.lineno} compares a tier's kind"
