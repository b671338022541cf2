"""`SeaweedFSServer` leaves nothing behind in /tmp: ``weed`` names its local unix sockets there by port, outside
its data directory, and left four per server (thousands on a developer's machine after a few test runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_tiercache.tools.s3_server import GRPC_PORT_OFFSET, LOCAL_SOCKET_DIR, SeaweedFSServer

pytestmark = [pytest.mark.s3]


def _sockets_of(server: SeaweedFSServer) -> list[str]:
    """The unix sockets under /tmp named by one of the server's ports."""
    return sorted(path.name for service_port in server.ports.values()
                  for port in (service_port, service_port + GRPC_PORT_OFFSET)
                  for path in Path(LOCAL_SOCKET_DIR).glob(f"seaweedfs-*-{port}.sock") if path.is_socket())


def test_a_server_that_ran_leaves_no_socket_in_tmp() -> None:
    with SeaweedFSServer() as server:
        made = _sockets_of(server)
        # weed made them while it ran (else this test would check nothing)
        assert any(name.startswith("seaweedfs-master-grpc-") for name in made), made
    assert _sockets_of(server) == [], "left in /tmp after the server stopped"
