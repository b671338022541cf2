"""The multimodal side of `tiercache bench serve`: a BLIP-2 model, page images, and the KV + encoder cache case.

Why its own model and trace: the encoder cache pays where images repeat and the vision encoder is the
expensive part. The model is the demo's (a ViT-B/16-sized vision tower at 224 px in front of a small
OPT language model, random weights, generated here); its language model has 1024 positions, so the
documents are shorter than the text cases'. Each document has a page image (`demo.corpus.page_image`),
sent as a data: URL as an OpenAI client sends an upload.

Its cases compare with their own baseline, vLLM alone on the same model and trace (``mm-vllm``), never
with the text cases.

vLLM's own encoder cache is sized to a few images, as on the models people serve. vLLM sizes it by
`--max-num-batched-tokens`: 2048-8192 tokens in common deployments, where an image is 576 (LLaVA-1.5)
to a few thousand tokens (Qwen2-VL at high resolution), so it holds a handful of images. Our BLIP-2's
image is 32 tokens, so vLLM's default would hold every image of the trace and no encoder cache could
matter. Every mm- case (vLLM alone too) runs with `--max-num-batched-tokens` set so that vLLM's encoder
cache holds a quarter of a level's distinct images (`encoder_cache_images`): the images' working set is
4x vLLM's encoder cache, as the prefixes' is 4x its KV cache. That also makes prefill chunks that small,
for both cases alike.
"""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path
from typing import Any

#: Cases on the multimodal model, and which of them is the reference of their ratios and answers.
MM_BASELINE = "mm-vllm"
MM_CASES = (MM_BASELINE, "mm-kv-ec")
#: Every n-th session asks about the page image alone (the image behind other text than its document's).
PAGE_ONLY_EVERY = 2


def encoder_cache_images(distinct_images: int, ratio: float) -> int:
    """Images vLLM's own encoder cache holds in the mm- cases: the level's distinct images / `ratio` (the
    working-set ratio of the KV budget), at least one."""
    return max(1, int(distinct_images / ratio))


def engine_args(image_tokens: int, encoder_images: int) -> list[str]:
    """vLLM flags of every mm- case: an encoder cache of `encoder_images` images (vLLM sizes it by the step's
    token budget)."""
    return ["--max-num-batched-tokens", str(encoder_images * image_tokens)]


def make_model(quick: bool, work: Path) -> Path:
    """BLIP-2 with random weights: the demo's large vision tower, or the tests' tiny one for --quick."""
    from vllm_tiercache.tools.tiny_models.blip2 import LARGE_VISION_SPEC, TinyBlip2Spec, make_tiny_blip2

    if quick:
        return make_tiny_blip2(work / "models" / "mm-tiny", spec=TinyBlip2Spec())
    return make_tiny_blip2(work / "models" / "mm-large", spec=LARGE_VISION_SPEC)


def image_geometry(model_dir: Path) -> tuple[int, int]:
    """(image side in pixels, prompt tokens per image) from the model's config."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg["vision_config"]["image_size"]), int(cfg["num_query_tokens"])


def page_images(level: int, n_docs: int, size: int, seed: int) -> tuple[str, ...]:
    """One PNG data: URL per document of a level: distinct per level and document, the same in every case."""
    from vllm_tiercache.tools.demo.corpus import page_image

    urls = []
    for i in range(n_docs):
        buf = io.BytesIO()
        page_image(random.Random(f"{seed}:{level}:image:{i}"), i, size).save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return tuple(urls)


def transfer_configs(case: str, namespace: str, chunk_size: int, memory_bytes: int
                     ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(--kv-transfer-config, --ec-transfer-config) of a multimodal case; (None, None) for vLLM alone.

    Both connectors get the same store (one memory tier holding the working set) and namespace: in the
    worker they share one store, as an operator would run them.
    """
    if case == MM_BASELINE:
        return None, None
    store = {"namespace": f"{namespace}-{case}", "chunk_size": chunk_size,
             "tiers": [{"kind": "memory", "capacity": memory_bytes}]}
    return ({"kv_connector": "TieredKVConnector", "kv_role": "kv_both", "kv_connector_extra_config": store},
            {"ec_connector": "TieredECConnector", "ec_role": "ec_both", "ec_connector_extra_config": store})
