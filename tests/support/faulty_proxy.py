"""A loopback TCP proxy in front of a store that can turn into the store's bad days: hung, refusing
connections, or throttling (S3's 503 SlowDown), and back; and that tells when a request it forwards
contains a pattern (a fault lands at its moment, not at a guessed time).

Modes, switched by `set_mode` (every connection open at a switch is cut, so the new mode holds for every
request from then on; a client sees what it would see of a store that changed under it):

- ``forward``: bytes pass unchanged both ways;
- ``hang``: connections are accepted and read, and never answered (a store stopped with SIGSTOP, a
  black-holed route): each request runs into the client's own timeout;
- ``refuse``: nothing listens on the port (a store that is down): connections are refused;
- ``throttle``: every request is answered ``503 SlowDown`` with S3's XML error body, without reaching the
  store (``throttled`` lists them).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

MODES = ("forward", "hang", "refuse", "throttle")
_SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                  b"<Message>Please reduce your request rate.</Message></Error>")
_SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
             b"Content-Length: " + str(len(_SLOWDOWN_BODY)).encode() + b"\r\n\r\n" + _SLOWDOWN_BODY)


class FaultyProxy:
    """``with FaultyProxy(port) as proxy:`` forwards ``127.0.0.1:proxy.port`` to ``127.0.0.1:port``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode = "forward"
        #: the first line of every request answered 503 SlowDown so far (``b"PUT /bucket/name HTTP/1.1"``)
        self.throttled: list[bytes] = []
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._watch: tuple[bytes, Callable[[], None]] | None = None
        self._closed = False
        self._listener: socket.socket | None = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._serve(self._listener)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def on_request(self, pattern: bytes, hook: Callable[[], None]) -> None:
        """Run ``hook`` once (on the proxy's thread, before forwarding) when client bytes contain ``pattern``."""
        with self._lock:
            self._watch = (pattern, hook)

    def set_mode(self, mode: str) -> None:
        """Switch to ``mode`` (`MODES`), cutting every open connection."""
        assert mode in MODES, mode
        with self._lock:
            self.mode = mode
            cut, self._sockets = self._sockets, []
            listener = self._listener
            if mode == "refuse" and listener is not None:
                self._listener = None
        for sock in cut:
            _close(sock)
        if mode == "refuse" and listener is not None:
            _close(listener)
        elif mode != "refuse" and listener is None and self._listener is None:
            relisten = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
            with self._lock:
                self._listener = relisten
            self._serve(relisten)

    def _serve(self, listener: socket.socket) -> None:
        threading.Thread(target=self._accept, args=(listener,), name="faulty-proxy", daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                mode = self.mode
                self._sockets.append(client)
            if mode == "forward":
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.target_port))
                except OSError:
                    _close(client)
                    continue
                with self._lock:
                    self._sockets.append(upstream)
                threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
                threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()
            elif mode == "hang":
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
            elif mode == "throttle":
                threading.Thread(target=self._slow_down, args=(client,), daemon=True).start()
            else:
                _close(client)

    def _pipe(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        try:
            while data := src.recv(65536):
                if watch and self._watch is not None:
                    with self._lock:
                        hook = None
                        if self._watch is not None and self._watch[0] in data:
                            hook, self._watch = self._watch[1], None
                    if hook is not None:
                        hook()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    @staticmethod
    def _swallow(client: socket.socket) -> None:
        """Read and never answer, until the client gives up or the mode changes."""
        try:
            while client.recv(65536):
                pass
        except OSError:
            pass
        _close(client)

    def _slow_down(self, client: socket.socket) -> None:
        """Answer the request 503 SlowDown once it arrived, then close: after its head when the client waits
        for ``100-continue`` (it reads the answer instead of sending the body), else after its body too (a
        client still sending would see a reset, not the answer)."""
        head = b""
        try:
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    break
                head += data
            fields, _, body = head.partition(b"\r\n\r\n")
            lines = [line.lower() for line in fields.split(b"\r\n")[1:]]
            length = next((int(line.split(b":", 1)[1]) for line in lines if line.startswith(b"content-length:")), 0)
            if not any(line.startswith(b"expect:") and b"100-continue" in line for line in lines):
                while len(body) < length and (data := client.recv(65536)):
                    body += data
            if head:
                client.sendall(_SLOWDOWN)
                with self._lock:
                    self.throttled.append(head.split(b"\r\n", 1)[0])
        except OSError:
            pass
        _close(client)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            cut, self._sockets = self._sockets, []
            listener, self._listener = self._listener, None
        for sock in [*cut, *([listener] if listener is not None else [])]:
            _close(sock)

    def __enter__(self) -> FaultyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
