"""TieredKVConnector on a real vLLM engine serving a hybrid-attention model (the tiny Gemma 3: sliding-window
and global layers) with vLLM's hybrid KV cache manager on. Each engine runs in a fresh process, all with
the same reserved cores (VLLM_CPU_NUM_OF_RESERVED_CPU=1), so their greedy tokens are comparable.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest

from tests.fixtures.models import run_engine
from vllm_tiercache.shared.stats_dump import read_stats
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.tools.tiny_models.gemma3 import make_tiny_gemma3
from vllm_tiercache.tools.tiny_models.granite_hybrid import make_tiny_granite_hybrid

pytestmark = pytest.mark.engine

BLOCK = 32
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
HMA_OFF = "Turning off hybrid kv cache manager"


def _prompts() -> list[list[int]]:
    rng = random.Random(4321)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 259) for _ in range(n)]

    shared = tokens(512)
    return [
        tokens(100),  # one partial chunk (longer than the 64-token window)
        tokens(256),  # exactly one chunk: block-aligned, the hit ends one block short
        tokens(300),  # a chunk and a partial one
        shared,  # two chunks
        shared + tokens(200),  # shares two chunks with the previous prompt
        tokens(777),
        tokens(31),  # shorter than a block: nothing to cache
    ]


PROMPTS = _prompts()


def expected_hits(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def kv_config(disk: Path) -> dict:
    return {
        "kv_connector": "TieredKVConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "namespace": "hma",
            "tiers": [{"kind": "disk", "path": str(disk), "capacity": "1GiB"}],
        },
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("hma")
    model = str(make_tiny_gemma3(work / "tiny-gemma3"))
    baseline = run_engine({"model": model, "rounds": [PROMPTS]}, work, env_extra=ENV)
    disk = work / "disk"
    first = run_engine({"model": model, "rounds": [PROMPTS], "kv_transfer_config": kv_config(disk)}, work,
                       env_extra=ENV)
    restarted = run_engine({"model": model, "rounds": [PROMPTS], "kv_transfer_config": kv_config(disk)}, work,
                           env_extra=ENV, stats_dir=work / "stats")
    return {"baseline": baseline, "first": first, "restarted": restarted, "stats_dir": work / "stats",
            "disk": disk, "model": model}


def test_hma_stays_on_with_the_connector(engines: dict) -> None:
    log = Path(engines["first"]["log_path"]).read_text()
    assert "TieredKVConnector" in log
    assert HMA_OFF not in log
    assert "hybrid KV cache groups" in log  # the connector's own line naming the sliding-window group
    # the same KV capacity as vLLM alone (with HMA off it would shrink to what full attention allows)
    baseline = Path(engines["baseline"]["log_path"]).read_text()
    assert kv_capacity(log) == kv_capacity(baseline) > 0


def kv_capacity(log: str) -> int:
    """vLLM's 'KV cache size: N tokens' (the token capacity of its blocks)."""
    (found,) = set(re.findall(r"KV cache size: ([\d,]+) tokens", log))
    return int(found.replace(",", ""))


def test_restart_hits_with_tokens_identical_to_vllm_alone(engines: dict) -> None:
    reference = engines["baseline"]["rounds"][0]["tokens"]
    assert engines["first"]["rounds"][0]["tokens"] == reference
    assert engines["first"]["rounds"][0]["num_cached_tokens"] == [0] * len(PROMPTS)
    restarted = engines["restarted"]["rounds"][0]
    assert restarted["tokens"] == reference
    assert restarted["num_cached_tokens"] == [expected_hits(p) for p in PROMPTS]
    (stats,) = read_stats(str(engines["stats_dir"]), "kv-worker")
    assert stats["counters"]["load_errors"] == 0
    assert stats["counters"]["loaded_blocks"] == sum(expected_hits(p) for p in PROMPTS) // BLOCK


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def sliding_window_records(disk: Path) -> list[Path]:
    """The record files of the sliding-window group's layers (their keys carry the group's tag)."""
    store = build_store({"tiers": [{"kind": "disk", "path": str(disk), "capacity": "1GiB"}]})
    try:
        (tier,) = store.tiers
        texts = [record.text for record in tier.iter_stored() if "|Gsw" in record.text]
        return [tier.path_for(StoreKey(text)) for text in texts]
    finally:
        store.close()


