"""A loopback TCP proxy that puts a far store's round trip in front of a near one: `RttProxy`.

Why: the benches run Redis and SeaweedFS on this machine, a fraction of a millisecond away, while a
deployment's object store answers its first byte in 10-30 ms and a Redis in another zone is a few ms off.
What the product does at that distance (a scheduler's lookup against ``lookup_budget_ms``, a hit's GETs, the
write-behind) is what ``--store-rtt-ms N`` on `bench serve`, `bench kv` and `bench lookups` measures. The
kernel here has no netem (``tc qdisc ... netem delay``), so the delay is made in user space, here.

What it does: every chunk of bytes read from one side is written to the other ``N / 2`` ms after it was
read, in either direction, so a request and its answer cost ``N`` ms more than without the proxy. Each
direction of each connection is a delay line (a queue of chunks with the time each is due), not "sleep,
then forward": a pipelined request or a stream of records keeps flowing while earlier chunks wait, so the
proxy adds latency, not a limit on throughput (up to `BUFFER_BYTES` in flight per direction, as a TCP
window would). Order is kept per connection and direction; a half-close (one side's EOF) and a reset travel
the same delay line, after the bytes sent before them. A new connection's first bytes wait one round trip
more (``handshake=True``): the SYN / SYN-ACK a client of a far store pays before it can send anything,
which the local accept of this proxy does not. TLS's own round trips are not added (the stores the benches
start speak plain TCP).

One asyncio loop on a daemon thread serves every connection (a Redis pool, the S3 client's pool of 16 or
more), so the process that starts the bench's stores can hold it while engines in other processes use it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import socket
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from vllm_tiercache.tools.cli import UsageError, float_in
from vllm_tiercache.tools.ports import free_port

#: The largest delay ``--store-rtt-ms`` takes (10 s: far beyond any store a deployment would use).
MAX_RTT_MS = 10000.0
#: Bytes read per chunk, and bytes one direction of a connection holds before it stops reading (its window).
CHUNK = 256 << 10
BUFFER_BYTES = 64 << 20
_DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "http": 80, "https": 443}


class _End:
    """A marker in a delay line: the source's EOF (``reset=False``: deliver a half-close) or its error."""

    def __init__(self, reset: bool) -> None:
        self.reset = reset


def _bind(port: int | None) -> socket.socket:
    """A listener on 127.0.0.1: ``port``, or one `free_port` gives (below the ephemeral range, where no
    client's outgoing connection can take it first; another listener still may, so a few are tried)."""
    for attempt in range(20):
        try:
            return socket.create_server(("127.0.0.1", port or free_port()), backlog=512)
        except OSError as exc:
            if port is not None or exc.errno != errno.EADDRINUSE or attempt == 19:
                raise
    raise AssertionError("unreachable")


class _Lane:
    """One direction of one connection: chunks with the loop time each is due, and the bytes they hold."""

    def __init__(self) -> None:
        self.items: deque[tuple[float, bytes | _End]] = deque()
        self.buffered = 0
        self.ready = asyncio.Event()  # something is queued
        self.room = asyncio.Event()  # below BUFFER_BYTES: the reader may read on
        self.room.set()


