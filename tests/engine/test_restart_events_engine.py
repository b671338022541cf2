"""A restarted instance shows the router what its disk and Redis still hold, from its first request on.

NVIDIA Dynamo's standalone KV indexer (the router's own code) subscribes to each server's KV event
publisher. Four servers run one after another over one real redis-server:

1. the first serves four prompts over memory (small), a disk tier (smaller than the prompts' KV: the
   oldest chunks' records are left on Redis alone) and Redis, and is stopped with SIGTERM 1 s after its
   last answer, as Kubernetes stops a pod;
2. the second starts on the same disk and Redis with a fresh indexer: after one unrelated request, every
   prompt's ``disk`` match equals the tokens a resend then loads. It serves four more prompts and is
   SIGKILLed (the whole process group) 1 s after its last answer: a crash;
3. the third, on the same disk and Redis again: the same for all eight prompts;
4. a fourth on the same Redis but a disk directory of its own (another host): it announces what Redis
   holds, which is every prompt, from the other instances' journal.

Only one request is sent before the index is read, and it shares no token with the prompts: whatever the
index shows came from the journal, announced with that request's first step.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_kv_events_engine import _complete, _server
from vllm_tiercache.tools.bench.router_index import TIERS, DynamoIndexer
from vllm_tiercache.tools.demo.server import Server, free_port

pytestmark = pytest.mark.engine

SERVED, BLOCK, CHUNK = "tiny", 32, 64  # 5 to 7 chunks a prompt: more than the 16 chunks a step once discovered
#: prompt lengths, none a multiple of the block size (a router matches whole blocks, the connector loads
#: whole blocks short of the prompt's last token: the two agree only then)
LENGTHS = (300, 430, 390, 470)
#: how long the index may take to show what the first request's step published (no nudges meanwhile)
SETTLE_S = 20.0


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def _store(redis_url: str, disk: Path) -> dict[str, Any]:
    return {"namespace": "restart", "chunk_size": CHUNK, "tiers": [
        {"kind": "memory", "capacity": "1MiB"},  # a chunk is 128 KiB (2 layers, float32): the last few only
        {"kind": "disk", "path": str(disk), "capacity": "2MiB"},  # under the prompts' KV: Redis keeps the rest
        {"kind": "redis", "url": redis_url},
    ]}


@contextlib.contextmanager
def _serving(model: Path, work: Path, name: str, store: dict[str, Any]) -> Iterator[tuple[Server, DynamoIndexer]]:
    """A server publishing KV events, and Dynamo's indexer subscribed to it from the server's start (a zmq
    subscriber misses what was published before it joined)."""
    zmq_port = free_port()
    server = _server(model, work, name, store, zmq_port)
    with server:
        indexer = DynamoIndexer({1: zmq_port}, block_size=BLOCK, model_name=SERVED,
                                log_path=work / f"indexer-{name}.log")
        try:
            server.wait_healthy(timeout_s=300)
            time.sleep(2.0)  # the subscriber's connection is up before the first step publishes
            yield server, indexer
        finally:
            indexer.stop()


def _disk_matches(indexer: DynamoIndexer, prompts: list[list[int]]) -> list[int]:
    """Each prompt's ``disk`` match in tokens, read until it stops growing (the first step's events arrive
    over a moment), at most `SETTLE_S`."""
    def read() -> list[int]:
        return [indexer.query(p).get(1, dict.fromkeys(TIERS, 0))["disk"] for p in prompts]

    deadline, last = time.monotonic() + SETTLE_S, read()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = read()
        if now == last and all(now):
            break
        last = now
    return last


def _restarted(server: Server, indexer: DynamoIndexer, prompts: list[list[int]]) -> dict[str, list[int]]:
    """One unrelated request, then each prompt's disk match in the index and what a resend of it loads."""
    _complete(server, [251] * 40)  # tokens no prompt has (prompts draw from 3..249)
    matched = _disk_matches(indexer, prompts)
    return {"matched": matched, "loaded": [_complete(server, p) for p in prompts]}


@pytest.fixture(scope="module")
def seen(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("restart-events")
    with redis_server.client() as client:
        client.flushall()
    store = _store(redis_server.url, work / "disk")
    first = [_prompt(seed, length) for seed, length in enumerate(LENGTHS, start=1)]
    later = [_prompt(seed, length) for seed, length in enumerate(LENGTHS, start=11)]
    seen: dict[str, Any] = {"logs": work}
    with _serving(tiny_llama, work, "first", store) as (server, _):
        for prompt in first:
            _complete(server, prompt)
        time.sleep(1.0)
        seen["sigterm_exit"] = server.stop(sig="SIGTERM")
    seen["disk_bytes"] = sum(f.stat().st_size for f in (work / "disk").rglob("*.rec"))
    with _serving(tiny_llama, work, "after-sigterm", store) as (server, indexer):
        seen["after_sigterm"] = _restarted(server, indexer, first)
        for prompt in later:
            _complete(server, prompt)
        time.sleep(1.0)
        server.kill()
    with _serving(tiny_llama, work, "after-sigkill", store) as (server, indexer):
        seen["after_sigkill"] = _restarted(server, indexer, first + later)
    other_host = _store(redis_server.url, work / "other-disk")
    with _serving(tiny_llama, work, "other-host", other_host) as (server, indexer):
        seen["other_host"] = _restarted(server, indexer, first + later)
    return seen


def _check(result: dict[str, list[int]], logs: Path) -> None:
    matched, loaded = result["matched"], result["loaded"]
    assert all(tokens >= CHUNK for tokens in loaded), (result, logs)  # every prompt is still held
    assert matched == loaded, (f"the index promised {matched} tokens, resends loaded {loaded}", logs)


def test_a_sigterm_stopped_server_restarted_announces_every_prompt(seen: dict[str, Any]) -> None:
    assert seen["sigterm_exit"] == 0, "the server did not stop cleanly on SIGTERM"
    # the disk holds less than the prompts' KV (2 KiB a token): some chunks are on Redis alone
    assert 0 < seen["disk_bytes"] < sum(seen["after_sigterm"]["loaded"]) * 2048, seen["disk_bytes"]
    _check(seen["after_sigterm"], seen["logs"])


def test_a_sigkilled_server_restarted_announces_every_prompt(seen: dict[str, Any]) -> None:
    _check(seen["after_sigkill"], seen["logs"])


def test_another_host_on_the_same_redis_announces_what_redis_holds(seen: dict[str, Any]) -> None:
    _check(seen["other_host"], seen["logs"])
