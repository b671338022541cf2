"""A process that imports vLLM once, then forks one child per one-process engine job.

Why: importing vLLM (and torch under it) is most of what a one-process test engine costs here, about
two thirds of its CPU time, and the suite starts dozens of them. vLLM itself forks its engine-core
process from an interpreter that has imported it (`VLLM_WORKER_MULTIPROC_METHOD` is "fork" on CPU), so a
child forked after the import is a layout vLLM runs every day. Each child is still a fresh process for
what the tests care about: it starts its own engine and its own store, with the environment the test
gave it, and exits; nothing of it survives into the next job.

Jobs in vLLM's multiproc layout (`run_engine(multiproc=True)`) fork from here too: the forked job is the
front process (`LLM`), and vLLM still spawns its EngineCore and worker from fresh interpreters, so the
process boundaries those tests are about are the real ones (one such engine cost ~37 CPU-s from a fresh
interpreter, ~25 forked). So do the tests' OpenAI servers (`tools/demo/server.py`'s `Server`, through
`tests.support.zygote_client.zygote_subprocess`): the forked job is the API server's front end.

Protocol, one JSON object per line: the test side writes ``{"id", "module" or "path", "argv", "env", "cwd",
"stdout", "stderr", "append"}`` (the output files: ``stderr`` may name the ``stdout`` file, both then share one
descriptor; ``append`` keeps what the file holds); the zygote forks, answers ``{"id": ID, "pid": N}`` at once,
then ``{"id": ID, "rc": CODE}`` when that child exits (a negative code: killed by that signal). Jobs run side
by side (an OpenAI server runs for a whole module while offline engines come and go), so answers come in
the order things happen and the id says whose they are. `tests.support.zygote_client` is the test side.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import sys
import threading
import traceback
from typing import Any

#: Modules every job needs, imported before the first fork (what each child then need not import).
PRELOAD = ("torch", "vllm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.config",
           "vllm.inputs", "vllm.lora.request", "vllm.entrypoints.llm", "vllm.v1.executor.uniproc_executor",
           "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.model_loader",
           "vllm.entrypoints.openai.api_server", "vllm_tiercache.kvcache", "vllm_tiercache.eccache")


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become the job's process (environment, directory, log) and run it; never return."""
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills the job and whatever it started
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


def serve() -> None:
    """Import `PRELOAD`, then fork a child per request line on stdin until stdin closes, and report each
    child's exit. One thread only (a fork copies the locks other threads hold): requests and exits are
    watched in one loop, stdin with `select` and the children with non-blocking `waitpid`."""
    import importlib
    import select

    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise SystemExit(f"engine zygote: {threading.active_count()} threads after the imports; a fork is unsafe")
    # What the imports built lives as long as every child: move it out of the collector's sight, so the full
    # collections vLLM runs while an engine starts and stops walk only the child's own objects (the imports
    # are most of a child's heap), and a child's collections do not touch, and so copy, the pages it shares
    # with this process. Python's documented pre-fork recipe.
    gc.collect()
    gc.freeze()
    reply = sys.stdout

    def answer(message: dict[str, Any]) -> None:
        print(json.dumps(message), file=reply, flush=True)

    answer({"ready": True})
    jobs: dict[int, Any] = {}  # pid -> the request's id
    pending = b""
    while True:  # until stdin closes (the test process is done or gone); jobs still running live on
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_child(request)
                jobs[pid] = request.get("id")
                answer({"id": jobs[pid], "pid": pid})
        while jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in jobs:
                answer({"id": jobs.pop(pid), "rc": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
