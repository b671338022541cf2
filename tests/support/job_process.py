"""Turn a freshly forked process into a test's job: what `python -m module ...` or `python script.py ...`
would have been, started with the job's environment, directory, output files and process group.

The engine zygote runs every job it forks through `become_job`, and so do the jobs that tools start inside a
zygote job (`tests.support.spawned_from_zygote.forked_subprocess`). A request is a dict: ``module`` or
``path``, ``argv``, ``env``, ``cwd``, ``stdout`` and ``stderr`` (file paths; ``stderr`` may name the
``stdout`` file, both then share one descriptor), ``append`` (keep what the files hold) and ``group`` (a
process group of its own, as ``start_new_session`` gives: the default).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn


def become_job(request: dict[str, Any]) -> NoReturn:
    """In the forked child: become the job's process and run it; exit with its code, never return."""
    code = 1
    try:
        if request.get("group", True):
            # Its own process group, so a timeout kills the job and whatever it started. A group, not a
            # session: the processes vLLM starts for it come from the zygote's fork server
            # (spawned_from_zygote), which can join them to this group only within the session they share.
            os.setpgid(0, 0)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
        out = os.open(request["stdout"], mode, 0o644)
        os.dup2(out, 1)
        if request["stderr"] == request["stdout"]:
            os.dup2(out, 2)
        else:
            err = os.open(request["stderr"], mode, 0o644)
            os.dup2(err, 2)
            os.close(err)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
        if "module" in request:
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [request["path"], *request["argv"]]
            sys.path.insert(0, os.path.dirname(os.path.abspath(request["path"])))
            runpy.run_path(request["path"], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # the job's own failure: printed to its log, a non-zero exit
        traceback.print_exc()
        code = 1
    finally:
        try:
            _shut_down_as_python_does()
        finally:
            os._exit(code)


def _shut_down_as_python_does() -> None:
    """What an interpreter does on its way out, which `os._exit` alone would skip: wait for the job's
    non-daemon threads, run the exit handlers (the stores' `atexit` close flushes their write-behind),
    flush the output."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:  # reported as an interpreter reports a failing exit handler
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()


def job_request(args: list[str], *, stdout: Any, stderr: Any, env: dict[str, str] | None,
                cwd: str | Path | None, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The request (as `become_job` reads it, without ``group``) for a `Popen` of a Python job whose output goes
    to named files or nowhere; None when the call is not one (it then needs the real `Popen`)."""
    module = args[:2] == [sys.executable, "-m"] and len(args) > 2
    script = len(args) > 1 and args[0] == sys.executable and args[1].endswith(".py")
    out_path = _path_of(stdout)
    err_path = out_path if stderr is subprocess.STDOUT else _path_of(stderr)
    if not (module or script) or out_path is None or err_path is None:
        return None
    if kwargs.get("stdin") not in (None, subprocess.DEVNULL) or not set(kwargs) <= {"stdin"}:
        return None
    for stream in (stdout, stderr):
        if hasattr(stream, "flush"):
            stream.flush()
    target = {"module": args[2], "argv": args[3:]} if module else {"path": args[1], "argv": args[2:]}
    return {**target, "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd()),
            "stdout": out_path, "stderr": err_path, "append": True}


def _path_of(stream: Any) -> str | None:
    """The file a `Popen` output argument writes to: an open file's name, or /dev/null for DEVNULL; None for
    anything else (a pipe, or the caller's own stream)."""
    if stream is subprocess.DEVNULL:
        return os.devnull
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) else None


class JobHandle:
    """The signalling half of a `subprocess.Popen` handle, over ``pid`` and `poll`: for a job that is not this
    process's child (the zygote's, or the fork server's), so the handle answers from what its starter says."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def subprocess_starting_jobs(start: Callable[[list[str], dict[str, Any]], Any]) -> types.SimpleNamespace:
    """`subprocess`, whose `Popen` of a Python job with its output in files (`job_request`) is handed to
    ``start(args, request)``, request with its ``group`` (``start_new_session``); ``start`` returns the job's
    handle, or None to leave the call to the real `Popen`, which gets everything else too."""
    shim = types.SimpleNamespace(**{name: getattr(subprocess, name) for name in dir(subprocess)
                                    if not name.startswith("__")})

    def popen(args: Sequence[str], *, stdout: Any = None, stderr: Any = None, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, start_new_session: bool = False, **kwargs: Any) -> Any:
        args = list(args)
        request = job_request(args, stdout=stdout, stderr=stderr, env=env, cwd=cwd, kwargs=kwargs)
        job = None if request is None else start(args, {**request, "group": start_new_session})
        if job is None:
            return subprocess.Popen(args, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                    start_new_session=start_new_session, **kwargs)
        return job

    shim.Popen = popen
    return shim
