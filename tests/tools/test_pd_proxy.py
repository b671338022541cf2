"""`tiercache pd-proxy` against two stand-in instances (plain HTTP servers that record what they get).

The flow against real vLLM servers and the connector is tests/engine/test_pd_handoff_engine.py; here:
the prefill instance gets one token, no streaming and ``do_remote_decode``; the decode instance gets the
client's request with exactly the params the prefill returned (none when the prefill failed), and its
answer, streamed or not, is the client's.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from vllm_tiercache.tools.pd_proxy import running_proxy

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "tiercache": {"v": 1, "chunks": 3}}


class Instance:
    """A stand-in for one vLLM instance: records each request body, answers ``answer(body)``."""

    def __init__(self, answer: Any, status: int = 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        instance = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                instance.bodies.append(body)
                payload = answer(body)
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if body.get("stream") else "application/json")
                self.end_headers()
                self.wfile.write(payload if isinstance(payload, bytes) else json.dumps(payload).encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def instances() -> Iterator[tuple[Instance, Instance]]:
    prefill = Instance(lambda body: {"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
    decode = Instance(lambda body: b"data: one\n\ndata: [DONE]\n\n" if body.get("stream")
                      else {"choices": [{"text": "decoded"}]})
    yield prefill, decode
    prefill.close()
    decode.close()


def _post(url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


def test_the_prefill_gets_one_token_and_the_decode_its_params(instances: tuple[Instance, Instance]) -> None:
    prefill, decode = instances
    body = {"model": "m", "prompt": "hello", "max_tokens": 16, "stream": False, "temperature": 0}
    with running_proxy([prefill.url], [decode.url]) as proxy:
        answer = json.loads(_post(proxy + "/v1/completions", body))
        streamed = _post(proxy + "/v1/completions", {**body, "stream": True, "stream_options": {"x": 1}})
    assert answer == {"choices": [{"text": "decoded"}]}
    assert streamed == b"data: one\n\ndata: [DONE]\n\n"
    first = prefill.bodies[0]
    assert first["max_tokens"] == 1 and first["stream"] is False and first["prompt"] == "hello"
    assert first["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "stream_options" not in prefill.bodies[1]
    assert decode.bodies[0] == {**body, "kv_transfer_params": PARAMS}
    assert decode.bodies[1]["stream"] is True and decode.bodies[1]["kv_transfer_params"] == PARAMS


def test_a_failed_prefill_leaves_the_decode_to_compute(instances: tuple[Instance, Instance]) -> None:
    _, decode = instances
    broken = Instance(lambda body: {"error": "boom"}, status=500)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8,
            "kv_transfer_params": {"stale": True}}
    with running_proxy([broken.url], [decode.url]) as proxy:
        json.loads(_post(proxy + "/v1/chat/completions", body))
    broken.close()
    assert broken.bodies[0]["max_completion_tokens"] == 1
    assert "kv_transfer_params" not in decode.bodies[0]  # no params: the decode instance looks the prompt up
