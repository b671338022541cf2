"""The engine zygote (tests/support/engine_zygote.py) runs a job as a fresh interpreter would: its own
arguments, environment, directory and output, its exit code, its exit handlers, and a timeout that kills it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.zygote_client import EngineZygote, ZygoteJob, process_runs, zygote_subprocess

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
    zygote = EngineZygote.shared()
    with pytest.raises(subprocess.TimeoutExpired):
        _run(tmp_path, "hang", timeout=10)
    pid = int((tmp_path / "hang.done.started").read_text())
    deadline = time.monotonic() + 60  # SIGKILL was sent; the kernel takes its moment to end the process
    while process_runs(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_runs(pid)
    assert _run(tmp_path, "plain")[0] == 0
    assert EngineZygote.shared() is zygote  # answers carry their job's id: no need to retire the zygote


def test_a_server_started_through_the_shim_runs_beside_other_jobs_and_stops_on_a_signal(tmp_path: Path) -> None:
    """What `Server.start` does with `zygote_subprocess().Popen`: a module job whose output is appended to
    the log the caller opened, a handle that polls, waits and signals it, while other jobs come and go."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "serve.py").write_text(textwrap.dedent("""
        import os, signal, sys, time
        print("serving", sys.argv[1:], os.environ["ZYGOTE_TEST_VAR"], "own group", os.getpgid(0) == os.getpid(),
              flush=True)
        signal.signal(signal.SIGINT, lambda *_: sys.exit(7))
        while True:
            time.sleep(0.05)
    """))
    log = tmp_path / "server.log"
    env = {**os.environ, "ZYGOTE_TEST_VAR": "server", "PYTHONPATH": str(tmp_path)}
    shim = zygote_subprocess()
    with open(log, "wb") as out:
        out.write(b"header\n")
        out.flush()
        proc = shim.Popen([sys.executable, "-m", "pkg.serve", "--port", "1"], stdout=out, stderr=shim.STDOUT,
                          stdin=shim.DEVNULL, env=env, start_new_session=True)
    assert isinstance(proc, ZygoteJob) and proc.pid > 0
    deadline = time.monotonic() + 30
    while "serving" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    assert _run(tmp_path, "exit3")[0] == 3  # another job, start to end, while the server runs
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 7 and proc.returncode == 7
    assert log.read_text() == "header\nserving ['--port', '1'] server own group True\n"
    # what the zygote cannot fork (not `python -m`, no file for the output) gets the real Popen
    real = shim.Popen([sys.executable, "-c", "pass"], stdout=shim.DEVNULL)
    assert isinstance(real, subprocess.Popen) and real.wait(timeout=60) == 0


def test_jobs_from_several_threads_each_get_their_own_answer(tmp_path: Path) -> None:
    modes = ["exit3", "plain", "message", "plain"]
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda m: _run(tmp_path / m, m)[0] if (tmp_path / m).mkdir(exist_ok=True) is None
                              else None, [f"{m}" for m in modes]))
    assert codes == [3, 0, 1, 0]


SPAWNING_JOB = textwrap.dedent("""
    import json, multiprocessing, os, sys, time

    def child(report):
        print("from the spawned child", flush=True)
        with open(report + ".tmp", "w") as fh:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "cwd": os.getcwd(),
                       "var": os.environ.get("ZYGOTE_TEST_VAR"), "argv": sys.argv[1:],
                       "vllm_imported": "vllm" in sys.modules}, fh)
        os.replace(report + ".tmp", report)
        if sys.argv[1] == "hang":
            time.sleep(600)

    if __name__ == "__main__":
        report = os.path.join(os.getcwd(), "child.json")
        proc = multiprocessing.get_context("spawn").Process(target=child, args=(report,))
        proc.start()
        print("job", json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0)}), flush=True)
        proc.join()
        sys.exit(proc.exitcode)
""")


def _start_spawning_job(tmp_path: Path, mode: str) -> tuple[ZygoteJob, Path]:
    script = tmp_path / "spawning_job.py"
    script.write_text(SPAWNING_JOB)
    out = tmp_path / "out.txt"
    env = {**os.environ, "ZYGOTE_TEST_VAR": f"set for {mode}"}
    job = EngineZygote.shared().start({"path": str(script), "argv": [mode], "env": env, "cwd": str(tmp_path),
                                       "stdout": str(out), "stderr": str(out)}, cmd=[sys.executable, str(script)])
    return job, out


def test_a_process_the_job_spawns_is_forked_from_the_imports_with_the_jobs_environment_and_group(tmp_path) -> None:
    """vLLM spawns its EngineCore and workers (a fresh interpreter each, on CPU); in a zygote job they come
    from the zygote's fork server (tests/support/spawned_from_zygote.py), with what a spawned process gets."""
    job, out = _start_spawning_job(tmp_path, "plain")
    assert job.wait(timeout=120) == 0, out.read_text()
    child = json.loads((tmp_path / "child.json").read_text())
    parent = json.loads(out.read_text().split("job ", 1)[1].splitlines()[0])
    assert child["vllm_imported"]  # forked after the zygote's imports: nothing to import again
    assert child["ppid"] != parent["pid"]  # the fork server's child, not the job's
    assert child["pgid"] == parent["pgid"] == parent["pid"]  # in the job's group, as a spawned process is
    assert (child["var"], child["cwd"], child["argv"]) == ("set for plain", str(tmp_path), ["plain"])
    assert "from the spawned child" in out.read_text()  # the job's standard streams


def test_a_forked_spawn_ends_when_the_process_that_started_it_is_killed(tmp_path) -> None:
    """Only the job is SIGKILLed, not its group: its child, whose parent is the fork server, ends anyway."""
    job, _ = _start_spawning_job(tmp_path, "hang")
    report = tmp_path / "child.json"
    deadline = time.monotonic() + 120
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = json.loads(report.read_text())
    assert process_runs(child["pid"])
    os.kill(job.pid, signal.SIGKILL)
    assert job.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while process_runs(child["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_runs(child["pid"])


def test_vllms_kill_of_a_process_the_fork_server_already_reaped_is_not_an_error(monkeypatch) -> None:
    """A forked spawn leaves no zombie: between vLLM's `is_alive()` and its `kill_process_tree` it may be gone,
    and psutil's `NoSuchProcess` must not fail vLLM's shutdown (other errors still do)."""
    import psutil
    from vllm.utils import system_utils
    from vllm.v1 import utils as v1_utils

    from tests.support import spawned_from_zygote

    tries: list[int] = []

    def vanished(pid: int) -> None:  # a child gone while listed: the next listing no longer has it
        tries.append(pid)
        if pid == 7 and len(tries) == 1:
            raise psutil.NoSuchProcess(pid)
        if pid == 8:
            raise PermissionError(pid)

    monkeypatch.setattr(system_utils, "kill_process_tree", vanished)
    monkeypatch.setattr(v1_utils, "kill_process_tree", vanished)
    spawned_from_zygote._tolerate_vanished_processes()
    assert v1_utils.kill_process_tree is not vanished
    v1_utils.kill_process_tree(7)
    assert tries == [7, 7]  # listed again, so the rest of the tree still gets its SIGKILL
    with pytest.raises(PermissionError):
        v1_utils.kill_process_tree(8)
