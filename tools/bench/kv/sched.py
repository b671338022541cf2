"""`tiercache bench kv-sched`: the scheduler's time per engine step while far lookups and fetches are pending.

Why: vLLM schedules every request on one thread, between forward passes. A lookup that waits on a far store
(S3 at 10-30 ms to the first byte, a Redis in another zone) on that thread holds up every running request's
next token, and a load that waits on it inside the forward does the same. `vllm_tiercache.kvcache.lookup`
moves both off those paths; this bench shows what is left on the scheduling thread, against vLLM alone on
the same arrivals.

How: ``--hits`` prompts of ``--prompt-len`` tokens are stored in the far tier first (a writer engine, in a
process of its own), then each arm runs in a fresh process with one in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler and worker here) on the same arrivals: ``--background``
short prompts that decode ``--new-tokens`` tokens each and the stored prompts, all at once, so that steps
run while the stored prompts' lookups and fetches are pending. The far tier (``--store``: a private Redis or
SeaweedFS) is reached through a delaying proxy (``--store-rtt-ms``, `vllm_tiercache.tools.bench.rtt_proxy`).
The arms:

- ``vllm``: vLLM alone (no connector): the baseline;
- ``sync``: the connector with ``lookup_deadline_ms: 0``: lookups on the scheduling thread (bounded by
  ``lookup_budget_ms``), far records read in the forward;
- ``far``: the connector as it ships: lookups and fetches off both.

Per step that ran a forward, two figures: the scheduler's own time (``Scheduler.schedule`` plus
``update_from_output``, the scheduling thread's work outside the forward) and the whole engine step's wall
time. Each arm's p50 and p99, and the ratio of its p99 to vLLM alone's; and the scheduler's longest time of
any step, the steps vLLM runs while every request waits included (``idle``). Every arm pins
``VLLM_CPU_NUM_OF_RESERVED_CPU`` alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.bench.kv.command import TOKEN_RANGE
from vllm_tiercache.tools.bench.kv.engine import BLOCK_SIZE
from vllm_tiercache.tools.bench.rtt_proxy import add_store_rtt_argument, store_rtt_header
from vllm_tiercache.tools.cli import int_at_least

ARMS = ("vllm", "sync", "far")
CHUNK_SIZE = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", choices=("object", "redis"), default="object",
                        help="the far tier: a private SeaweedFS bucket or redis-server (default %(default)s)")
    add_store_rtt_argument(parser, "the far tier")
    parser.add_argument("--hits", type=int_at_least(1, 256), default=8,
                        help="stored prompts that arrive together (default %(default)s)")
    parser.add_argument("--background", type=int_at_least(0, 256), default=4,
                        help="short prompts decoding beside them (default %(default)s)")
    parser.add_argument("--prompt-len", type=int_at_least(64, 32768), default=1024,
                        help="tokens per stored prompt (default %(default)s)")
    parser.add_argument("--new-tokens", type=int_at_least(1, 4096), default=64,
                        help="tokens each background prompt generates (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smoke size: 2 hits, 1 background, 512 tokens, 16 new")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--arm", choices=(*ARMS, "store"), help=argparse.SUPPRESS)
    parser.add_argument("--arm-config", help=argparse.SUPPRESS)


def _prompts(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """(the stored prompts, the background prompts): the same in every process."""
    rng = random.Random(20261128)
    hits = [[rng.randrange(*TOKEN_RANGE) for _ in range(args.prompt_len)] for _ in range(args.hits)]
    background = [[rng.randrange(*TOKEN_RANGE) for _ in range(2 * BLOCK_SIZE)] for _ in range(args.background)]
    return hits, background


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def run_arm(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """One arm in this process: an in-process engine, the arrivals, the per-step times."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    hits, background = _prompts(args)
    kv = None
    if args.arm != "vllm":
        extra = {"namespace": config["namespace"], "chunk_size": CHUNK_SIZE, "tiers": config["tiers"],
                 **({"lookup_deadline_ms": 0.0} if args.arm == "sync" else {})}
        kv = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    max_len = args.prompt_len + args.new_tokens + BLOCK_SIZE
    llm = LLM(model=config["model"], dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
              max_model_len=max_len, max_num_batched_tokens=max(max_len, 2048),
              max_num_seqs=args.hits + args.background, enable_prefix_caching=True, seed=0, kv_transfer_config=kv)
    try:
        if args.arm == "store":
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in hits], SamplingParams(max_tokens=1), use_tqdm=False)
            from vllm_tiercache.shared import store as store_module

            for store in list(store_module._STORES.values()):
                store.flush(300.0)
            return {}
        core = llm.llm_engine.engine_core.engine_core
        timings = _time_steps(core)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in background + hits]
        params = [SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=0.0)] * len(background) + [
            SamplingParams(max_tokens=1, temperature=0.0)] * len(hits)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        cached = [int(out.num_cached_tokens or 0) for out in outputs[len(background):]]
    finally:
        llm.llm_engine.engine_core.shutdown()
    sched, step = timings["busy_sched"], timings["busy_step"]
    return {"arm": args.arm, "steps": len(step), "idle_steps": len(timings["step"]) - len(step),
            "hit_tokens": sum(cached),
            "sched_p50_ms": _percentile(sched, 0.5) * 1e3, "sched_p99_ms": _percentile(sched, 0.99) * 1e3,
            "step_p50_ms": _percentile(step, 0.5) * 1e3, "step_p99_ms": _percentile(step, 0.99) * 1e3,
            "sched_max_ms": max(timings["sched"], default=0.0) * 1e3}


