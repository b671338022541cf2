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

No step waits on a guessed time (a loaded 2-core VM misses any guess; issue 54): each waits for the event
it needs, bounded only against a hang:

- the request goes out once the server logged the end of its start-up check of the journal
  (`vllm_tiercache.kvcache.events.discovery`): the first step announces a check that is done, and waits at
  most 1 s for one still running, so on a loaded machine a check still running would leave the index empty;
- the index is read once it shows the block of a later fence request (also unrelated to the prompts): the
  indexer applies batches in order, so the first step's batch, with the announcement, is in. A subscriber
  that joined after that batch was published gets it replayed: vLLM's replay endpoint is on and the
  indexer registered with it, and a fence's batch shows it the gap;
- the SIGKILL comes once Redis holds every record of the later prompts and the journal on Redis lists
  them: a crash after the journal's write (the writer's cadence is no bound a loaded machine keeps;
  docs/operations.md);
- a SIGTERM's stop may take as long as it needs (vLLM's ``--shutdown-timeout`` and the wait for the exit
  are hang bounds);
- the Redis tier's timeouts and the lookup budget are raised to hang bounds: a Redis answer slower than
  the defaults (2 s, 100 ms) on a loaded machine would make the tier down at start or a lookup a miss, a
  difference between index and resend this test is not about.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_kv_events_engine import _complete, _server
from vllm_tiercache.kvcache.events.journal import decode_segment
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.tools.bench.router_index import TIERS, DynamoIndexer
from vllm_tiercache.tools.demo.server import Server, free_port

pytestmark = pytest.mark.engine

SERVED, BLOCK, CHUNK = "tiny", 32, 64  # 5 to 7 chunks a prompt: more than the 16 chunks a step once discovered
#: prompt lengths, none a multiple of the block size (a router matches whole blocks, the connector loads
#: whole blocks short of the prompt's last token: the two agree only then)
LENGTHS = (300, 430, 390, 470)
#: hang bounds (never reached unless something is broken): a wait on the server's log, the index, Redis
HANG_S = 300.0
#: the server's line once its start-up check of the journal is done (`discovery.StartupDiscovery`)
CHECKED = re.compile(r"tiercache: (KV events journal: \d+ of \d+ journaled chunks"
                     r"|could not read the KV events journal)")


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def _store(redis_url: str, disk: Path) -> dict[str, Any]:
    return {"namespace": "restart", "chunk_size": CHUNK, "lookup_budget_ms": 60000.0, "lookup_deadline_ms": 60000.0,
            "tiers": [
        {"kind": "memory", "capacity": "1MiB"},  # a chunk is 128 KiB (2 layers, float32): the last few only
        {"kind": "disk", "path": str(disk), "capacity": "2MiB"},  # under the prompts' KV: Redis keeps the rest
        {"kind": "redis", "url": redis_url, "timeout_s": 60.0},
    ]}


def _until(what: str, ok: Callable[[], bool], pause_s: float = 0.2) -> None:
    """Wait until ``ok()``; past `HANG_S` something is broken (not slow): fail saying what never came."""
    deadline = time.monotonic() + HANG_S
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {HANG_S:.0f}s")
        time.sleep(pause_s)


@contextlib.contextmanager
def _serving(model: Path, work: Path, name: str, store: dict[str, Any]) -> Iterator[tuple[Server, DynamoIndexer]]:
    """A server publishing KV events (and replaying them), and Dynamo's indexer subscribed to it from the
    server's start and registered with its replay endpoint; yielded once the server's start-up check of
    the journal is done."""
    zmq_port, replay_port = free_port(), free_port()
    server = _server(model, work, name, store, zmq_port, replay_port=replay_port)
    # a SIGTERM's stop (the journal's last write, the stores' flush) ends when done: the shutdown timeout
    # is a hang bound here, not the 15 s a loaded machine might pass
    i = server.args.index("--shutdown-timeout")
    server.args[i + 1] = str(int(HANG_S))
    with server:
        indexer = DynamoIndexer({1: zmq_port}, block_size=BLOCK, model_name=SERVED,
                                log_path=work / f"indexer-{name}.log", replay={1: replay_port})
        try:
            server.wait_healthy(timeout_s=300)
            _until(f"the journal check's line in {server.log_path}",
                   lambda: CHECKED.search(server.log_path.read_text(errors="replace")) is not None)
            yield server, indexer
        finally:
            indexer.stop()


