"""`tiercache precompute docs|images` end to end: real jobs, then real consumer engines in fresh processes.

Per model: a baseline engine without connectors, the job (through the CLI, in its own process; documents
tagged and their corpus pinned, then one document evicted by its tag), a consumer engine that must hit
everything the job stored (the evicted document: nothing) with identical greedy tokens, and a rerun of
the job that must skip everything still stored (no engine starts then). This module is also the engine
script the tests spawn (`python tests/tools/test_precompute.py SPEC_JSON`), so every engine starts in a fresh process.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from tests.support.zygote_client import run_job

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
QUESTION = "what is in the picture?"
LLAMA_ENGINE = {"dtype": "bfloat16", "block_size": BLOCK, "max_model_len": 2048, "enforce_eager": True, "seed": 0,
                "enable_prefix_caching": False}
BLIP_ENGINE = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 256, "enforce_eager": True, "seed": 0,
               "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 64 << 20}


# ------------------------------------------------------------------------------------------ engine side
def _engine_main(spec: dict) -> None:
    """One engine: generate for text prompts (optionally with image files), write tokens and counters."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_tiercache.tools.precompute.ec import ec_transfer, load_image

    kwargs = dict(spec["engine"])
    if spec.get("kv"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv"])
    if spec.get("ec"):
        kwargs.update(ec_transfer(spec["ec"], role="ec_consumer"))
    llm = LLM(model=spec["model"], **kwargs)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens, cached = [], []
    for item in spec["prompts"]:  # one request at a time: each is its own lookup
        prompt: dict = {"prompt": item["prompt"]}
        if item.get("image"):
            prompt["multi_modal_data"] = {"image": load_image(item["image"])}
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        tokens.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
    result: dict = {"tokens": tokens, "num_cached_tokens": cached}
    if spec.get("ec"):
        from vllm_tiercache.eccache.connector import process_stats

        result["ec_stats"] = process_stats()
    Path(spec["out"]).write_text(json.dumps(result))


def _run_engine(work: Path, name: str, env_extra: dict | None = None, **spec) -> dict:
    """One engine in a fresh process, in that one process (vLLM's uniproc executor, as the precompute job
    runs its own engine: see `tests.fixtures.models.run_engine` for why)."""
    spec["out"] = str(work / f"{name}.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env_extra or {})}
    proc = run_job([sys.executable, str(Path(__file__).resolve()), json.dumps(spec)], cwd=ROOT, env=env,
                   timeout=600)
    assert proc.returncode == 0, f"{name} engine failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(Path(spec["out"]).read_text())


def _run_job(*args: str, env_extra: dict | None = None) -> tuple[int, dict, str]:
    """`tiercache precompute ...` in its own process; returns (exit code, JSON summary, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", **(env_extra or {})}
    proc = run_job([sys.executable, "-m", "vllm_tiercache.tools.cli", "precompute", *args, "--json",
                    "--no-progress"], cwd=ROOT, env=env, timeout=900)
    start = proc.stdout.find("{\n")
    assert start >= 0, f"job printed no summary (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.returncode, json.loads(proc.stdout[start:]), proc.stderr


# ------------------------------------------------------------------------------------------------ docs
def _make_docs(root: Path) -> list[Path]:
    rng = random.Random(7)
    words = "alpha beta gamma delta cache tier vector memory disk layer token prefix chunk river stone".split()
    root.mkdir()
    docs = []
    for i, n_words in enumerate((40, 95, 150, 230)):  # ~0.3k to 1.6k tokens with the byte tokenizer
        path = root / f"doc{i}.txt"
        path.write_text(" ".join(rng.choice(words) for _ in range(n_words)) + f". Document {i}.\n")
        docs.append(path)
    return docs


@pytest.mark.engine
def test_precompute_docs_then_consumer_hits_every_prefix(tiny_llama: Path, tmp_path: Path) -> None:
    import vllm  # noqa: F401  (fail, not skip, without vLLM)

    from vllm_tiercache.shared.stats_dump import read_stats
    from vllm_tiercache.tools.evict_cmd import evict
    from vllm_tiercache.tools.precompute.kv import rag_prompt
    from vllm_tiercache.tools.stats_cmd import collect

    docs = _make_docs(tmp_path / "docs")
    template_path = tmp_path / "template.txt"
    template_path.write_text("You answer from the context below.\n\nContext:\n{document}\n")
    template = template_path.read_text()
    store = {"namespace": "rag", "chunk_size": 64,
             "tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB", "pin_budget": 0.5}]}
    model = str(tiny_llama)
    prompts = [{"prompt": rag_prompt(d.read_text(), f"question {i}?", template)} for i, d in enumerate(docs)]

    expected = _expected_hits(model, LLAMA_ENGINE, store, docs, prompts, template)
    assert all(e >= 256 for e in expected[1:]) and expected[0] > 0

    base = _run_engine(tmp_path, "baseline", model=model, engine=LLAMA_ENGINE, prompts=prompts)
    assert base["num_cached_tokens"] == [0] * len(docs)

    job_args = ["docs", "--model", model, "--docs", str(tmp_path / "docs"), "--template", str(template_path),
                "--config", json.dumps(store), "--engine-args", json.dumps(LLAMA_ENGINE), "--tag", "corpus:v3",
                "--pin"]
    code, summary, err = _run_job(*job_args)
    assert code == 0, err[-4000:]
    assert (summary["total"], summary["stored"], summary["skipped"], summary["failed"]) == (4, 4, 0, [])
    assert summary["bytes_stored"] > 0 and summary["per_second"] > 0
    assert "pinned corpus:v3" in json.dumps(summary)

    # Every record carries its document's tag and the corpus's; then one document changes: evict its tag.
    (disk,) = collect(store, None, by_tag=True)["tiers"]
    per_tag = {t["tag"]: t["entries"] for t in disk["tags"]}
    assert per_tag["corpus:v3"] == disk["entries"] == sum(per_tag[f"doc:{d.stem}"] for d in docs)
    removed = evict(store, tags=["doc:doc2"])
    assert removed["records"] == per_tag["doc:doc2"] > 0
    assert [t["entries"] for t in collect(store, None, by_tag=True)["tiers"][0]["tags"]
            if t["tag"] == "corpus:v3"] == [disk["entries"] - removed["records"]]

    stats_dir = tmp_path / "consumer-stats"
    kv = {"kv_connector": "TieredKVConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": store}
    cons = _run_engine(tmp_path, "consumer", env_extra={"TIERCACHE_STATS_DIR": str(stats_dir)}, model=model,
                       engine=LLAMA_ENGINE, prompts=prompts, kv=kv)
    assert cons["tokens"] == base["tokens"]  # the changed document's request too: a miss, computed afresh
    expected[2] = 0
    assert cons["num_cached_tokens"] == expected
    (worker,) = read_stats(str(stats_dir), "kv-worker")
    assert worker["counters"]["loaded_blocks"] == sum(expected) // BLOCK
    assert worker["counters"]["load_errors"] == 0

    kept = tmp_path / "kept.txt"  # the documents still stored (a list file): a rerun over them starts no engine
    kept.write_text("".join(f"{d}\n" for i, d in enumerate(docs) if i != 2))
    code, rerun, err = _run_job(*[str(kept) if a == str(tmp_path / "docs") else a for a in job_args])
    assert code == 0, err[-4000:]
    assert (rerun["stored"], rerun["skipped"], rerun["failed"]) == (0, 3, [])
    assert "Loading safetensors" not in err, "a rerun with everything stored must not start an engine"


GEMMA_ENGINE = {"block_size": BLOCK, "max_model_len": 2048, "enforce_eager": True, "seed": 0,
                "enable_prefix_caching": False}


@pytest.mark.engine
def test_precompute_docs_for_a_sliding_window_model_names_records_by_the_engines_groups(tmp_path: Path) -> None:
    """Gemma 3 (sliding-window and global layers, vLLM's hybrid KV cache manager): the job names the
    records with the engine's KV cache groups, so it counts them stored (it reported every document
    failed when it named them offline), a rerun skips them all without an engine, and a consumer hits
    every stored prefix."""
    from vllm_tiercache.tools.precompute.kv import rag_prompt
    from vllm_tiercache.tools.tiny_models.gemma3 import make_tiny_gemma3

    model = str(make_tiny_gemma3(tmp_path / "tiny-gemma3"))
    docs = _make_docs(tmp_path / "docs")
    store = {"namespace": "rag", "chunk_size": 64,
             "tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"}]}
    env = {"TIERCACHE_CACHE_DIR": str(tmp_path / "cache")}
    job_args = ["docs", "--model", model, "--docs", str(tmp_path / "docs"), "--config", json.dumps(store),
                "--engine-args", json.dumps(GEMMA_ENGINE)]
    code, summary, err = _run_job(*job_args, env_extra=env)
    assert code == 0, err[-4000:]
    assert (summary["total"], summary["stored"], summary["skipped"], summary["failed"]) == (4, 4, 0, [])
    assert list((tmp_path / "cache" / "kv-groups").glob("*.json")), "the engine's groups are remembered"

    code, rerun, err = _run_job(*job_args, env_extra=env)
    assert code == 0, err[-4000:]
    assert (rerun["stored"], rerun["skipped"], rerun["failed"]) == (0, 4, [])
    assert "Loading safetensors" not in err, "a rerun with everything stored must not start an engine"

    prompts = [{"prompt": rag_prompt(d.read_text(), f"question {i}?")} for i, d in enumerate(docs)]
    kv = {"kv_connector": "TieredKVConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": store}
    cons = _run_engine(tmp_path, "consumer", model=model, engine=GEMMA_ENGINE, prompts=prompts, kv=kv)
    assert cons["num_cached_tokens"] == _expected_hits(model, GEMMA_ENGINE, store, docs, prompts, None)


def _expected_hits(model: str, engine: dict, store: dict, docs: list[Path], prompts: list[dict],
                   template: str | None) -> list[int]:
    """Tokens a consumer hits per prompt: every stored chunk of its document's prefix (the partial last
    one too), stopping one token short of the prompt, from vLLM's own processor and the connector's naming."""
    from vllm_tiercache.kvcache.naming import KVNaming
    from vllm_tiercache.kvcache.options import KVConnectorOptions
    from vllm_tiercache.tools.jobs import engine_config, offline_input_processor, process_offline
    from vllm_tiercache.tools.precompute.kv import rag_prompt

    cfg = engine_config(model, engine)
    processor = offline_input_processor(cfg)
    options, store_config = KVConnectorOptions.load(store)
    naming = KVNaming.from_configs(cfg, store_config, options)
    expected = []
    for doc, item in zip(docs, prompts, strict=True):
        prefix = process_offline(processor, {"prompt": rag_prompt(doc.read_text(), None, template)})
        full = process_offline(processor, item)
        assert list(full.prompt_token_ids[: len(prefix.prompt_token_ids)]) == list(prefix.prompt_token_ids)
        _, reusable = naming.prompt_keys(prefix)
        expected.append(min(reusable, (len(full.prompt_token_ids) - 1) // BLOCK * BLOCK))
    return expected


# ---------------------------------------------------------------------------------------------- images
def _make_images(root: Path) -> list[Path]:
    import numpy as np
    from PIL import Image

    root.mkdir()
    paths = []
    for seed in range(4):
        rng = np.random.RandomState(seed + 1)
        path = root / f"img{seed}.png"
        Image.fromarray((rng.rand(48, 48, 3) * 255).astype("uint8")).save(path)
        paths.append(path)
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    return paths


@pytest.mark.engine
def test_precompute_images_then_consumer_hits_every_image(tiny_blip2: Path, tmp_path: Path) -> None:
    import vllm  # noqa: F401  (fail, not skip, without vLLM)

    from vllm_tiercache.tools.precompute.kv import rag_prompt
    from vllm_tiercache.tools.stats_cmd import collect

    images = _make_images(tmp_path / "images")
    store = {"namespace": "img", "tiers": [{"kind": "memory", "capacity": "64MiB"},
                                           {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"}]}
    model = str(tiny_blip2)
    prompts = [{"prompt": rag_prompt("", QUESTION).lstrip(), "image": str(p)} for p in images]

    base = _run_engine(tmp_path, "baseline", model=model, engine=BLIP_ENGINE, prompts=prompts)
    assert len({tuple(t) for t in base["tokens"]}) > 1, "images must change tokens"

    job_args = ["images", "--model", model, "--images", str(tmp_path / "images"), "--config", json.dumps(store),
                "--engine-args", json.dumps(BLIP_ENGINE), "--tag", "corpus:img"]
    code, summary, err = _run_job(*job_args)
    assert code == 1, "a failed (corrupt) image must make the exit status non-zero"
    assert (summary["total"], summary["stored"], summary["skipped"]) == (5, 4, 0)
    assert [f["name"] for f in summary["failed"]] == ["corrupt.png"]
    assert "not a readable image" in summary["failed"][0]["reason"]
    assert summary["bytes_stored"] > 0
    # each encoder record carries its image's tag and the job's
    disk = collect(store, None, by_tag=True)["tiers"][1]
    assert {t["tag"]: t["entries"] for t in disk["tags"]} == {
        "corpus:img": 4, **{f"image:{p.stem}": 1 for p in images if p.name != "corrupt.png"}}

    cons = _run_engine(tmp_path, "consumer", model=model, engine=BLIP_ENGINE, prompts=prompts, ec=store)
    assert cons["tokens"] == base["tokens"]
    st = cons["ec_stats"]
    assert st["hits"] == len(images) and st["loads"] == len(images)
    assert st["misses"] == 0 and st["load_failures"] == 0 and st["saves"] == 0

    code, rerun, err = _run_job(*job_args)
    assert (rerun["stored"], rerun["skipped"], [f["name"] for f in rerun["failed"]]) == (0, 4, ["corrupt.png"])
    assert "Loading safetensors" not in err, "a rerun with everything stored must not start an engine"


if __name__ == "__main__":
    _engine_main(json.loads(sys.argv[1]))
