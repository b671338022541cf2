"""`tiercache precompute docs --salt`: a tenant's corpus is named and sealed for that tenant only.

No engine: the job's prompts and offline names are checked directly (the engine computes the same block
hashes from the same prompt dict, vLLM's ``cache_salt`` entering them as an extra key).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from vllm_tiercache.kvcache.naming import ChunkGeometry, KVNaming
from vllm_tiercache.shared.naming.keys import KVModelIdentity
from vllm_tiercache.tools.precompute.kv import add_arguments, doc_request, salt_arg

IDENTITY = KVModelIdentity(model="tiny", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64, block_size=16,
                           layout="paged-bhnc", tp_size=1, tp_rank=0)


def naming() -> KVNaming:
    return KVNaming(namespace="t", identities=(IDENTITY,), geometry=ChunkGeometry(16, 64), hash_algo="sha256")


def prompt(salt: str | None) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=list(range(3, 200)), mm_features=None, cache_salt=salt)


def test_a_salted_corpus_has_keys_no_other_tenant_and_no_unsalted_request_names() -> None:
    keys = {salt: naming().prompt_keys(prompt(salt))[0] for salt in ("tenant-a", "tenant-b", None)}
    digests = {salt: {k.digest for k in ks} for salt, ks in keys.items()}
    assert all(len(d) == len(keys["tenant-a"]) > 0 for d in digests.values())
    assert digests["tenant-a"].isdisjoint(digests["tenant-b"]) and digests["tenant-a"].isdisjoint(digests[None])
    assert {k.tenant for k in keys["tenant-a"]} == {"tenant-a"} and {k.tenant for k in keys[None]} == {None}


def test_the_job_sends_the_salt_with_every_prompt(tmp_path) -> None:
    doc = tmp_path / "a.txt"
    doc.write_text("a document")
    assert doc_request(doc, None, multimodal=False, salt="tenant-a")["cache_salt"] == "tenant-a"
    assert "cache_salt" not in doc_request(doc, None, multimodal=False)


def test_salt_argument_takes_a_value_or_an_environment_variable(monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m", "--config", "{}", "--docs", "d", "--salt", "t1"]).salt == "t1"
    monkeypatch.setenv("TC_SALT", "from-env")
    assert salt_arg("env:TC_SALT") == "from-env"
    monkeypatch.delenv("TC_SALT")
    with pytest.raises(argparse.ArgumentTypeError, match="'TC_SALT' is not set"):
        salt_arg("env:TC_SALT")
    with pytest.raises(argparse.ArgumentTypeError, match="empty salt"):
        salt_arg("")
