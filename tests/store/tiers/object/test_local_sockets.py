"""`SeaweedFSServer` leaves nothing behind in /tmp: ``weed`` names its local unix sockets there by port, outside
its data directory, and left four per server (thousands on a developer's machine after a few test runs); and
it writes its own log files to the temp dir unless told where."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from vllm_tiercache.tools.s3_server import SeaweedFSServer

pytestmark = [pytest.mark.s3]


def test_a_server_that_ran_leaves_no_socket_in_tmp() -> None:
    with SeaweedFSServer() as server:
        made = [path.name for path in server.local_sockets()]
        # weed made them while it ran (else this test would check nothing)
        assert any(name.startswith("seaweedfs-master-grpc-") for name in made), made
    assert server.local_sockets() == [], "left in /tmp after the server stopped"


def test_weeds_own_log_files_are_written_in_the_servers_directory_not_the_temp_dir() -> None:
    """glog names each file by host, user, level, start time and pid; weed wrote them to the temp dir."""
    with SeaweedFSServer() as server:
        assert server.proc is not None
        pid = server.proc.pid
        own = [path.name for path in server.log_dir.iterdir()]
        assert any(name.endswith(f".{pid}") for name in own), own
        assert not list(Path(tempfile.gettempdir()).glob(f"weed.*.{pid}")), "weed logged into the temp dir"
    assert not server.log_dir.exists()  # gone with the server's directory
