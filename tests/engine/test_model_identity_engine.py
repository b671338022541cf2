"""The key names the weights, not the string the user typed, on real engines.

Two things an operator meets in the second week:
- weights rewritten in the same directory (same path, same config.json, the fine-tuning workflow): a
  restarted engine on the same disk tier must hit nothing and give the new weights' tokens. Before the
  key carried a digest of the weights, it reported cached tokens on every prompt and its outputs matched
  neither weights;
- another spelling of the same model (a trailing slash, a symlink): it must hit the records the plain
  path wrote, with identical tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.fixtures.models import run_engine
from tests.kv.test_kv_connector import PROMPTS, disk_tier, expected_hits, kv_config
from tests.support.zygote_client import run_job
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec, make_tiny_llama
from vllm_tiercache.tools.tiny_models.lora import make_tiny_lora

pytestmark = pytest.mark.engine

ROUND = PROMPTS[:4]


def link_or(model: Path) -> Path:
    """Another spelling of ``model``: the CLI must give the engine's identity for it too."""
    return Path(f"{model}/")


def _identity_cli(model: str, store: dict) -> dict:
    out = run_job([sys.executable, "-m", "vllm_tiercache.tools.cli", "identity", "--model", model,
                   "--block-size", "32", "--dtype", "bfloat16", "--config", json.dumps(store), "--json"],
                  env=dict(os.environ), cwd=os.getcwd(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _stored_texts(disk: Path) -> list[str]:
    store = build_store({"tiers": [disk_tier(disk)]})
    try:
        return [r.text for r in store.tiers[0].iter_stored()]
    finally:
        store.close()


@pytest.fixture(autouse=True)
def _same_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines with and without a connector are compared: same reserved cores (see the developers' guide)."""
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


def test_rewritten_weights_miss_and_other_spellings_hit(tiny_llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_llama, model)
    disk = tmp_path / "disk"
    connector = kv_config("kv_both", [disk_tier(disk)])

    old = run_engine({"model": str(model), "rounds": [ROUND], "kv_transfer_config": connector}, tmp_path)
    assert old["rounds"][0]["num_cached_tokens"] == [0] * len(ROUND)
    # `tiercache identity` predicts the keys the engine wrote (a precompute job and servers can compare).
    predicted = _identity_cli(str(link_or(model)), connector["kv_connector_extra_config"])
    texts = _stored_texts(disk)
    assert texts and all(t.startswith(predicted["kv_key_prefixes"][0]) for t in texts), (predicted, texts[:2])

    link = tmp_path / "link-to-tiny"
    link.symlink_to(model)
    for spelling in (f"{model}/", str(link)):
        again = run_engine({"model": spelling, "rounds": [ROUND], "kv_transfer_config": connector}, tmp_path)
        assert again["rounds"][0]["num_cached_tokens"] == [expected_hits(p) for p in ROUND], spelling
        assert again["rounds"][0]["tokens"] == old["rounds"][0]["tokens"], spelling

    # New weights in the same directory: only the safetensors file changes (config, tokenizer, path stay).
    other = make_tiny_llama(tmp_path / "other", TinyLlamaSpec(seed=7))
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")
    new_baseline = run_engine({"model": str(model), "rounds": [ROUND]}, tmp_path)
    assert new_baseline["rounds"][0]["tokens"] != old["rounds"][0]["tokens"], "the new weights must differ"

    restarted = run_engine({"model": str(model), "rounds": [ROUND], "kv_transfer_config": connector}, tmp_path)
    assert restarted["rounds"][0]["num_cached_tokens"] == [0] * len(ROUND)
    assert restarted["rounds"][0]["tokens"] == new_baseline["rounds"][0]["tokens"]


def test_a_rewritten_lora_adapter_misses_and_the_same_adapter_hits(tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM hashes a LoRA request's blocks with the adapter's name and path, not its weights: an adapter
    retrained into the same directory must not meet the old adapter's KV after a restart."""
    adapter = make_tiny_lora(tmp_path / "adapters" / "a", seed=1)
    disk = tmp_path / "disk"
    connector = kv_config("kv_both", [disk_tier(disk)])
    asked = [{"tokens": p, "lora": "a"} for p in ROUND]
    spec = {"model": str(tiny_llama), "lora_adapters": {"a": str(adapter)}, "one_at_a_time": True,
            "rounds": [asked]}

    old = run_engine({**spec, "kv_transfer_config": connector}, tmp_path)
    assert old["rounds"][0]["num_cached_tokens"] == [0] * len(ROUND)
    same = run_engine({**spec, "kv_transfer_config": connector}, tmp_path)
    assert same["rounds"][0]["num_cached_tokens"] == [expected_hits(p) for p in ROUND]
    assert same["rounds"][0]["tokens"] == old["rounds"][0]["tokens"]

    # The adapter retrained in place: same name, same path, same adapter_config.json, new weights.
    make_tiny_lora(tmp_path / "adapters" / "retrained", seed=2)
    shutil.copyfile(tmp_path / "adapters" / "retrained" / "adapter_model.safetensors",
                    adapter / "adapter_model.safetensors")
    new_baseline = run_engine(spec, tmp_path)
    assert new_baseline["rounds"][0]["tokens"] != old["rounds"][0]["tokens"], "the new adapter must differ"
    restarted = run_engine({**spec, "kv_transfer_config": connector}, tmp_path)
    assert restarted["rounds"][0]["num_cached_tokens"] == [0] * len(ROUND)
    assert restarted["rounds"][0]["tokens"] == new_baseline["rounds"][0]["tokens"]
