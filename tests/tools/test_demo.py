"""End to end: `tiercache demo --quick` in a process of its own, as `make demo` runs it (real servers, real
client).

Why a process of its own: the demo starts and kills whole process groups of vLLM servers and producer jobs;
run from here it proves the command line, the exit code and the clean-up, not just the functions.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support.zygote_client import run_tiercache
from vllm_tiercache.tools.demo.server import RPC_BASE_ENV, Server

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
UUID_NAME = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@pytest.mark.engine
@pytest.mark.timeout(1260)
def test_demo_quick_end_to_end(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    temp = Path(tempfile.gettempdir())  # the demo's too: the zygote it forks from has the same
    ipc_before = vllm_ipc_leftovers(temp)
    # forked from the engine zygote, as are the servers and producer jobs it starts; a hang bound, not a speed
    # target. Without the IPC directory this suite gives every engine (tests/conftest.py): as an operator runs it
    proc = run_tiercache(["demo", "--quick", "--work-dir", str(work)], timeout=1200, without=[RPC_BASE_ENV])
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out[-4000:]}\n{proc.stderr[-6000:]}"

    # The table, with the baseline and the tiercache rows.
    assert "run / served by" in out and "TTFT p50" in out
    assert "no cache (vLLM alone)" in out and "tiercache, all queries" in out

    # The plot: a real PNG in the work dir, whose path was printed.
    plot = work / "demo-ttft.png"
    assert f"plot:    {plot}" in out
    data = plot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000

    results = json.loads((work / "results.json").read_text())
    for run in ("no_cache", "tiercache"):
        assert len(results[run]) == results["queries"]
        assert all(r["error"] is None for r in results[run]), f"failed requests in {run}"
    # Hits: the consumer loaded KV for RAG queries (per-request cached tokens), and the worker's store
    # and the EC connector counted reads.
    assert sum(r["cached_tokens"] for r in results["tiercache"]) > 0
    assert all(r["cached_tokens"] == 0 for r in results["no_cache"])
    rows = {r["label"].strip(): r for r in results["rows"]}
    assert rows["tiercache, all queries"]["kv_hit"] > 0
    assert results["stats"]["kv_loaded_blocks"] > 0 and results["stats"]["kv_load_errors"] == 0
    assert results["stats"]["ec_hits"] > 0

    # Clean-up: no server of this demo left behind. A process forked from the zygote keeps the zygote's
    # command line, so what gives a leftover away is a file it holds under the work dir (every server and
    # job writes its log there), or a command line naming it.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(work) not in ps
    assert processes_holding_files_under(work) == []
    # nor vLLM's IPC sockets (each server's directory of them is gone with it, `tools/demo/server.py`)
    assert vllm_ipc_leftovers(temp) - ipc_before == set()


def test_a_server_that_cannot_start_leaves_no_ipc_directory_and_a_callers_is_kept(tmp_path: Path) -> None:
    temp = Path(tempfile.gettempdir())
    before = vllm_ipc_leftovers(temp)
    server = Server(tmp_path / "model", tmp_path / "server.log", served_name="m", chat_template=tmp_path / "t",
                    max_model_len=64)
    server.env.pop(RPC_BASE_ENV, None)
    server.args[0] = str(tmp_path / "no-python-here")
    with pytest.raises(FileNotFoundError):
        server.start()
    assert server.ipc_dir is None and RPC_BASE_ENV not in server.env
    assert vllm_ipc_leftovers(temp) - before == set()
    # a directory the caller chose is used as it is, and left to the caller
    server.env[RPC_BASE_ENV] = str(tmp_path)
    with pytest.raises(FileNotFoundError):
        server.start()
    assert server.ipc_dir is None and server.env[RPC_BASE_ENV] == str(tmp_path) and tmp_path.is_dir()


def vllm_ipc_leftovers(temp: Path) -> set[str]:
    """What vLLM's IPC would leave in ``temp``: sockets named by a UUID (vLLM's names, when
    ``$VLLM_RPC_BASE_PATH`` is not set) and the servers' ``tiercache-ipc-`` directories. Other test processes' own
    sockets are in their IPC directories, made before any test, so only this test's can be new."""
    found = set()
    for entry in temp.iterdir():
        try:
            mode = entry.lstat().st_mode
        except OSError:  # gone meanwhile
            continue
        if (stat.S_ISSOCK(mode) and UUID_NAME.fullmatch(entry.name)) or (
                stat.S_ISDIR(mode) and entry.name.startswith("tiercache-ipc-")):
            found.add(entry.name)
    return found


def processes_holding_files_under(directory: Path) -> list[int]:
    """The pids of live processes with an open file, or their working directory, under ``directory``."""
    holders = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            targets = [os.readlink(entry / "cwd")]
            targets += [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if any(target.startswith(f"{directory}/") or target == str(directory) for target in targets):
            holders.append(int(entry.name))
    return holders
