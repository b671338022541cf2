"""The object tier under real OpenAI servers: a corpus precomputed into a bucket, served by two servers that
share nothing else, through restarts and the faults operators meet.

One SeaweedFS of this module's own (it is paused, killed, restarted and loses its bucket here), then:

1. a server without connectors answers every prompt: the reference;
2. `tiercache precompute docs` stores the corpus and the fault documents into the bucket alone;
3. servers A and B start side by side, each with its own memory and disk directory, the bucket the only
   thing they share. A hits every corpus prompt's stored prefix, exactly; B, asking after A, hits that and
   what A wrote back (every whole block before the prompt's last token);
4. faults while A and B serve, each landed at its moment by a watching proxy between that server and
   SeaweedFS, one per server, so that a fault meant for one server's request is never set off by the other's
   (`tests.support.watching_proxy`): garbage PUT under a stored record's name (B's fetch of it fails, so
   B computes from that chunk on; the garbage is deleted and counted); SeaweedFS SIGSTOPped as the first
   record GET of A's fetches reaches it, continued once A answered (the fetches fail at the tier's
   timeout and their chunks are computed); SeaweedFS SIGKILLed as the
   fifth record PUT of B's write-behind reaches it, then restarted on its data (A reads only whole
   records of what landed);
5. everything restarted, SeaweedFS included, A and B on fresh disk directories (as on new hosts): the
   corpus hits again, from the bucket alone;
6. the bucket deleted under both running servers: A computes a stored document afresh (no request
   fails, /health stays 200); the bucket made again, B loads what A wrote. (SeaweedFS makes a deleted
   bucket again on the next PUT, AWS answers NoSuchBucket: test_faults.py covers that the tier goes down
   and the prober finds the bucket back.)

Every answer equals the reference's; no request fails; every server stops cleanly on SIGTERM. Six engine
starts and the job's (A and B start side by side).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.redis import PATIENT_LOOKUP_BUDGET_MS, PATIENT_LOOKUP_DEADLINE_MS
from tests.support.quiet import until_quiet
from tests.support.watching_proxy import WatchingProxy
from tests.support.zygote_client import run_job
from tests.tools.test_precompute import _expected_hits
from vllm_tiercache.shared.stats_dump import read_stats
from vllm_tiercache.tools.demo.server import Server
from vllm_tiercache.tools.precompute.kv import rag_prompt
from vllm_tiercache.tools.s3_server import SeaweedFSServer

pytestmark = [pytest.mark.engine, pytest.mark.s3]

ROOT = Path(__file__).resolve().parents[4]
SERVED, BLOCK, CHUNK, MAX_LEN = "tiny", 32, 64, 2048
BUCKET = "tiercache-serving"
ENGINE = {"dtype": "float32", "block_size": BLOCK, "max_model_len": MAX_LEN, "enforce_eager": True, "seed": 0,
          "enable_prefix_caching": False}
TEMPLATE = "You answer from the context below.\n\nContext:\n{document}\n"
WORDS = "alpha beta gamma delta cache tier vector memory disk layer token prefix chunk river stone".split()
#: documents the job stores: the corpus served throughout, and those the faults use once each
CORPUS = ("c0", "c1", "c2")
GARBAGE, PAUSED = "g0", ("p0", "p1", "p2")
#: prompts no job stored: written behind during the SIGKILL
WRITTEN = ("w0", "w1", "w2")


def _docs(root: Path) -> dict[str, Path]:
    """Every document of the scenario, 600 to 1,300 tokens each with the byte tokenizer."""
    root.mkdir(parents=True)
    docs = {}
    for i, name in enumerate((*CORPUS, GARBAGE, *PAUSED, *WRITTEN)):
        rng = random.Random(4900 + i)
        path = root / f"{name}.txt"
        path.write_text(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(100, 220))) + f". Doc {name}.\n")
        docs[name] = path
    return docs


def _prompt(doc: Path) -> str:
    return rag_prompt(doc.read_text(), f"what does {doc.stem} say?", TEMPLATE)


class Served:
    """One OpenAI server and what it answered: text and cached tokens per document name."""

    def __init__(self, server: Server, stats: Path) -> None:
        self.server, self.stats = server, stats
        self.failures: list[str] = []

    def ask(self, doc: Path) -> tuple[str, int, int]:
        """One completion (8 greedy tokens): its text, the prompt tokens vLLM did not compute, and the
        prompt's tokens."""
        body = {"model": SERVED, "prompt": _prompt(doc), "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        req = urllib.request.Request(self.server.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                answer = json.loads(resp.read())
        except Exception as exc:  # recorded: the test asserts that no request failed
            self.failures.append(f"{doc.stem}: {exc!r}")
            return "", -1, -1
        usage = answer["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return answer["choices"][0]["text"], int(cached), int(usage["prompt_tokens"])

    def ask_all(self, docs: list[Path]) -> dict[str, tuple[str, int, int]]:
        """Several at once (each its own request, as concurrent users send them)."""
        with ThreadPoolExecutor(len(docs)) as pool:
            return dict(zip((d.stem for d in docs), pool.map(self.ask, docs), strict=True))

    def worker_stats(self) -> dict[str, Any]:
        (stats,) = read_stats(str(self.stats), "kv-worker")
        return stats


#: the servers' request timeout: a margin a loaded 2-core machine meets (a HEAD or GET that misses it is a
#: miss, and the tests assert exact hits); the SIGSTOP fault costs the paused loads one of it
SERVER_TIMEOUT_S = 10.0
#: the job's: short on purpose, the job is patient (`vllm_tiercache.tools.precompute.waits`): a request that
#: runs into it on a loaded machine marks the tier down, and the job waits it out instead of failing
JOB_TIMEOUT_S = 2.0


def _store(endpoint: str, *local: dict[str, Any], timeout_s: float = SERVER_TIMEOUT_S) -> dict[str, Any]:
    bucket = {"kind": "object", "endpoint": endpoint, "bucket": BUCKET, "path_style": True, "timeout_s": timeout_s,
              "retry_after_s": 0.5}
    return {"namespace": "corpus", "chunk_size": CHUNK, "lookup_budget_ms": PATIENT_LOOKUP_BUDGET_MS,
            "lookup_deadline_ms": PATIENT_LOOKUP_DEADLINE_MS, "tiers": [*local, bucket]}


def _server(model: Path, work: Path, name: str, store: dict[str, Any] | None, env: dict[str, str]) -> Served:
    template = work / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    kv = None if store is None else {"kv_connector": "TieredKVConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": store}
    stats = work / f"stats-{name}"
    server = Server(model, work / f"{name}.log", served_name=SERVED, chat_template=template, max_model_len=MAX_LEN,
                    kv_transfer=kv, stats_dir=stats if store is not None else None)
    i = server.args.index("--limit-mm-per-prompt")  # a text model
    del server.args[i:i + 2]
    server.env.update(env)
    server.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), server.env.get("PYTHONPATH")) if p)
    return Served(server, stats)


