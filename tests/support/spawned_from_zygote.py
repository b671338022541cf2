"""The processes vLLM spawns (its EngineCore, and its workers where there are several) forked from the engine
zygote's imports instead of started as fresh interpreters.

Why: vLLM's CPU platform makes every process it starts a `spawn` (a fresh interpreter), and a fresh interpreter
imports vLLM again before it does anything: about 20 CPU-s of a test server's start on a 2-core machine, paid
by every OpenAI server and every multi-process engine the suite starts. The zygote has those imports already.

How: the zygote forks one more child before its first job, which runs Python's own fork server
(`multiprocessing.forkserver.main`) with nothing left to import; in the zygote and everything forked from it,
the `spawn` context's processes are started through that server (`_ForkedSpawn`). Each one is still a process
of its own that vLLM pickles its work to, with the parent's environment, directory, standard streams, `sys.path`
and `sys.argv` (a fresh interpreter inherits those; a fork of the server would have the server's, so they
travel with the request: `_prepare_as_spawned`), and in its parent's process group. What a test could still
tell apart: the process's parent is the fork server, so each one also ends itself when the process that started
it ends (`_end_with_parent`), as it would have if that process's group had been swept with SIGKILL; a process
that ends is reaped by the fork server at once, so it leaves no zombie for its starter to find
(`_tolerate_vanished_processes`); and vLLM's `LD_PRELOAD` (tcmalloc, torch's libgomp), which only an exec
applies, is not loaded: allocation speed, not results.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import types
from multiprocessing import (
    connection,
    context,
    forkserver,
    popen_forkserver,
    process,
    reduction,
    resource_tracker,
    spawn,
    util,
)
from typing import Any

from tests.support.job_process import JobHandle, become_job, subprocess_starting_jobs

#: Keys this module adds to multiprocessing's preparation data (`spawn.prepare` ignores keys it does not know).
_ENV = "tiercache_env"
_STDIO = "tiercache_stdio"
_PARENT_WATCH = "tiercache_parent_watch"
_GROUP = "tiercache_process_group"

_original_prepare = spawn.prepare


#: Set (to anything) to leave vLLM's `spawn` as it is: every spawned process a fresh interpreter (to compare).
SPAWN_FRESH_ENV = "TIERCACHE_TEST_SPAWN_FRESH"


def install() -> None:
    """In the zygote, after its imports and while it has one thread: start the fork server and route `spawn`
    through it, for the zygote and every process forked from it (unless ``SPAWN_FRESH_ENV`` is set)."""
    if os.environ.get(SPAWN_FRESH_ENV):
        return
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server ends when every holder of alive_w (the zygote's tree) is gone
    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    # The server runs already (started below); a forked process cannot wait on it, so it must not try.
    server.ensure_running = resource_tracker.ensure_running
    context.SpawnProcess._Popen = staticmethod(_ForkedSpawn)  # type: ignore[method-assign]
    spawn.prepare = _prepare_as_spawned
    _tolerate_vanished_processes()  # before the fork: the server's children (the tools' jobs) inherit it
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)  # the zygote's stdout is its answer channel: nothing else may write there
            os.close(devnull)
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    listener.close()
    os.close(alive_r)
    _install_in_tools()


def _tolerate_vanished_processes() -> None:
    """vLLM's shutdown asks `is_alive()` of its EngineCore, then kills its process tree (psutil). A spawned
    child that ends in between stays a zombie until its starter reaps it, so psutil still finds it; one the
    fork server started is reaped by the server at once, and psutil then raises `NoSuchProcess` out of vLLM's
    shutdown (seen: a CI run's EngineCore ending on `abort`). Gone is what the kill wanted: the names vLLM
    imported `kill_process_tree` under take a version that lists the tree again when a process vanished
    under it (the others still get their SIGKILL; a parent that is gone ends it)."""
    import psutil
    from vllm.utils import system_utils

    original = system_utils.kill_process_tree

    def kill_process_tree(pid: int) -> None:
        for _ in range(3):
            try:
                original(pid)
                return
            except psutil.NoSuchProcess:
                continue

    for name in ("vllm.utils.system_utils", "vllm.v1.utils", "vllm.entrypoints.launchers.dp_supervisor"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "kill_process_tree", None) is original:
            module.kill_process_tree = kill_process_tree  # type: ignore[attr-defined]


class _ForkedSpawn(popen_forkserver.Popen):
    """A `spawn` process, started by the zygote's fork server; the preparation data carries what a fresh
    interpreter would have inherited from this process."""

    def _launch(self, process_obj: process.BaseProcess) -> None:
        watch_r, watch_w = os.pipe()  # this process holds watch_w only: the child sees EOF when it is gone
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data[_ENV] = dict(os.environ)
        prep_data[_STDIO] = {fd: self.duplicate_for_child(fd) for fd in (0, 1, 2) if _is_open(fd)}
        prep_data[_PARENT_WATCH] = self.duplicate_for_child(watch_r)
        prep_data[_GROUP] = os.getpgid(0)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        try:
            self.sentinel, data_w = forkserver.connect_to_new_process(self._fds)
        finally:
            os.close(watch_r)
        parent_w = os.dup(data_w)  # as multiprocessing's own fork server Popen: the child's parent sentinel
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel, watch_w))
        with open(data_w, "wb", closefd=True) as stream:
            stream.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _prepare_as_spawned(data: dict[str, Any]) -> None:
    """`spawn.prepare` in the forked child: take the parent's environment, standard streams and process group
    first (the main module `prepare` runs again may read them), and end with the parent."""
    env = data.pop(_ENV, None)
    stdio = data.pop(_STDIO, {})
    watch = data.pop(_PARENT_WATCH, None)
    group = data.pop(_GROUP, None)
    if env is not None:
        inherited = forkserver.get_inherited_fds() or []
        os.environ.clear()
        os.environ.update(env)
        for fd, index in stdio.items():
            os.dup2(inherited[index], fd)
        if group is not None:
            # The parent's group, where a spawned process would be: a sweep of the group (`Server.stop`) or
            # a sum over it (the load tests' resident memory) sees it. Possible within the session the zygote's
            # jobs share (`engine_zygote` gives each job a group, not a session); the watch covers the rest.
            with contextlib.suppress(OSError):
                os.setpgid(0, group)
        if watch is not None:
            _end_with_parent(inherited[watch])
    _original_prepare(data)


def _end_with_parent(watch_fd: int) -> None:
    """SIGKILL this process when the process that started it is gone (the read end sees EOF)."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(watch_fd, 1):
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="tiercache-end-with-parent", daemon=True).start()


