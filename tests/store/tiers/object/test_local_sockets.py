"""`SeaweedFSServer` leaves nothing behind in /tmp: ``weed`` names its local unix sockets there by port, outside
its data directory, and left four per server (thousands on a developer's machine after a few test runs)."""

from __future__ import annotations

import pytest

from vllm_tiercache.tools.s3_server import SeaweedFSServer

pytestmark = [pytest.mark.s3]


def test_a_server_that_ran_leaves_no_socket_in_tmp() -> None:
    with SeaweedFSServer() as server:
        made = [path.name for path in server.local_sockets()]
        # weed made them while it ran (else this test would check nothing)
        assert any(name.startswith("seaweedfs-master-grpc-") for name in made), made
    assert server.local_sockets() == [], "left in /tmp after the server stopped"
