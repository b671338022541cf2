"""A real router's view of serving instances, for the benchmarks: NVIDIA Dynamo's standalone KV indexer.

Why Dynamo's own indexer and not our decoder of the events: what a benchmark about routing must show is
what a router concludes from the events the connector publishes (its block keys, its tiers, its parent
links), so the answer comes from the router's code. `python -m dynamo.indexer` (the `ai-dynamo-runtime`
wheel, a dev dependency) subscribes to each instance's vLLM KV event publisher (zmq) and answers
``POST /query`` with the longest matched prefix per instance and per tier, in tokens. Its tiers are
cumulative: a GPU block counts for ``cpu`` and ``disk`` too.

Also here: the two plain HTTP calls the audits need, a chat prompt's token ids (``/tokenize``, the same
template and tokenizer as a chat request) and a completion of given token ids that reports how many prompt
tokens vLLM did not compute (``cached_tokens``) and its time to first token.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.demo.server import free_port

TIERS = ("gpu", "cpu", "disk")
INSTALL_HINT = ("NVIDIA Dynamo's indexer is not installed: `pip install ai-dynamo-runtime==1.6.1` (a 75 MB wheel; "
                "`make setup` installs it with the dev dependencies)")


class RouterIndexError(RuntimeError):
    """Dynamo's indexer is missing or does not answer; the message says why and how to fix it."""


def events_config(zmq_port: int, replay_port: int | None = None) -> dict[str, Any]:
    """vLLM's ``--kv-events-config`` for a zmq publisher on ``zmq_port`` (every topic); with ``replay_port``,
    its replay endpoint too (vLLM keeps its last batches there for a subscriber that missed some)."""
    config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{zmq_port}",
                              "topic": ""}
    if replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{replay_port}"
    return config


class DynamoIndexer:
    """``python -m dynamo.indexer`` subscribed to instances ``{worker id: zmq port}``; a context manager.

    ``replay`` (``{worker id: replay port}``, vLLM's ``replay_endpoint``): those workers are registered with
    their replay endpoint (``POST /register``; the command line has no place for it). A zmq subscriber
    misses what was published before its subscription reached the publisher; with a replay endpoint the
    indexer sees the gap in the batches' sequence numbers at the next batch it gets (a first batch numbered
    above 0 included) and asks the engine for the batches it missed."""

    def __init__(self, workers: dict[int, int], *, block_size: int, model_name: str, log_path: Path,
                 start_timeout_s: float = 300.0, replay: dict[int, int] | None = None) -> None:
        if importlib.util.find_spec("dynamo") is None:
            raise RouterIndexError(INSTALL_HINT)
        self.model_name = model_name
        self.port = free_port()
        self.log_path = log_path
        replay = replay or {}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        spec = ",".join(f"{worker}=tcp://127.0.0.1:{port}" for worker, port in workers.items() if worker not in replay)
        self._log = open(log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--block-size", str(block_size), "--threads", "1",
             "--port", str(self.port), "--model-name", model_name, *(["--workers", spec] if spec else [])],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        try:
            for worker, replay_port in replay.items():
                self._until_answered(deadline, lambda w=worker, r=replay_port: _post(
                    f"http://127.0.0.1:{self.port}/register",
                    {"instance_id": w, "endpoint": f"tcp://127.0.0.1:{workers[w]}", "model_name": model_name,
                     "block_size": block_size, "replay_endpoint": f"tcp://127.0.0.1:{r}"}, timeout_s=10))
            self._until_answered(deadline, lambda: self.query([1, 2, 3]))
        except BaseException:
            self.stop()
            raise

    def _until_answered(self, deadline: float, call: Any) -> None:
        """Call ``call`` until the indexer's HTTP server answers it (it starts listening a moment after)."""
        while True:
            try:
                call()
                return
            except (OSError, RouterIndexError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RouterIndexError(f"dynamo.indexer did not answer on port {self.port}; see "
                                           f"{self.log_path}") from None
                time.sleep(0.3)

    def query(self, tokens: list[int], lora_name: str | None = None) -> dict[int, dict[str, int]]:
        """Matched tokens per worker id and tier (``gpu``, ``cpu``, ``disk``); a worker with no match is absent."""
        body: dict[str, Any] = {"token_ids": tokens, "model_name": self.model_name}
        if lora_name is not None:
            body["lora_name"] = lora_name
        answer = _post(f"http://127.0.0.1:{self.port}/query", body, timeout_s=10)
        return {int(worker): {tier: int(tiers.get(tier, 0)) for tier in TIERS}
                for worker, tiers in (answer.get("instances") or {}).items()}

    def wait_matched(self, tokens: list[int], worker: int, at_least: int, timeout_s: float) -> bool:
        """Ask until ``worker`` matches at least ``at_least`` tokens of ``tokens`` on some tier (events reach
        the index a moment after vLLM publishes them); False when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while max(self.query(tokens).get(worker, {}).values(), default=0) < at_least:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> DynamoIndexer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_until_indexed(indexer: DynamoIndexer, base_url: str, model: str, worker: int, *, block_size: int,
                       timeout_s: float = 60.0) -> None:
    """Send a short probe prompt to the instance until the indexer shows its first block for ``worker``: a zmq
    subscriber misses what was published before its subscription reached the publisher, so a benchmark
    must not count on the index before this. Raises `RouterIndexError` when the index never shows it."""
    import random

    from vllm_tiercache.tools.bench.pd.client import TOKEN_RANGE

    deadline = time.monotonic() + timeout_s
    rng = random.Random()
    while time.monotonic() < deadline:
        probe = [rng.randrange(*TOKEN_RANGE) for _ in range(2 * block_size)]  # the tiny models' plain byte ids
        complete(base_url, model, probe)
        if indexer.wait_matched(probe, worker, block_size, timeout_s=2.0):
            return
    raise RouterIndexError(f"the indexer never showed worker {worker}'s blocks within {timeout_s:.0f}s: is the "
                           f"server publishing KV events (--kv-events-config)? see {indexer.log_path}")


@dataclass(frozen=True)
class Completion:
    """One completion of given prompt token ids: vLLM's reused prompt tokens and the time to its first token."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def chat_token_ids(base_url: str, model: str, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt token ids vLLM builds for a chat request of ``messages`` (template and generation prompt)."""
    answer = _post(base_url + "/tokenize", {"model": model, "messages": messages, "add_generation_prompt": True},
                   timeout_s=60)
    return [int(t) for t in answer["tokens"]]


def complete(base_url: str, model: str, tokens: list[int], *, max_tokens: int = 1,
             allowed_ids: list[int] | None = None) -> Completion:
    """Send ``tokens`` as a streamed completion; TTFT is the first streamed chunk with text or a token."""
    body: dict[str, Any] = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if allowed_ids:
        body["allowed_token_ids"] = allowed_ids
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return Completion(prompt_tokens=int(usage.get("prompt_tokens", len(tokens))),
                      cached_tokens=int(details.get("cached_tokens") or 0),
                      ttft_s=ttft if ttft is not None else time.perf_counter() - start)


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise RouterIndexError(f"POST {url}: HTTP {exc.code}: {detail}") from None
