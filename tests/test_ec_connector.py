"""End-to-end: TieredECConnector in real vLLM engines, each in its own process (stores cross processes).

One module is both the tests and the engine script they spawn (`python tests/test_ec_connector.py ...`):
every engine runs in a fresh process so nothing (memory tier, vLLM globals) leaks between roles, and
only the disk tier in a tmp dir connects producer and consumer, as in a real deployment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Question: what is in the picture? Answer:"
MAX_TOKENS = 8


def _image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(48, 48, 3) * 255).astype("uint8"))


def _engine_main(spec: dict) -> None:
    """Run one engine: generate for `spec["images"]` (image seeds), write tokens and connector counters."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    kwargs: dict = {}
    if spec.get("role"):
        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector="TieredECConnector", ec_connector_module_path="eccache.connector",
            ec_role=spec["role"], ec_connector_extra_config=spec["extra"],
        )
    if spec.get("manager"):
        kwargs["ec_manager_config"] = {"encoder_cache_manager_cls": spec["manager"]}
    llm = LLM(
        model=spec["model"], enforce_eager=True, max_model_len=256, max_num_seqs=4, block_size=32,
        dtype="float32", seed=0, gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20, **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = []
    for seed in spec["images"]:  # one prompt at a time: each image is its own request and lookup
        out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": _image(seed)}}], params,
                           use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    result: dict = {"tokens": tokens}
    if spec.get("manager"):
        mgr = llm.llm_engine.engine_core.engine_core.scheduler.encoder_cache_manager
        result["manager"] = type(mgr).__name__
    if spec.get("role"):
        from vllm.distributed.ec_transfer import get_ec_transfer

        from eccache.connector import process_stats

        get_ec_transfer()._store.flush(30.0)
        result["stats"] = process_stats()
    Path(spec["out"]).write_text(json.dumps(result))


def _run_engine(tmp_path: Path, name: str, **spec) -> dict:
    spec["out"] = str(tmp_path / f"{name}.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{name} engine failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(Path(spec["out"]).read_text())


def _extra(disk: Path) -> dict:
    return {"namespace": "ectest", "tiers": [{"kind": "memory", "capacity": "256MiB"},
                                             {"kind": "disk", "path": str(disk), "capacity": "1GiB"}]}


@pytest.mark.engine
def test_producer_consumer_identical_tokens(tiny_blip2: Path, tmp_path: Path) -> None:
    import vllm  # noqa: F401  (fail, not skip, without vLLM)

    disk = tmp_path / "disk"
    stored, fresh = [1, 2, 3], [4, 5]
    # The baseline also runs our LRU manager through vLLM's --ec-manager-config extension point.
    base = _run_engine(tmp_path, "baseline", model=str(tiny_blip2), images=stored + fresh,
                       manager="eccache.managers.LRUEncoderCacheManager")
    assert base["manager"] == "LRUEncoderCacheManager"
    prod = _run_engine(tmp_path, "producer", model=str(tiny_blip2), images=stored, role="ec_producer",
                       extra=_extra(disk))
    assert prod["stats"]["saves"] == len(stored)

    cons = _run_engine(tmp_path, "consumer", model=str(tiny_blip2), images=stored + fresh,
                       role="ec_consumer", extra=_extra(disk))
    assert cons["tokens"] == base["tokens"]
    assert len({tuple(t) for t in base["tokens"]}) > 1, "images must change tokens"
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
    bad = _run_engine(tmp_path, "corrupt", model=str(tiny_blip2), images=stored, role="ec_both",
                      extra=_extra(disk))
    assert bad["tokens"] == base["tokens"][: len(stored)]
    assert bad["stats"]["loads"] == 0
    assert bad["stats"]["recomputed"] + bad["stats"]["misses"] >= len(stored)


if __name__ == "__main__":
    _engine_main(json.loads(sys.argv[1]))
