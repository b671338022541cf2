"""Our background threads leave the core vLLM bound its worker to (`vllm_tiercache.shared.threads`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# A child process that binds itself to one core, as vLLM's CPU worker does, then reports the cores a
# thread it starts plainly and one of ours may run on.
_CHILD = """
import json, os, threading
from vllm_tiercache.shared.threads import background_thread
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
seen = {}
def report(name):
    seen[name] = sorted(os.sched_getaffinity(0))
plain = threading.Thread(target=report, args=("plain",)); plain.start(); plain.join()
ours = background_thread(lambda: report("ours"), "t"); ours.start(); ours.join()
beside = background_thread(lambda: report("beside"), "s", beside_forward=True); beside.start(); beside.join()
print(json.dumps({**seen, "main": sorted(os.sched_getaffinity(0))}))
"""


def test_our_threads_run_on_the_cores_of_the_process_that_started_the_bound_one() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(out.stdout)
    mine = sorted(os.sched_getaffinity(0))
    assert seen["main"] == seen["plain"] == [mine[0]]  # what vLLM's binding gives every thread it starts
    assert seen["ours"] == mine  # ours widen to the parent's cores (all of them on a 2-core machine)
    # save-side threads (saver, store writer) keep off the bound cores where the parent has others
    assert seen["beside"] == (mine[1:] or mine)


def test_an_urgent_item_goes_ahead_of_the_ordinary_ones_queued_and_closing_comes_after_both() -> None:
    """One thread, held busy by the first item: what was queued behind it comes in priority, then arrival
    order, and `close` still runs everything queued before the threads end."""
    import threading

    from vllm_tiercache.shared.threads import WorkerThreads

    release, started = threading.Event(), threading.Event()
    order: list[str] = []

    def handle(item: str) -> None:
        if item == "busy":
            started.set()
            assert release.wait(30)
        order.append(item)

    threads: WorkerThreads[str] = WorkerThreads(handle, "t", 1)
    threads.put("busy")
    assert started.wait(30)
    for item in ("queued-1", "queued-2"):
        threads.put(item)
    threads.put("urgent-1", urgent=True)
    threads.put("urgent-2", urgent=True)
    threads.close()  # queued before the items below: every ordinary and urgent item still runs first
    release.set()
    for thread in threads.threads:
        thread.join(30)
    assert order == ["busy", "urgent-1", "urgent-2", "queued-1", "queued-2"]
