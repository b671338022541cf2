"""One engine configuration of `tiercache bench kv`, in its own fresh process: both sides of that process.

Why a module of its own: `tools/bench/kv/command.py` decides what to measure (cases, prompts, the report); this
module is how one measurement runs. The child side, `run_job`, builds one engine from a JSON spec and
times each prompt; the parent side, `run_engine_process`, writes the spec, starts the child
(``python -m vllm_tiercache.tools.bench.kv.command --job SPEC.json --job-out OUT.json``), echoes its progress
lines, and returns its timings or raises with the root cause from its log. A fresh process per
configuration is what makes the disk and Redis cases mean anything: a producer process writes and exits,
and a new consumer, whose memory holds nothing, measures the hit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vllm_tiercache.kvcache.load.trace import LOAD_TRACE_ENV, read_load_trace

BLOCK_SIZE = 32
#: the load trace's times (`vllm_tiercache.kvcache.load.trace`)
_TIMES = ("load_s", "fetch_s", "copy_s")
#: Seconds one engine process may take, start-up included.
JOB_TIMEOUT_S = 1800
#: Lines an engine process writes with this prefix are echoed by the runner as progress.
PROGRESS_MARK = "tiercache-bench: "
#: How long a paired send may wait for the saves before it (`SavesStored`): a hang bound, not a guess at
#: how long they take.
SAVES_STORED_TIMEOUT_S = 300.0
#: Prompt tokens of the request that carries the workers' report of the stored saves to the scheduler:
#: under one block, so it neither saves nor loads anything, and vLLM's prefix cache keeps none of it.
_REPORT_TOKENS = 8


class SavesStored:
    """A vLLM worker extension (``worker_extension_cls``) for `run_job`: wait in each worker until
    `TieredKVConnector` stored every save it was handed.

    Why: a paired step asks the connector for a hit of a prompt an earlier send of the same engine saved.
    The save is stored by the connector's saver thread after that send's step, and the scheduler hears of
    it with a later step's report; asked before, the hit is a miss (seen as ``tiered-memory`` status
    ``miss`` on a loaded 2-core VM). A user's benchmark on a loaded machine must not report that false
    miss, so the bench waits for the save itself (`_saves_heard`), never for a guessed time."""

    def tiercache_wait_saves_stored(self, timeout_s: float) -> bool:
        """True once this worker's connector stored its saves (or it has no `TieredKVConnector`)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return True
        wait = getattr(get_kv_transfer_group(), "wait_saves_stored", None)
        return True if wait is None else bool(wait(timeout_s))


# ------------------------------------------------------------------------------------- engine process
def _send(llm: Any, prompt: Any, params: Any) -> tuple[float, int]:
    """One request alone: its wall time (the TTFT, at ``max_tokens=1``) and vLLM's cached-token count."""
    t0 = time.perf_counter()
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - t0, int(output.num_cached_tokens or 0)


def _saves_stored(llm: Any) -> None:
    """Every worker stored its saves, on every tier (`SavesStored`)."""
    if not all(llm.collective_rpc("tiercache_wait_saves_stored", args=(SAVES_STORED_TIMEOUT_S,))):
        raise RuntimeError(f"the connector's saves were not stored within {SAVES_STORED_TIMEOUT_S:.0f}s")


def _saves_heard(llm: Any, prompt: list[int], params: Any) -> None:
    """Before a paired send: every worker stored its saves (`_saves_stored`), then one request of a few
    tokens runs a step whose report tells the scheduler what the memory tier took (the hit's lookup reads
    that)."""
    from vllm.inputs import TokensPrompt

    _saves_stored(llm)
    llm.generate([TokensPrompt(prompt_token_ids=prompt[:_REPORT_TOKENS])], params, use_tqdm=False)


