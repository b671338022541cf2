"""Run a test's job (``python -m module ...`` or ``python script.py ...``) forked from an interpreter that
imported vLLM once (`tests.support.engine_zygote`), with `subprocess.run`'s answer.

Why: most of a one-process test engine's cost is importing vLLM, and the suite starts dozens of them. One
zygote per test process (each xdist worker) pays that import once; every job is still a process of its
own, with the environment, directory and arguments the test gave it.

A job runs from a fresh interpreter instead when the test is not marked `engine` (the engine guard of
`tests/support/engine_guard` lives in a fresh interpreter's start-up), or when ``TIERCACHE_TEST_NO_ZYGOTE`` is set
(to compare, or to rule the zygote out while debugging).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from tests.support.engine_guard.sitecustomize import GUARD_ENV

#: Set (to anything) to run every job from a fresh interpreter, never from the zygote.
NO_ZYGOTE_ENV = "TIERCACHE_TEST_NO_ZYGOTE"
REPO = Path(__file__).resolve().parents[2]


def run_job(cmd: Sequence[str], *, env: dict[str, str], cwd: str | Path, timeout: float
            ) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(cmd, capture_output=True, text=True)` for ``[sys.executable, "-m", module, *args]`` or
    ``[sys.executable, script, *args]``, forked from the zygote unless the module docstring's exceptions
    apply. Raises `subprocess.TimeoutExpired` after ``timeout`` seconds (the job's process group is killed)."""
    cmd = list(cmd)
    if cmd[0] != sys.executable:
        raise ValueError(f"run_job runs Python jobs only, not {cmd[0]!r}")
    fresh = GUARD_ENV in env or os.environ.get(NO_ZYGOTE_ENV)
    if fresh:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if cmd[1] == "-m":
        target, argv = {"module": cmd[2]}, cmd[3:]
    else:
        target, argv = {"path": cmd[1]}, cmd[2:]
    with tempfile.TemporaryDirectory(prefix="zygote-job-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        code = EngineZygote.shared().run({**target, "argv": argv, "env": env, "cwd": str(cwd),
                                          "stdout": str(out), "stderr": str(err)}, timeout=timeout, cmd=cmd)
        return subprocess.CompletedProcess(cmd, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


class EngineZygote:
    """The test side of `tests.support.engine_zygote`: one per test process, started on first use."""

    _shared: EngineZygote | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        env.pop(GUARD_ENV, None)
        self._lock = threading.Lock()
        self._stderr: IO[str] = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.engine_zygote"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1)
        if self._read(timeout=300).get("ready") is not True:
            raise RuntimeError("the engine zygote did not say it was ready")
        atexit.register(self.close)

    @classmethod
    def shared(cls) -> EngineZygote:
        with cls._shared_lock:
            if cls._shared is None or cls._shared.proc.poll() is not None:
                cls._shared = cls()
            return cls._shared

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            self._stderr.seek(0)
            raise RuntimeError(f"the engine zygote exited ({self.proc.returncode}):\n{self._stderr.read()[-6000:]}")
        return json.loads(line)

    def run(self, request: dict[str, Any], *, timeout: float, cmd: list[str]) -> int:
        """Fork one job; its exit code (negative: killed by that signal).

        One job at a time: tests that start engines from several threads (`test_isolation`) take turns
        here. A run left unfinished (a timeout, an interrupted test) retires this zygote with its job, so
        the next job never reads an answer meant for another."""
        with self._lock:
            if self.proc.poll() is not None:
                raise RuntimeError("this engine zygote was retired; EngineZygote.shared() starts another")
            assert self.proc.stdin is not None
            pid = None
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                pid = self._read(timeout=60)["pid"]
                return int(self._read(timeout=timeout)["rc"])
            except TimeoutError:
                self._retire(pid)
                raise subprocess.TimeoutExpired(cmd, timeout) from None
            except BaseException:
                self._retire(pid)
                raise

    def _retire(self, pid: int | None) -> None:
        """Kill an unfinished job's process group and this zygote."""
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait(timeout=60)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
