"""Real engines: a promised encoder output that vanishes before the worker loads it is re-encoded in that step.

The connector under test is `VanishingRecordECConnector`: `TieredECConnector` whose scheduler side, right
after promising an item (`has_cache_item` True), evicts its record from the store, the worst case of a
record evicted (or corrupted) between the lookup and the load. The worker's load then fails and the item
must be encoded in the same step through the reference to `scheduled_encoder_inputs` the metadata carries
(no frame walk). Were it not, vLLM would stop with "Encoder cache miss"; were it fed garbage, the tokens
would differ from a run without any connector. Both executors: uniproc (the worker gets the scheduler's
very `SchedulerOutput`) and multiproc (it gets a pickled copy), as vLLM-CPU runs by default.

The test connector's worker also checks, on the V1 model runner of vLLM 0.32 (the one vLLM-CPU uses),
that the dict it was handed is the `SchedulerOutput`'s own (found from its caller's frame, in the test
only) and writes what it saw to `$TIERCACHE_TEST_IDENTITY_LOG`.

One module is both the tests and the engine script they spawn (`python tests/ec/test_ec_stale_engine.py ...`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ec.test_ec_connector import MAX_TOKENS, PROMPT, _image, ec_totals
from tests.support.zygote_client import run_job
from vllm_tiercache.eccache.connector import TieredECConnector
from vllm_tiercache.eccache.scheduler import TieredECMetadata

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [1, 2, 3]


class VanishingRecordECConnector(TieredECConnector):
    """Evicts every record right after promising it (scheduler side); logs the dict identity (worker side)."""

    def has_cache_item(self, identifier: str) -> bool:
        promised = super().has_cache_item(identifier)
        if promised:
            text = self._key(identifier).text
            for tier in self._store.tiers:
                if tier.kind == "disk":
                    tier.delete_where(lambda key_text, size, atime: key_text == text)
        return promised

    def start_load_caches(self, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TieredECMetadata)
        if metadata.loads:
            self._log_identity(metadata)
        super().start_load_caches(encoder_cache, **kwargs)

    @staticmethod
    def _log_identity(metadata: TieredECMetadata) -> None:
        """Test-only check: is the carried dict the worker's `scheduler_output.scheduled_encoder_inputs`?"""
        frame = sys._getframe(1)
        seen = None
        for _ in range(10):
            if frame is None:
                break
            candidate = frame.f_locals.get("scheduler_output")
            if candidate is not None and getattr(candidate, "ec_connector_metadata", None) is metadata:
                seen = candidate.scheduled_encoder_inputs is metadata.scheduled_encoder_inputs
                break
            frame = frame.f_back
        path = os.environ.get("TIERCACHE_TEST_IDENTITY_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "same_object": seen, "loads": len(metadata.loads)}) + "\n")


def _engine_main(spec: dict) -> None:
    """One engine, one prompt per request over `spec["seeds"]`; writes the tokens to `spec["out"]`."""
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    kwargs: dict = {}
    if spec.get("role"):
        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector=spec.get("connector", "TieredECConnector"),
            ec_connector_module_path=spec.get("module", "vllm_tiercache.eccache.connector"),
            ec_role=spec["role"], ec_connector_extra_config=spec["extra"],
        )
    llm = LLM(
        model=spec["model"], enforce_eager=True, max_model_len=256, max_num_seqs=4, block_size=32,
        dtype="float32", seed=0, gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False, **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = []
    for seed in spec["seeds"]:
        out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": _image(seed)}}], params,
                           use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    Path(spec["out"]).write_text(json.dumps({"tokens": tokens}))


def _run(tmp_path: Path, name: str, *, mp: bool = False, **spec: Any) -> dict:
    spec["out"] = str(tmp_path / f"{name}.json")
    stats_dir = tmp_path / f"{name}-stats"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIERCACHE_STATS_DIR": str(stats_dir),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if mp else "0",
           "TIERCACHE_TEST_IDENTITY_LOG": str(tmp_path / f"{name}-identity.jsonl")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Pinned for every engine, with and without a connector: the forward pass sums in one order.
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    proc = run_job([sys.executable, str(Path(__file__).resolve()), json.dumps(spec)], cwd=ROOT, env=env,
                   timeout=600)
    assert proc.returncode == 0, f"{name} engine failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(Path(spec["out"]).read_text())
    result["stats"] = ec_totals(stats_dir)
    identity = tmp_path / f"{name}-identity.jsonl"
    result["identity"] = [json.loads(line) for line in identity.read_text().splitlines()] if identity.exists() else []
    result["log"] = proc.stdout + proc.stderr
    return result


def _disk_only(disk: Path) -> dict:
    """No memory tier: every load reads the disk tier, where the scheduler side evicts the record."""
    return {"namespace": "stale", "tiers": [{"kind": "disk", "path": str(disk), "capacity": "1GiB"}]}


@pytest.fixture(scope="module")
def stored(tiny_blip2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Baseline tokens (no connector) and a producer's published encoder outputs for SEEDS."""
    work = tmp_path_factory.mktemp("ec-stale")
    base = _run(work, "baseline", model=str(tiny_blip2), seeds=SEEDS)
    assert len({tuple(t) for t in base["tokens"]}) > 1, "images must change tokens"
    disk = work / "disk"
    prod = _run(work, "producer", model=str(tiny_blip2), seeds=SEEDS, role="ec_producer", extra=_disk_only(disk))
    assert prod["stats"]["saves"] == len(SEEDS)
    # A second encode-only run finds everything published: vLLM encodes nothing again, nothing is saved.
    again = _run(work, "producer-again", model=str(tiny_blip2), seeds=SEEDS, role="ec_producer",
                 extra=_disk_only(disk))
    assert again["stats"]["hits"] == len(SEEDS) and again["stats"]["misses"] == 0, again["stats"]
    assert again["stats"]["saves"] == 0 and again["stats"]["loads"] == 0, again["stats"]
    return {"tokens": base["tokens"], "disk": disk}


@pytest.mark.engine
@pytest.mark.parametrize("mp", [False, True], ids=["uniproc", "multiproc"])
def test_a_record_gone_after_the_promise_is_re_encoded_in_the_same_step(
    tiny_blip2: Path, stored: dict[str, Any], tmp_path: Path, mp: bool
) -> None:
    import shutil

    disk = tmp_path / "disk"
    shutil.copytree(stored["disk"], disk)  # each run evicts its own copy
    run = _run(tmp_path, "vanishing", mp=mp, model=str(tiny_blip2), seeds=SEEDS, role="ec_consumer",
               extra=_disk_only(disk), connector="VanishingRecordECConnector",
               module="tests.ec.test_ec_stale_engine")
    assert run["tokens"] == stored["tokens"]
    st = run["stats"]
    assert st["hits"] == len(SEEDS), st  # every item was promised ...
    assert st["loads"] == 0 and st["load_failures"] == len(SEEDS) and st["recomputed"] == len(SEEDS), st
    assert "Encoder cache miss" not in run["log"]
    # ... and the worker got the step's own dict: the object itself (uniproc) or its pickled twin (multiproc).
    assert len(run["identity"]) == len(SEEDS), run["identity"]
    assert all(entry["same_object"] is True for entry in run["identity"]), run["identity"]
    assert len({entry["pid"] for entry in run["identity"]}) == 1


if __name__ == "__main__":
    _engine_main(json.loads(sys.argv[1]))
