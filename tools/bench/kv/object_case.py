"""`tiercache bench kv`'s object-tier case, ``tiered-object``: a hit that a fresh process reads from an S3
bucket, against vLLM's resident hit, the cold prefill and boto3's raw GETs of the same objects.

How: the bench starts its own SeaweedFS (`vllm_tiercache.tools.bench.object_row.s3_target`, as the
Redis case starts its own redis-server) and one bucket; while it runs, its credentials are in this process's
environment, so the engine processes, which inherit it, find them through the standard AWS chain as a
deployment would (no secret is written to a job spec, a log or the table). A producer process with the
object tier alone stores the prompts and exits (its shutdown drains the tier's write-behind queue); a
fresh ``kv_consumer`` process with the object tier alone measures the hits, each paired with vLLM's
resident hit of the same prompt in the same engine (`Bench._produce_then_consume`). With ``--store-rtt-ms``
the engines and the raw GETs reach the SeaweedFS through a delaying proxy (`rtt_proxy`) this process holds.

Why the object tier alone in the consumer, and not memory + object: a memory tier in front would take the
records of the first hit (promotion), and every repeat (``--hit-repeats``) would then be a memory hit, so
the row would mostly measure memory. With the object tier alone, every measured hit GETs all its records
from the bucket: the row is what the object tier costs, which is what its targets are about.

The raw reference (`medium.object_get_s`): boto3 GETs of objects of the sizes the tier stores for one hit
(one pack per chunk, `object_sizes`), with the tier's ``concurrency`` in flight on a client
tuned as the tier's, from the same SeaweedFS right after the consumer exited. Targets (issue 49): TTFT <=
resident hit + `RAW_GET_TARGET` x that raw GET time, and TTFT <= `COLD_TARGET` x the cold prefill.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Protocol

from vllm_tiercache.tools.cli import UsageError

CASE = "tiered-object"
LABEL = "5b Tiered hit, object tier (fresh process)"
#: Requests in flight, the tier's and the raw reference's (the tier's default, `bench tiers`' too).
CONCURRENCY = 16
#: (hit - resident) / raw GET of the same objects, at most (issue 49).
RAW_GET_TARGET = 1.5
#: hit / cold prefill, at most (issue 49).
COLD_TARGET = 0.2


class _Bench(Protocol):
    """What the case uses of `vllm_tiercache.tools.bench.kv.command.Bench` (which imports this module)."""

    args: argparse.Namespace
    namespace: str
    model: str
    prompt_len: int
    min_hit_tokens: int
    object_get: tuple[float | None, int | None, int | None]
    store_rtt_ms: float

    def progress(self, message: str) -> None: ...

    def tiered(self, role: str, tiers: list[dict[str, Any]]) -> dict[str, Any]: ...

    def _produce_then_consume(self, name: str, producer: dict[str, Any], consumer: dict[str, Any]) -> None: ...


def require_weed(cases: str) -> None:
    """A `UsageError` before any engine starts when ``tiered-object`` is asked for and no ``weed`` binary is
    found (instead of a NOT MEASURED row after minutes of other cases)."""
    if CASE not in {c.strip() for c in cases.split(",")}:
        return
    from vllm_tiercache.tools.s3_server import SeaweedFSError, find_weed

    try:
        find_weed()
    except SeaweedFSError as exc:
        raise UsageError(f"--cases {CASE} needs SeaweedFS: {exc}") from None


def tier_item(target: dict[str, Any], namespace: str) -> dict[str, Any]:
    """The object tier item of the case: the bench's bucket, a prefix of this run, the tier's concurrency."""
    return {**target, "prefix": f"{namespace}/", "concurrency": CONCURRENCY}


def chunk_size() -> int:
    """The connector's chunk_size in the bench's engines: its default, or $TIERCACHE_CHUNK_SIZE's override."""
    from vllm_tiercache.kvcache.options import CHUNK_SIZE_ENV, KVConnectorOptions

    env = os.environ.get(CHUNK_SIZE_ENV, "").strip()
    return int(env) if env.isdigit() else KVConnectorOptions().chunk_size


def object_sizes(layers: int, layer_token_bytes: int, prompt_len: int, hit_tokens: int, chunk: int) -> list[int]:
    """Payload bytes of the objects a hit of ``hit_tokens`` reads: one pack per chunk that holds any of them
    (the tier's default ``layout: chunk``: every layer's record of the chunk), as the producer stored it
    (whole chunks, the prompt's last one partial)."""
    chunks = -(-hit_tokens // chunk)
    return [min(chunk, prompt_len - i * chunk) * layer_token_bytes * layers for i in range(chunks)]


def run_case(bench: _Bench) -> None:
    """The producer and the consumer on a private SeaweedFS, then the raw GETs of the same objects there."""
    from vllm_tiercache.tools.bench.kv.medium import kv_bytes_per_layer_token, object_get_s
    from vllm_tiercache.tools.bench.object_row import s3_target
    from vllm_tiercache.tools.bench.rtt_proxy import delayed_item

    with s3_target(None, None) as server, delayed_item(server, bench.store_rtt_ms) as target:
        assert target is not None
        item = tier_item(target, bench.namespace)
        bench.progress(f"    SeaweedFS serving S3 at {item['endpoint']}, bucket {item['bucket']}/{item['prefix']}")
        tiers = [item]
        bench._produce_then_consume(CASE, bench.tiered("kv_both", tiers), bench.tiered("kv_consumer", tiers))
        geometry = kv_bytes_per_layer_token(bench.model, bench.args.dtype)
        if geometry is None:
            return
        sizes = object_sizes(*geometry, bench.prompt_len, bench.min_hit_tokens, chunk_size())
        bench.progress(f"    raw S3 GETs: {len(sizes)} objects, {sum(sizes) / 2**20:.1f} MiB, {CONCURRENCY} in flight")
        bench.object_get = (object_get_s(sizes, item, CONCURRENCY), len(sizes), sum(sizes))


def raw_get_target(rows: dict[str, dict[str, Any]], resident: float | None) -> dict[str, Any] | None:
    """The target row (hit - resident) / raw GET <= `RAW_GET_TARGET`: the resident hit of the case's own
    engine where measured (paired), else the baseline's. None when the case was not asked for."""
    row = rows.get(CASE)
    if row is None:
        return None
    own, raw = row["ttft_median_s"] if row["status"] == "ok" else None, row.get("raw_medium_s")
    base = row.get("own_resident_s") or resident
    ratio = max(0.0, own - base) / raw if own is not None and base and raw else None
    return {"case": CASE, "reference": "raw S3 GET", "target": RAW_GET_TARGET,
            "formula": f"({CASE} - resident{' (same engine)' if row.get('own_resident_s') else ''}) / raw S3 GET",
            "ratio": round(ratio, 3) if ratio is not None else None,
            "ok": ratio is not None and ratio <= RAW_GET_TARGET}
