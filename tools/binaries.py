"""The real servers the tests and benchmarks start (redis-server, SeaweedFS's weed): where they are found,
and when one that was paused has stopped.

One rule for each: the path an environment variable names (refused in one line when it is no executable),
else the binary beside this Python (a dev dependency's wheel puts it in the venv's bin/), else PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

#: how long `wait_stopped` waits for a SIGSTOP to take hold of every thread
STOP_WAIT_S = 30.0


def find_binary(name: str, env_var: str, error: type[Exception], hint: str) -> str:
    """Path of ``name``; raises ``error`` with ``hint`` (what to install, how) when there is none."""
    env = os.environ.get(env_var)
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise error(f"{env_var}={env!r} is not an executable file; {hint}")
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise error(hint)
    return found


def wait_stopped(pid: int, timeout_s: float = STOP_WAIT_S) -> None:
    """Return once every thread of process ``pid`` is stopped (state ``T`` in ``/proc/<pid>/task/*/stat``).

    Why: a signal is delivered asynchronously, so a SIGSTOP's sender returns while the server may still
    answer a request or two; a test that pauses a server and then expects no answer saw a GET served (the
    object tier's hung-server test, once). Raises `RuntimeError` naming the process when it did not stop
    within ``timeout_s``, or is gone; without ``/proc`` (not Linux) returns at once.
    """
    tasks = Path(f"/proc/{pid}/task")
    if not Path("/proc/self/task").is_dir():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # the state follows the command's name, which is in parentheses and may hold any character
            states = [(task / "stat").read_text().rpartition(")")[2].split()[0] for task in tasks.iterdir()]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            states = []  # a thread ended between the listing and the read: look again
            if not tasks.is_dir():
                raise RuntimeError(f"process {pid} is gone; it was to be paused") from None
        if states and all(state in ("T", "t") for state in states):
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"process {pid} did not stop within {timeout_s:g} s of SIGSTOP (states {states})")
        time.sleep(0.01)
