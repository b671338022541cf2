"""The client side of `tiercache bench serve`: N concurrent users replaying a `Workload` through the OpenAI API.

Why async with one worker per user: a user waits for each answer before sending the next turn (its
history includes that answer), so concurrency is the number of sessions in flight, not a request rate.
N workers take sessions from one queue in trace order, so every case sees the same arrivals.

Timing comes from the stream: TTFT is the arrival of the first chunk that carries text, inter-token
latency the gaps between the chunks that follow (vLLM sends one token per chunk here). A failed request
is a result with its error, never an exception out of the run; the session's later turns are then not
sent (their history would be missing an answer) and count as failed too.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_tiercache.tools.bench.serve.trace import Workload, messages_for


@dataclass
class RequestResult:
    """One request: where it sits in the trace, its timings, usage and answer text (or its error)."""

    level: int
    session: int
    turn: int
    start_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return self.level, self.session, self.turn


async def _one_request(client: Any, model: str, result: RequestResult, messages: list[dict[str, str]],
                       max_tokens: int, allowed_ids: list[int] | None, t0: float) -> None:
    extra: dict[str, Any] = {"ignore_eos": True}  # random weights: an early EOS would end the answer at once
    if allowed_ids:
        extra["allowed_token_ids"] = allowed_ids
    start = time.perf_counter()
    result.start_s = start - t0
    last: float | None = None
    parts: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            now = time.perf_counter()
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                if result.ttft_s is None:
                    result.ttft_s = now - start
                elif last is not None:
                    result.itl_s.append(now - last)
                last = now
                parts.append(text)
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.completion_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                result.cached_tokens = int(getattr(details, "cached_tokens", 0) or 0) if details else 0
        result.latency_s = time.perf_counter() - start
        result.text = "".join(parts)
        if result.ttft_s is None:
            result.error = "the stream ended without a token"
    except Exception as exc:  # one failed request is a row in the report, not a crash of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"[:300]


async def _run(base_url: str, model: str, workload: Workload, users: int, max_tokens: int,
               allowed_ids: list[int] | None, on_result: Callable[[RequestResult], None] | None
               ) -> tuple[list[RequestResult], float]:
    import httpx
    from openai import AsyncOpenAI

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=users + 4, max_keepalive_connections=users + 4),
                             timeout=httpx.Timeout(900.0))
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="tiercache-bench", max_retries=0, http_client=http)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(workload.sessions)):
        queue.put_nowait(i)
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def user() -> None:
        while True:
            try:
                index = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            session = workload.sessions[index]
            answers: list[str] = []
            failed = False
            for turn in range(len(session.questions)):
                result = RequestResult(workload.level, session.index, turn)
                if failed:
                    result.error = "not sent: an earlier turn of this session failed"
                else:
                    await _one_request(client, model, result, messages_for(workload, session, turn, answers),
                                       max_tokens, allowed_ids, t0)
                    failed = result.error is not None
                    answers.append(result.text)
                results.append(result)
                if on_result is not None:
                    on_result(result)

    try:
        await asyncio.gather(*(user() for _ in range(users)))
    finally:
        await client.close()
        await http.aclose()
    return results, time.perf_counter() - t0


def run_level(base_url: str, model: str, workload: Workload, users: int, *, max_tokens: int,
              allowed_ids: list[int] | None = None, on_result: Callable[[RequestResult], None] | None = None
              ) -> tuple[list[RequestResult], float]:
    """Replay `workload` with `users` concurrent sessions; (results in completion order, wall seconds)."""
    return asyncio.run(_run(base_url, model, workload, users, max_tokens, allowed_ids, on_result))


class GroupRSS:
    """Peak resident memory of a process group (the server, its engine core and workers), sampled.

    Why the sum over the group: the KV cache and the connector's memory tier live in the worker process,
    the API server is another; what an operator sizes a host for is all of them. `peak()` returns the peak
    since the last `reset()`; sampling runs on a daemon thread every `interval_s`.
    """

    def __init__(self, pgid: int, interval_s: float = 0.5) -> None:
        self.pgid = pgid
        self.interval_s = interval_s
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-serve-rss", daemon=True)

    def sample(self) -> int:
        import psutil

        total = 0
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == self.pgid:
                    total += proc.memory_info().rss
            except (ProcessLookupError, psutil.Error, OSError):
                continue
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, self.sample())

    def start(self) -> GroupRSS:
        self._peak = self.sample()
        self._thread.start()
        return self

    def reset(self) -> None:
        self._peak = self.sample()

    def peak(self) -> int:
        return max(self._peak, self.sample())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
