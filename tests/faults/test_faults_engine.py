"""Faults around real vLLM engines: a producer SIGKILLed while it writes, Redis killed under a live server.

Why whole processes: what must hold is what a client or a later engine sees, and a crash is only real
when the kernel ends the process (no `finally`, no flush). The store-level half of the fault tests
(writer processes killed at random points, corrupted records, a full disk) is in the store's own tests;
these start real engines on the project's tiny Llama (float32, so a server's greedy tokens match an
offline engine's) and compare every answer with an engine that has no connector.

- SIGKILL: a `kv_producer` engine in its own process group, killed once its commits have indexed a random
  number (5-40) of records more than the directory held, KILLS times over on one directory (each run ends
  with prompts of its own, so it is always killed with writes ahead of it); then a `kv_consumer` in a fresh
  process on that directory must give the baseline's tokens, hit only complete chunks, and meet no
  corrupt record (writes are temp file + fsync + rename, so a kill leaves a whole record or none).
- Redis: `api_server` with `TieredKVConnector` on a Redis-only store; redis-server is SIGKILLed while
  requests are being served, requests go on while it is down, then it restarts empty on the same port.
  No request may fail, every answer must be the baseline's, and hits must come back after the restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.models import REPO, run_engine
from tests.support.zygote_client import zygote_subprocess
from vllm_tiercache.shared.stats_dump import read_stats
from vllm_tiercache.shared.store.counters import counter_deltas
from vllm_tiercache.shared.store.tiers.disk.index import DiskIndex
from vllm_tiercache.tools.demo.prompts import CHAT_TEMPLATE
from vllm_tiercache.tools.demo.server import Server
from vllm_tiercache.tools.redis_server import RedisServer

BLOCK = 32
DTYPE = "float32"
MAX_TOKENS = 8
#: Producer engines SIGKILLed in a row on one directory (each kill costs an engine start in CI).
KILLS = 2


def _prompts() -> list[list[int]]:
    """24 prompts, 100 to 1100 tokens; some share 256- and 512-token prefixes (chunks reused across prompts)."""
    rng = random.Random(606)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 259) for _ in range(n)]

    shared = tokens(512)
    out = []
    for i in range(24):
        if i % 4 == 1:
            out.append(shared + tokens(rng.randrange(40, 400)))
        elif i % 4 == 3:
            out.append(shared[:256] + tokens(rng.randrange(40, 400)))
        else:
            out.append(tokens(rng.randrange(100, 1100)))
    return out


PROMPTS = _prompts()


def _expected_hits(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[list[list[int]]]]:
    """Greedy tokens of every prompt from an engine without a connector (fresh process).

    A future: the engine runs beside the first test's own engines (an engine start is mostly
    single-threaded), and each test waits for it only when it compares answers.
    """
    work = tmp_path_factory.mktemp("faults-baseline")
    spec = {"model": str(tiny_llama), "dtype": DTYPE, "max_tokens": MAX_TOKENS, "rounds": [PROMPTS]}
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(lambda: run_engine(spec, work)["rounds"][0]["tokens"])


# ------------------------------------------------------------------------------ producer SIGKILL
def _disk_kv(role: str, disk: Path) -> dict[str, Any]:
    return {"kv_connector": "TieredKVConnector", "kv_role": role,
            "kv_connector_extra_config": {"namespace": "killed", "chunk_size": 64,
                                          "tiers": [{"kind": "disk", "path": str(disk), "capacity": "1GiB"}]}}


def _records(disk: Path) -> int:
    return sum(1 for _ in disk.rglob("*.rec")) if disk.exists() else 0


def _indexed(index: DiskIndex) -> int:
    """Records the producers' commits have indexed (what a consumer's lookups can find)."""
    with index.env.begin() as txn:
        return index.count(txn)


def _start_engine(spec: dict[str, Any], work: Path, name: str) -> Any:
    """`tests.support.engine_job` in its own process group, in that one process like the consumer and the
    baseline (`run_engine`'s default): SIGKILL stops the worker side's writer wherever it is."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("TIERCACHE_STATS_DIR", None)
    with open(work / f"{name}.log", "wb") as log:
        job = [sys.executable, "-m", "tests.support.engine_job", str(spec_path), str(work / f"{name}.out")]
        # forked from the engine zygote like `run_engine`'s jobs (a process of its own, its own group)
        return zygote_subprocess().Popen(job, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)


def _run_own_rounds(run: int) -> list[list[list[int]]]:
    """16 prompts of 1000 tokens that no other run and no consumer asks for (240 chunks of this run's own)."""
    rng = random.Random(7000 + run)
    return [[[rng.randrange(3, 259) for _ in range(1000)] for _ in range(4)] for _ in range(4)]


def _kill_group(proc: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.mark.engine
def test_producer_sigkilled_while_writing_leaves_a_store_consumers_trust(
        tiny_llama: Path, baseline: Future[list[list[int]]], tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    rng = random.Random(2026)
    kills: list[dict[str, Any]] = []
    # The kill follows the index, not the record files: a writer renames a batch's files into place inside
    # its index write transaction, and a batch holds a step's records layer by layer (every chunk's layer 0,
    # then layer 1), so a kill among the renames can leave layer-0 files only: no chunk whole in every layer.
    # Seen on a loaded machine: a run killed at 30 record files had none indexed; with both runs killed so,
    # the consumer found nothing. A commit holds whole steps, the first one the first chunks of PROMPTS[:4]
    # in every layer (and 1GiB evicts nothing), so a run that committed leaves hits.
    index = DiskIndex(str(disk / "index.lmdb"))  # read here while the producers write it
    try:
        for k in range(KILLS):
            # Prompts in batches of 4 over several rounds, so the writes are spread over the engine's whole
            # run, then prompts of this run's own: a run always has writes ahead of it, even when an earlier
            # run left every record of PROMPTS on disk or this run's writer commits them in one burst (seen
            # on a loaded CI machine: all 298 records between two polls, so the next run had nothing left).
            spec = {"model": str(tiny_llama), "dtype": DTYPE, "max_tokens": MAX_TOKENS, "max_num_seqs": 4,
                    "rounds": [PROMPTS[i:i + 4] for i in range(0, len(PROMPTS), 4)] + _run_own_rounds(k),
                    "kv_transfer_config": _disk_kv("kv_producer", disk)}
            # Counted from the files: the run's tier indexes at its start whatever files the run before left
            # unindexed (`bookkeeping.adopt_unindexed`), which must not count as this run's commits.
            before = _records(disk)
            # Kill once this run's commits have indexed a random number of records: mid-run whatever the
            # machine's speed, and after at least one commit of its own.
            target = before + rng.randint(5, 40)
            proc = _start_engine(spec, tmp_path, f"producer-{k}")
            try:
                while proc.poll() is None and _indexed(index) < target:
                    time.sleep(0.01)
                alive = proc.poll() is None
            finally:
                _kill_group(proc)
            kills.append({"alive_at_kill": alive, "records_before": before, "records_after": _records(disk),
                          "indexed_after": _indexed(index), "exit": proc.returncode})
    finally:
        index.close()
    # A run that finished before its kill would prove nothing about crashes.
    assert all(k["alive_at_kill"] and k["exit"] == -signal.SIGKILL for k in kills), kills
    assert kills[-1]["records_after"] > kills[0]["records_before"], kills

    stats_dir = tmp_path / "consumer-stats"
    consumer = run_engine({"model": str(tiny_llama), "dtype": DTYPE, "max_tokens": MAX_TOKENS, "rounds": [PROMPTS],
                           "kv_transfer_config": _disk_kv("kv_consumer", disk)}, tmp_path, stats_dir=stats_dir)
    (only,) = consumer["rounds"]
    assert only["tokens"] == baseline.result()
    cached = only["num_cached_tokens"]
    assert all(c % BLOCK == 0 and 0 <= c <= _expected_hits(p) for c, p in zip(cached, PROMPTS, strict=True))
    assert sum(cached) > 0, ("the killed producers left nothing a consumer could use", kills)
    (worker,) = read_stats(str(stats_dir), "kv-worker")
    assert worker["counters"]["load_errors"] == 0, worker["counters"]
    assert worker["store"]["tiers"]["disk"]["corrupt"] == 0, worker["store"]
    assert worker["counters"]["loaded_blocks"] == sum(cached) // BLOCK
    print("sigkill runs:", kills, "consumer cached tokens:", sum(cached))


# ------------------------------------------------------------------------------- redis restart
def _complete(base_url: str, prompt: list[int]) -> dict[str, Any]:
    """One /v1/completions request; returns tokens, cached prompt tokens and the error, if any."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    request = urllib.request.Request(base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            data = json.loads(resp.read())
    except Exception as exc:  # a failed request is a result here, asserted on by the test
        return {"error": f"{type(exc).__name__}: {exc}", "tokens": None, "cached": 0}
    choice = data["choices"][0]
    details = data["usage"].get("prompt_tokens_details") or {}
    return {"error": None, "tokens": choice.get("token_ids"), "cached": int(details.get("cached_tokens") or 0)}


@pytest.mark.engine
@pytest.mark.redis
def test_redis_killed_and_restarted_under_a_live_server(
        tiny_llama: Path, baseline: Future[list[list[int]]], tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    served: list[tuple[int, dict[str, Any]]] = []

    def send(indices: list[int]) -> list[dict[str, Any]]:
        out = []
        for i in indices:
            result = _complete(server.base_url, PROMPTS[i])
            served.append((i, result))
            out.append(result)
        return out

    with RedisServer() as redis_srv:
        kv = {"kv_connector": "TieredKVConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"namespace": "redis-fault", "chunk_size": 64, "tiers": [
                  {"kind": "redis", "url": redis_srv.url, "timeout_s": 0.5, "retry_after_s": 0.5}]}}
        with Server(tiny_llama, tmp_path / "server.log", served_name="tiny", chat_template=template,
                    max_model_len=2048, kv_transfer=kv, stats_dir=tmp_path / "stats") as server:
            server.wait_healthy()
            first = list(range(8))
            # 1. Fill Redis, then repeat until every prompt hits (saves are asynchronous).
            send(first)
            warm = []
            for _ in range(10):
                warm = send(first)
                if all(r["cached"] > 0 for r in warm):
                    break
            assert [r["cached"] for r in warm] == [_expected_hits(PROMPTS[i]) for i in first], warm

            # 2. SIGKILL redis-server while a run of requests (hits and misses) is being served.
            during = list(range(24))
            runner = threading.Thread(target=send, args=(during,))
            n_before = len(served)
            runner.start()
            while runner.is_alive() and len(served) < n_before + 3:
                time.sleep(0.01)
            redis_srv.kill()
            killed_after = len(served) - n_before
            runner.join()
            assert killed_after < len(during), "the run ended before the kill"

            # 3. While it is down: every request is served, from recomputation.
            down = send(first)
            assert [r["cached"] for r in down] == [0] * len(first)

            # 4. Restart it (empty, same port): saves resume, then the same prompts hit again.
            redis_srv.start()
            recovered = []
            rounds_to_recover = 0
            for _ in range(20):
                rounds_to_recover += 1
                recovered = send(first)
                if all(r["cached"] > 0 for r in recovered):
                    break
                time.sleep(0.5)  # the tier retries a down server every retry_after_s
            assert [r["cached"] for r in recovered] == [_expected_hits(PROMPTS[i]) for i in first], recovered
            metrics = server.metrics()

    failed = [(i, r["error"]) for i, r in served if r["error"]]
    assert not failed, failed
    reference = baseline.result()
    wrong = [i for i, r in served if r["tokens"] != reference[i]]
    assert not wrong, f"{len(wrong)} of {len(served)} answers differ from the baseline: prompts {wrong}"
    assert "tiercache" in metrics
    (worker,) = read_stats(str(tmp_path / "stats"), "kv-worker")
    print(f"redis fault: {len(served)} requests served, 0 failed; killed after {killed_after} of the run; "
          f"hits back after {rounds_to_recover} round(s); worker counters {worker['counters']}")


#: The Redis tier's socket timeout in the hung-Redis test: a request that waited on the hung Redis would
#: wait this long (the one server: twice, with its retry; a cluster batch takes no retry, so the cluster's is
#: doubled): `HUNG_STALL_S`. A request that does not may still wait its lookup deadline (1 s) while the tier
#: is not yet marked down, and a loaded 2-core machine adds its noise. Before the budget, the first lookup
#: waited the socket timeout twice on the engine's scheduling thread: requests of 8 s and 4 s (2 s timeout).
HUNG_TIMEOUT_S = 4.0
HUNG_STALL_S = 2 * HUNG_TIMEOUT_S
#: How much longer than the slowest request before the pause a request may take while Redis hangs: half of
#: what waiting on the hung Redis costs. It was 1.5 s against a 4 s stall (the cluster's: 2 s), while a
#: request that waits its 1 s lookup deadline, as several do before the tier is marked down, took 1.1 s on
#: an idle machine: half a second of noise allowed. Now 3 s of it, and the bug still fails by 4 s.
HANG_NOISE_S = HUNG_STALL_S / 2
#: The cluster's node timeout during the test: the paused master must hang past the tier's socket timeout
#: (the shard is marked down, then found back by the prober) but for less than this (no failover). The
#: session's cluster runs with 5 s; the fixture sets this and restores that.
HANG_NODE_TIMEOUT_MS = 25000


@dataclass
class HangTarget:
    """One shape of the hung-Redis test: its server (connector on memory + that Redis) and how to hang it."""

    server: Server
    pause_s: float
    pause: Callable[[], object]
    resume: Callable[[], object]
    #: Records held now by the Redis that receives this server's records (on a cluster: by the master
    #: serving the hung master's slots, whichever node that is after the pause).
    stored: Callable[[], int]
    #: What the Redis side looks like, for a failure's message.
    describe: Callable[[], str]


@pytest.fixture(scope="module")
def hang_targets(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory,
                 request: pytest.FixtureRequest) -> Iterator[dict[str, HangTarget]]:
    """Both shapes' servers, started side by side before the first of the two tests, so the serial pass
    waits for one server start instead of two in a row (an idle server beside the other test costs it
    nothing: its OpenMP threads wait passively)."""
    work = tmp_path_factory.mktemp("redis-hang")
    template = work / "template.jinja"
    template.write_text(CHAT_TEMPLATE)

    def server(shape: str, url: str, timeout_s: float) -> Server:
        kv = {"kv_connector": "TieredKVConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"namespace": f"redis-hang-{shape}", "chunk_size": 64, "tiers": [
                  {"kind": "memory", "capacity": "64MiB"},
                  {"kind": "redis", "url": url, "timeout_s": timeout_s, "retry_after_s": 1.0}]}}
        return Server(tiny_llama, work / f"server-{shape}.log", served_name="tiny", chat_template=template,
                      max_model_len=2048, kv_transfer=kv, stats_dir=work / f"stats-{shape}")

    with contextlib.ExitStack() as stack:
        # the one server: paused 20 s: the hung call's two socket timeouts (2 x 4 s) mark it down, then a
        # probe (retry_after_s 1 s) fails the same way and the next one finds it back after SIGCONT
        redis_srv = stack.enter_context(RedisServer())
        # the session's cluster, restored and emptied as `redis_cluster` does for a test: one master hangs
        # for less than its node timeout (no failover)
        cluster = request.getfixturevalue("redis_cluster_session")
        cluster.start()
        cluster.flushall()
        cluster.config_set("cluster-node-timeout", str(HANG_NODE_TIMEOUT_MS))
        stack.callback(lambda: cluster.config_set("cluster-node-timeout", str(cluster.node_timeout_ms)))
        victim = cluster.master_nodes()[0]
        # a key of the hung master's slots: records must reach that shard again, not only the others; counted
        # on whichever node serves it then (a loaded machine may have it fail over during the pause)
        marker = next(key for key in (f"slot-of-{i}" for i in range(1000)) if cluster.node_of(key) == victim)
        one_server = stack.enter_context(redis_srv.client())

        def shard_stored() -> int:
            with cluster.node_client(cluster.node_of(marker)) as client:
                return int(client.dbsize())

        def cluster_roles() -> str:
            return f"victim node {victim}; roles now " + ", ".join(
                f"{i}: {cluster.role(i) if node.running and not node.paused else 'down'}"
                for i, node in enumerate(cluster.nodes))

        targets = {
            "server": HangTarget(stack.enter_context(server("server", redis_srv.url, HUNG_TIMEOUT_S)), 20.0,
                                 redis_srv.pause, redis_srv.resume, lambda: int(one_server.dbsize()),
                                 lambda: "one server"),
            # no retry on a cluster: twice the timeout for the same stall; paused one timeout past it
            "cluster": HangTarget(stack.enter_context(server("cluster", cluster.url, HUNG_STALL_S)),
                                  HUNG_STALL_S + HUNG_TIMEOUT_S, lambda: cluster.pause(victim),
                                  lambda: cluster.resume(victim), shard_stored, cluster_roles),
        }
        for target in targets.values():
            target.server.wait_healthy()
        yield targets
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:  # each orderly stop waits seconds: together
            list(pool.map(lambda target: target.server.stop(), targets.values()))


@pytest.mark.serial
@pytest.mark.engine
@pytest.mark.redis
@pytest.mark.parametrize("shape", ["server", "cluster"])
def test_a_paused_redis_stalls_no_request(baseline: Future[list[list[int]]], hang_targets: dict[str, HangTarget],
                                          shape: str) -> None:
    """Redis stops answering (SIGSTOP: a hang, not a refusal) under a stream of requests: the one server,
    or one master of a 3 + 3 cluster (a hung shard; the others keep answering).

    What it guards: a lookup that runs on the engine's scheduling thread and waits the socket timeout, so
    every new request stalls for seconds (docs/reliability.md has the figures from before the lookup budget).
    No request may be slower than before the pause by more than half what waiting on the hung Redis would
    cost (`HANG_NOISE_S`: its lookup deadline and a loaded machine's noise fit in it), every answer is the
    baseline's, and after SIGCONT the tier comes back by itself (new records reach Redis again) without a
    request paying for a probe.
    """
    target = hang_targets[shape]
    server = target.server
    served: list[tuple[int, dict[str, Any], float]] = []

    def send(indices: list[int]) -> list[float]:
        seconds = []
        for i in indices:
            t0 = time.perf_counter()
            result = _complete(server.base_url, PROMPTS[i])
            seconds.append(time.perf_counter() - t0)
            served.append((i, result, seconds[-1]))
        return seconds

    send(list(range(4)))  # first requests pay one-time costs (kernels, connections)
    before = send(list(range(4, 10)))
    target.pause()
    try:  # a stream of requests through the whole pause (prompts 10-19 in turn)
        during: list[float] = []
        end = time.monotonic() + target.pause_s
        while time.monotonic() < end:
            during += send([10 + len(during) % 10])
    finally:
        target.resume()
    stored = target.stored()
    deadline = time.monotonic() + 30
    rng = random.Random(f"after-{shape}")
    while target.stored() <= stored and time.monotonic() < deadline:
        for _ in range(4):  # prompts never seen: their saves reach Redis once the tier is back
            fresh = _complete(server.base_url, [rng.randrange(3, 259) for _ in range(300)])
            assert not fresh["error"], fresh["error"]
        time.sleep(0.5)
    back = target.stored() > stored

    failed = [(i, r["error"]) for i, r, _ in served if r["error"]]
    assert not failed, failed
    reference = baseline.result()
    wrong = [i for i, r, _ in served if r["tokens"] != reference[i]]
    assert not wrong, f"answers differ from the baseline for prompts {wrong}"
    print(f"redis {shape} paused {target.pause_s:g} s: requests before {[round(s, 3) for s in before]} s, "
          f"{len(during)} during, slowest {sorted(round(s, 3) for s in during)[-3:]} s")
    assert max(during) <= max(before) + HANG_NOISE_S, (before, during)
    logged = [line for line in server.log_tail(20_000).splitlines() if "tiercache" in line][-12:]
    assert back, ("no new record reached Redis within 30 s of SIGCONT: the tier did not come back by itself "
                  f"({target.describe()}); the server's last tiercache lines:\n" + "\n".join(logged))


def test_tier_deltas_survive_a_redis_tier_that_was_down() -> None:
    """Regression: the worker died (`int - None`) on the first stats step after Redis came back.

    A down Redis tier reports `bytes_used: None`; the next snapshot has an int. Only the monotonic
    counters are differenced, so gauges can be None or shrink without harm.
    """
    down = {"redis": {"hits": 3, "misses": 5, "entries": None, "bytes_used": None, "down": True}}
    up = {"redis": {"hits": 4, "misses": 9, "entries": None, "bytes_used": 1024, "down": False}}
    assert counter_deltas(up, down) == {"redis": {**dict.fromkeys(counter_deltas(up, {})["redis"], 0),
                                                  "hits": 1, "misses": 4}}
    shrunk = {"redis": {"hits": 4, "misses": 9, "bytes_used": 10}}
    assert all(v >= 0 for v in counter_deltas(shrunk, up)["redis"].values())
