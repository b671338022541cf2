"""The engine zygote (tests/support/engine_zygote.py) runs a job as a fresh interpreter would: its own
arguments, environment, directory and output, its exit code, its exit handlers, and a timeout that kills it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.zygote_client import EngineZygote

# The zygote imports vLLM (what the engine tests share it for); this module starts no engine, but it
# belongs with the modules that pay for that import once per worker.
pytestmark = pytest.mark.engine

JOB = textwrap.dedent("""
    import atexit, os, sys, threading, time
    mode = sys.argv[1]
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "var", os.environ.get("ZYGOTE_TEST_VAR"))
    print("to stderr", file=sys.stderr)
    atexit.register(lambda: open(sys.argv[2], "w").write("exit handler ran"))
    if mode == "thread":
        threading.Thread(target=lambda: (time.sleep(0.2), open(sys.argv[2] + ".thread", "w").write("ok"))).start()
    if mode == "exit3":
        sys.exit(3)
    if mode == "message":
        sys.exit("a message")
    if mode == "raise":
        raise ValueError("the job failed")
    if mode == "hang":
        open(sys.argv[2] + ".started", "w").write(str(os.getpid()))
        time.sleep(600)
""")


def _run(tmp_path: Path, mode: str, timeout: float = 60) -> tuple[int, str, str, Path]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    marker = tmp_path / f"{mode}.done"
    out, err = tmp_path / f"{mode}.out", tmp_path / f"{mode}.err"
    env = {**os.environ, "ZYGOTE_TEST_VAR": mode}
    code = EngineZygote.shared().run({"path": str(script), "argv": [mode, str(marker)], "env": env,
                                      "cwd": str(tmp_path), "stdout": str(out), "stderr": str(err)},
                                     timeout=timeout, cmd=[sys.executable, str(script)])
    return code, out.read_text(), err.read_text(), marker


def _running(pid: int) -> bool:
    """True while ``pid`` runs (a killed job whose zygote is gone may linger as a zombie until init reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_job_gets_its_arguments_environment_directory_and_output(tmp_path: Path) -> None:
    code, out, err, marker = _run(tmp_path, "plain")
    assert code == 0
    assert out == f"argv ['plain', '{marker}'] cwd {tmp_path} var plain\n"
    assert err == "to stderr\n"
    assert marker.read_text() == "exit handler ran"


def test_exit_codes_and_failures_read_as_a_fresh_interpreters(tmp_path: Path) -> None:
    assert _run(tmp_path, "exit3")[0] == 3
    code, _, err, _ = _run(tmp_path, "message")
    assert (code, err.splitlines()[-1]) == (1, "a message")
    code, _, err, marker = _run(tmp_path, "raise")
    assert code == 1 and "ValueError: the job failed" in err
    assert marker.read_text() == "exit handler ran"  # exit handlers run after a failure too


def test_the_job_waits_for_its_threads_before_exiting(tmp_path: Path) -> None:
    code, _, _, marker = _run(tmp_path, "thread")
    assert code == 0 and Path(f"{marker}.thread").read_text() == "ok"


def test_a_timeout_kills_the_job_and_the_zygote_serves_the_next(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        _run(tmp_path, "hang", timeout=10)
    pid = int((tmp_path / "hang.done.started").read_text())
    deadline = time.monotonic() + 60  # SIGKILL was sent; the kernel takes its moment to end the process
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)
    assert _run(tmp_path, "plain")[0] == 0  # a new zygote: the old one was retired with its job


def test_jobs_from_several_threads_each_get_their_own_answer(tmp_path: Path) -> None:
    modes = ["exit3", "plain", "message", "plain"]
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda m: _run(tmp_path / m, m)[0] if (tmp_path / m).mkdir(exist_ok=True) is None
                              else None, [f"{m}" for m in modes]))
    assert codes == [3, 0, 1, 0]