def _load_of(lines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One send's loads from the connector's load trace (None: the send loaded nothing).

    Each worker's steps are summed; with several workers (tensor parallel) every one loads its own share of
    each step at the same time, so a time is the slowest worker's and the bytes are everyone's."""
    if not lines:
        return None
    per_worker: dict[tuple[Any, Any], dict[str, float]] = {}
    for line in lines:
        sums = per_worker.setdefault((line.get("pid"), line.get("rank")), dict.fromkeys((*_TIMES, "bytes"), 0.0))
        for name in sums:
            sums[name] += float(line.get(name, 0.0))
    out: dict[str, Any] = {name: max(sums[name] for sums in per_worker.values()) for name in _TIMES}
    out["bytes"] = sum(sums["bytes"] for sums in per_worker.values())
    out["failed"] = sum(int(line.get("failed", 0)) for line in lines)
    # a layerwise load runs while the forward does: the hit's time is then not the load plus the rest
    out["before_forward"] = all(bool(line.get("before_forward")) for line in lines)
    return out


def _per_prompt(times: list[float], cached: list[int]) -> str:
    """Progress text: each prompt's TTFT and cached-token count."""
    return ", ".join(f"{t:.3f}s/{c}" for t, c in zip(times, cached, strict=True))


def run_job(spec_path: str, out_path: str) -> int:
    """Inside a fresh process: build one engine, send each step's prompts one at a time, write timings.

    Each prompt is its own `generate` call with ``max_tokens=1`` so its wall time is that request's
    TTFT and nothing else is in flight. Steps run in order; a step only warms up when `measure` is false.

    A ``paired`` step (prefix caching on) empties vLLM's prefix cache before each prompt, so the connector
    must supply it, then sends it again: vLLM's own resident hit of the same prompt in the same engine
    (``resident_ttft_s``). Why: identical engines started one after the other can differ in their resident
    hits by more than the gaps being measured (docs/benchmarks-kv.md, "Paired hits").
    """
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],
        max_num_seqs=4,
        enable_prefix_caching=spec["enable_prefix_caching"],
        seed=0,
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    # the paired sends of the connector's hits wait for its saves (`SavesStored`)
    tiered = (spec.get("kv_transfer_config") or {}).get("kv_connector") == "TieredKVConnector"
    if tiered:
        kwargs["worker_extension_cls"] = "vllm_tiercache.tools.bench.kv.engine.SavesStored"
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - started, "steps": []}
    # vLLM's KV capacity in blocks, and whether its hybrid KV cache manager runs (a connector without
    # SupportsHMA turns it off, which costs a sliding-window model most of its capacity)
    engine_config = llm.llm_engine.vllm_config
    result["num_gpu_blocks"] = engine_config.cache_config.num_gpu_blocks
    result["hma"] = not engine_config.scheduler_config.disable_hybrid_kv_cache_manager
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # the connector's own account of each load (`vllm_tiercache.kvcache.load.trace`), when the runner set it
    trace, trace_at = os.environ.get(LOAD_TRACE_ENV), 0
    for step in spec["steps"]:
        ttft, cached, resident, resident_cached = [], [], [], []
        loads: list[dict[str, Any] | None] = []
        for prompt in step["prompts"]:
            if step.get("paired") and tiered:  # what earlier sends saved is stored and known: outside the timing
                _saves_heard(llm, prompt, params)
            # vLLM's own cache emptied (not the connector's: reset_connector=False), outside the timing
            if step.get("paired") and not llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache between paired sends")
            if trace:
                _, trace_at = read_load_trace(trace, trace_at)
            took, hit = _send(llm, TokensPrompt(prompt_token_ids=prompt), params)
            ttft.append(took)
            cached.append(hit)
            if trace:
                lines, trace_at = read_load_trace(trace, trace_at)
                loads.append(_load_of(lines))
            if step.get("paired"):
                took, hit = _send(llm, TokensPrompt(prompt_token_ids=prompt), params)
                resident.append(took)
                resident_cached.append(hit)
        result["steps"].append({"name": step["name"], "ttft_s": ttft, "num_cached_tokens": cached,
                                "resident_ttft_s": resident, "resident_cached_tokens": resident_cached,
                                "loads": loads})
        per_prompt = _per_prompt(ttft, cached)
        if resident:
            per_prompt += "; vLLM's resident hit right after each: " + _per_prompt(resident, resident_cached)
        print(f"{PROGRESS_MARK}{step['name']} (TTFT/cached tokens): {per_prompt}", file=sys.stderr, flush=True)
    # Let a producer's background writes reach disk/Redis before the process ends, and time it. The
    # connector's shutdown flushes too, but within bounds (its store flush 30 s, vLLM's shutdown timeout)
    # that a loaded machine can pass: a consumer would then report a false miss. So wait for the saves
    # themselves first (a hang bound only).
    flush_started = time.perf_counter()
    if tiered:
        _saves_stored(llm)
    del llm
    result["shutdown_s"] = time.perf_counter() - flush_started
    Path(out_path).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------------------- the runner
def root_cause(log_path: Path) -> str:
    """The first exception line of a failed engine's log (vLLM re-raises it several times, wrapped)."""
    lines = log_path.read_text(errors="replace").splitlines()
    for line in lines:
        match = re.search(r"\b(\w+(?:Error|Exception): .*)", line)
        if match:
            return match.group(1)[:300]
    return " | ".join(lines[-5:])[-300:]


def run_engine_process(spec: dict[str, Any], work: Path, n: int, env: Mapping[str, str],
                       progress: Callable[[str], None]) -> dict[str, Any]:
    """Run job number ``n`` (``spec["label"]`` names it) in a fresh process; return what `run_job` wrote.

    Its spec, result and log go to ``work``; raises RuntimeError with the root cause when it fails.
    """
    label = spec["label"]
    spec_path, out_path = work / f"job-{n}.json", work / f"job-{n}.out.json"
    log_path = work / f"job-{n}-{label}.log"
    spec_path.write_text(json.dumps(spec))
    started = time.perf_counter()
    progress(f"[{n}] {label}: starting engine process (log: {log_path})")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_tiercache.tools.bench.kv.command", "--job", str(spec_path),
             "--job-out", str(out_path)],
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _follow(proc, log_path, started, progress)
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"engine process exited with {proc.returncode}: {root_cause(log_path)}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    elapsed = time.perf_counter() - started
    progress(f"[{n}] {label}: done in {elapsed:.0f}s (engine start-up {result['startup_s']:.0f}s)")
    return result


def _follow(proc: subprocess.Popen[bytes], log_path: Path, started: float, progress: Callable[[str], None]) -> None:
    """Wait for an engine process, echoing its progress lines (vLLM's own log stays in the file)."""
    seen = 0
    while True:
        done = proc.poll() is not None
        text = log_path.read_text(errors="replace")
        for line in text[seen:].splitlines(keepends=True):
            if not line.endswith("\n") and not done:
                break
            seen += len(line)
            if line.startswith(PROGRESS_MARK):
                progress("    " + line[len(PROGRESS_MARK) :].rstrip())
        if done:
            return
        if time.perf_counter() - started > JOB_TIMEOUT_S:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"engine process ran past {JOB_TIMEOUT_S}s (log: {log_path})")
        time.sleep(0.5)