def test_corrupted_sliding_window_records_are_recomputed(engines: dict, tmp_path: Path) -> None:
    """A window record that fails to load fails the whole-request load (vLLM allows no block-level failure
    with several KV cache groups): vLLM recomputes the request, the tokens stay those of vLLM alone."""
    damaged = tmp_path / "damaged"
    shutil.copytree(engines["disk"], damaged)
    records = sliding_window_records(damaged)
    assert len(records) >= 8
    for path in records[::2]:
        _damage(path)
    result = run_engine({"model": engines["model"], "rounds": [PROMPTS], "kv_transfer_config": kv_config(damaged)},
                        tmp_path / "run", env_extra=ENV, stats_dir=tmp_path / "stats")
    assert result["rounds"][0]["tokens"] == engines["baseline"]["rounds"][0]["tokens"]
    (stats,) = read_stats(str(tmp_path / "stats"), "kv-worker")
    assert stats["store"]["tiers"]["disk"]["corrupt"] >= 1
    assert stats["counters"]["load_errors"] >= 1
    log = Path(result["log_path"]).read_text()
    assert "failed to load; they are recomputed" in log


def test_preemption_reloads_its_own_chunks_with_tokens_identical_to_vllm_alone(engines: dict,
                                                                              tmp_path: Path) -> None:
    """A KV cache too small for the batch: vLLM preempts decoding requests and re-admits them later. With
    the connector they find their own saved prompt chunks (the only loads possible here: every prompt is
    new to a fresh store), and the tokens are vLLM's own, preempted alike."""
    rng = random.Random(99)
    prompts = [[rng.randrange(3, 259) for _ in range(300)] for _ in range(6)]
    spec = {"model": engines["model"], "rounds": [prompts], "num_gpu_blocks_override": 48, "max_tokens": 160,
            "max_model_len": 512}
    alone = run_engine(spec, tmp_path / "alone", env_extra=ENV)
    disk = tmp_path / "disk"
    ours = run_engine({**spec, "kv_transfer_config": kv_config(disk)}, tmp_path / "ours", env_extra=ENV,
                      stats_dir=tmp_path / "stats")
    assert ours["rounds"][0]["tokens"] == alone["rounds"][0]["tokens"]
    (stats,) = read_stats(str(tmp_path / "stats"), "kv-worker")
    assert stats["counters"]["loaded_blocks"] > 0  # a preempted request got its prefix back from the store
    assert stats["counters"]["load_errors"] == 0


def test_hybrid_ssm_model_starts_with_hma_on_and_claims_no_hit(tmp_path: Path) -> None:
    """A mamba2 + attention model (tiny Granite 4.0 H shape) needs the hybrid KV cache manager to start at
    all. With the connector it starts, HMA stays on, the connector says in one line that it will not load
    for this model, claims no hit, and the tokens are vLLM's own."""
    model = str(make_tiny_granite_hybrid(tmp_path / "tiny-granite-hybrid"))
    prompts = PROMPTS[:4]
    alone = run_engine({"model": model, "rounds": [prompts, prompts]}, tmp_path / "alone", env_extra=ENV)
    ours = run_engine({"model": model, "rounds": [prompts, prompts], "kv_transfer_config": kv_config(tmp_path / "d")},
                      tmp_path / "ours", env_extra=ENV)
    log = Path(ours["log_path"]).read_text()
    assert HMA_OFF not in log
    assert "no KV loads or saves for this model: group 0 is MambaSpec" in log
    assert [r["tokens"] for r in ours["rounds"]] == [r["tokens"] for r in alone["rounds"]]
    assert all(hit == 0 for r in ours["rounds"] for hit in r["num_cached_tokens"])
    assert not list((tmp_path / "d").rglob("*.rec"))


def test_local_prefix_hit_completed_by_the_store(engines: dict, tmp_path: Path) -> None:
    """vLLM's own prefix cache holds the shared document (loaded from the store in round 1); the longer
    prompt then takes the document from vLLM and only the rest from the store: the sliding-window group
    loads just the window blocks past the local hit."""
    disk = tmp_path / "disk"
    shutil.copytree(engines["disk"], disk)
    document, longer = PROMPTS[3], PROMPTS[4]
    result = run_engine({"model": engines["model"], "rounds": [[document], [longer]], "enable_prefix_caching": True,
                         "kv_transfer_config": kv_config(disk)}, tmp_path / "run", env_extra=ENV,
                        stats_dir=tmp_path / "stats")
    reference = engines["baseline"]["rounds"][0]["tokens"]
    assert [r["tokens"][0] for r in result["rounds"]] == [reference[3], reference[4]]
    assert [r["num_cached_tokens"][0] for r in result["rounds"]] == [expected_hits(document), expected_hits(longer)]
    (stats,) = read_stats(str(tmp_path / "stats"), "kv-worker")
    # round 1: 15 blocks of the document (one short of its end); round 2: blocks 15..22 past vLLM's own hit
    assert stats["counters"]["loaded_blocks"] == expected_hits(document) // BLOCK + (
        expected_hits(longer) - expected_hits(document)) // BLOCK
    assert stats["counters"]["load_errors"] == 0