def _pair(model: Path, work: Path, names: tuple[str, str], stores: tuple[dict, dict], env: dict[str, str]
          ) -> tuple[Served, Served]:
    """Two servers started side by side (their start-ups overlap), both healthy."""
    a, b = (_server(model, work, n, s, env) for n, s in zip(names, stores, strict=True))
    a.server.start()
    b.server.start()
    try:
        a.server.wait_healthy(timeout_s=400)
        b.server.wait_healthy(timeout_s=400)
    except Exception:
        a.server.stop()
        b.server.stop()
        raise
    return a, b


def _precompute(model: Path, work: Path, docs: list[Path], store: dict[str, Any], env: dict[str, str]) -> dict:
    listed = work / "job-docs.txt"
    listed.write_text("".join(f"{d}\n" for d in docs))
    (work / "template.txt").write_text(TEMPLATE)
    proc = run_job([sys.executable, "-m", "vllm_tiercache.tools.cli", "precompute", "docs", "--model", str(model),
                    "--docs", str(listed), "--template", str(work / "template.txt"), "--config", json.dumps(store),
                    "--engine-args", json.dumps(ENGINE), "--tag", "corpus:serving", "--json", "--no-progress"],
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", **env},
                   timeout=900)
    start = proc.stdout.find("{\n")
    assert proc.returncode == 0 and start >= 0, f"precompute failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout[start:])


