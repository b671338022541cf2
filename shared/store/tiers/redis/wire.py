"""How the Redis tier's commands reach the socket: a payload goes out as the buffer it is, not copied.

Why: with hiredis installed, redis-py packs every command with `hiredis.pack_command`, which first turns a
memoryview argument into bytes (one copy of the payload) and then writes the whole command into one new
bytes object (another; docs/benchmarks.md has the figures). A raw `SET` of
bytes pays that packing too, so the tier's put (which hands redis-py memoryviews over the record it
built) could not reach the speed of a raw `SET`. redis-py's pure-Python packer sends any argument longer
than its buffer cutoff as a separate buffer, as it is; `BufferPacker` uses it for commands that carry a
payload and keeps hiredis for the small ones (keys, heads, lookups), where it is faster.

`connection_class(url)` gives the connection class `redis_client.make_client` passes to redis-py (a public keyword of
`Redis.from_url` and `RedisCluster.from_url`; `command_packer` is a public keyword of redis-py's
connections). On a TLS cluster URL redis-py picks its own TLS connection class, so commands there are
packed as redis-py does by default: correct, one copy more.
"""

from __future__ import annotations

from typing import Any

from redis._parsers.encoders import Encoder
from redis.connection import (
    HIREDIS_AVAILABLE,
    Connection,
    HiredisRespSerializer,
    PythonRespSerializer,
    SSLConnection,
)

#: Arguments longer than this are sent as their own buffer (redis-py's own cutoff for its Python packer).
BUFFER_CUTOFF = 6000


class BufferPacker:
    """redis-py's command packing, except that a command with a payload argument (a memoryview, or bytes
    longer than `BUFFER_CUTOFF`) is packed by redis-py's Python packer, which sends that argument as it is."""

    def __init__(self, encoding: str = "utf-8", errors: str = "strict") -> None:
        self._python = PythonRespSerializer(BUFFER_CUTOFF, Encoder(encoding, errors, False).encode)
        self._small = HiredisRespSerializer() if HIREDIS_AVAILABLE else self._python

    def pack(self, *args: Any) -> list[Any]:
        payload = False
        for i, arg in enumerate(args):
            if isinstance(arg, memoryview):
                if arg.ndim != 1 or arg.format != "B":  # the packer measures and sends bytes
                    args = (*args[:i], arg.cast("B"), *args[i + 1 :])
                payload = True
            elif isinstance(arg, (bytes, bytearray)) and len(arg) > BUFFER_CUTOFF:
                payload = True
        return self._python.pack(*args) if payload else self._small.pack(*args)


class _BufferPacking:
    """Mixin: a redis-py connection that packs with `BufferPacker` unless told another packer."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", BufferPacker(kwargs.get("encoding", "utf-8"),
                                                         kwargs.get("encoding_errors", "strict")))
        super().__init__(**kwargs)


class BufferConnection(_BufferPacking, Connection):
    """A TCP connection whose payloads go to the socket uncopied."""


class BufferSSLConnection(_BufferPacking, SSLConnection):
    """A TLS connection whose payloads go to the TLS layer uncopied."""


def connection_class(url: str) -> type:
    """The connection class for a tier URL (``rediss`` schemes are TLS)."""
    return BufferSSLConnection if url.startswith("rediss") else BufferConnection
