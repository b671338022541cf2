"""Loopback ports for the servers the tools and tests start (vLLM's OpenAI server, its KV events publisher,
SeaweedFS, Redis, proxies), chosen below the range the kernel hands outgoing connections.

Why below it: a port taken with ``bind(0)`` comes from that ephemeral range, and between the choice and the
server's own bind the kernel may give it to another socket (any client's outgoing connection: a Redis or S3
call, a health poll). On a loaded machine that window is wide: CI saw SeaweedFS exit with "bind: address
already in use", and a vLLM engine fail its start-up when its KV events publisher could not bind. Below the
range, only another listener could take the port, and the few this project starts are tracked in ``taken``.
"""

from __future__ import annotations

import random
import socket

#: Where outgoing connections take their local ports (Linux's default when it cannot be read).
_EPHEMERAL_DEFAULT = (32768, 60999)
#: Ports handed out by this process, never handed out twice.
_GIVEN: set[int] = set()


class NoFreePort(RuntimeError):
    """No free loopback port was found below the ephemeral range."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_DEFAULT[0]


def port_free(port: int) -> bool:
    """Whether nothing is bound to ``port`` on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair(taken: set[int], offset: int = 10000) -> int:
    """A free port P whose P + ``offset`` is free as well (SeaweedFS's gRPC port), both below the ephemeral
    range and not in ``taken`` (which gets both)."""
    low = _ephemeral_low()
    candidates = range(10000, low - offset) if low - offset > 10000 + 500 else range(1024, 65535 - offset)
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.choice(candidates)
        if port not in taken and port + offset not in taken and port_free(port) and port_free(port + offset):
            taken.update((port, port + offset))
            return port
    raise NoFreePort("no free port P with P + offset free below the ephemeral port range on 127.0.0.1")


def free_port() -> int:
    """A loopback port nobody listens on right now, below the ephemeral range (the module docstring says
    why), never one this process handed out before."""
    low = _ephemeral_low()
    candidates = range(10000, low) if low > 10000 + 500 else range(1024, 65535)
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.choice(candidates)
        if port not in _GIVEN and port_free(port):
            _GIVEN.add(port)
            return port
    raise NoFreePort("no free port below the ephemeral port range on 127.0.0.1")