class RttProxy:
    """``with RttProxy(port, rtt_ms) as proxy:`` forwards ``127.0.0.1:proxy.port`` to ``target_host:port``,
    every byte ``rtt_ms / 2`` later each way (the module docstring says how). ``rtt_ms`` 0 forwards at once."""

    def __init__(self, target_port: int, rtt_ms: float, *, target_host: str = "127.0.0.1",
                 handshake: bool = True, port: int | None = None) -> None:
        if not 0.0 <= rtt_ms <= MAX_RTT_MS:
            raise ValueError(f"rtt_ms {rtt_ms!r}: allowed from 0 to {MAX_RTT_MS:g}")
        self.target = (target_host, target_port)
        self.rtt_ms = float(rtt_ms)
        self.handshake = handshake
        self._half = self.rtt_ms / 2000.0
        self._listener = _bind(port)
        self._listener.setblocking(False)  # accepted from the loop (`_accept`)
        self.port = int(self._listener.getsockname()[1])
        #: every socket of every connection, from its accept or its dial on: `close` cuts each one, whatever
        #: its connection's task got to (a connection accepted just before `close` has no stream yet)
        self._sockets: set[socket.socket] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rtt-proxy", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop listening and cut every connection (their clients see the store go away), then end the
        loop's thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError, TimeoutError, concurrent.futures.TimeoutError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        for sock in [self._listener, *self._sockets]:  # the loop is stopped: nothing else uses them now
            _cut(sock)
        self._sockets.clear()
        if not self._thread.is_alive():
            self._loop.close()

    async def _start(self) -> None:
        self._loop.add_reader(self._listener.fileno(), self._accept)

    async def _shutdown(self) -> None:
        """No more accepts, then every connection's task ended (their sockets: `close`'s sweep)."""
        self._loop.remove_reader(self._listener.fileno())
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> RttProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RttProxy(127.0.0.1:{self.port} -> {self.target[0]}:{self.target[1]}, +{self.rtt_ms:g} ms)"

    # ---------------------------------------------------------------------------------- connections
    def _accept(self) -> None:
        """Every connection waiting on the listener, each tracked before anything else can happen to it."""
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # none waiting (BlockingIOError), or an error of that one connection
                return
            self._sockets.add(client)
            task = self._loop.create_task(self._serve(client, self._loop.time()))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _dial(self) -> socket.socket:
        """A socket connected to the target (each address of its name in turn), tracked from its creation."""
        last: OSError = OSError(f"{self.target[0]}: no address")
        for family, kind, proto, _, address in await self._loop.getaddrinfo(*self.target, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            self._sockets.add(sock)
            try:
                await self._loop.sock_connect(sock, address)
                return sock
            except OSError as exc:
                last = exc
                self._sockets.discard(sock)
                sock.close()
        raise last

    async def _serve(self, client: socket.socket, accepted: float) -> None:
        """One client connection: dial the target at once, then a delay line each way until both end."""
        upstream: socket.socket | None = None
        writers: list[asyncio.StreamWriter] = []
        try:
            client.setblocking(False)
            client_r, client_w = await asyncio.open_connection(sock=client, limit=CHUNK)
            writers.append(client_w)
            try:
                upstream = await self._dial()
            except OSError:  # the store is down: the client sees its connection cut, as with a refused one
                return
            upstream_r, upstream_w = await asyncio.open_connection(sock=upstream, limit=CHUNK)
            writers.append(upstream_w)
            first = accepted + (2 * self._half if self.handshake else 0.0)
            await asyncio.gather(self._direction(client_r, upstream_w, client_w, first),
                                 self._direction(upstream_r, client_w, upstream_w, 0.0))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for writer in writers:  # the transport closes its socket (at once when cut by `close`)
                if self._closed:
                    _abort(writer)
                else:
                    _close(writer)
            if not self._closed:  # (after `close`, its sweep cuts the sockets: the loop may not run again)
                for i, sock in enumerate((client, upstream)):
                    if sock is not None:
                        self._sockets.discard(sock)
                        if i >= len(writers):  # no transport was made to close it
                            _cut(sock)

    async def _direction(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                         src_w: asyncio.StreamWriter, not_before: float) -> None:
        """Read ``src`` into a delay line and write each chunk to ``dst`` when it is due; ``not_before``:
        the earliest a chunk is read as arrived (the handshake's round trip)."""
        lane = _Lane()
        reader = asyncio.ensure_future(self._read(src, lane, not_before))
        try:
            await self._deliver(lane, dst, src_w)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(self, src: asyncio.StreamReader, lane: _Lane, not_before: float) -> None:
        while True:
            try:
                data = await src.read(CHUNK)
                end = None if data else _End(reset=False)
            except (OSError, asyncio.IncompleteReadError):
                data, end = b"", _End(reset=True)
            due = max(self._loop.time(), not_before) + self._half
            lane.items.append((due, end if end is not None else data))
            lane.ready.set()
            if end is not None:
                return
            lane.buffered += len(data)
            if lane.buffered >= BUFFER_BYTES:
                lane.room.clear()
                await lane.room.wait()

    async def _deliver(self, lane: _Lane, dst: asyncio.StreamWriter, src_w: asyncio.StreamWriter) -> None:
        """Write every chunk at its due time (never before: the loop is asked again until it is), all the
        chunks due by then in one write; at the source's end, half-close ``dst`` (or cut both on a reset)."""
        while True:
            if not lane.items:
                lane.ready.clear()
                await lane.ready.wait()
            due = lane.items[0][0]
            while (wait := due - self._loop.time()) > 0:
                await asyncio.sleep(wait)
            now = self._loop.time()
            chunks: list[bytes] = []
            end: _End | None = None
            while lane.items and lane.items[0][0] <= now and end is None:
                item = lane.items.popleft()[1]
                if isinstance(item, _End):
                    end = item
                else:
                    chunks.append(item)
            if chunks:
                size = sum(len(c) for c in chunks)
                try:
                    dst.writelines(chunks)
                    await dst.drain()
                except OSError:  # the receiver is gone: so is this connection, both ways
                    _abort(src_w)
                    _abort(dst)
                    return
                lane.buffered -= size
                if lane.buffered < BUFFER_BYTES:
                    lane.room.set()
            if end is not None:
                if end.reset or not dst.can_write_eof():
                    _abort(src_w)
                    _abort(dst)
                else:
                    with contextlib.suppress(OSError):
                        dst.write_eof()
                return


def _cut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        writer.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        writer.transport.abort()


# ---------------------------------------------------------------------------------------- the benches
def add_store_rtt_argument(parser: Any, where: str) -> None:
    """``--store-rtt-ms`` of a bench: ``where`` names the stores it delays ("the object tier and Redis")."""
    parser.add_argument("--store-rtt-ms", type=float_in(0.0, MAX_RTT_MS), default=0.0, metavar="MS",
                        help=f"milliseconds of round trip added to {where}: a proxy delays every byte to and from "
                             "the store by half of it each way, and a new connection by one round trip (a far "
                             "store: S3 answers its first byte in 10-30 ms); 0 (default): no proxy; at most "
                             f"{MAX_RTT_MS:g}")


def store_rtt_header(rtt_ms: float, where: str) -> str:
    """The line a bench's table starts with when its stores are delayed ('' when they are not)."""
    if not rtt_ms:
        return ""
    return (f"store RTT +{rtt_ms:g} ms: {where} behind a proxy that delays every byte {rtt_ms / 2:g} ms each way "
            "(--store-rtt-ms)")


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None:
        raise UsageError(f"--store-rtt-ms: {url!r} names no host to put the proxy in front of")
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    if port is None:
        raise UsageError(f"--store-rtt-ms: {url!r} names no port")
    return parts.hostname, port


@contextmanager
def delayed_url(url: str | None, rtt_ms: float) -> Iterator[str | None]:
    """``url`` (``redis://``, ``http://``) with its host and port replaced by an `RttProxy`'s in front of
    them, for as long as the block runs; ``url`` itself when ``rtt_ms`` is 0 or ``url`` is None.

    A TLS endpoint (``https://``, ``rediss://``) is refused with a `UsageError`: its certificate names the
    store's host, not the proxy's 127.0.0.1."""
    if url is None or not rtt_ms:
        yield url
        return
    parts = urlsplit(url)
    if parts.scheme in ("https", "rediss"):
        raise UsageError(f"--store-rtt-ms: cannot delay the TLS endpoint {url} (its certificate names its host, "
                         "not the proxy's 127.0.0.1); give a plain http:// or redis:// endpoint, or no --store-rtt-ms")
    host, port = _host_port(url)
    with RttProxy(port, rtt_ms, target_host=host) as proxy:
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{proxy.port}" if auth else f"127.0.0.1:{proxy.port}"
        yield urlunsplit(parts._replace(netloc=netloc))


@contextmanager
def delayed_item(item: dict[str, Any] | None, rtt_ms: float) -> Iterator[dict[str, Any] | None]:
    """An object tier item whose ``endpoint`` goes through an `RttProxy` (`delayed_url`) while the block runs."""
    if item is None or not rtt_ms:
        yield item
        return
    with delayed_url(item["endpoint"], rtt_ms) as endpoint:
        yield {**item, "endpoint": endpoint}
