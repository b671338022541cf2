"""`RedisWire`: which threads connected to, sent to or read from which Redis server (redis-py connections).

Why: "this call does not wait for a hung server" is a property of where the network calls run, not of how
long the call took. A test that records every command sent and every reply read (with the thread and the
server's port) proves it on a loaded machine too: a thread that never touched the hung server's socket
cannot have waited on it, however slowly it was scheduled. A wall-clock bound tight enough to tell "waited"
from "did not" is one that a loaded 2-core CI machine misses.

Every connection of the Redis tier (`vllm_tiercache.shared.store.tiers.redis.wire`'s classes, on a cluster
too) and of the prober inherits `redis.connection.AbstractConnection`'s ``connect_check_health`` (a
connection attempt: a pool connects a connection as it hands it out, before any command),
``send_packed_command`` and ``read_response``; `RedisWire.install` wraps the three (with pytest's
``monkeypatch``, so the test's end undoes it).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import pytest
from redis.connection import AbstractConnection


class WireCall(NamedTuple):
    thread: int  # threading.get_ident() of the caller
    port: int  # the server's port
    what: str  # "connect", "send" or "read"


class RedisWire:
    """Records every connection attempt, command sent and reply read through redis-py while installed
    (`calls`)."""

    def __init__(self) -> None:
        self.calls: list[WireCall] = []
        self._lock = threading.Lock()

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> RedisWire:
        wire = cls()
        connect = AbstractConnection.connect_check_health
        send = AbstractConnection.send_packed_command
        read = AbstractConnection.read_response

        def traced_connect(conn: Any, *args: Any, **kwargs: Any) -> Any:
            if conn._sock is None:  # otherwise it returns at once: connected already
                wire._record(conn, "connect")
            return connect(conn, *args, **kwargs)

        def traced_send(conn: Any, *args: Any, **kwargs: Any) -> Any:
            wire._record(conn, "send")
            return send(conn, *args, **kwargs)

        def traced_read(conn: Any, *args: Any, **kwargs: Any) -> Any:
            wire._record(conn, "read")
            return read(conn, *args, **kwargs)

        monkeypatch.setattr(AbstractConnection, "connect_check_health", traced_connect)
        monkeypatch.setattr(AbstractConnection, "send_packed_command", traced_send)
        monkeypatch.setattr(AbstractConnection, "read_response", traced_read)
        return wire

    def _record(self, conn: Any, what: str) -> None:
        call = WireCall(threading.get_ident(), int(getattr(conn, "port", 0) or 0), what)
        with self._lock:
            self.calls.append(call)

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()

    def on(self, thread: int, port: int | None = None) -> list[WireCall]:
        """The calls made on ``thread`` (to ``port`` only, when given)."""
        with self._lock:
            return [c for c in self.calls if c.thread == thread and (port is None or c.port == port)]
