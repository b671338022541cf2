"""Encryption at rest on real vLLM engines: the issue's proof on a disk tier and a persistent redis-server.

A kv_producer without encryption writes tenant A's prompts; the test reads back the KV tensors that engine
computed (the plaintext records' payloads). Redis is emptied, and a kv_producer with encryption and
``require_cache_salt`` writes the same prompts plus one without a salt. Then: no 64-byte window of any of
those tensors appears in the Redis dump (BGSAVE) or in the sealed disk tier's files; the request without a
salt saved nothing (as many records as the plaintext run's); kv_consumers on the plaintext and the sealed
store give the tokens of an engine without a connector and the same hit counts; and on the sealed store
tenant B's salt and no salt get no hit. Five engine starts, run two and three at a time.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.models import run_engine
from tests.fixtures.redis import PATIENT_LOOKUP_BUDGET_MS, PATIENT_LOOKUP_DEADLINE_MS
from tests.store.sealing.rings import new_key, shares_window, write_ring
from vllm_tiercache.shared.config import DiskTierConfig
from vllm_tiercache.shared.store import records
from vllm_tiercache.shared.store.tiers.disk.tier import DiskTier
from vllm_tiercache.tools.redis_server import RedisServer

pytestmark = pytest.mark.engine

BLOCK = 32
PROMPT_LEN = 300  # one 256-token chunk and a partial one
HIT = (PROMPT_LEN - 1) // BLOCK * BLOCK


def _tokens(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(PROMPT_LEN)]


DOCS = [_tokens(21), _tokens(22)]
UNSALTED = _tokens(23)


def _item(tokens: list[int], salt: str | None) -> dict[str, Any]:
    return {"tokens": tokens, "cache_salt": salt}


#: what the consumers ask: tenant A's documents with A's salt, B's salt, and none
ASKED = [_item(t, s) for t in DOCS for s in ("tenant-a", "tenant-b", None)]


def _kv(role: str, disk: Path, url: str, ring: Path | None) -> dict[str, Any]:
    """The connector config: memory, disk, Redis; with ``ring``, sealing and ``require_cache_salt`` (and a
    namespace of its own: a sealing store and a plaintext one never share records)."""
    extra: dict[str, Any] = {
        "namespace": "sealed" if ring is not None else "plain", "lookup_budget_ms": PATIENT_LOOKUP_BUDGET_MS,
        "lookup_deadline_ms": PATIENT_LOOKUP_DEADLINE_MS,
        "tiers": [{"kind": "memory", "capacity": "256MiB"}, {"kind": "disk", "path": str(disk), "capacity": "1GiB"},
                  {"kind": "redis", "url": url}],
    }
    if ring is not None:
        extra.update(encryption={"ring": str(ring)}, require_cache_salt=True)
    return {"kv_connector": "TieredKVConnector", "kv_role": role, "kv_connector_extra_config": extra}


def _parallel(*calls: Callable[[], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _payloads(disk: Path) -> list[bytes]:
    """The raw tensor bytes of every record of a plaintext disk tier (what the engine computed)."""
    out = []
    for path in sorted(disk.rglob("*.rec")):
        buf = path.read_bytes()
        header = records.decode_header(buf)
        out.append(buf[header.payload_offset:header.payload_offset + header.nbytes])
    return out


def _record_count(disk: Path) -> int:
    tier = DiskTier(DiskTierConfig(path=str(disk)))
    try:
        return sum(1 for _ in tier.iter_stored())
    finally:
        tier.close()


@pytest.fixture(scope="module")
def saving_redis() -> Iterator[RedisServer]:
    with RedisServer(extra_args=["--save", "3600 1", "--dbfilename", "dump.rdb", "--rdbcompression", "no"]) as s:
        yield s


@pytest.fixture(scope="module")
def world(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, saving_redis: RedisServer) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("sealed-engine")
    model, url = str(tiny_llama), saving_redis.url
    ring = write_ring(work / "ring.json", "k1", {"k1": new_key()})
    plain_disk, sealed_disk = work / "plain-disk", work / "sealed-disk"
    written = [_item(t, "tenant-a") for t in DOCS]
    baseline, _ = _parallel(
        lambda: run_engine({"model": model, "one_at_a_time": True, "rounds": [ASKED]}, work / "baseline"),
        lambda: run_engine({"model": model, "one_at_a_time": True, "rounds": [written],
                            "kv_transfer_config": _kv("kv_producer", plain_disk, url, None)}, work / "plain"),
    )
    plaintext = _payloads(plain_disk)
    plain_dump = saving_redis.saved_dump(timeout_s=60)
    with saving_redis.client() as client:
        client.flushall()
    run_engine({"model": model, "one_at_a_time": True, "rounds": [[*written, _item(UNSALTED, None)]],
                "kv_transfer_config": _kv("kv_producer", sealed_disk, url, ring)}, work / "sealed")
    sealed_dump = saving_redis.saved_dump(timeout_s=60)
    stores = {"plain": (plain_disk, None), "sealed": (sealed_disk, ring)}
    consumers = _parallel(*[
        (lambda d=d, r=r, name=name: run_engine(
            {"model": model, "one_at_a_time": True, "rounds": [ASKED],
             "kv_transfer_config": _kv("kv_consumer", d, url, r)}, work / f"consumer-{name}"))
        for name, (d, r) in stores.items()])
    return {"baseline": baseline["rounds"][0]["tokens"], "plaintext": plaintext, "plain_dump": plain_dump,
            "sealed_dump": sealed_dump, "sealed_disk": sealed_disk, "plain_disk": plain_disk,
            "consumers": dict(zip(stores, [c["rounds"][0] for c in consumers], strict=True))}


def test_no_window_of_a_computed_tensor_is_in_the_dump_or_the_sealed_files(world: dict[str, Any]) -> None:
    plaintext = world["plaintext"]
    assert len(plaintext) >= 4 and all(len(p) >= 1024 for p in plaintext)
    assert all(shares_window(p, world["plain_dump"]) for p in plaintext)  # the check finds plaintext records
    sealed_files = b"".join(p.read_bytes() for p in sorted(world["sealed_disk"].rglob("*")) if p.is_file())
    for payload in plaintext:
        assert not shares_window(payload, world["sealed_dump"])
        assert not shares_window(payload, sealed_files)


def test_a_request_without_a_salt_saved_nothing(world: dict[str, Any]) -> None:
    assert _record_count(world["sealed_disk"]) == _record_count(world["plain_disk"]) == len(world["plaintext"])


def test_same_tokens_and_hits_with_and_without_encryption_and_no_hit_for_another_tenant(
        world: dict[str, Any]) -> None:
    plain, sealed = world["consumers"]["plain"], world["consumers"]["sealed"]
    assert plain["tokens"] == sealed["tokens"] == world["baseline"]
    expected = [HIT if item["cache_salt"] == "tenant-a" else 0 for item in ASKED]
    assert sealed["num_cached_tokens"] == expected
    # the plaintext store, without require_cache_salt: the same hits (no salt differs from tenant A's hashes)
    assert plain["num_cached_tokens"] == expected
