"""A process that imports vLLM once, then forks one child per test job (an engine, a server, a CLI run).

Why: importing vLLM (and torch under it) costs about 20 CPU-s on a 2-core machine, most of what a one-process
test engine costs, and the suite starts dozens of engines and servers. Each child is still a fresh process for
what the tests care about: it starts its own engine and its own store, with the environment, directory and
output the test gave it (`tests.support.job_process`), and exits; nothing of it survives into the next job.
The imports are all it shares: the layout is the one `gc.freeze`'s documentation recommends before forking.

Jobs in vLLM's multiproc layout (`run_engine(multiproc=True)`) and the tests' OpenAI servers (`tools/demo/
server.py`'s `Server`, through `tests.support.zygote_client.zygote_subprocess`) fork from here too: the forked
job is the front process. vLLM's CPU platform spawns its EngineCore and worker from fresh interpreters; in a
zygote job they come from this zygote's fork server instead, with the job's environment, streams and process
group (`tests.support.spawned_from_zygote`), and so do the Python jobs a CLI run starts (its servers, its
engine jobs). The process boundaries the tests are about stay the real ones.

Protocol, one JSON object per line: the test side writes a request as `tests.support.job_process` reads it,
with an ``"id"``; the zygote forks, answers ``{"id": ID, "pid": N}`` at once, then ``{"id": ID, "rc": CODE}``
when that child exits (a negative code: killed by that signal). Jobs run side by side (an OpenAI server runs
for a whole module while offline engines come and go), so answers come in the order things happen and the id
says whose they are. `tests.support.zygote_client` is the test side.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from typing import Any

from tests.support import spawned_from_zygote
from tests.support.job_process import become_job

#: Modules every job needs, imported before the first fork (what each child then need not import).
PRELOAD = ("torch", "vllm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.config",
           "vllm.inputs", "vllm.lora.request", "vllm.entrypoints.llm", "vllm.v1.executor.uniproc_executor",
           "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.model_loader",
           "vllm.entrypoints.openai.api_server", "vllm_tiercache.kvcache", "vllm_tiercache.eccache")


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
    spawned_from_zygote.install()
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
                    become_job(request)
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
