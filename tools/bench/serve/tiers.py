"""The tiers of `tiercache bench serve`'s text cases, and the private stores the bench starts for them.

Why a module of its own: `command` runs servers and levels; which tiers a case has, and which throwaway
store (a redis-server, a SeaweedFS with one bucket) it needs, is read and tested here without a server.

The tiered cases put a memory tier only as large as vLLM's KV cache in front, so the lower tiers serve most
of what vLLM evicted: ``memory-disk``, ``memory-redis``, ``memory-disk-redis``, and ``memory-object`` /
``memory-disk-object`` with an object (S3) tier on a private SeaweedFS (issue 49). The object tier takes
its credentials from the AWS chain: `s3_target` puts the SeaweedFS's in this process's environment while
the bench runs, and each server inherits them (no config or log holds them). Each case has its own key
prefix in the one bucket, so no case reads another's records and each one's capacity is its own.
With ``--store-rtt-ms`` both stores are reached through a delaying proxy (`rtt_proxy`) the bench process holds
while the servers run: the stores of a deployment are a network away, these are on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

REDIS_CASES = ("memory-redis", "memory-disk-redis")
OBJECT_CASES = ("memory-object", "memory-disk-object")
#: the text family's cases with a connector, after ``vllm`` (vLLM alone)
TIERED_CASES = ("memory", "memory-disk", *REDIS_CASES, *OBJECT_CASES)


def weed_missing(cases: Sequence[str]) -> str | None:
    """Why the object cases among ``cases`` cannot run (no ``weed`` binary), or None: said before any server
    starts, not after the other cases ran."""
    if not any(c in OBJECT_CASES for c in cases):
        return None
    from vllm_tiercache.tools.s3_server import SeaweedFSError, find_weed

    try:
        find_weed()
    except SeaweedFSError as exc:
        return f"--cases {','.join(c for c in cases if c in OBJECT_CASES)} need SeaweedFS: {exc}"
    return None


@contextmanager
def private_stores(cases: Sequence[str], store_rtt_ms: float = 0.0) -> Iterator[dict[str, Any]]:
    """``{"redis_url": ..., "object": ...}``: a private redis-server's URL when a Redis case runs, and the
    object tier item of a private SeaweedFS's bucket when an object case runs (None otherwise); both stop
    when the bench ends. ``store_rtt_ms``: both are given behind an `RttProxy` adding that round trip."""
    from vllm_tiercache.tools.bench.rtt_proxy import delayed_item, delayed_url
    from vllm_tiercache.tools.redis_server import optional_redis_url

    with ExitStack() as stack:
        redis_url = stack.enter_context(optional_redis_url(any(c in REDIS_CASES for c in cases)))
        stores: dict[str, Any] = {"redis_url": stack.enter_context(delayed_url(redis_url, store_rtt_ms)),
                                  "object": None}
        if any(c in OBJECT_CASES for c in cases):
            from vllm_tiercache.tools.bench.object_row import s3_target

            stores["object"] = stack.enter_context(delayed_item(stack.enter_context(s3_target(None, None)),
                                                                store_rtt_ms))
        yield stores


def tiers_of(case: str, *, memory_full: int, memory_small: int, disk_path: Path, redis_url: str | None,
             object_item: dict[str, Any] | None, prefix: str) -> list[dict[str, Any]]:
    """The ``tiers`` list of a text case; ``prefix``: the object tier's key prefix for this case."""
    memory = {"kind": "memory", "capacity": memory_small}
    disk = {"kind": "disk", "path": str(disk_path), "capacity": "16GiB"}
    redis = {"kind": "redis", "url": redis_url}
    s3 = {**(object_item or {}), "prefix": prefix}
    return {
        "memory": [{"kind": "memory", "capacity": memory_full}],
        "memory-disk": [memory, disk],
        "memory-redis": [memory, redis],
        "memory-disk-redis": [memory, disk, redis],
        "memory-object": [memory, s3],
        "memory-disk-object": [memory, disk, s3],
    }[case]


def kv_transfer(case: str, namespace: str, chunk_size: int, memory_full: int, memory_small: int, work: Path,
                stores: dict[str, Any], *, lookup_budget_ms: float | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a text case with a connector (`TIERED_CASES`); ``lookup_budget_ms``:
    the store's, where the bench was given one (``--lookup-budget-ms``)."""
    tiers = tiers_of(case, memory_full=memory_full, memory_small=memory_small, disk_path=work / "tiers" / case,
                     redis_url=stores.get("redis_url"), object_item=stores.get("object"),
                     prefix=f"{namespace}/{case}/")
    extra: dict[str, Any] = {"namespace": f"{namespace}-{case}", "chunk_size": chunk_size, "tiers": tiers}
    if lookup_budget_ms is not None:
        extra["lookup_budget_ms"] = lookup_budget_ms
    return {"kv_connector": "TieredKVConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
