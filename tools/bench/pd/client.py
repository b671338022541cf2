"""What `tiercache bench pd` asks of its OpenAI servers: a greedy completion, a `/metrics` sum, the promise's size.

Why apart from `command.py`: the many-hand-offs run (`handoffs.py`) and the other benches (bench serve's events
audit, bench route, bench kv) ask the same of their servers, and the command imports the hand-offs run.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import Any

SERVED = "bench"
#: Token ids of the byte tokenizer that are plain bytes (0-2 are <unk>, <s>, </s>).
TOKEN_RANGE = (3, 259)


def complete(url: str, tokens: list[int], params: dict[str, Any] | None = None, *, served: str = SERVED,
             max_tokens: int = 1, ignore_eos: bool = False) -> tuple[float, dict[str, Any]]:
    """A greedy completion of ``tokens``: the client's wall time and the server's answer."""
    body: dict[str, Any] = {"model": served, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        answer = json.loads(resp.read())
    return time.perf_counter() - started, answer


def promised_tokens(length: int, block_size: int) -> int:
    """What the consumer can take of a ``length``-token prompt: its full blocks, short of the last token."""
    return (length - 1) // block_size * block_size


def metric_sum(text: str, name: str) -> float:
    """The sum of the series ``name`` over all its labels in a `/metrics` text."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))