def _fenced(server: Server, indexer: DynamoIndexer) -> int:
    """Send fence requests (random tokens no prompt has) until the index shows one's first block: the
    indexer applies batches in order, so every batch before it is in. Another one while none shows: its
    batch shows a subscriber that missed earlier ones the gap, and the indexer replays them (a fence not
    shown within a second costs one more fence, never a wrong answer). Returns how many were sent."""
    rng, deadline, sent = random.Random(), time.monotonic() + HANG_S, 0
    while time.monotonic() < deadline:
        fence = [rng.randrange(251, 256) for _ in range(BLOCK + 8)]  # prompts draw from 3..249
        _complete(server, fence)
        sent += 1
        if indexer.wait_matched(fence, 1, BLOCK, timeout_s=1.0):
            return sent
    pytest.fail(f"the index never showed a fence request's block within {HANG_S:.0f}s; see {indexer.log_path}")


def _restarted(server: Server, indexer: DynamoIndexer, prompts: list[list[int]]) -> dict[str, list[int]]:
    """One unrelated request, then each prompt's disk match in the index and what a resend of it loads."""
    _complete(server, [251] * 40)  # tokens no prompt has (prompts draw from 3..249)
    fences = _fenced(server, indexer)
    matched = [indexer.query(p).get(1, dict.fromkeys(TIERS, 0))["disk"] for p in prompts]
    return {"matched": matched, "loaded": [_complete(server, p) for p in prompts], "fences": [fences]}


def _journaled_on_redis(redis_url: str, prompts: list[list[int]]) -> bool:
    """Whether Redis holds every record of every full block of ``prompts`` (both layers) and the journal's
    records there list all those chunks: what a crash then may not lose."""
    store = build_store({"tiers": [{"kind": "redis", "url": redis_url, "timeout_s": 60.0}]})
    try:
        (tier,) = store.tiers
        texts = {record.text for record in tier.iter_stored()}
        journal = [StoreKey(text) for text in texts if text.endswith("|Lall|Gevents")]
        entries = [entry for record in tier.get_many(journal) if record is not None
                   for entry in (decode_segment(record.tensor.numpy().tobytes()) or (0, []))[1]]
    finally:
        store.close()
    held = {name.hex() for name, _ in entries
            if all(any(text.endswith(f"|{name.hex()}|L{layer}") for text in texts) for layer in (0, 1))}
    covered: dict[int, set[int]] = {}
    for name, payload in entries:
        if name.hex() not in held:
            continue
        tokens, first = list(payload.token_ids), payload.start_block
        for i, prompt in enumerate(prompts):
            if prompt[first * BLOCK:first * BLOCK + len(tokens)] == tokens:
                covered.setdefault(i, set()).update(range(first, first + len(tokens) // BLOCK))
    return all(covered.get(i, set()) >= set(range(len(p) // BLOCK)) for i, p in enumerate(prompts))


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
        seen["sigterm_exit"] = server.stop(grace_s=HANG_S, sig="SIGTERM")
    seen["disk_bytes"] = sum(f.stat().st_size for f in (work / "disk").rglob("*.rec"))
    with _serving(tiny_llama, work, "after-sigterm", store) as (server, indexer):
        seen["after_sigterm"] = _restarted(server, indexer, first)
        for prompt in later:
            _complete(server, prompt)
        _until("Redis holding the later prompts' records and the journal listing them",
               lambda: _journaled_on_redis(redis_server.url, later), pause_s=0.5)
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