def _time_steps(core: Any) -> dict[str, list[float]]:
    """Wrap the engine core's step and its scheduler's two calls on the instance: per step, the scheduler's
    own seconds and the step's wall seconds."""
    timings: dict[str, list[float]] = {"sched": [], "step": [], "busy_sched": [], "busy_step": []}
    spent, busy = [0.0], [False]
    scheduler = core.scheduler

    def timed_scheduler(name: str) -> None:
        real = getattr(scheduler, name)

        def call(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                out = real(*a, **k)
            finally:
                spent[0] += time.perf_counter() - started
            if name == "schedule":
                busy[0] = bool(getattr(out, "total_num_scheduled_tokens", 0))
            return out
        setattr(scheduler, name, call)

    timed_scheduler("schedule")
    timed_scheduler("update_from_output")
    step_name = "step_fn" if hasattr(core, "step_fn") else "step"
    real_step = getattr(core, step_name)

    def step(*a: Any, **k: Any) -> Any:
        spent[0], busy[0] = 0.0, False
        started = time.perf_counter()
        try:
            return real_step(*a, **k)
        finally:
            timings["step"].append(time.perf_counter() - started)
            timings["sched"].append(spent[0])
            if busy[0]:  # a step that ran a forward (the others: vLLM's loop while every request waits)
                timings["busy_step"].append(timings["step"][-1])
                timings["busy_sched"].append(spent[0])
    setattr(core, step_name, step)
    return timings


@contextlib.contextmanager
def _far_tier(server_name: str, rtt_ms: float) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(the far tier item, direct; the same through the delaying proxy), on a private server."""
    from vllm_tiercache.tools.bench.rtt_proxy import delayed_item, delayed_url

    if server_name == "redis-server":
        from vllm_tiercache.tools.redis_server import RedisServer

        with RedisServer() as server, delayed_url(server.url, rtt_ms) as url:
            item = {"kind": "redis", "url": server.url, "timeout_s": 5.0}
            yield item, {**item, "url": url}
        return
    from vllm_tiercache.tools.bench.object_row import s3_target

    with s3_target(None, None) as item, delayed_item(item, rtt_ms) as far:
        assert far is not None
        yield item, far


def _run_process(args: argparse.Namespace, arm: str, config: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "kv-sched", "--json", "--arm", arm,
           "--arm-config", json.dumps(config), "--hits", str(args.hits), "--background", str(args.background),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")}
    print(f"tiercache-bench: arm {arm}", file=sys.stderr)
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env)
    return json.loads(done.stdout) if done.stdout.strip() else {}


def format_table(report: dict[str, Any]) -> str:
    base = next(row for row in report["arms"] if row["arm"] == "vllm")
    header = store_rtt_header(report["store_rtt_ms"], f"the {report['store']} tier")
    lines = [*([header] if header else []),
             f"the scheduler's time per engine step: {report['hits']} stored prompts of {report['prompt_len']} "
             f"tokens arriving with {report['background']} decoding prompts; far tier {report['store']}",
             f"  {'arm':6s} {'steps':>6s} {'idle':>5s} {'hit tok':>8s} {'sched p50':>10s} {'sched p99':>10s} "
             f"{'max':>8s} {'step p50':>9s} {'step p99':>9s} {'sched p99/vllm':>15s} {'step p99/vllm':>14s}"]
    for row in report["arms"]:
        lines.append(f"  {row['arm']:6s} {row['steps']:6d} {row['idle_steps']:5d} {row['hit_tokens']:8d} "
                     f"{row['sched_p50_ms']:9.2f}m {row['sched_p99_ms']:9.2f}m {row['sched_max_ms']:7.1f}m "
                     f"{row['step_p50_ms']:8.2f}m "
                     f"{row['step_p99_ms']:8.2f}m {row['sched_p99_ms'] / base['sched_p99_ms']:15.2f} "
                     f"{row['step_p99_ms'] / base['step_p99_ms']:14.2f}")
    lines.append("  (ms; over the steps that ran a forward: sched, Scheduler.schedule + update_from_output; step, the "
                 "engine step's wall time; idle: steps while every request waited, max: the scheduler's longest "
                 "of all steps)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point of `tiercache bench kv-sched`."""
    if args.quick:
        args.hits, args.background, args.prompt_len, args.new_tokens = 2, 1, 512, 16
    if args.arm is not None:
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # vLLM logs to stdout: only the report may reach it
        with out:
            print(json.dumps(run_arm(args, json.loads(args.arm_config))), file=out)
        return 0
    work = Path(tempfile.mkdtemp(prefix="tiercache-bench-kv-sched-"))
    from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec, make_tiny_llama

    spec = TinyLlamaSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                         dtype="float32", max_position_embeddings=max(4096, args.prompt_len + 1024))
    model = str(make_tiny_llama(work / "model", spec))
    namespace = f"kv-sched-{os.getpid()}"
    arms = []
    with _far_tier("redis-server" if args.store == "redis" else "weed", args.store_rtt_ms) as (direct, far):
        memory = {"kind": "memory", "capacity": "2GiB"}
        _run_process(args, "store", {"model": model, "namespace": namespace, "tiers": [memory, direct]})
        for arm in ARMS:
            arms.append(_run_process(args, arm, {"model": model, "namespace": namespace, "tiers": [memory, far]}))
    report = {"store": args.store, "store_rtt_ms": args.store_rtt_ms, "hits": args.hits,
              "background": args.background, "prompt_len": args.prompt_len, "arms": arms,
              "median_sched_ms": {row["arm"]: row["sched_p50_ms"] for row in arms}}
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
