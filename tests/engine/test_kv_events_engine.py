"""A real router's indexer sees every tier: NVIDIA Dynamo's standalone KV indexer (``python -m
dynamo.indexer``, the ``ai-dynamo-runtime`` dev dependency) subscribed to a real OpenAI server's KV event
publisher (``--kv-events-config``, zmq), the server running TieredKVConnector over memory + disk + a real
Redis.

Dynamo answers ``POST /query`` with the longest matched prefix per worker and tier, in tokens; its tiers
are cumulative (a GPU block counts for ``cpu`` and ``disk`` too), so each check first makes vLLM's own
cache let the prompt go (17 GPU blocks, later prompts) and asserts past what the GPU explains.

One scenario, two server starts (the second on the same disk directory, with a fresh indexer), observed
once by the module's fixture and asserted by the tests below:

- prompt A, a LoRA prompt, then B and C: vLLM's GPU cache lost A, the indexer still reports A on the host
  tier, and a resend of A loads exactly that many tokens from the connector (``cached_tokens``); the LoRA
  prompt matches on the host tier only with its ``lora_name``;
- seven more prompts evict A from the memory tier: the host-tier match drops, the disk match stays;
- a restart on the same disk: before any request about A, the new server's journal announces A on disk
  (the first server wrote its journal's last entries as it stopped);
- ``tiercache evict`` of the namespace: the disk match drops too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.redis import PATIENT_LOOKUP_DEADLINE_MS
from vllm_tiercache.tools.bench.router_index import TIERS, DynamoIndexer, events_config
from vllm_tiercache.tools.demo.server import Server, free_port
from vllm_tiercache.tools.evict_cmd import evict
from vllm_tiercache.tools.tiny_models.lora import make_tiny_lora

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SERVED, LORA, BLOCK, CHUNK = "tiny", "sql", 32, 128
PROMPT_LEN = 300  # 9 full blocks: chunks ending at blocks 4, 8 and (partial) 9
PREFIX = 9 * BLOCK  # what the connector can give of such a prompt, and what a router can match of it


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(PROMPT_LEN)]


class Indexer:
    """Dynamo's standalone indexer for one worker (id 1) publishing on ``zmq_port``, serving ``model_name``
    (the benchmarks' `DynamoIndexer`, answering for that worker alone)."""

    def __init__(self, zmq_port: int, log_path: Path, model_name: str = SERVED) -> None:
        self._dynamo = DynamoIndexer({1: zmq_port}, block_size=BLOCK, model_name=model_name, log_path=log_path)

    def query(self, tokens: list[int], lora: str | None = None) -> dict[str, int]:
        """This worker's matched tokens per tier (gpu, cpu, disk; 0 when nothing matches)."""
        return self._dynamo.query(tokens, lora).get(1, dict.fromkeys(TIERS, 0))

    def stop(self) -> None:
        self._dynamo.stop()


def _complete(server: Server, tokens: list[int], model: str = SERVED) -> int:
    """Send a prompt (4 new tokens); the prompt tokens vLLM did not compute (``cached_tokens``)."""
    body = {"model": model, "prompt": tokens, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(server.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        usage = json.loads(resp.read())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _until(what: Callable[[], dict[str, int]], ok: Callable[[dict[str, int]], bool], nudge: Callable[[], Any],
           timeout_s: float = 60.0) -> dict[str, int]:
    """Ask ``what`` until ``ok``; between asks ``nudge`` the server (events go out only on engine steps).
    Returns the last answer (the test asserts on it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = what()
        if ok(answer) or time.monotonic() > deadline:
            return answer
        nudge()
        time.sleep(0.5)


def _server(model: Path, work: Path, name: str, store: dict[str, Any], zmq_port: int,
            adapter: Path | None = None, replay_port: int | None = None) -> Server:
    """An OpenAI server over ``store`` (its own ``chunk_size``, else `CHUNK`) publishing KV events on ``zmq_port``
    (and replaying them on ``replay_port`` when given), serving ``adapter`` as the LoRA module `LORA` when given."""
    template = work / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    kv = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "vllm_tiercache.kvcache.connector",
          "kv_role": "kv_both", "kv_connector_extra_config": {"chunk_size": CHUNK, **store}}
    lora = [] if adapter is None else ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
                                       "--lora-modules", f"{LORA}={adapter}"]
    server = Server(model, work / f"{name}.log", served_name=SERVED, chat_template=template, max_model_len=512,
                    kv_transfer=kv, extra_args=[
                        "--enable-prefix-caching", "--num-gpu-blocks-override", "17",
                        "--kv-events-config", json.dumps(events_config(zmq_port, replay_port)), *lora])
    i = server.args.index("--limit-mm-per-prompt")  # a text model
    del server.args[i:i + 2]
    server.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), server.env.get("PYTHONPATH")) if p)
    return server


@contextlib.contextmanager
def _serving(model: Path, work: Path, name: str, store: dict[str, Any], adapter: Path, nudge_seed: int
             ) -> Iterator[tuple[Server, Indexer, Callable[[], Any]]]:
    """A healthy server publishing events and Dynamo's indexer subscribed to it; and a nudge (a short
    request: events go out only on engine steps)."""
    zmq_port = free_port()
    with _server(model, work, name, store, zmq_port, adapter) as server:
        server.wait_healthy(timeout_s=300)
        indexer = Indexer(zmq_port, work / f"indexer-{name}.log")
        try:
            yield server, indexer, lambda: _complete(server, _prompt(nudge_seed)[:40])
        finally:
            indexer.stop()


@pytest.fixture(scope="module")
def seen(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> dict[str, Any]:
    """Run the scenario of the module docstring once; what the indexer and the server said at each point."""
    work = tmp_path_factory.mktemp("kv-events")
    with redis_server.client() as client:
        client.flushall()
    store = {"namespace": "events", "lookup_deadline_ms": PATIENT_LOOKUP_DEADLINE_MS, "tiers": [
        # ~7 prompts of 576 KiB: A stays while the GPU loses it, and leaves once 7 newer prompts came (by
        # recency: the default `prefix` policy would keep A, asked twice, over seven one-off prompts)
        {"kind": "memory", "capacity": "4MiB", "policy": "lru"},
        {"kind": "disk", "path": str(work / "disk"), "capacity": "1GiB"},
        {"kind": "redis", "url": redis_server.url},
    ]}
    adapter = make_tiny_lora(work / "lora", seed=1)
    a, seen = _prompt(1), {}
    with _serving(tiny_llama, work, "first", store, adapter, nudge_seed=999) as (server, indexer, nudge):
        lora_prompt = _prompt(4)
        # the adapter's first request waits at most 1 s for its files' digest (computed without the cache
        # when late): a short first request makes the LoRA prompt below never the first
        _complete(server, _prompt(5)[:40], model=LORA)
        _complete(server, a)
        _complete(server, lora_prompt, model=LORA)
        _complete(server, _prompt(2))
        _complete(server, _prompt(3))  # vLLM's 16 blocks hold neither A nor the LoRA prompt now
        seen["gpu_let_go"] = _until(lambda: indexer.query(a), lambda q: q["cpu"] >= PREFIX > q["gpu"], nudge)
        seen["lora_with_name"] = _until(lambda: indexer.query(lora_prompt, LORA),
                                        lambda q: q["cpu"] >= PREFIX > q["gpu"], nudge)
        seen["lora_without_name"] = indexer.query(lora_prompt)
        seen["resend_cached"] = _complete(server, a)
        for seed in range(10, 17):
            _complete(server, _prompt(seed))
        seen["memory_evicted"] = _until(lambda: indexer.query(a), lambda q: q["cpu"] < PREFIX <= q["disk"],
                                        nudge)
        # no wait for the journal's next write (every 2 s, on a step): stopping the server writes it (the
        # connector's shutdown, which vLLM runs given --shutdown-timeout) and flushes it to disk and Redis
    with _serving(tiny_llama, work, "second", store, adapter, nudge_seed=998) as (server, indexer, nudge):
        seen["restarted"] = _until(lambda: indexer.query(a), lambda q: q["disk"] >= PREFIX, nudge)
        seen["evicted_records"] = evict(store, namespace="events")["records"]
        seen["after_evict"] = _until(lambda: indexer.query(a), lambda q: q["disk"] == 0, nudge)
    seen["logs"] = work
    return seen


def test_the_host_tier_still_matches_what_vllm_let_go_and_a_resend_loads_exactly_that(seen: dict[str, Any]) -> None:
    tiers = seen["gpu_let_go"]
    assert tiers["gpu"] < PREFIX <= tiers["cpu"], (tiers, seen["logs"])
    assert tiers["cpu"] == PREFIX  # never more than the connector can give (a prompt's last token is computed)
    assert seen["resend_cached"] == tiers["cpu"]


def test_a_lora_prompt_matches_only_with_its_adapter_name(seen: dict[str, Any]) -> None:
    tiers = seen["lora_with_name"]
    assert tiers["gpu"] < PREFIX == tiers["cpu"], tiers  # our events, not vLLM's GPU ones
    assert seen["lora_without_name"] == {"gpu": 0, "cpu": 0, "disk": 0}


def test_a_memory_eviction_drops_the_host_tier_and_keeps_the_disk(seen: dict[str, Any]) -> None:
    tiers = seen["memory_evicted"]
    assert tiers["cpu"] < PREFIX and tiers["disk"] == PREFIX, (tiers, seen["logs"])


def test_a_restarted_server_announces_the_disk_before_any_request_about_it(seen: dict[str, Any]) -> None:
    tiers = seen["restarted"]
    assert tiers == {"gpu": 0, "cpu": 0, "disk": PREFIX}, (tiers, seen["logs"])


def test_tiercache_evict_drops_the_disk_tier_too(seen: dict[str, Any]) -> None:
    assert seen["evicted_records"] > 0
    assert seen["after_evict"] == {"gpu": 0, "cpu": 0, "disk": 0}, (seen["after_evict"], seen["logs"])
