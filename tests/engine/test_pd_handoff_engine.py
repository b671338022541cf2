"""Prefill/decode through the store, end to end: two real OpenAI servers, a real redis-server, the proxy.

The prefill server (``kv_producer``) and the decode server (``kv_consumer``) run the tiny Llama with
TieredKVConnector over memory + the same Redis; `tiercache pd-proxy` sends each request as vLLM's
disaggregated-prefill proxy does (one token and ``do_remote_decode`` to the producer, then the request
with the producer's ``kv_transfer_params`` to the consumer). Two server starts serve the whole module:

- several prompts through the proxy: the consumer takes every promised token from the store (its hit
  tokens on `/metrics` are exactly the producer's full-chunk tokens, one short of each prompt), with no
  fallback; its outputs equal the producer's own full run of the prompt (a ``kv_producer`` never loads, so
  that run computes everything; both servers pin ``VLLM_CPU_NUM_OF_RESERVED_CPU``); both sides count the
  hand-offs; and the same again with a Redis Cluster as the shared tier (a pair of servers of its own);
- the producer's records lost (its Redis write failed): the consumer waits its bound, recomputes, counts
  the fallback and logs it, and answers the same tokens;
- Redis paused for writes (the producer's write hangs): the consumer waits no longer than its bound (its
  wait histogram), recomputes, counts it, and answers the same tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_metrics_server import parse, value
from vllm_tiercache.tools.demo.prompts import CHAT_TEMPLATE
from vllm_tiercache.tools.demo.server import Server
from vllm_tiercache.tools.pd_proxy import running_proxy
from vllm_tiercache.tools.redis_server import LocalRedisCluster, RedisServer

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SERVED = "tiny-llama"
BLOCK, CHUNK = 32, 128
#: The consumer's bound on waiting for promised records. Long enough that a producer on a loaded 2-core
#: machine gets its records out in time (1 s was outrun once: a fallback where none is expected).
WAIT_MS = 3000
LENGTHS = (600, 700, 1100, 1310, 1790)


@dataclass
class PD:
    producer: Server
    consumer: Server
    proxy: str
    redis: RedisServer


def _server(model: Path, workdir: Path, name: str, role: str, redis_url: str) -> Server:
    template = workdir / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    kv = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "vllm_tiercache.kvcache.connector",
          "kv_role": role, "kv_connector_extra_config": {
              "namespace": "pd", "chunk_size": CHUNK, "handoff_wait_ms": WAIT_MS,
              "tiers": [{"kind": "memory", "capacity": "256MiB"}, {"kind": "redis", "url": redis_url}]}}
    server = Server(model, workdir / f"{name}.log", served_name=SERVED, chat_template=template,
                    max_model_len=2048, kv_transfer=kv)
    server.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), server.env.get("PYTHONPATH")) if p)
    server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    return server


@contextlib.contextmanager
def _pair(model: Path, workdir: Path, redis_url: str) -> Iterator[tuple[Server, Server, str]]:
    """A producer and a consumer on ``redis_url``, healthy, and the proxy in front of them."""
    producer = _server(model, workdir, "producer", "kv_producer", redis_url)
    consumer = _server(model, workdir, "consumer", "kv_consumer", redis_url)
    with producer, consumer:
        producer.wait_healthy(timeout_s=300)
        consumer.wait_healthy(timeout_s=300)
        with running_proxy([producer.base_url], [consumer.base_url]) as proxy:
            yield producer, consumer, proxy


@pytest.fixture(scope="module")
def pd(tiny_llama: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    if not redis_server.running:
        redis_server.start()
    with redis_server.client() as client:
        client.flushall()
    with _pair(tiny_llama, tmp_path_factory.mktemp("pd"), redis_server.url) as (producer, consumer, proxy):
        yield PD(producer, consumer, proxy, redis_server)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def complete(url: str, tokens: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED, "prompt": tokens, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **extra}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["text"])


def counters(server: Server, *names: str) -> dict[str, float]:
    got = parse(server.metrics())
    return {name: value(got, f"vllm:tiercache_kv_{name}_total") or 0.0 for name in names}


def settled(server: Server, want: dict[str, float], timeout_s: float = 60.0) -> dict[str, float]:
    """The server's counters once they reach ``want`` (stats ride on engine steps: a one-token request
    makes one), or as they are at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = counters(server, *dict.fromkeys([*NAMES, *want]))
        if all(now[name] >= target for name, target in want.items()) or time.monotonic() > deadline:
            return now
        complete(server.base_url, prompt(20, seed=999), max_tokens=1)  # shorter than a block: never cached
        time.sleep(0.5)