def _record_names_of(s3: SeaweedFSServer, doc: str) -> list[str]:
    """The bucket's record objects tagged with ``doc:{doc}`` (the job tags each document's records)."""
    client = s3.client()
    names = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="tiercache/r/"):
        for obj in page.get("Contents", ()):
            meta = client.head_object(Bucket=BUCKET, Key=obj["Key"])["Metadata"]
            if f"doc%3A{doc}" in meta.get("tc-tags", "") or f"doc:{doc}" in meta.get("tc-tags", ""):
                names.append(obj["Key"])
    return names


#: the start of a record's GET / PUT as the proxy sees it (path-style addressing)
RECORD_GET = f"GET /{BUCKET}/tiercache/r/".encode()
RECORD_PUT = f"PUT /{BUCKET}/tiercache/r/".encode()


@pytest.fixture(scope="module")
def seen(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the scenario of the module docstring once; every answer and counter the tests look at."""
    work = tmp_path_factory.mktemp("object-serving")
    docs = _docs(work / "docs")
    env = SeaweedFSServer.credentials_env()
    seen: dict[str, Any] = {"logs": work}
    with SeaweedFSServer() as s3, WatchingProxy(s3.ports["s3"]) as proxy_a, WatchingProxy(s3.ports["s3"]) as proxy_b:
        s3.create_bucket(BUCKET)
        # A and B reach the store each through its own proxy, which lands each fault at the moment it names
        # (A's write-behind of what it recomputed may still run when B's fault is armed)
        endpoint = {"a": proxy_a.endpoint, "b": proxy_b.endpoint}
        store_of = {name: _store(endpoint.get(name, s3.endpoint),
                                 {"kind": "memory", "capacity": "8MiB"},
                                 {"kind": "disk", "path": str(work / f"disk-{name}"), "capacity": "256MiB"})
                    for name in ("a", "b", "a2", "b2")}
        reference = _server(tiny_llama, work, "reference", None, env)
        with reference.server:
            reference.server.wait_healthy(timeout_s=400)
            seen["reference"] = {name: reference.ask(path)[0] for name, path in docs.items()}
        stored = [docs[n] for n in (*CORPUS, GARBAGE, *PAUSED)]
        seen["job"] = _precompute(tiny_llama, work, stored, _store(s3.endpoint, timeout_s=JOB_TIMEOUT_S), env)
        seen["expected"] = dict(zip((d.stem for d in stored), _expected_hits(
            str(tiny_llama), ENGINE, _store(s3.endpoint), stored, [{"prompt": _prompt(d)} for d in stored],
            TEMPLATE), strict=True))

        a, b = _pair(tiny_llama, work, ("a", "b"), (store_of["a"], store_of["b"]), env)
        try:
            stored_by_job = _record_count(s3)
            seen["a"] = a.ask_all([docs[n] for n in CORPUS])
            _written_behind(s3, more_than=stored_by_job)
            seen["b"] = b.ask_all([docs[n] for n in CORPUS])
            # garbage under the name of one record of a stored document: B recomputes from that chunk on
            victims = _record_names_of(s3, GARBAGE)
            s3.client().put_object(Bucket=BUCKET, Key=victims[0], Body=b"\x00garbage" * 100)
            seen["garbage"] = b.ask(docs[GARBAGE])
            seen["garbage_left"] = _object_bytes(s3, victims[0])
            # SIGSTOP as the first record GET of A's loads reaches the store; continued once A answered
            proxy_a.arm(RECORD_GET, s3.pause)
            seen["paused"] = a.ask_all([docs[n] for n in PAUSED])
            seen["pause_fired"] = proxy_a.fired.is_set()
            s3.resume()
            # SIGKILL as the fifth record PUT of B's write-behind reaches the store; restarted on its data
            proxy_b.arm(RECORD_PUT, s3.kill, skip=4)
            seen["written"] = b.ask_all([docs[n] for n in WRITTEN])
            seen["kill_fired"] = proxy_b.fired.wait(300)  # B's write-behind reaches the PUT that kills it
            s3.start()
            time.sleep(1.5)  # the prober (retry_after_s 0.5) finds it back
            seen["written_elsewhere"] = a.ask_all([docs[n] for n in WRITTEN])
        finally:
            for served in (a, b):
                seen.setdefault("stop_status", []).append(served.server.stop(sig="SIGTERM"))
        seen["stats_a"], seen["stats_b"] = a.worker_stats(), b.worker_stats()
        seen["failures"] = a.failures + b.failures

        s3.stop()  # everything restarted, SeaweedFS included
        s3.start()
        a2, b2 = _pair(tiny_llama, work, ("a2", "b2"), (store_of["a2"], store_of["b2"]), env)
        try:
            seen["a2"] = a2.ask_all([docs[n] for n in CORPUS])
            seen["b2"] = b2.ask_all([docs[n] for n in CORPUS])
            # the bucket deleted under both running servers: A asks a document the job stored there
            s3.delete_bucket(BUCKET)
            seen["bucketless"] = a2.ask(docs[PAUSED[0]])
            seen["bucketless_healthy"] = _healthy(a2.server)
            s3.create_bucket(BUCKET)  # (SeaweedFS may have made it again with A's first PUT: AWS would not)
            time.sleep(1.5)  # the prober finds the bucket back (when A's writes found it gone)
            _written_behind(s3, more_than=0)
            seen["back_b"] = b2.ask(docs[PAUSED[0]])
        finally:
            for served in (a2, b2):
                seen["stop_status"].append(served.server.stop(sig="SIGTERM"))
        seen["stats_a2"], seen["stats_b2"] = a2.worker_stats(), b2.worker_stats()
        seen["failures"] += a2.failures + b2.failures
    # what the tests look at, beside the servers' logs (for a failure in CI)
    (work / "seen.json").write_text(json.dumps({k: v for k, v in seen.items() if k not in ("logs", "reference")},
                                               default=str, indent=1))
    return seen


def _record_count(s3: SeaweedFSServer) -> int:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="tiercache/r/")
    return sum(page.get("KeyCount", 0) for page in pages)


def _written_behind(s3: SeaweedFSServer, more_than: int, quiet_s: float = 2.0, most_s: float = 60.0) -> None:
    """Until the bucket holds more than ``more_than`` records and their count stopped changing for ``quiet_s``:
    a server's answers come before its write-behind has written their chunks (a new writer's first put may
    wait for a capacity sweep first). Past ``most_s`` the test's own assertions say what is missing."""
    deadline = time.monotonic() + most_s
    while _record_count(s3) <= more_than and time.monotonic() < deadline:
        time.sleep(0.5)
    until_quiet(lambda: _record_count(s3), quiet_s, max(quiet_s, deadline - time.monotonic()))


