"""A real engine whose weights change in place (the RL-loop flow) must not serve KV of the old weights.

vLLM 0.32 resets its caches after an in-place weight update through
``Scheduler.reset_prefix_cache(reset_connector=True)``, which calls the KV connector's ``reset_cache``.
Before TieredKVConnector implemented it, the engine went on loading the KV its old weights had computed:
the prompts were reported as cache hits and the greedy tokens matched neither weights. Here one engine
(tiny Llama, memory + disk tiers) saves and hits, has its weights replaced from another tiny Llama's
file (`reload_weights`), is reset, and must then miss, give exactly the tokens of an uncached run with
the new weights, and hit its new generation's records afterwards (`tests.support.weights_update_job`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.models import run_engine
from tests.kv.test_kv_connector import PROMPTS, disk_tier, expected_hits, kv_config
from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec, make_tiny_llama

pytestmark = pytest.mark.engine

ROUND = PROMPTS[:4]


def test_a_weight_update_in_place_is_a_miss_with_the_new_weights_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    new_weights = make_tiny_llama(tmp_path / "new-weights", TinyLlamaSpec(seed=7))
    connector = kv_config("kv_both", [{"kind": "memory", "capacity": "256MiB"}, disk_tier(tmp_path / "disk")])
    result = run_engine(
        {"model": str(tiny_llama), "new_weights": str(new_weights), "prompts": ROUND, "kv_transfer_config": connector},
        tmp_path / "engine", job="tests.support.weights_update_job",
        env_extra={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
    )
    hits = [expected_hits(p) for p in ROUND]
    first, again = result["first"], result["again"]
    assert first["num_cached_tokens"] == [0] * len(ROUND)
    assert again["num_cached_tokens"] == hits and again["tokens"] == first["tokens"]

    assert result["reset"] is True
    after, reference = result["after"], result["reference"]
    assert reference["num_cached_tokens"] == [0] * len(ROUND)
    assert reference["tokens"] != first["tokens"], "the new weights must change the greedy tokens"
    # nothing computed with the old weights is loaded: no hit, and the uncached run's tokens exactly
    assert after["num_cached_tokens"] == [0] * len(ROUND)
    assert after["tokens"] == reference["tokens"]
    # the new generation's own records are hits for this engine
    assert result["after_again"]["num_cached_tokens"] == hits
    assert result["after_again"]["tokens"] == reference["tokens"]
    log = Path(result["log_path"]).read_text()
    assert log.count("started weights generation 1; records stored before are no longer used") == 1
