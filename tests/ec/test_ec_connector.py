"""End-to-end: TieredECConnector in real vLLM engines, each in its own process (stores cross processes).

One module is both the tests and the engine script they spawn (`python tests/ec/test_ec_connector.py ...`):
every engine runs in a fresh process so nothing (memory tier, vLLM globals) leaks between roles, and
only the disk tier in a tmp dir (or Redis) connects producer and consumer, as in a real deployment.

Engines run either with vLLM's uniproc executor (`"mp": False`: scheduler and worker in one process) or
as vLLM-CPU runs by default (`"mp": True`: engine core and worker in two more processes, so the worker's
memory tier is visible to the scheduler only through the connector's residency reports). Counters come
from the `ec-<pid>.json` files every process writes into `$TIERCACHE_STATS_DIR`, summed.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.redis import PATIENT_LOOKUP_BUDGET_MS
from tests.support.zygote_client import run_job
from vllm_tiercache.eccache.managers import LRUEncoderCacheManager
from vllm_tiercache.shared.stats_dump import read_stats

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Question: what is in the picture? Answer:"
MAX_TOKENS = 8
#: Embeddings per image of the tiny BLIP-2 (its num_query_tokens).
IMAGE_TOKENS = 8


class OneImageEncoderCacheManager(LRUEncoderCacheManager):
    """vLLM's own encoder cache shrunk to one image, so an image seen two prompts ago reaches the connector."""

    @classmethod
    def create_manager(cls, *, cache_size: int, vllm_config: Any) -> OneImageEncoderCacheManager:
        return cls(cache_size=min(cache_size, IMAGE_TOKENS))


ONE_IMAGE_MANAGER = "tests.ec.test_ec_connector.OneImageEncoderCacheManager"


def _image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(48, 48, 3) * 255).astype("uint8"))


def _prompt(item: int | list) -> tuple[str, int]:
    """A round item: an image seed (asked with PROMPT) or [prompt text, image seed(, multi_modal_uuid)]."""
    return (PROMPT, item) if isinstance(item, int) else (item[0], item[1])


def _request(item: int | list) -> dict:
    """The `generate` prompt of one round item; a third element is the image's `multi_modal_uuids` entry."""
    text, seed = _prompt(item)
    prompt: dict = {"prompt": text, "multi_modal_data": {"image": _image(seed)}}
    if isinstance(item, list) and len(item) > 2:
        prompt["multi_modal_uuids"] = {"image": [item[2]]}
    return prompt