def _object_bytes(s3: SeaweedFSServer, name: str) -> bytes | None:
    try:
        return s3.client().get_object(Bucket=BUCKET, Key=name)["Body"].read()
    except Exception:
        return None


def _healthy(server: Server) -> bool:
    with urllib.request.urlopen(server.base_url + "/health", timeout=10) as resp:
        return resp.status == 200


def _object(stats: dict[str, Any]) -> dict[str, Any]:
    return stats["store"]["tiers"]["object"]


def _answers_equal(seen: dict[str, Any], phase: str) -> None:
    answered = seen[phase] if isinstance(seen[phase], dict) else None
    assert answered is not None
    for name, (text, *_) in answered.items():
        assert text == seen["reference"][name], (phase, name, seen["logs"])


def test_the_job_stores_the_corpus_in_the_bucket(seen: dict[str, Any]) -> None:
    job = seen["job"]
    assert (job["total"], job["stored"], job["failed"]) == (7, 7, []), job
    assert all(tokens >= 4 * CHUNK for tokens in seen["expected"].values()), seen["expected"]


def _cached(answered: dict[str, tuple[str, int, int]]) -> dict[str, int]:
    return {name: cached for name, (_, cached, _) in answered.items()}


def _whole_prompt(answered: dict[str, tuple[str, int, int]]) -> dict[str, int]:
    """What a server hits once another server computed the whole prompt: every block before its last token."""
    return {name: (tokens - 1) // BLOCK * BLOCK for name, (_, _, tokens) in answered.items()}


def test_two_servers_sharing_only_the_bucket_both_hit_with_the_reference_answers(seen: dict[str, Any]) -> None:
    _answers_equal(seen, "a")
    _answers_equal(seen, "b")
    # A asks first: the job's stored prefix, exactly; B asks next: that and what A wrote back after it
    assert _cached(seen["a"]) == {name: seen["expected"][name] for name in CORPUS}
    assert _cached(seen["b"]) == _whole_prompt(seen["b"])
    assert all(seen["expected"][name] < hit for name, hit in _cached(seen["b"]).items()), seen["b"]
    assert _object(seen["stats_a"])["hits"] > 0 and _object(seen["stats_b"])["hits"] > 0


def test_garbage_under_a_records_name_is_recomputed_counted_and_deleted(seen: dict[str, Any]) -> None:
    assert seen["garbage"][0] == seen["reference"][GARBAGE]
    # the damaged chunk's fetch into host memory failed, so it was never claimed: B computed it (and every
    # later chunk) itself
    assert seen["stats_b"]["counters"]["prefetch_failures"] >= 1
    assert _object(seen["stats_b"])["corrupt"] >= 1
    # deleted when read; B then saves the chunk it computed anew, so the name may hold a good record again
    left = seen["garbage_left"]
    assert left is None or not left.startswith(b"\x00garbage"), "the garbage object was left in the bucket"


def test_a_store_hung_during_loads_costs_hits_never_a_request(seen: dict[str, Any]) -> None:
    assert seen["pause_fired"], "no record GET reached the store while A served the stored documents"
    _answers_equal(seen, "paused")
    # the fetches that hung failed at the tier's timeout; their chunks were computed, no forward waited on them
    assert seen["stats_a"]["counters"]["prefetch_failures"] >= 1
    assert _object(seen["stats_a"])["errors"] >= 1


def test_a_store_killed_mid_write_leaves_only_whole_records(seen: dict[str, Any]) -> None:
    assert seen["kill_fired"], "B wrote fewer than five records behind its answers"
    _answers_equal(seen, "written")
    _answers_equal(seen, "written_elsewhere")
    # A read what landed before the kill: whole records or none, never a damaged one
    assert _object(seen["stats_a"])["corrupt"] == 0
    assert _object(seen["stats_b"])["dropped_writes"] >= 1


def test_everything_restarted_seaweedfs_included_the_corpus_hits_from_the_bucket(seen: dict[str, Any]) -> None:
    for server in ("a2", "b2"):  # on fresh disks: every hit is the bucket's
        _answers_equal(seen, server)
        assert _cached(seen[server]) == _whole_prompt(seen[server])
        assert _object(seen[f"stats_{server}"])["hits"] > 0


def test_a_bucket_deleted_under_running_servers_and_created_again(seen: dict[str, Any]) -> None:
    assert seen["bucketless"][:2] == (seen["reference"][PAUSED[0]], 0)  # the job's records went with it
    assert seen["bucketless_healthy"]
    assert seen["back_b"][0] == seen["reference"][PAUSED[0]]
    assert seen["back_b"][1] == (seen["back_b"][2] - 1) // BLOCK * BLOCK, "B did not load what A wrote there"


def test_no_request_failed_and_every_server_stopped_cleanly(seen: dict[str, Any]) -> None:
    assert seen["failures"] == [], seen["failures"]
    assert seen["stop_status"] == [0, 0, 0, 0], (seen["stop_status"], seen["logs"])
