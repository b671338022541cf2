"""Mooncake-format KV traces (FAST'25): one JSON object per line, one id per 512-token block of a prompt.

A line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}``.
An id names its block together with every block before it, so two prompts share a leading run of ids
exactly where they share a prefix: the shape of vLLM's chained block hashes, without the tokens.

Why a reader of its own (not `json.load` in the command): a bad line must be one clear line naming the
file, the line and what is wrong (`UsageError`, exit status 2), never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vllm_tiercache.tools.cli import UsageError

#: tokens per block in Mooncake's traces (their ids are per 512-token block)
BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it came, its lengths, and its blocks' ids in prompt order."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"timestamp": self.timestamp_ms, "input_length": self.input_length,
                           "output_length": self.output_length, "hash_ids": list(self.hash_ids)})


def _request(obj: object) -> TraceRequest:
    """The request a parsed line holds; ValueError saying what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("hash_ids is not a list of integers")
    numbers = [obj[k] for k in ("timestamp", "input_length", "output_length")]
    if not all(isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0 for n in numbers):
        raise ValueError("timestamp, input_length and output_length must be numbers >= 0")
    return TraceRequest(float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]), tuple(ids))


def format_tokens(tokens: int) -> str:
    """A token count as the trace's capacities are written (``1M``, ``300k``)."""
    for suffix, scale in (("G", 1_000_000_000), ("M", 1_000_000), ("k", 1_000)):
        if tokens >= scale:
            return f"{tokens / scale:g}{suffix}"
    return str(tokens)


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all when None) of the trace at ``path``; blank lines are skipped.

    A missing or unreadable file, a line that is not JSON or not a request, or a trace without requests
    is a `UsageError` naming the file (and the line).
    """
    path = Path(path)
    requests: list[TraceRequest] = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    requests.append(_request(json.loads(line)))
                except ValueError as exc:  # json.JSONDecodeError is a ValueError
                    raise UsageError(f"{path}:{number}: not a Mooncake trace line ({exc})") from None
    except OSError as exc:
        raise UsageError(f"cannot read the trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text file (a Mooncake trace is JSON lines)") from None
    if not requests:
        raise UsageError(f"{path}: no requests in the trace")
    return requests


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Write ``requests`` to ``path``, one JSON line each (what `read_trace` reads back)."""
    with Path(path).open("w", encoding="utf-8") as out:
        for request in requests:
            out.write(request.to_json() + "\n")
