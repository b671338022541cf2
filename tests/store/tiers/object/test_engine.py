"""The object tier under real vLLM engines: a producer saves into a bucket, a fresh consumer that shares
nothing else with it (no memory, no disk) loads every whole block and answers as an engine without
connectors does. (Two OpenAI servers and a restart of everything, SeaweedFS included, are issue 49's next
steps.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fixtures.models import run_engine
from tests.fixtures.redis import PATIENT_LOOKUP_BUDGET_MS
from vllm_tiercache.shared.stats_dump import read_stats

pytestmark = [pytest.mark.engine, pytest.mark.s3]
BLOCK = 32


def _prompts() -> list[list[int]]:
    rng = random.Random(49)
    shared = [rng.randrange(3, 259) for _ in range(512)]
    return [shared, shared[:256] + [rng.randrange(3, 259) for _ in range(90)],
            [rng.randrange(3, 259) for _ in range(300)]]


def _kv(role: str, tiers: list[dict]) -> dict:
    return {"kv_connector": "TieredKVConnector", "kv_role": role,
            "kv_connector_extra_config": {"namespace": "objtest", "tiers": tiers,
                                          "lookup_budget_ms": PATIENT_LOOKUP_BUDGET_MS}}


def test_a_consumer_loads_what_a_producer_saved_in_the_bucket(tiny_llama: Path, s3_bucket, tmp_path: Path):
    prompts = _prompts()
    env = s3_bucket.server.credentials_env()
    obj = s3_bucket.tier_config(timeout_s=10.0)
    baseline = run_engine({"model": str(tiny_llama), "rounds": [prompts]}, tmp_path / "base")
    produced = run_engine({"model": str(tiny_llama), "rounds": [prompts],
                           "kv_transfer_config": _kv("kv_producer", [{"kind": "memory", "capacity": "64MiB"}, obj])},
                          tmp_path / "producer", env_extra=env)
    assert produced["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"]
    stats_dir = tmp_path / "consumer-stats"
    consumed = run_engine({"model": str(tiny_llama), "rounds": [prompts],
                           "kv_transfer_config": _kv("kv_consumer", [obj])},
                          tmp_path / "consumer", env_extra=env, stats_dir=stats_dir)
    (only,) = consumed["rounds"]
    assert only["tokens"] == baseline["rounds"][0]["tokens"]
    assert only["num_cached_tokens"] == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
    (stats,) = read_stats(str(stats_dir), "kv-worker")
    assert stats["store"]["tiers"]["object"]["hits"] > 0 and stats["counters"]["load_errors"] == 0
