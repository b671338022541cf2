"""`SeaweedFSServer` leaves nothing behind in /tmp: ``weed`` names its local unix sockets there by port, outside
its data directory, and left four per server (thousands on a developer's machine after a few test runs); and
it writes its own log files to the temp dir unless told where."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from vllm_tiercache.tools.s3_server import SeaweedFSServer

pytestmark = [pytest.mark.s3]


@pytest.fixture(scope="module")
def ran() -> dict[str, Any]:
    """One server started and stopped; what it left where, while it ran and after."""
    with SeaweedFSServer() as server:
        assert server.proc is not None
        pid = server.proc.pid
        seen: dict[str, Any] = {
            "sockets": [path.name for path in server.local_sockets()],
            "own_logs": [path.name for path in server.log_dir.iterdir()], "pid": pid,
            "temp_logs": [path.name for path in Path(tempfile.gettempdir()).glob(f"weed.*.{pid}")]}
    seen["sockets_after"] = server.local_sockets()
    seen["log_dir_after"] = server.log_dir.exists()
    return seen


def test_a_server_that_ran_leaves_no_socket_in_tmp(ran: dict[str, Any]) -> None:
    # weed made them while it ran (else this test would check nothing)
    assert any(name.startswith("seaweedfs-master-grpc-") for name in ran["sockets"]), ran["sockets"]
    assert ran["sockets_after"] == [], "left in /tmp after the server stopped"


def test_weeds_own_log_files_are_written_in_the_servers_directory_not_the_temp_dir(ran: dict[str, Any]) -> None:
    """glog names each file by host, user, level, start time and pid; weed wrote them to the temp dir."""
    assert any(name.endswith(f".{ran['pid']}") for name in ran["own_logs"]), ran["own_logs"]
    assert ran["temp_logs"] == [], "weed logged into the temp dir"
    assert not ran["log_dir_after"]  # gone with the server's directory
