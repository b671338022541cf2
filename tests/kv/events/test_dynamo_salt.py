"""What NVIDIA Dynamo's standalone indexer does with a salted block (docs/operations.md, "Salted blocks, and
the router's limit"): the real indexer fed vLLM's own `BlockStored` events by vLLM's own zmq publisher.

Why a test of another project's behaviour: the operations guide tells operators that the router drops the
event's salt (a request without the salt matches a salted prefix; one with the salt matches nothing). When a
Dynamo release changes that, this fails and the guide must change with it.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from vllm_tiercache.tools.bench.router_index import DynamoIndexer
from vllm_tiercache.tools.demo.server import free_port

BLOCK = 16
TOKENS = list(range(100, 100 + 4 * BLOCK))


def _query(port: int, **extra: Any) -> int:
    body = {"token_ids": TOKENS, "model_name": "m", **extra}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/query", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        answer = json.loads(reply.read())
    return max((int(w.get("longest_matched", 0)) for w in (answer.get("instances") or {}).values()), default=0)


def test_dynamos_indexer_matches_a_salted_prefix_without_the_salt_and_not_with_it(tmp_path: Path) -> None:
    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    try:
        with DynamoIndexer({1: port}, block_size=BLOCK, model_name="m", log_path=tmp_path / "indexer.log") as index:
            event = BlockStored(block_hashes=[11, 12, 13, 14], parent_block_hash=None, token_ids=TOKENS,
                                block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
                                extra_keys=[("tenant-a",), None, None, None])
            deadline = time.monotonic() + 30
            while _query(index.port) == 0 and time.monotonic() < deadline:  # zmq subscribers join late: resend
                publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
                time.sleep(0.2)
            assert _query(index.port) == len(TOKENS)  # no salt: the salted prefix matches
            assert _query(index.port, cache_salt="tenant-a") == 0  # its own salt: nothing
    finally:
        publisher.shutdown()
