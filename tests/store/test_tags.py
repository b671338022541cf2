"""Tags on records, `tiercache evict --tag`, `tiercache stats --by-tag` and the memory tiers' invalidation
through the shared control entries, on real files and a real redis-server.

The corpus is 100 documents of two KV layer records and one encoder record each, tagged ``doc:<i>`` and
``corpus:v3`` (the way `tiercache precompute` tags them), beside untagged records: the filters are tested
on what the tiers keep beside the records, never on payloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import pytest
import torch

from tests.support.waiting import wait_until
from vllm_tiercache.shared.naming.keys import EncoderIdentity, KVModelIdentity, encoder_key, kv_chunk_key
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.tags import MAX_TAG_LENGTH, MAX_TAGS, validate_tags, with_tags
from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex
from vllm_tiercache.tools.cli import main as cli_main
from vllm_tiercache.tools.evict_cmd import evict
from vllm_tiercache.tools.stats_cmd import collect

DOCS = 100
IDENT = KVModelIdentity(model="m1", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
                        block_size=32, layout="paged-bhnc", tp_size=1, tp_rank=0)


def _doc_keys(i: int) -> list[StoreKey]:
    return [kv_chunk_key("a", IDENT, f"doc{i}".encode(), layer) for layer in (0, 1)] + [
        encoder_key("a", EncoderIdentity("m1", "f" * 16), f"img{i}")]


def _items(docs: range) -> list[tuple[StoreKey, torch.Tensor, dict]]:
    return [(k, torch.full((64,), float(i)), {"tags": [f"doc:{i}", "corpus:v3"]})
            for i in docs for k in _doc_keys(i)]


UNTAGGED = [kv_chunk_key("a", IDENT, f"plain{i}".encode(), 0) for i in range(5)]


def _config(tmp_path: Path, redis_url: str | None = None, memory: bool = False, poll_s: float = 5.0) -> dict:
    tiers: list[dict] = [{"kind": "memory", "capacity": "64MiB"}] if memory else []
    tiers.append({"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"})
    if redis_url:
        tiers.append({"kind": "redis", "url": redis_url})
    return {"namespace": "a", "control_poll_s": poll_s, "tiers": tiers}


def _fill(config: dict, docs: range = range(DOCS)) -> None:
    with build_store(config) as store:
        store.put_many([*_items(docs), *[(k, torch.ones(64), None) for k in UNTAGGED]])
        assert store.flush(60.0)


def _tags_by_text(tier) -> dict[str, tuple[str, ...]]:
    return {r.text: r.tags for r in tier.iter_stored()}


@pytest.mark.parametrize(("tags", "message"), [
    (["", "x"], "invalid tag ''"),
    (["  "], "invalid tag '  '"),
    (["doc:1\n"], r"invalid tag 'doc:1\\n'"),
    (["a\x00b"], r"invalid tag 'a\\x00b'"),
    (["x" * (MAX_TAG_LENGTH + 1)], f"at most {MAX_TAG_LENGTH} printable"),
    ([f"t{i}" for i in range(MAX_TAGS + 1)], f"{MAX_TAGS + 1} tags"),
    ([3], "invalid tag 3"),
    ("doc:1", "a list of tags"),
])
def test_bad_tags_are_refused_naming_the_tag(tags, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_tags(tags)


def test_tags_merge_without_repeats_and_untagged_meta_stays_without_the_key() -> None:
    assert with_tags({"tags": ["a"], "x": 1}, ["b", "a"]) == {"tags": ["a", "b"], "x": 1}
    assert with_tags({"x": 1}, []) == {"x": 1}


def test_tags_survive_reopening_and_a_disk_index_rebuild(tmp_path: Path, redis_url: str) -> None:
    config = _config(tmp_path, redis_url)
    _fill(config, range(3))
    want = {k.text: (f"doc:{i}", "corpus:v3") for i in range(3) for k in _doc_keys(i)}
    want.update({k.text: () for k in UNTAGGED})
    with build_store(config) as store:  # a restart: a new store over the same directory and server
        for tier in store.tiers:
            assert _tags_by_text(tier) == want, tier.name
        disk = store.tiers[0]
        with disk._index.env.begin(write=True) as txn:  # an index lost its entries (rebuilt from headers)
            txn.drop(disk._index.entries, delete=False)
            txn.drop(disk._index.tags, delete=False)
            txn.drop(disk._index.by_atime, delete=False)
        assert list(disk.iter_stored()) == []
        assert disk.rebuild_index() == len(want)
        rebuilt = sorted(r.tags for r in disk.iter_stored())  # rebuilt entries have no key text, tags yes
        assert rebuilt == sorted(want.values())


# ----------------------------------------------------------------------------------------- evict --tag
def test_evict_by_tag_removes_exactly_one_document_on_every_tier(tmp_path: Path, redis_url: str, capsys) -> None:
    config = _config(tmp_path, redis_url)
    _fill(config)
    per_doc = len(_doc_keys(0))
    dry = evict(config, tags=["doc:42"], dry_run=True)
    assert [t["records"] for t in dry["tiers"]] == [per_doc, per_doc] and "invalidated" not in dry
    with build_store(config) as store:
        assert all(tier.contains_many(_doc_keys(42)) == [True] * per_doc for tier in store.tiers)
        assert all(tier.read_control() == {} for tier in store.tiers)  # a dry run writes nothing

    result = evict(config, tags=["doc:42"])
    assert [t["records"] for t in result["tiers"]] == [per_doc, per_doc]
    assert result["bytes"] == dry["bytes"] > 0 and result["invalidated"] == ["disk", "redis"]
    others = [k for i in range(DOCS) if i != 42 for k in _doc_keys(i)] + UNTAGGED
    with build_store(config) as store:
        for tier in store.tiers:
            assert tier.contains_many(_doc_keys(42)) == [False] * per_doc, tier.name
            assert tier.contains_many(others) == [True] * len(others), tier.name
            assert set(tier.read_control()) == {"invalidate:doc:42"}
    # combined with another filter as AND: nothing of namespace b carries the tag
    assert evict(config, tags=["doc:7"], namespace="b")["records"] == 0
    # repeated: any of the tags
    assert cli_main(["evict", "--config", json.dumps(config), "--tag", "doc:1", "--tag", "doc:2", "--dry-run"]) == 0
    assert f"total: would remove {2 * 2 * per_doc} records" in capsys.readouterr().out


def test_evict_by_tag_on_a_redis_cluster(tmp_path: Path, redis_cluster) -> None:
    config = {"tiers": [{"kind": "redis", "url": redis_cluster.url}]}
    _fill(config, range(10))
    assert evict(config, tags=["doc:3"])["records"] == len(_doc_keys(3))
    with build_store(config) as store:
        tier = store.tiers[0]
        assert tier.contains_many(_doc_keys(3)) == [False] * 3 and tier.contains_many(_doc_keys(4)) == [True] * 3
        assert set(tier.read_control()) == {"invalidate:doc:3"}


def test_stats_by_tag_counts_records_and_bytes_per_tag(tmp_path: Path, redis_url: str, capsys) -> None:
    config = _config(tmp_path, redis_url)
    _fill(config, range(4))
    for tier in collect(config, None, by_tag=True)["tiers"]:
        tags = {t["tag"]: (t["entries"], t["bytes"]) for t in tier["tags"]}
        assert set(tags) == {"corpus:v3", "doc:0", "doc:1", "doc:2", "doc:3"}
        assert tags["corpus:v3"][0] == 4 * 3 and tags["doc:2"][0] == 3
        assert tags["corpus:v3"][1] == 4 * tags["doc:2"][1] > 3 * 256
    assert "tags" not in collect(config, None)["tiers"][0]
    assert cli_main(["stats", "--config", json.dumps(config), "--by-tag"]) == 0
    assert "by tag (5 tags):" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["--tag", ""], ["--tag", "a\tb"], ["--tag", "x" * (MAX_TAG_LENGTH + 1)],
])
def test_evict_refuses_a_bad_tag_in_one_line(tmp_path: Path, argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["evict", "--config", json.dumps(_config(tmp_path)), *argv])
    assert exc.value.code == 2
    assert "invalid tag" in capsys.readouterr().err


# ---------------------------------------------------------------------- memory tiers, through the store
def test_a_running_store_drops_an_invalidated_tag_from_memory_at_its_next_poll(tmp_path: Path) -> None:
    config = _config(tmp_path, memory=True, poll_s=0.02)
    with build_store(config) as serving:
        serving.put_many(_items(range(5)))
        assert serving.flush(30.0)
        memory = serving.tiers[0]
        assert memory.contains_many(_doc_keys(2)) == [True] * 3
        evict(config, tags=["doc:2"])
        polls = serving.control.polls
        # two polls began after the command returned: the invalidation was read and applied
        wait_until("two polls after the command", lambda: serving.control.polls >= polls + 2, poll_s=0.01)
        assert memory.contains_many(_doc_keys(2)) == [False] * 3
        assert memory.contains_many(_doc_keys(3)) == [True] * 3
        assert serving.get_many(_doc_keys(2)) == [None] * 3  # nor any other tier
        # a record of the tag written after the invalidation is kept
        serving.put_many(_items(range(2, 3)))
        polls = serving.control.polls  # two polls since (a fixed 0.1 s sleep could see none on a loaded machine)
        wait_until("two polls after the put", lambda: serving.control.polls >= polls + 2, poll_s=0.01)
        assert memory.contains_many(_doc_keys(2)) == [True] * 3


# --------------------------------------------------------------------------------------- mixed versions
def test_an_older_builds_index_and_records_read_in_this_build(tmp_path: Path) -> None:
    """An older build wrote untagged records into an index without the ``tags`` and ``control`` databases."""
    config = _config(tmp_path)
    _fill(config, range(0))
    index_dir = str(tmp_path / "disk" / "index.lmdb")
    env = lmdb.open(index_dir, max_dbs=8, subdir=True)
    with env.begin(write=True) as txn:  # as an older build leaves it: no tags, no control
        for name in (b"tags", b"control"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
    env.close()
    with build_store(config) as store:
        disk = store.tiers[0]
        assert {r.text: r.tags for r in disk.iter_stored()} == {k.text: () for k in UNTAGGED}
        assert all(r is not None for r in store.get_many(UNTAGGED))
        assert disk.read_control() == {}


def test_an_older_reader_ignores_tags_and_its_evictions_leave_orphans_this_build_cleans(
        tmp_path: Path, redis_url: str) -> None:
    config = _config(tmp_path, redis_url)
    _fill(config, range(3))
    # An older build reads ``entries`` as it always has: the value layout is unchanged.
    env = lmdb.open(str(tmp_path / "disk" / "index.lmdb"), max_dbs=4, subdir=True)
    with env.begin() as txn:
        entries = env.open_db(b"entries", txn=txn)
        raw = txn.get(_doc_keys(1)[0].digest, db=entries)
    env.close()
    assert bytes(raw[16:]).decode() == _doc_keys(1)[0].text
    with build_store(config) as store:
        disk, redis = store.tiers
        # An older build evicts doc:1: it deletes the entry, its atime and the file, not the tags.
        index: DiskIndex = disk._index
        with index.env.begin(write=True) as txn:
            for key in _doc_keys(1):
                entry = index.get(txn, key.digest)
                txn.delete(key.digest, db=index.entries)
                txn.delete(int(entry.atime_ns).to_bytes(8, "big") + key.digest, db=index.by_atime)
                disk.path_for(key).unlink()  # (a file left behind would be adopted when a tier opens)
        client = redis._calls.client_or_raise()
        for key in _doc_keys(1):  # and Redis: head, part, text
            client.delete(redis._names.head(key), redis._names.part(key, 0), redis._names.text(key))
        assert client.exists(*[redis._names.tags(k) for k in _doc_keys(1)]) == 3
        for tier in store.tiers:  # orphans are not records
            assert "doc:1" not in {t for r in tier.iter_stored() for t in r.tags}
    assert evict(config, tags=["doc:1"])["records"] == 0  # and a real run drops them
    with build_store(config) as store:
        disk, redis = store.tiers
        with disk._index.env.begin() as txn:
            assert {d for d, _ in disk._index.scan_tags(txn)} == {k.digest for i in (0, 2) for k in _doc_keys(i)}
        client = redis._calls.client_or_raise()
        assert client.exists(*[redis._names.tags(k) for k in _doc_keys(1)]) == 0
        assert client.exists(*[redis._names.tags(k) for k in _doc_keys(0)]) == 3
