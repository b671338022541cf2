"""`RttProxy`, the delay ``--store-rtt-ms`` puts in front of Redis and S3: a real redis-server through it pays at
least the round trip per request (and one more for a new connection's handshake), pipelined and concurrent
requests keep their order, a half-close and a close cross it, and it closes cleanly.

Timings are asserted only from below (a delay of at least N: a loaded machine can only add to it).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from vllm_tiercache.tools.bench.rtt_proxy import RttProxy, delayed_url
from vllm_tiercache.tools.cli import UsageError
from vllm_tiercache.tools.ports import free_port
from vllm_tiercache.tools.redis_server import RedisServer

RTT_MS = 20.0


def _recv_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data


@contextlib.contextmanager
def _one_connection_server(handle: Callable[[socket.socket], None]) -> Iterator[int]:
    """A loopback server that runs ``handle`` on the one connection it accepts (then closes it); its port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                handle(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        thread.join(timeout=30)


@pytest.mark.redis
def test_a_request_costs_at_least_the_round_trip_and_a_new_connection_one_more(redis_server: RedisServer,
                                                                               redis_url: str) -> None:
    with RttProxy(redis_server.port, RTT_MS) as proxy:
        assert 1024 <= proxy.port < 32768 and proxy.port != redis_server.port  # tools/ports.py: below ephemeral
        started = time.perf_counter()  # the handshake's round trip counts from the connect (the proxy's accept)
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(64) == b"+PONG\r\n"
            assert time.perf_counter() - started >= 2 * RTT_MS / 1000  # the handshake's round trip, then the PING's
            for _ in range(3):
                started = time.perf_counter()
                sock.sendall(b"PING\r\n")
                assert sock.recv(64) == b"+PONG\r\n"
                assert time.perf_counter() - started >= RTT_MS / 1000
        with redis.Redis.from_url(redis_url.replace(f":{redis_server.port}/", f":{proxy.port}/")) as client:
            client.set("k", b"v")
            started = time.perf_counter()
            assert client.get("k") == b"v"
            assert time.perf_counter() - started >= RTT_MS / 1000


@pytest.mark.redis
def test_pipelined_requests_on_many_connections_keep_their_order(redis_server: RedisServer, redis_url: str) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB values: replies that cross many of the proxy's chunks

    def pipelined(worker: int) -> None:
        with redis.Redis(port=proxy.port) as client:
            pipe = client.pipeline(transaction=False)
            for i in range(300):
                pipe.incr(f"n{worker}")
                if i % 50 == 0:
                    pipe.set(f"big{worker}", big[i:] + bytes([worker]))
                    pipe.get(f"big{worker}")
            replies = pipe.execute()
            counts = [r for r in replies if isinstance(r, int) and not isinstance(r, bool)]
            assert counts == list(range(1, 301))
            values = [r for r in replies if isinstance(r, bytes)]
            assert values == [big[i:] + bytes([worker]) for i in range(0, 300, 50)]

    with RttProxy(redis_server.port, RTT_MS) as proxy:
        with ThreadPoolExecutor(16) as pool:  # a pool's worth of connections at once
            list(pool.map(pipelined, range(16)))
        # requests sent one by one without waiting: each its own segment, the replies in the same order
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            for i in range(200):
                sock.sendall(f"ECHO m{i}\r\n".encode())
            expected = b"".join(f"${len(f'm{i}')}\r\nm{i}\r\n".encode() for i in range(200))
            got = b""
            while len(got) < len(expected):
                got += sock.recv(1 << 16)
            assert got == expected


def test_a_half_close_reaches_the_server_and_its_answer_still_comes_back() -> None:
    def count_until_eof(conn: socket.socket) -> None:
        conn.sendall(str(len(_recv_all(conn))).encode())  # answers after the client's EOF, then closes

    with _one_connection_server(count_until_eof) as port, RttProxy(port, RTT_MS) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"x" * 3_000_000)
        sock.shutdown(socket.SHUT_WR)
        assert _recv_all(sock) == b"3000000"  # then EOF: the server's close crossed too


def test_a_server_that_closes_first_is_seen_closing_after_what_it_sent() -> None:
    with _one_connection_server(lambda conn: conn.sendall(b"bye")) as port, RttProxy(port, RTT_MS) as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        assert _recv_all(sock) == b"bye"


def test_a_store_that_is_down_cuts_the_connection_and_close_stops_everything() -> None:
    proxy = RttProxy(free_port(), RTT_MS)  # nothing listens there
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(64) == b""
    held = socket.create_connection(("127.0.0.1", proxy.port))
    proxy.close()
    with held, contextlib.suppress(ConnectionResetError):
        assert held.recv(64) == b""  # an open connection is cut, not left hanging
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port))
    proxy.close()  # idempotent


@pytest.mark.redis
def test_delayed_url_points_at_a_proxy_while_the_block_runs() -> None:
    with RedisServer(password="pw") as server:
        with delayed_url(server.url, RTT_MS) as url:
            assert url is not None and url.startswith("redis://:pw@127.0.0.1:") and url != server.url
            with redis.Redis.from_url(url) as client:
                assert client.ping()
        with pytest.raises(redis.ConnectionError), redis.Redis.from_url(url, socket_connect_timeout=5) as client:
            client.ping()  # the proxy is gone with the block
    with delayed_url("redis://127.0.0.1:1/0", 0.0) as same:
        assert same == "redis://127.0.0.1:1/0"  # 0: no proxy
    with pytest.raises(UsageError, match=r"--store-rtt-ms: cannot delay the TLS endpoint https://s3\.example\.com"), \
            delayed_url("https://s3.example.com", RTT_MS):
        pass