#: The tool modules whose `subprocess.Popen` of a Python job (`python -m ...`) is forked here in a zygote job:
#: the servers, engine jobs and producer jobs a CLI run (`tiercache demo`, `bench serve`, `bench kv`) starts, and
#: `bench kv-sched`'s arms.
TOOLS_THAT_START_PYTHON_JOBS = ("vllm_tiercache.tools.demo.server", "vllm_tiercache.tools.demo",
                                "vllm_tiercache.tools.bench.kv.engine", "vllm_tiercache.tools.bench.kv.sched")


def _install_in_tools() -> None:
    """The tools' Python jobs fork from the fork server too, in every zygote job."""
    import importlib

    for name in TOOLS_THAT_START_PYTHON_JOBS:
        importlib.import_module(name).subprocess = forked_subprocess()  # type: ignore[attr-defined]


class ForkedJob(JobHandle):
    """A Python job forked from the fork server, read like a `subprocess.Popen`: ``pid``, ``returncode``,
    `poll`, `wait`, and `JobHandle`'s signals."""

    def __init__(self, proc: process.BaseProcess, args: list[str]) -> None:
        self.args = args
        self._proc = proc
        self.pid: int = proc.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code


def forked_subprocess() -> types.SimpleNamespace:
    """`subprocess`, whose `Popen` of ``python -m module ...`` or ``python script.py ...`` with its output in
    files forks the job from the fork server (`tests.support.job_process` makes it the job); anything else
    gets the real `Popen`."""

    def start(args: list[str], request: dict[str, Any]) -> ForkedJob:
        proc = context.SpawnProcess(target=become_job, args=(request,),
                                    name=f"job {request.get('module') or request.get('path')}")
        proc.start()
        # Not one of this process's children for multiprocessing: its exit handler would wait for a server
        # that outlives the run (a fresh `Popen` child would be left running); the watch ends it instead.
        process._children.discard(proc)  # type: ignore[attr-defined]
        return ForkedJob(proc, args)

    return subprocess_starting_jobs(start)
