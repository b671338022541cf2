"""`tiercache pd-proxy`: the prefill/decode proxy of vLLM's disaggregated-serving examples, in the wheel.

vLLM's own proxy lives in its source tree's examples and tests (``toy_proxy_server.py``), not in the
installed wheel, so this is the same flow as a small command (docs/serving.md has the recipe):

1. the client's request goes to a prefill instance (``kv_role`` ``kv_producer``) with ``max_tokens=1``
   (and ``max_completion_tokens=1``), no streaming, and
   ``"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}``;
2. as soon as it answers, the same request goes to a decode instance (``kv_consumer``) with the
   ``kv_transfer_params`` the prefill instance returned (TieredKVConnector's promise of the records it
   stored: `vllm_tiercache.kvcache.handoff.promise`); the decode instance's answer, streamed or not, is the
   client's.

A prefill that fails or returns no params is not fatal: the decode instance then computes the prompt
itself (a plain lookup), as it would without the proxy. Instances are taken round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

#: The request paths the proxy splits into prefill and decode; any other path is refused.
PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, not streamed, asked to hand its KV over."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The request as the decode instance gets it: the client's, with the prefill instance's params."""
    out = copy.deepcopy(body)
    if params:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return out


def build_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600.0) -> Any:
    """The proxy's aiohttp application (imported here: aiohttp comes with vLLM, the CLI must start without it)."""
    from aiohttp import ClientSession, ClientTimeout, web

    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    sessions: dict[str, ClientSession] = {}

    async def on_startup(app: web.Application) -> None:
        sessions["http"] = ClientSession(timeout=ClientTimeout(total=timeout_s))

    async def on_cleanup(app: web.Application) -> None:
        await sessions["http"].close()

    async def split(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        http = sessions["http"]
        params = None
        try:
            async with http.post(next(prefills) + request.path, json=prefill_body(body)) as resp:
                answer = await resp.json()
                if resp.status == 200:
                    params = answer.get("kv_transfer_params")
                else:
                    log.warning("pd-proxy: prefill answered %d: %s; the decode instance computes the prompt",
                                resp.status, str(answer)[:200])
        except Exception as exc:  # the decode instance can still serve the request alone
            log.warning("pd-proxy: prefill failed (%s); the decode instance computes the prompt", exc)
        async with http.post(next(decodes) + request.path, json=decode_body(body, params)) as resp:
            if not body.get("stream"):
                return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def forward_get(request: web.Request) -> web.Response:
        async with sessions["http"].get(next(decodes) + request.path) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)

    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    for path in PATHS:
        app.router.add_post(path, split)
    for path in ("/health", "/v1/models"):
        app.router.add_get(path, forward_get)
    return app


@contextmanager
def running_proxy(prefill_urls: list[str], decode_urls: list[str], host: str = "127.0.0.1",
                  port: int = 0) -> Iterator[str]:
    """The proxy on a thread of this process (tests, `tiercache bench pd`); yields its base URL."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict[str, Any] = {}

    async def start() -> None:
        runner = web.AppRunner(build_app(prefill_urls, decode_urls))
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        state["runner"] = runner
        state["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as exc:
            state["error"] = exc
        started.set()
        if "error" not in state:
            loop.run_forever()

    thread = threading.Thread(target=serve, name="tiercache-pd-proxy", daemon=True)
    thread.start()
    started.wait(30)
    if "error" in state:
        raise state["error"]
    try:
        yield f"http://{host}:{state['port']}"
    finally:
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="base URL of a prefill instance (kv_producer); repeat for several")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="base URL of a decode instance (kv_consumer); repeat for several")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    logging.basicConfig(level=logging.INFO)
    strip = [url.rstrip("/") for url in args.prefill], [url.rstrip("/") for url in args.decode]
    web.run_app(build_app(*strip), host=args.host, port=args.port)
    return 0
