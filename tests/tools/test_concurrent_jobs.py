"""A precompute job, a serving engine and `tiercache evict` on one disk directory at the same time.

Why real processes: the store-level soak (tests/faults/test_faults_store.py) checks the disk tier with
precompute-like and serving-like workers; this checks the real commands together. `tiercache precompute
docs` runs again and again (each run re-stores what eviction removed, so it keeps writing), a `kv_both`
engine answers RAG prompts over the same documents round after round (reading chunks the job and it
wrote, and writing its own), and `tiercache evict --older-than 2s` keeps removing records under both.
What must hold: every answer equals an engine's without a connector, no job or eviction fails (a job
whose records were evicted after it wrote them has not failed), no record is ever found corrupt, and
afterwards (one more job run, nobody evicting) the index and the files agree and every indexed record
reads back whole.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.zygote_client import run_job, zygote_subprocess
from tests.tools.test_precompute import LLAMA_ENGINE, ROOT, _run_engine
from vllm_tiercache.shared.stats_dump import read_stats

pytestmark = pytest.mark.engine

SERVING_ROUNDS = 4


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", **extra}
    if "TIERCACHE_STATS_DIR" not in extra:
        env.pop("TIERCACHE_STATS_DIR", None)
    return env


def _make_docs(root: Path) -> list[Path]:
    rng = random.Random(99)
    words = "alpha beta gamma delta cache tier vector memory disk layer token prefix chunk river stone".split()
    root.mkdir()
    docs = []
    for i in range(10):
        path = root / f"doc{i}.txt"
        path.write_text(" ".join(rng.choice(words) for _ in range(rng.randrange(40, 160))) + f". Doc {i}.\n")
        docs.append(path)
    return docs


def _audit(disk: Path) -> dict[str, Any]:
    """A fresh disk tier on the directory: does the index match the files, and does every entry read?"""
    from vllm_tiercache.shared.config import DiskTierConfig
    from vllm_tiercache.shared.store.api import StoreKey
    from vllm_tiercache.shared.store.tiers.disk.tier import DiskTier

    tier = DiskTier(DiskTierConfig(path=str(disk), capacity=1 << 30))
    try:
        index = list(tier.iter_index())
        entries = {d: size for d, size, _, _ in index}
        files = {bytes.fromhex(f.stem): f.stat().st_size for f in disk.glob("??/*.rec")}
        consistent = entries == files and tier.usage()["bytes_used"] == sum(entries.values())
        records = tier.get_many([StoreKey(text) for _, _, _, text in index if text])
        return {"entries": len(entries), "files": len(files), "consistent": consistent,
                "unreadable": sum(r is None for r in records), "corrupt": tier.counters.get("corrupt"),
                "without_text": sum(1 for *_, text in index if not text)}
    finally:
        tier.close()


def test_precompute_serving_and_evict_at_once(tiny_llama: Path, tmp_path: Path) -> None:
    from vllm_tiercache.tools.precompute.kv import rag_prompt

    docs = _make_docs(tmp_path / "docs")
    model = str(tiny_llama)
    disk = tmp_path / "disk"
    store = {"namespace": "rag", "chunk_size": 64, "tiers": [{"kind": "disk", "path": str(disk), "capacity": "1GiB"}]}
    prompts = [{"prompt": rag_prompt(d.read_text(), f"question {i}?")} for i, d in enumerate(docs)]
    # The connector-less reference runs beside the rest (one more engine on the machine changes nothing
    # that is asserted, and CI does not wait for its start on its own).
    pool = ThreadPoolExecutor(max_workers=1)
    base_future = pool.submit(_run_engine, tmp_path, "baseline", model=model, engine=LLAMA_ENGINE, prompts=prompts)

    # The serving engine: kv_both over SERVING_ROUNDS rounds of the prompts, one request at a time, in one
    # process like the baseline (the layouts whose tokens are compared are the same).
    spec = {"model": model, "engine": LLAMA_ENGINE, "prompts": prompts * SERVING_ROUNDS,
            "out": str(tmp_path / "serving.json"),
            "kv": {"kv_connector": "TieredKVConnector", "kv_role": "kv_both", "kv_connector_extra_config": store}}
    stats_dir = tmp_path / "serving-stats"
    serving_log = open(tmp_path / "serving.log", "wb")
    engine_script = ROOT / "tests" / "tools" / "test_precompute.py"
    # every engine job forks from the engine zygote (a process of its own, its own group), like run_job's
    launch = zygote_subprocess().Popen
    serving = launch([sys.executable, str(engine_script), json.dumps(spec)], cwd=ROOT,
                     env=_env(TIERCACHE_STATS_DIR=str(stats_dir), VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                     stdout=serving_log, stderr=subprocess.STDOUT, start_new_session=True)
    job_cmd = [sys.executable, "-m", "vllm_tiercache.tools.cli", "precompute", "docs", "--model", model, "--docs",
               str(tmp_path / "docs"), "--config", json.dumps(store), "--engine-args", json.dumps(LLAMA_ENGINE),
               "--json", "--no-progress"]
    evict_cmd = [sys.executable, "-m", "vllm_tiercache.tools.cli", "evict", "--config", json.dumps(store),
                 "--namespace", "rag",
                 "--older-than", "2s", "--json"]
    jobs: list[dict[str, Any]] = []
    evictions: list[dict[str, Any]] = []
    job: Any = None
    job_out = tmp_path / "job.out"
    try:
        while True:
            if job is None or job.poll() is not None:
                if job is not None:
                    jobs.append({"code": job.returncode, "out": job_out.read_text(errors="replace")})
                    job = None
                if serving.poll() is None:  # a new precompute run while the engine still serves
                    with open(job_out, "wb") as out:
                        job = launch(job_cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
            ev = subprocess.run(evict_cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
            evictions.append({"code": ev.returncode, "out": ev.stdout, "err": ev.stderr[-2000:]})
            if serving.poll() is not None and job is None:
                break
            time.sleep(0.5)
    finally:
        for proc in (serving, job):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        serving_log.close()

    log_tail = (tmp_path / "serving.log").read_text(errors="replace")[-4000:]
    assert serving.returncode == 0, log_tail
    result = json.loads((tmp_path / "serving.json").read_text())
    base = base_future.result()
    pool.shutdown()
    assert result["tokens"] == base["tokens"] * SERVING_ROUNDS

    (tmp_path / "jobs.json").write_text(json.dumps({"jobs": jobs, "evictions": evictions}))
    assert jobs and all(j["code"] == 0 for j in jobs), [j["out"][j["out"].find("{\n"):] for j in jobs]
    summaries = [json.loads(j["out"][j["out"].find("{\n"):]) for j in jobs]
    assert all(s["failed"] == [] for s in summaries), summaries
    assert all(e["code"] == 0 for e in evictions), [e for e in evictions if e["code"]][:2]
    reports = [json.loads(e["out"]) for e in evictions]
    assert not [t for r in reports for t in r["tiers"] if "error" in t]
    evicted = sum(r["records"] for r in reports)
    assert evicted > 0, "eviction never found a record to remove: the three did not overlap"

    (worker,) = read_stats(str(stats_dir), "kv-worker")
    assert worker["store"]["tiers"]["disk"]["corrupt"] == 0, worker["store"]
    # Afterwards, with nobody evicting: one more job run stores whatever was evicted, and then the index
    # and the files agree, and every indexed record reads back whole.
    final = run_job(job_cmd, cwd=ROOT, env=_env(), timeout=600)
    assert final.returncode == 0, final.stderr[-4000:]
    summary = json.loads(final.stdout[final.stdout.find("{\n"):])
    assert summary["stored"] + summary["skipped"] == len(docs) and summary["failed"] == [], summary
    audit = _audit(disk)
    assert audit["entries"] > 0 and audit["without_text"] == 0, audit
    assert audit["consistent"] and audit["unreadable"] == 0 and audit["corrupt"] == 0, audit
    assert not list(disk.glob("??/.tmp-*"))
    print(f"concurrent: {len(jobs)} precompute runs (stored {sum(s['stored'] for s in summaries)} docs), "
          f"{len(evictions)} evict runs removed {evicted} records, serving answered {len(result['tokens'])} "
          f"requests ({sum(1 for c in result['num_cached_tokens'] if c)} with hits, "
          f"{worker['counters']['load_errors']} load errors recomputed); audit {audit}")