def _engine_main(spec: dict) -> None:
    """Run one engine over `spec["rounds"]`, one prompt per request; write tokens and cached-token counts."""
    if not spec.get("mp"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig, KVTransferConfig

    kwargs: dict = {}
    if spec.get("role"):
        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector="TieredECConnector", ec_connector_module_path="vllm_tiercache.eccache.connector",
            ec_role=spec["role"], ec_connector_extra_config=spec["extra"],
        )
    if spec.get("kv"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv"])
    if spec.get("manager"):
        kwargs["ec_manager_config"] = {"encoder_cache_manager_cls": spec["manager"]}
    llm = LLM(
        model=spec["model"], enforce_eager=True, max_model_len=256, max_num_seqs=4, block_size=32,
        dtype="float32", seed=0, gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False, mm_processor_cache_gb=spec.get("mm_processor_cache_gb", 4), **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rounds = []
    for items in spec["rounds"]:
        tokens, cached = [], []
        for item in items:  # one prompt at a time: each image is its own request and lookup
            out = llm.generate([_request(item)], params, use_tqdm=False)
            tokens.append(list(out[0].outputs[0].token_ids))
            cached.append(out[0].num_cached_tokens or 0)
        rounds.append({"tokens": tokens, "num_cached_tokens": cached})
    result: dict = {"rounds": rounds, "tokens": [t for r in rounds for t in r["tokens"]]}
    if spec.get("manager") and not spec.get("mp"):
        mgr = llm.llm_engine.engine_core.engine_core.scheduler.encoder_cache_manager
        result["manager"] = type(mgr).__name__
    if spec.get("role") and not spec.get("mp"):
        from vllm.distributed.ec_transfer import get_ec_transfer

        get_ec_transfer()._store.flush(30.0)
    # Shut the engine down here (workers flush their stores and write their final counters).
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    Path(spec["out"]).write_text(json.dumps(result))


def ec_totals(stats_dir: Path) -> dict[str, float]:
    """EC counters of every process of one engine, summed (each process counts what it did)."""
    totals: dict[str, float] = {}
    for entry in read_stats(str(stats_dir), "ec"):
        for name, value in entry.get("connector", {}).items():
            totals[name] = totals.get(name, 0) + value
    return totals


def run_mm_engine(tmp_path: Path, name: str, **spec: Any) -> dict:
    """Run one engine (see `_engine_main`) in a fresh process; its EC counters are in `result["stats"]`."""
    spec["out"] = str(tmp_path / f"{name}.json")
    stats_dir = tmp_path / f"{name}-stats"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIERCACHE_STATS_DIR": str(stats_dir),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if spec.get("mp") else "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vllm-cpu reserves another core count with a KV connector; pinned, every engine sums in one order.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    if "images" in spec:
        spec["rounds"] = [spec.pop("images")]
    started = time.perf_counter()
    proc = run_job([sys.executable, str(Path(__file__).resolve()), json.dumps(spec)], cwd=ROOT, env=env,
                   timeout=600)
    if spec.get("expect_failure"):
        assert proc.returncode != 0, f"{name} engine was expected to fail at start but ran"
        return {"log": proc.stdout + proc.stderr}
    assert proc.returncode == 0, f"{name} engine failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(Path(spec["out"]).read_text())
    result["stats"] = ec_totals(stats_dir)
    result["stats_dir"] = str(stats_dir)
    result["seconds"] = time.perf_counter() - started
    result["log"] = proc.stdout + proc.stderr
    return result


def _extra(disk: Path) -> dict:
    return {"namespace": "ectest", "tiers": [{"kind": "memory", "capacity": "256MiB"},
                                             {"kind": "disk", "path": str(disk), "capacity": "1GiB"}]}


@pytest.fixture(scope="module")
def baseline(tiny_blip2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[int]]:
    """Tokens of an engine without connector, per image seed 1..5 (asked with PROMPT)."""
    import vllm  # noqa: F401  (fail, not skip, without vLLM)

    seeds = [1, 2, 3, 4, 5]
    # The baseline also runs our LRU manager through vLLM's --ec-manager-config extension point.
    base = run_mm_engine(tmp_path_factory.mktemp("ec-baseline"), "baseline", model=str(tiny_blip2), images=seeds,
                         manager="vllm_tiercache.eccache.managers.LRUEncoderCacheManager")
    assert base["manager"] == "LRUEncoderCacheManager"
    assert len({tuple(t) for t in base["tokens"]}) > 1, "images must change tokens"
    return dict(zip(seeds, base["tokens"], strict=True))


@pytest.mark.engine
def test_producer_consumer_identical_tokens(tiny_blip2: Path, baseline: dict, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    stored, fresh = [1, 2, 3], [4, 5]
    prod = run_mm_engine(tmp_path, "producer", model=str(tiny_blip2), images=stored, role="ec_producer",
                         extra=_extra(disk))
    assert prod["stats"]["saves"] == len(stored)

    cons = run_mm_engine(tmp_path, "consumer", model=str(tiny_blip2), images=stored + fresh,
                         role="ec_consumer", extra=_extra(disk))
    assert cons["tokens"] == [baseline[s] for s in stored + fresh]
    st = cons["stats"]
    assert st["loads"] == len(stored) and st["hits"] == len(stored)
    assert st["misses"] == len(fresh) and st["saves"] == 0 and st["load_failures"] == 0

    # Corrupt every stored record (flip payload bytes): still the same tokens, every load re-encoded.
    files = sorted(p for p in disk.rglob("*") if p.is_file() and p.stat().st_size > 256)
    assert files, "the producer wrote no record files"
    for path in files:
        data = bytearray(path.read_bytes())
        data[-16:] = bytes(b ^ 0xFF for b in data[-16:])
        path.write_bytes(bytes(data))
    bad = run_mm_engine(tmp_path, "corrupt", model=str(tiny_blip2), images=stored, role="ec_both",
                        extra=_extra(disk))
    assert bad["tokens"] == [baseline[s] for s in stored]
    assert bad["stats"]["loads"] == 0
    assert bad["stats"]["recomputed"] + bad["stats"]["misses"] >= len(stored)


@pytest.mark.engine
def test_redis_producer_then_fresh_consumer_process(
    tiny_blip2: Path, baseline: dict, redis_url: str, tmp_path: Path
) -> None:
    """Redis is the only tier: the producer's encoder outputs reach a consumer engine in another process."""
    extra = {"namespace": "ecredis", "lookup_budget_ms": PATIENT_LOOKUP_BUDGET_MS,
             "tiers": [{"kind": "redis", "url": redis_url}]}
    stored, fresh = [1, 2], [3]
    # An ec_producer engine is an encode-only instance (vLLM generates no tokens there).
    prod = run_mm_engine(tmp_path, "redis-producer", model=str(tiny_blip2), images=stored, role="ec_producer",
                         extra=extra)
    assert prod["stats"]["saves"] == len(stored) and prod["stats"]["save_errors"] == 0

    # The consumer runs as vLLM-CPU does by default (scheduler and worker in separate processes).
    cons = run_mm_engine(tmp_path, "redis-consumer", model=str(tiny_blip2), images=stored + fresh,
                         role="ec_consumer", extra=extra, mp=True)
    assert cons["tokens"] == [baseline[s] for s in stored + fresh]
    st = cons["stats"]
    assert st["hits"] == len(stored) and st["loads"] == len(stored), st
    assert st["misses"] == len(fresh) and st["load_failures"] == 0 and st["recomputed"] == 0, st
    (worker,) = [e for e in read_stats(cons["stats_dir"], "ec") if e["connector"]["loads"]]
    assert worker["store"]["tiers"]["redis"]["hits"] >= len(stored)


@pytest.mark.engine
def test_memory_only_ec_both_hits_across_scheduler_worker_split(
    tiny_blip2: Path, baseline: dict, tmp_path: Path
) -> None:
    """Only the worker's in-process memory tier holds the outputs; the scheduler runs in another process.

    vLLM's own encoder cache is shrunk to one image, so the second round asks the connector; the hits
    are possible only through the worker's residency reports.
    """
    extra = {"namespace": "ecmem", "tiers": [{"kind": "memory", "capacity": "64MiB"}]}
    seeds = [1, 2]
    res = run_mm_engine(tmp_path, "memory-only", model=str(tiny_blip2), rounds=[seeds, seeds], role="ec_both",
                        extra=extra, mp=True, manager=ONE_IMAGE_MANAGER)
    first, second = res["rounds"]
    assert first["tokens"] == second["tokens"] == [baseline[s] for s in seeds]
    pids = {e["pid"] for e in read_stats(res["stats_dir"], "ec")}
    assert len(pids) == 2, f"expected the scheduler and the worker in two processes, got {pids}"
    st = res["stats"]
    assert st["saves"] == len(seeds), st
    assert st["misses"] == len(seeds) and st["hits"] == len(seeds), st
    assert st["loads"] == len(seeds) and st["load_failures"] == 0 and st["recomputed"] == 0, st


@pytest.mark.engine
def test_memory_only_ec_both_hits_beside_the_kv_connector_on_one_store(
    tiny_blip2: Path, tmp_path: Path
) -> None:
    """The same split as above with TieredKVConnector beside it on the same memory-only store, as an operator
    runs both (and `bench serve`'s mm-kv-ec case). The second round asks about the same images in other
    words, so no KV chunk covers the image (BLIP-2 puts its tokens first) and each repeat must come from
    the encoder cache. Tokens are compared with an engine without connectors on the same prompts.
    """
    extra = {"namespace": "ecmem-kv", "tiers": [{"kind": "memory", "capacity": "64MiB"}]}
    kv = {"kv_connector": "TieredKVConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    rounds = [[["Question: what is in the picture? Answer:", s] for s in (1, 2)],
              [["Describe this image in one short line please:", s] for s in (1, 2)]]
    plain = run_mm_engine(tmp_path, "memory-only-kv-plain", model=str(tiny_blip2), rounds=rounds)
    res = run_mm_engine(tmp_path, "memory-only-kv", model=str(tiny_blip2), rounds=rounds, role="ec_both",
                        extra=extra, kv=kv, mp=True, manager=ONE_IMAGE_MANAGER)
    assert res["tokens"] == plain["tokens"]
    assert res["rounds"][1]["num_cached_tokens"] == [0, 0]  # the KV connector did not cover the images
    st = res["stats"]
    assert st["saves"] == 2, st
    assert st["misses"] == 2 and st["hits"] == 2, st
    assert st["loads"] == 2 and st["load_failures"] == 0 and st["recomputed"] == 0, st


def test_residency_reports_follow_the_memory_tier() -> None:
    """Unit level: saves, promotions and evictions of the worker's memory tier reach the scheduler's lookup."""
    import torch

    from vllm_tiercache.eccache.connector import ECCounters
    from vllm_tiercache.eccache.scheduler import ECSchedulerSide, TieredECWorkerMetadata
    from vllm_tiercache.eccache.worker import ECWorkerSide, worker_in_process
    from vllm_tiercache.shared.store import build_store
    from vllm_tiercache.shared.store.api import StoreKey

    def key_of(h: str) -> StoreKey:
        return StoreKey(f"unit|enc|m|f|{h}")

    # 3 records of 4 KiB fit in the 13 KiB memory tier; the worker's store is another process's.
    worker_store = build_store({"tiers": [{"kind": "memory", "capacity": 13 * 1024}]})
    sched_store = build_store({"tiers": [{"kind": "memory", "capacity": 13 * 1024}]})
    try:
        counters = ECCounters()
        worker = ECWorkerSide(worker_store, key_of, device=torch.device("cpu"), dtype=torch.float32,
                              hidden_size=128, save_enabled=True, counters=counters)
        sched = ECSchedulerSide(sched_store, key_of, load_enabled=True,
                                same_process=lambda: worker_in_process(sched_store), counters=counters)
        assert worker_in_process(worker_store) and not worker_in_process(sched_store)

        def ask(mm_hash: str, report: TieredECWorkerMetadata | None = None) -> bool:
            """One request with one image, as vLLM's scheduler drives it (a report may land in between)."""
            feature = type("Feature", (), {"identifier": mm_hash})()
            request = type("Request", (), {"request_id": f"req-{mm_hash}", "mm_features": [feature]})()
            sched.ensure_cache_available(request)
            if report is not None:
                sched.update_connector_output(report)
            answer = sched.has_cache_item(mm_hash)
            sched.build_connector_meta()
            sched.request_finished(request)
            return answer

        assert worker.worker_meta() is None
        cache = {h: torch.full((8, 128), float(i)) for i, h in enumerate("abcd")}
        worker.save_caches(cache, "a")
        worker.save_caches(cache, "b")
        meta = worker.worker_meta()
        assert isinstance(meta, TieredECWorkerMetadata) and meta.added == {"a", "b"} and not meta.evicted
        assert not ask("a")  # before the report the other process's memory tier is invisible
        sched.update_connector_output(meta)
        assert ask("a") and ask("b") and not ask("c")
        worker.save_caches(cache, "c")
        worker.save_caches(cache, "d")  # evicts the oldest ("a")
        meta = worker.worker_meta()
        assert meta.added == {"c", "d"} and meta.evicted == {"a"}
        sched.update_connector_output(meta)
        assert set(sched.resident) == {"b", "c", "d"} and not ask("a")
        # A report answer is re-checked when the item is evicted before it becomes a promise.
        assert not ask("b", report=TieredECWorkerMetadata(evicted={"b"}))
        # Aggregation over tensor-parallel workers: resident only where every worker holds it.
        both = TieredECWorkerMetadata(added={"x", "y"}, evicted={"p"}).aggregate(
            TieredECWorkerMetadata(added={"y"}, evicted={"q"}))
        assert both.added == {"y"} and both.evicted == {"p", "q"}
        # In one process with the worker, the scheduler sees the memory tier itself (uniproc executor).
        local = ECSchedulerSide(worker_store, key_of, load_enabled=True,
                                same_process=lambda: worker_in_process(worker_store), counters=counters)
        feature = type("Feature", (), {"identifier": "d"})()
        local.ensure_cache_available(type("Request", (), {"request_id": "r", "mm_features": [feature]})())
        assert local.has_cache_item("d")
    finally:
        worker_store.close()
        sched_store.close()


if __name__ == "__main__":
    _engine_main(json.loads(sys.argv[1]))
