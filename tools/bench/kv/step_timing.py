"""Per engine step, the scheduler's time, split into its own CPU and its waits: `tiercache bench kv-sched`.

Why CPU beside wall time: on a small machine the scheduling thread's wall time per step is its own work
plus every wait for a core or for the interpreter lock, and those waits come from whatever else runs
there: the connector's threads in the same process (the in-process layout, ``--executor uni``), the
worker process and, in a bench, the store's server and the delaying proxy on the same cores. The thread's
CPU time (``time.thread_time``) is the work the scheduler did itself, ours included; the process's CPU
time over the same call says whether the wait was for this process's other threads (it grew by about the
wait) or for another process (it did not). The connector's share of that CPU (its scheduler-side calls,
the same clock) says which part of the scheduler's work is ours and which is vLLM's own.
"""

from __future__ import annotations

import time
from typing import Any


def percentile(values: list[float], share: float) -> float:
    """The value at ``share`` of ``values`` sorted (0.0 when there are none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def time_steps(core: Any) -> dict[str, Any]:
    """Wrap the engine core's step and its scheduler's two calls on the instance: per step, the scheduler's
    wall seconds, its thread's and its process's CPU seconds, and the step's wall seconds (the lists
    named ``busy_*`` hold the steps that ran a forward); per request, when a schedule first gave it tokens."""
    timings: dict[str, Any] = {"sched": [], "step": [], "busy_sched": [], "busy_step": [], "busy_sched_cpu": [],
                               "busy_sched_process_cpu": [], "busy_connector_cpu": [], "busy_step_end": [],
                               "arrival": {}, "first_token": {}, "first_scheduled": {}}
    # this step's sums over the scheduler's calls: wall, thread CPU, process CPU, and the thread CPU of the
    # connector's calls within them; whether it ran a forward
    spent, busy, within = [0.0, 0.0, 0.0, 0.0], [False], [False]
    scheduler = core.scheduler
    _time_connector(getattr(scheduler, "connector", None), spent, within)

    def timed_scheduler(name: str) -> None:
        real = getattr(scheduler, name)

        def call(*a: Any, **k: Any) -> Any:
            started, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            within[0] = True
            try:
                out = real(*a, **k)
            finally:
                within[0] = False
                spent[0] += time.perf_counter() - started
                spent[1] += time.thread_time() - thread
                spent[2] += time.process_time() - process
            if name == "schedule":
                busy[0] = bool(getattr(out, "total_num_scheduled_tokens", 0))
                now = time.perf_counter()
                for rid in getattr(out, "num_scheduled_tokens", None) or {}:
                    timings["first_scheduled"].setdefault(rid, now)
            return out
        setattr(scheduler, name, call)

    timed_scheduler("schedule")
    timed_scheduler("update_from_output")
    step_name = "step_fn" if hasattr(core, "step_fn") else "step"
    real_step = getattr(core, step_name)

    def step(*a: Any, **k: Any) -> Any:
        spent[:] = [0.0, 0.0, 0.0, 0.0]
        busy[0] = False
        started = time.perf_counter()
        try:
            return real_step(*a, **k)
        finally:
            ended = time.perf_counter()
            timings["step"].append(ended - started)
            timings["sched"].append(spent[0])
            if busy[0]:  # a step that ran a forward (the others: vLLM's loop while every request waits)
                timings["busy_step"].append(ended - started)
                timings["busy_sched"].append(spent[0])
                timings["busy_sched_cpu"].append(spent[1])
                timings["busy_sched_process_cpu"].append(spent[2])
                timings["busy_connector_cpu"].append(spent[3])
                timings["busy_step_end"].append(ended)
    setattr(core, step_name, step)
    return timings


def _time_connector(connector: Any, spent: list[float], within: list[bool]) -> None:
    """Wrap the scheduler's connector's public methods on the instance (the calls vLLM's scheduler makes):
    the thread CPU of those made within a timed scheduler call (``within``) is added to ``spent[3]``, once per
    outermost call (a method calling another counts once), so that it is a part of ``spent[1]``. Nothing for
    an engine without a connector."""
    if connector is None:
        return
    depth = [0]

    def timed(real: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            depth[0] += 1
            started = time.thread_time()
            try:
                return real(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0 and within[0]:
                    spent[3] += time.thread_time() - started
        return call

    for name in dir(type(connector)):
        if name.startswith("_") or isinstance(getattr(type(connector), name, None), property):
            continue
        method = getattr(connector, name, None)
        if callable(method):
            setattr(connector, name, timed(method))


def step_figures(timings: dict[str, Any], start: float, worst: int = 5) -> dict[str, Any]:
    """The arm's report figures of `time_steps`'s timings: p50 and p99 of the scheduler's wall and own CPU
    time, of the connector's part of that CPU (and its sum) and of the rest (vLLM's own, p99) and of the step's
    wall time over the steps that ran a forward, the longest scheduler time of any
    step, and the ``worst`` steps by scheduler wall time, each with its CPU times and when it ended (ms
    from ``start``, the first arrival)."""
    sched, cpu, step = timings["busy_sched"], timings["busy_sched_cpu"], timings["busy_step"]
    ours = timings["busy_connector_cpu"]
    theirs = [total - connector for total, connector in zip(cpu, ours, strict=True)]
    steps = sorted(zip(sched, cpu, timings["busy_sched_process_cpu"], ours, timings["busy_step_end"], strict=True),
                   reverse=True)[:worst]
    return {"sched_p50_ms": percentile(sched, 0.5) * 1e3, "sched_p99_ms": percentile(sched, 0.99) * 1e3,
            "sched_cpu_p50_ms": percentile(cpu, 0.5) * 1e3, "sched_cpu_p99_ms": percentile(cpu, 0.99) * 1e3,
            # the connector's own CPU per step, and the scheduler's without it (vLLM's own work)
            "connector_cpu_p50_ms": percentile(ours, 0.5) * 1e3, "connector_cpu_p99_ms": percentile(ours, 0.99) * 1e3,
            # and over the whole run: every step counts, where the p99 is one step (the second slowest of 200)
            "connector_cpu_sum_ms": sum(ours) * 1e3,
            "vllm_cpu_p99_ms": percentile(theirs, 0.99) * 1e3,
            "step_p50_ms": percentile(step, 0.5) * 1e3, "step_p99_ms": percentile(step, 0.99) * 1e3,
            "sched_max_ms": max(timings["sched"], default=0.0) * 1e3,
            "worst_sched_steps": [{"wall_ms": wall * 1e3, "thread_cpu_ms": thread * 1e3,
                                   "process_cpu_ms": process * 1e3, "connector_cpu_ms": connector * 1e3,
                                   "at_ms": (ended - start) * 1e3}
                                  for wall, thread, process, connector, ended in steps]}