def expected_hit(length: int) -> int:
    """The tokens the consumer takes from the store: the producer's chunks (partial last one included)
    end at the prompt's last full block; the consumer stops one token short of the prompt."""
    return min(length // BLOCK, (length - 1) // BLOCK) * BLOCK


NAMES = ("hit_tokens", "handoff_loads", "handoffs_received", "handoff_fallbacks", "handoff_missing_records",
         "handoffs_rejected")


def test_the_decode_takes_every_promised_token_from_the_store(pd: PD) -> None:
    assert_every_promised_token_is_taken(pd.producer, pd.consumer, pd.proxy, seed=0)


def test_the_decode_takes_every_promised_token_through_a_redis_cluster(
        tiny_llama: Path, redis_cluster: LocalRedisCluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same hand-off with the shared tier a 3-master Redis Cluster: the producer's records of one prompt
    land on several masters (their keys hash to other slots), and the consumer takes every one."""
    with _pair(tiny_llama, tmp_path_factory.mktemp("pd-cluster"), redis_cluster.url) as (producer, consumer, proxy):
        assert_every_promised_token_is_taken(producer, consumer, proxy, seed=100)
    holding = []
    for node in redis_cluster.master_nodes():
        with redis_cluster.node_client(node) as client:
            holding.append(client.dbsize() > 0)
    assert sum(holding) > 1, "every record on one master: the hand-off would not cross shards"


def assert_every_promised_token_is_taken(producer: Server, consumer: Server, proxy: str, seed: int) -> None:
    """Prompts of `LENGTHS` through the proxy: the consumer takes exactly the promised tokens of each one from
    the store, with no fallback and none rejected, both sides count the hand-offs, and the answers equal the
    producer's own full run of the prompts."""
    before = counters(consumer, *NAMES)
    offered_before = counters(producer, "handoffs_offered")["handoffs_offered"]
    prompts = [prompt(length, seed=seed + i) for i, length in enumerate(LENGTHS)]
    decoded = [complete(proxy, tokens) for tokens in prompts]
    want = {"hit_tokens": before["hit_tokens"] + sum(expected_hit(n) for n in LENGTHS),
            "handoff_loads": before["handoff_loads"] + len(LENGTHS)}
    after = settled(consumer, want)
    assert after["hit_tokens"] - before["hit_tokens"] == sum(expected_hit(n) for n in LENGTHS), (
        after, consumer.log_tail())
    assert after["handoff_loads"] - before["handoff_loads"] == len(LENGTHS)
    assert after["handoffs_received"] - before["handoffs_received"] == len(LENGTHS)
    assert after["handoff_fallbacks"] == before["handoff_fallbacks"], consumer.log_tail()
    assert after["handoffs_rejected"] == before["handoffs_rejected"]
    offered = settled(producer, {"handoffs_offered": offered_before + len(LENGTHS)})["handoffs_offered"]
    assert offered - offered_before == len(LENGTHS)
    # the producer computes the whole prompt itself (a kv_producer never loads): the tokens must agree
    plain = [complete(producer.base_url, tokens) for tokens in prompts]
    assert [text(a) for a in decoded] == [text(a) for a in plain]


def test_a_run_of_handoffs_through_the_proxy_is_counted_by_the_bench(pd: PD) -> None:
    """`tiercache bench pd --handoffs`' own counting (tools/bench/pd/handoffs.py) on these servers, with the
    producer's full run as the reference answer: every promised token taken, no fallback, nothing silent."""
    from vllm_tiercache.tools.bench.pd.handoffs import run_handoffs

    seeds = iter(range(1000, 2000))
    lines: list[str] = []
    report = run_handoffs(plain=pd.producer, producer=pd.producer, consumer=pd.consumer, served=SERVED,
                          lengths=[640, 1000], count=6, prompt=lambda n: prompt(n, seed=next(seeds)), block_size=BLOCK,
                          progress=lines.append)
    assert report["promised_tokens"] == 3 * (expected_hit(640) + expected_hit(1000))
    assert report["taken_tokens"] == report["promised_tokens"] and report["taken_share"] == 1.0, (
        report, pd.consumer.log_tail())
    assert (report["received"], report["loads"], report["fallbacks"], report["rejected"]) == (6, 6, 0, 0)
    assert report["silent_recompute_tokens"] == 0 and report["identical_outputs"] == 6
    assert lines[-1] == "6/6 hand-offs"


def _fallback_lines(server: Server) -> int:
    return server.log_path.read_text(errors="replace").count("fell back to recompute")


def test_lost_records_fall_back_to_recompute(pd: PD) -> None:
    tokens = prompt(900, seed=101)
    body = {"model": SERVED, "prompt": tokens, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    req = urllib.request.Request(pd.producer.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pd.redis.client() as client:
        client.flushall()  # the earlier tests' records: what Redis holds next is this prompt's alone
        with urllib.request.urlopen(req, timeout=300) as resp:
            params = json.loads(resp.read())["kv_transfer_params"]
        assert params["tiercache"]["chunks"] == 7  # 28 full blocks: 7 chunks of 4 blocks
        # the write landed (a record per chunk and layer, all of them: the count stops growing) ...
        deadline, seen, still_since = time.monotonic() + 60, -1, time.monotonic()
        while time.monotonic() < deadline:
            size = client.dbsize()
            if size != seen:
                seen, still_since = size, time.monotonic()
            elif size >= 7 * 2 and time.monotonic() - still_since >= 1.0:
                break
            time.sleep(0.05)
        assert seen >= 7 * 2, f"the producer's records did not reach Redis within 60 s ({seen} keys)"
        client.flushall()  # ... and is lost, as if it had failed
    before = counters(pd.consumer, *NAMES)
    lines = _fallback_lines(pd.consumer)
    decoded = complete(pd.consumer.base_url, tokens, kv_transfer_params=params)
    after = settled(pd.consumer, {"handoff_fallbacks": before["handoff_fallbacks"] + 1})
    assert after["handoff_fallbacks"] - before["handoff_fallbacks"] == 1, pd.consumer.log_tail()
    assert after["handoff_missing_records"] > before["handoff_missing_records"]
    assert after["hit_tokens"] == before["hit_tokens"]  # nothing loaded: all recomputed
    assert _fallback_lines(pd.consumer) == lines + 1
    assert text(decoded) == text(complete(pd.producer.base_url, tokens))


def _waits(server: Server) -> tuple[float, float]:
    """(hand-off loads that waited at most 5 s, all hand-off loads) from the wait histogram."""
    got = parse(server.metrics())
    name = "vllm:tiercache_kv_handoff_wait_seconds"
    return value(got, name + "_bucket", le="5.0") or 0.0, value(got, name + "_count") or 0.0


def test_a_hung_producer_write_does_not_stall_the_decode(pd: PD) -> None:
    """Redis refuses writes for longer than the bound (CLIENT PAUSE WRITE: the producer's write hangs, then
    times out and is dropped): the consumer gives up at its bound, counted, and recomputes. Asserted on
    the consumer's own account of its wait (the histogram), not on the client's clock."""
    tokens = prompt(1000, seed=202)
    before = counters(pd.consumer, *NAMES)
    waits_before = _waits(pd.consumer)
    with pd.redis.client() as client:
        client.execute_command("CLIENT", "PAUSE", 8000, "WRITE")
        try:
            decoded = complete(pd.proxy, tokens)
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
    after = settled(pd.consumer, {"handoff_fallbacks": before["handoff_fallbacks"] + 1})
    assert after["handoff_fallbacks"] - before["handoff_fallbacks"] == 1, pd.consumer.log_tail()
    assert after["handoff_loads"] - before["handoff_loads"] == 1
    within, count = _waits(pd.consumer)
    assert (within - waits_before[0], count - waits_before[1]) == (1, 1)  # it waited its 3 s bound, no longer
    assert text(decoded) == text(complete(pd.producer.base_url, tokens))
