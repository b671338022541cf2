"""Run a test's job (``python -m module ...`` or ``python script.py ...``) forked from an interpreter that
imported vLLM once (`tests.support.engine_zygote`), with `subprocess.run`'s answer (`run_job`), or start one
that keeps running, with a `subprocess.Popen`-like handle (`EngineZygote.start`; `zygote_subprocess` makes the
OpenAI servers of `tools/demo/server.py` start that way in the tests).

Why: most of a one-process test engine's cost is importing vLLM, and the suite starts dozens of them. One
zygote per test process (each xdist worker) pays that import once; every job is still a process of its
own, with the environment, directory and arguments the test gave it. An OpenAI server forked from the zygote
skips its front end's import of vLLM, and the EngineCore and worker vLLM starts for it come from the zygote's
fork server (`tests.support.spawned_from_zygote`) instead of fresh interpreters.

A job runs from a fresh interpreter instead when the test is not marked `engine` (the engine guard of
`tests/support/engine_guard` lives in a fresh interpreter's start-up), or when ``TIERCACHE_TEST_NO_ZYGOTE`` is set
(to compare, or to rule the zygote out while debugging).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from tests.support.engine_guard.sitecustomize import GUARD_ENV
from tests.support.job_process import JobHandle, subprocess_starting_jobs

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


def run_tiercache(args: Sequence[str], *, timeout: float, without: Sequence[str] = ()
                  ) -> subprocess.CompletedProcess[str]:
    """``tiercache ARGS`` through its real command line (`run_job`: forked from the zygote, as are the servers
    it starts), from the repository root; ``$TIERCACHE_STATS_DIR`` is not passed on (the command's servers
    must not write their stats where the test run's own engines write theirs), nor the variables named in
    ``without`` (to run the command as an operator's shell would, without what this suite sets)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("TIERCACHE_STATS_DIR", *without):
        env.pop(name, None)
    return run_job([sys.executable, "-m", "vllm_tiercache.tools.cli", *args], env=env, cwd=REPO, timeout=timeout)


class ZygoteJob(JobHandle):
    """A job forked by the zygote, read like a `subprocess.Popen`: ``pid``, ``returncode``, `poll`, `wait`,
    `send_signal`. The job is the zygote's child, not this process's: its exit code comes as the zygote's
    answer."""

    def __init__(self, zygote: EngineZygote, job_id: int, args: list[str]) -> None:
        self.args = args
        self.pid = 0
        self.returncode: int | None = None
        #: The zygote died before it could say how the job ended (`poll` then reads it as killed).
        self.lost = False
        self._zygote = zygote
        self._id = job_id
        self._started = threading.Event()
        self._ended = threading.Event()

    def poll(self) -> int | None:
        if self.returncode is None and self._zygote.gone and not process_runs(self.pid):
            self.returncode, self.lost = -signal.SIGKILL, True  # its zygote died first: the exit code is lost
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            pause = 0.5 if left is None else min(left, 0.5)
            if self._ended.is_set():  # the zygote is gone while the job runs on: look again in a moment
                time.sleep(min(pause, 0.1))
            else:
                self._ended.wait(pause)
        assert self.returncode is not None
        return self.returncode


def process_runs(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


class EngineZygote:
    """The test side of `tests.support.engine_zygote`: one per test process, started on first use. Jobs run
    side by side; a reader thread hands each answer to the job whose id it carries."""

    _shared: EngineZygote | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        env.pop(GUARD_ENV, None)
        self._write_lock = threading.Lock()
        self._jobs: dict[int, ZygoteJob] = {}
        self._ids = itertools.count(1)
        self.gone = False
        self._stderr: IO[str] = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.engine_zygote"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 300)
        line = self.proc.stdout.readline() if ready else ""
        if not line or json.loads(line).get("ready") is not True:
            self.proc.kill()
            raise RuntimeError(f"the engine zygote did not say it was ready:\n{self.exit_report()}")
        threading.Thread(target=self._read_answers, name="engine-zygote-answers", daemon=True).start()
        atexit.register(self.close)

    @classmethod
    def shared(cls) -> EngineZygote:
        with cls._shared_lock:
            if cls._shared is None or cls._shared.gone or cls._shared.proc.poll() is not None:
                cls._shared = cls()
            return cls._shared

    def exit_report(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._stderr.seek(0)
        return f"the engine zygote exited ({self.proc.returncode}):\n{self._stderr.read()[-6000:]}"

    def _read_answers(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            answer = json.loads(line)
            job = self._jobs.get(answer.get("id"))
            if job is None:
                continue
            if "pid" in answer:
                job.pid = int(answer["pid"])
                job._started.set()
            elif "rc" in answer:
                job.returncode = int(answer["rc"])
                self._jobs.pop(job._id, None)
                job._ended.set()
        self.gone = True  # stdout closed: the zygote exited; jobs still waiting learn it from `gone`
        for job in list(self._jobs.values()):
            job._started.set()
            job._ended.set()

    def start(self, request: dict[str, Any], *, cmd: list[str]) -> ZygoteJob:
        """Fork one job (``request`` as `tests.support.engine_zygote` reads it, without the id); its handle
        once the zygote has said its pid."""
        job = ZygoteJob(self, next(self._ids), cmd)
        self._jobs[job._id] = job
        assert self.proc.stdin is not None
        with self._write_lock:
            if self.gone:
                raise RuntimeError("this engine zygote is gone; EngineZygote.shared() starts another")
            self.proc.stdin.write(json.dumps({**request, "id": job._id}) + "\n")
            self.proc.stdin.flush()
        if not job._started.wait(60) or not job.pid:
            raise RuntimeError(f"the engine zygote forked no job within 60 s\n{self.exit_report()}")
        return job

    def run(self, request: dict[str, Any], *, timeout: float, cmd: list[str]) -> int:
        """Fork one job and wait for it; its exit code (negative: killed by that signal). A job that outlives
        ``timeout`` is killed with its process group and `subprocess.TimeoutExpired` raised."""
        job = self.start(request, cmd=cmd)
        try:
            code = job.wait(timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            raise
        if job.lost:
            raise RuntimeError(f"the job's exit code is lost: {self.exit_report()}")
        return code

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def zygote_subprocess() -> types.SimpleNamespace:
    """`subprocess` whose `Popen` of ``python -m module ...`` or ``python script.py ...`` with its output in
    files (what `Server.start` does) forks from the zygote; anything else is the real `Popen`.
    `tools/demo/server.py` gets it in the tests, and tests that start such jobs themselves use it.

    Why the module is swapped and not `Server`: `Server.start` runs as it is (its log header, its flags, its
    environment); only where the process comes from changes. Installed once per test process
    (tests/conftest.py), because servers start in module-scoped fixtures, before any per-test fixture."""

    def start(args: list[str], request: dict[str, Any]) -> ZygoteJob | None:
        if GUARD_ENV in request["env"] or os.environ.get(NO_ZYGOTE_ENV):
            return None  # a fresh interpreter: see the module's docstring
        return EngineZygote.shared().start(request, cmd=args)

    return subprocess_starting_jobs(start)
