"""A loopback TCP forwarder that runs a hook when a request it forwards contains a pattern, before that
request goes on: a fault lands at an exact moment (SeaweedFS SIGSTOPped as the first record GET of a load
reaches it) instead of at a guessed time that may fall before or after the operation under test.

It only watches: bytes pass unchanged both ways, and the hook runs once per arming.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class WatchingProxy:
    """``with WatchingProxy(port) as proxy:`` forwards ``127.0.0.1:proxy.port`` to ``127.0.0.1:port``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._armed: tuple[bytes, Callable[[], None]] | None = None
        self._skip = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.fired = threading.Event()
        self._closed = False
        threading.Thread(target=self._accept, name="watching-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, pattern: bytes, hook: Callable[[], None], skip: int = 0) -> None:
        """Run ``hook`` once, on the client bytes that contain ``pattern`` after ``skip`` such sends went on
        untouched, before forwarding them."""
        with self._lock:
            self.fired.clear()
            self._armed, self._skip = (pattern, hook), skip

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the store is down: the client sees the connection close, as it would
                client.close()
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        try:
            while data := src.recv(65536):
                if watch and self._armed is not None:
                    with self._lock:
                        armed, hit = self._armed, self._armed is not None and self._armed[0] in data
                        if hit and self._skip:
                            self._skip, hit = self._skip - 1, False
                        elif hit:
                            self._armed = None
                    if hit and armed is not None:
                        armed[1]()
                        self.fired.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass

    def __enter__(self) -> WatchingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
