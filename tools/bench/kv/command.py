"""`tiercache bench kv`: time-to-first-token of KV-cache hits per tier, beside vLLM's own prefix cache.

Why these cases: a KV connector is worth having when loading a prefix is much cheaper than computing
it, and it must cost (almost) nothing when it misses. vLLM's own prefix-cache hit (the KV is still in
the engine's paged cache) is the best any connector can do, so every hit is reported as a ratio to it;
the cold prefill without a connector is the cost a hit saves, and the reference a miss with the
connector is held to. vLLM's `ExampleConnector` (safetensors files) and `SimpleCPUOffloadConnector`
show what the connectors shipped with vLLM achieve on the same machine.

Why subprocesses: every engine configuration runs in its own fresh Python process
(``python -m vllm_tiercache.tools.bench.kv.command --job SPEC.json``; both sides of it live in
`vllm_tiercache.tools.bench.kv.engine`), as it would after a restart or on another machine. The disk,
Redis and object (S3, `object_case`) cases need it to mean anything: a producer process writes, it exits,
and a new consumer process, whose memory holds nothing, measures the hit.

How TTFT is measured: one request at a time, ``max_tokens=1``, wall time of ``LLM.generate`` (the
prefill plus the one sampled token). Each process first sends warm-up prompts unrelated to the measured
ones (a short one, then a full-length one through the same path the measured prompts take, hit path
included), because the first requests of a process pay one-time costs (allocations, kernel set-up,
opening the store). The figure per case is the median over ``--prompts`` distinct random prompts. A
hit counts only when vLLM reports ``num_cached_tokens`` of at least the whole blocks before the last
prompt token (2016 of 2048); otherwise the table says the connector missed instead of printing a
number that is really a prefill.

Absolute seconds depend on the machine and on whatever else runs on it; the ratios between cases of
one run are the result.

``--store-rtt-ms N``: the Redis and object cases reach their redis-server and SeaweedFS through a proxy in this
process that adds N ms to every round trip (`vllm_tiercache.tools.bench.rtt_proxy`), as a store in another
zone or S3 would; their raw references (redis-py GETs, boto3 GETs) go through it too, so a hit is still held
to what the medium costs at that distance. Memory and disk are not delayed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from vllm_tiercache.kvcache.load.trace import LOAD_TRACE_ENV
from vllm_tiercache.kvcache.options import LOAD_MODES
from vllm_tiercache.shared.store.sealing.ring import write_new_ring
from vllm_tiercache.tools.bench.admission import policy_arg
from vllm_tiercache.tools.bench.kv import object_case
from vllm_tiercache.tools.bench.kv.engine import BLOCK_SIZE, run_engine_process, run_job
from vllm_tiercache.tools.bench.kv.report import CaseResult, format_table, hit_breakdown
from vllm_tiercache.tools.bench.object_row import lookup_budget_arg
from vllm_tiercache.tools.bench.pd.client import TOKEN_RANGE
from vllm_tiercache.tools.bench.rtt_proxy import add_store_rtt_argument, delayed_url
from vllm_tiercache.tools.cli import UsageError

#: Targets, as (case, reference case, most allowed ratio): case TTFT / reference TTFT <= ratio.
TARGETS: list[tuple[str, str, float]] = [
    ("tiered-memory", "resident", 1.3),
    ("tiered-disk", "resident", 2.0),
    ("tiered-memory", "example", 0.5),
    ("tiered-cold", "cold", 1.05),
    (object_case.CASE, "cold", object_case.COLD_TARGET),  # and object_case.raw_get_target
]

#: Case name -> label printed in the table, in table order.
CASE_LABELS: dict[str, str] = {
    "cold": "1 cold, no connector (prefix caching on)",
    "resident": "2 vLLM prefix-cache hit (resident)",
    "tiered-memory": "3 Tiered hit, memory tier (same engine)",
    "tiered-disk": "4 Tiered hit, disk tier (fresh process)",
    "tiered-disk-cold": "4b Tiered hit, disk, page cache dropped",
    "tiered-redis": "5 Tiered hit, Redis tier (fresh process)",
    object_case.CASE: object_case.LABEL,
    "example": "6 ExampleConnector hit (fresh process)",
    "simple-cpu": "7 SimpleCPUOffloadConnector hit",
    "tiered-cold": "8 cold, Tiered memory+disk (miss)",
}

#: The raw medium (`vllm_tiercache.tools.bench.kv.medium`) each tier's hit is compared with.
MEDIUM_OF = {"tiered-memory": "memory", "tiered-disk": "page_cache", "tiered-disk-cold": "o_direct",
             "tiered-redis": "redis", object_case.CASE: "s3_get"}

HIT_CASES = {"resident", "tiered-memory", "tiered-disk", "tiered-disk-cold", "tiered-redis", object_case.CASE,
             "example", "simple-cpu"}


# ------------------------------------------------------------------------------------------ arguments
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tiercache bench kv` (and the hidden `--job` entry each engine process runs)."""
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts per case (default %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smoke run: the 2-layer tiny model and 512-token prompts")
    parser.add_argument(
        "--work-dir", help="where models, disk tiers and logs go (default: a temp dir, removed afterwards)"
    )
    parser.add_argument(
        "--cases",
        default=",".join(CASE_LABELS),
        help="comma-separated subset of: " + ", ".join(CASE_LABELS) + " (default: all)",
    )
    parser.add_argument(
        "--hit-repeats",
        type=int,
        default=3,
        help="times the hit cases resend their prompts (hits are cheap; more samples against noise; default "
        "%(default)s)",
    )
    parser.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE per engine (GiB)")
    parser.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (default %(default)s, vLLM's own default without a "
        "connector); fixed so engines with and without a connector compute on the same number of cores",
    )
    parser.add_argument(
        "--model",
        default="llama",
        help="the model: 'llama' (generated tiny Llama, default), 'gemma3' (generated tiny Gemma 3: sliding-"
        "window and global layers, served with vLLM's hybrid KV cache manager), 'gemma3-bench' (its 12-layer "
        "benchmark size, 5 sliding layers per global one) or a model directory",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="model and KV cache dtype of every engine (default %(default)s)")
    parser.add_argument("--load-mode", choices=LOAD_MODES, default="auto",
                        help="the KV connector's load_mode in every tiered case (default %(default)s): compare "
                             "layerwise loads with loads before the forward")
    parser.add_argument("--admission", type=admission_arg, default="always",
                        help="the disk tier's admission in case 8 (the miss that stores): always (default) or "
                             "seen:N (N 2..15: a miss's chunks stay in memory until used again)")
    parser.add_argument("--encrypt", action="store_true",
                        help="seal the disk and Redis records of every tiered case (a fresh key ring in the work dir): "
                             "run with and without it to see what encryption at rest costs a hit")
    parser.add_argument("--lookup-budget-ms", type=lookup_budget_arg, default=None,
                        help="the store's lookup_budget_ms in every tiered case (default: the store's, 100 ms): how "
                             "long a scheduler's lookup waits on Redis or the object tier, which HEADs every record of "
                             "the prompt's chunks (96 at 2K on the bench model); past it, a miss")
    add_store_rtt_argument(parser, "the Redis and object cases' stores (and their raw references)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--job-out", help=argparse.SUPPRESS)


def check_model_positions(args: argparse.Namespace) -> None:
    """A model directory of the user's whose positions are fewer than the prompt needs: one line now, instead
    of every case NOT MEASURED with vLLM's validation error (the generated models are sized to the prompt)."""
    if getattr(args, "model", "llama") in ("llama", "gemma3", "gemma3-bench", None):
        return
    try:
        config = json.loads((Path(args.model) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {args.model}: no readable config.json ({exc}); allowed: a model directory, or "
                         "llama / gemma3 / gemma3-bench for a generated one") from None
    positions = (config.get("text_config") or config).get("max_position_embeddings")
    needed = args.prompt_len + 64
    if isinstance(positions, int) and positions < needed:
        raise UsageError(f"--prompt-len {args.prompt_len} needs a model with at least {needed} positions; "
                         f"{args.model} has {positions}: give a shorter --prompt-len, or --model llama (generated, "
                         "sized to the prompt)")


def admission_arg(text: str) -> str:
    """argparse ``type=``: ``always`` or ``seen:N`` (N from 2 to 15)."""
    policy_arg(text)
    if "," in text:
        raise argparse.ArgumentTypeError(f"{text!r}: one admission, always or seen:N")
    return text


class Bench:
    """Builds the prompts and engine specs of every case, runs the engine processes, collects rows."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.prompt_len: int = 512 if args.quick and args.prompt_len == 2048 else args.prompt_len
        self.num_prompts: int = args.prompts
        self.hit_repeats: int = max(1, args.hit_repeats)
        self.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [c for c in self.cases if c not in CASE_LABELS]
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASE_LABELS)}")
        self.namespace = f"bench-{uuid.uuid4().hex[:8]}"  # never hit records of an earlier run
        self.rng = random.Random(20261122)
        self.results: dict[str, CaseResult] = {}
        self.model = ""
        self.job_count = 0
        self._label = ""
        #: job label -> (vLLM's KV blocks, HMA on) of its engine
        self.engine_info: dict[str, tuple[int | None, bool | None]] = {}
        self.min_hit_tokens = (self.prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
        self.object_get: tuple[float | None, int | None, int | None] = (None, None, None)
        self.ring = (write_new_ring(str(work / f"ring-{uuid.uuid4().hex[:8]}.json"), "bench")
                     if getattr(args, "encrypt", False) else None)
        #: every engine's max_model_len: the prompt and the few tokens a case generates
        self.max_model_len = max(self.prompt_len + 64, 1024)
        #: round trip added to Redis and S3 (`vllm_tiercache.tools.bench.rtt_proxy`; 0: none)
        self.store_rtt_ms: float = getattr(args, "store_rtt_ms", 0.0) or 0.0

    # ------------------------------------------------------------------------------------- helpers
    def prompts(self, n: int, length: int | None = None) -> list[list[int]]:
        """Fresh random prompts; every call gives prompts no earlier call gave (no accidental hits)."""
        return [[self.rng.randrange(*TOKEN_RANGE) for _ in range(length or self.prompt_len)] for _ in range(n)]

    def warmups(self) -> tuple[list[int], list[int]]:
        """(short, full-length) prompts unrelated to every measured prompt."""
        return self.prompts(1, 64)[0], self.prompts(1)[0]

    def progress(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def tiered(self, role: str, tiers: list[dict[str, Any]]) -> dict[str, Any]:
        extra: dict[str, Any] = {"namespace": self.namespace, "tiers": tiers, "load_mode": self.args.load_mode}
        if self.ring is not None:
            extra["encryption"] = {"ring": self.ring}
        if getattr(self.args, "lookup_budget_ms", None) is not None:
            extra["lookup_budget_ms"] = float(self.args.lookup_budget_ms)
        return {"kv_connector": "TieredKVConnector", "kv_role": role, "kv_connector_extra_config": extra}

    def disk_tier(self, name: str) -> dict[str, Any]:
        return {"kind": "disk", "path": str(self.work / name), "capacity": "4GiB"}

    def job(
        self,
        label: str,
        steps: list[tuple[str, list[list[int]]]],
        *,
        prefix_caching: bool,
        kv_transfer_config: dict[str, Any] | None = None,
        paired: tuple[str, ...] = (),
    ) -> dict[str, list[dict[str, Any]]]:
        """Run one engine process; return its steps by name (raises RuntimeError with the log tail).

        Steps named in ``paired`` empty vLLM's prefix cache before each prompt and resend it after
        (`run_job`): the connector's hit and vLLM's resident hit of the same prompt in the same engine."""
        self.job_count += 1
        self._label = label
        spec = {
            "label": label,
            "model": self.model,
            "max_model_len": self.max_model_len,
            "dtype": self.args.dtype,
            "enable_prefix_caching": prefix_caching,
            "kv_transfer_config": kv_transfer_config,
            "steps": [{"name": name, "prompts": prompts, "paired": name in paired} for name, prompts in steps],
        }
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.args.kv_space_gib)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # vLLM's CPU backend reserves one more core for the scheduler whenever a kv_transfer_config is set;
        # on a 2-core machine that silently gives connector engines twice the compute threads of the
        # baseline (its reservation no longer fits, so none is made). Pin it for every engine.
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(self.args.reserved_cpus)
        if kv_transfer_config:  # each load's reads and copies, for the breakdown of a hit's time
            trace = self.work / f"load-trace-{self.job_count}.jsonl"
            trace.unlink(missing_ok=True)  # a reused --work-dir: this engine's lines only
            env[LOAD_TRACE_ENV] = str(trace)
        result = run_engine_process(spec, self.work, self.job_count, env, self.progress)
        self.engine_info[label] = (result.get("num_gpu_blocks"), result.get("hma"))
        out: dict[str, list[dict[str, Any]]] = {}
        for step in result["steps"]:
            out.setdefault(step["name"], []).append(step)
        return out

    def record(self, name: str, step: dict[str, Any]) -> None:
        blocks, hma = self.engine_info.get(self._label, (None, None))
        self.results[name] = CaseResult(name, list(step["ttft_s"]), list(step["num_cached_tokens"]),
                                        kv_blocks=blocks, hma=hma,
                                        resident_ttft_s=list(step.get("resident_ttft_s", [])),
                                        resident_cached_tokens=list(step.get("resident_cached_tokens", [])),
                                        loads=list(step.get("loads", [])))

    def guarded(self, names: list[str], fn: Any) -> None:
        """Run a case's processes; a failure marks its rows instead of ending the whole benchmark."""
        if not any(n in self.cases for n in names):
            return
        try:
            fn()
        except Exception as exc:  # a connector that cannot run here is a result, not a crash
            for name in names:
                if name in self.cases and name not in self.results:
                    self.results[name] = CaseResult(name, error=f"{type(exc).__name__}: {exc}")
            self.progress(f"    failed: {exc}")

    # --------------------------------------------------------------------------------------- cases
    def case_baseline(self) -> None:
        """Cases 1 and 2: cold prefill, then the same prompts again while vLLM still holds their KV."""
        short, full = self.warmups()
        measured = self.prompts(self.num_prompts)
        steps = self.job(
            "baseline",
            [("warmup", [short, full, full]), ("cold", measured), ("resident", measured * self.hit_repeats)],
            prefix_caching=True,
        )
        self.record("cold", steps["cold"][0])
        self.record("resident", steps["resident"][0])

    def case_tiered_cold(self) -> None:
        """Case 8: a miss with the connector (memory+disk, saving everything), prefix caching on as in 1."""
        short, full = self.warmups()
        measured = self.prompts(self.num_prompts)
        admission = dict(policy_arg(self.args.admission)[0][1])
        disk = {**self.disk_tier("disk-cold"), "admission": admission}
        config = self.tiered("kv_both", [{"kind": "memory", "capacity": "2GiB"}, disk])
        steps = self.job(
            "tiered-cold",
            [("warmup", [short, full, full]), ("cold", measured)],
            prefix_caching=True,
            kv_transfer_config=config,
        )
        self.record("tiered-cold", steps["cold"][0])

    def case_tiered_memory(self) -> None:
        """Case 3: second send in the same engine, vLLM's prefix cache emptied before each, so only the
        connector can hit; each hit is followed by vLLM's own resident hit of the prompt (paired)."""
        short, full = self.warmups()
        measured = self.prompts(self.num_prompts)
        config = self.tiered("kv_both", [{"kind": "memory", "capacity": "2GiB"}])
        steps = self.job(
            "tiered-memory",
            [("warmup", [short, full]), ("warmup-hit", [full]), ("first", measured),
             ("hit", measured * self.hit_repeats)],
            prefix_caching=True,
            kv_transfer_config=config,
            paired=("warmup-hit", "hit"),
        )
        self.record("tiered-memory", steps["hit"][0])

    def _produce_then_consume(self, name: str, producer: dict[str, Any], consumer: dict[str, Any], *,
                              between: Any = None, repeats: int | None = None) -> None:
        """Cases 4-6: a producer process stores the prompts and exits; a fresh consumer measures hits
        (paired with vLLM's resident hit of each prompt in the consumer).

        The full-length warm-up prompt is stored by the producer too, so the consumer's warm-up takes
        the hit path (opening files, connecting to Redis) without touching any measured prompt.
        ``between`` runs after the producer exits; ``repeats`` overrides ``--hit-repeats``.
        """
        short, full = self.warmups()
        measured = self.prompts(self.num_prompts)
        self.job(f"{name}-producer", [("store", [full, *measured])], prefix_caching=False, kv_transfer_config=producer)
        if between is not None:
            between()
        steps = self.job(
            f"{name}-consumer",
            [("warmup", [short, full]), ("hit", measured * (repeats or self.hit_repeats))],
            prefix_caching=True,
            kv_transfer_config=consumer,
            paired=("hit",),
        )
        self.record(name, steps["hit"][0])

    def case_tiered_disk(self) -> None:
        tiers = [self.disk_tier("disk-only")]
        self._produce_then_consume("tiered-disk", self.tiered("kv_both", tiers), self.tiered("kv_consumer", tiers))

    def case_tiered_disk_cold(self) -> None:
        """A disk hit whose files are not in the page cache (dropped with ``POSIX_FADV_DONTNEED`` after the
        producer wrote them): what a restart long after the writes, or a working set larger than RAM, costs.
        Each measured prompt is sent once (a second send would read from the page cache)."""
        tiers = [self.disk_tier("disk-cold-read")]
        directory = self.work / "disk-cold-read"

        def drop() -> None:
            from vllm_tiercache.tools.bench.kv.medium import drop_page_cache

            dropped = drop_page_cache(directory)
            self.progress(f"    dropped the page cache of {dropped} files under {directory}")

        self._produce_then_consume("tiered-disk-cold", self.tiered("kv_both", tiers),
                                   self.tiered("kv_consumer", tiers), between=drop, repeats=1)

    def case_tiered_redis(self) -> None:
        from vllm_tiercache.tools.redis_server import RedisServer

        with RedisServer() as server, delayed_url(server.url, self.store_rtt_ms) as url:
            tiers = [{"kind": "redis", "url": url}]
            self._produce_then_consume("tiered-redis", self.tiered("kv_both", tiers), self.tiered("kv_consumer", tiers))

    def case_example(self) -> None:
        path = self.work / f"example-{self.namespace}"  # its files are keyed by tokens only
        path.mkdir(parents=True, exist_ok=True)
        config = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)},
        }
        self._produce_then_consume("example", config, config)

    def case_simple_cpu(self) -> None:
        """Case 7: vLLM's SimpleCPUOffloadConnector, second send in the same engine.

        It turns itself off without prefix caching, so this engine has prefix caching on; the hit is
        the connector's only if vLLM's own cache no longer holds the blocks, which `num_cached_tokens`
        cannot tell apart, so the row says which it was when it can.
        """
        short, full = self.warmups()
        measured = self.prompts(self.num_prompts)
        config = {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30},
        }
        steps = self.job(
            "simple-cpu",
            [("warmup", [short, full, full]), ("first", measured), ("hit", measured * self.hit_repeats)],
            prefix_caching=True,
            kv_transfer_config=config,
        )
        self.record("simple-cpu", steps["hit"][0])

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        from vllm_tiercache.tools.tiny_models.llama import BENCH_SPEC, TinyLlamaSpec, make_tiny_llama

        self.progress(
            f"model: {self.model_name}, {self.num_prompts} prompts x {self.prompt_len} tokens, work dir {self.work}"
        )
        choice = getattr(self.args, "model", "llama") or "llama"
        # a generated model's positions cover the longest engine (no weight depends on them): 8K prompts work
        positions = max(4096, self.max_model_len)
        if choice in ("gemma3", "gemma3-bench"):
            from vllm_tiercache.tools.tiny_models import gemma3

            shape = gemma3.BENCH_SPEC if choice == "gemma3-bench" else gemma3.TinyGemma3Spec()
            self.model = str(gemma3.make_tiny_gemma3(self.work / f"model-{choice}-{positions}",
                                                     dataclasses.replace(shape, max_position_embeddings=positions)))
        elif choice == "llama":
            spec = dataclasses.replace(TinyLlamaSpec() if self.args.quick else BENCH_SPEC,
                                       max_position_embeddings=positions)
            name = f"model-{'quick' if self.args.quick else 'bench'}-{positions}"
            self.model = str(make_tiny_llama(self.work / name, spec))
        else:
            self.model = choice
        # Cold-with-connector right after the baseline, so the miss comparison sees the same machine load.
        self.guarded(["cold", "resident"], self.case_baseline)
        self.guarded(["tiered-cold"], self.case_tiered_cold)
        self.guarded(["tiered-memory"], self.case_tiered_memory)
        self.guarded(["tiered-disk"], self.case_tiered_disk)
        self.guarded(["tiered-disk-cold"], self.case_tiered_disk_cold)
        self.guarded(["tiered-redis"], self.case_tiered_redis)
        self.guarded([object_case.CASE], lambda: object_case.run_case(self))
        self.guarded(["example"], self.case_example)
        self.guarded(["simple-cpu"], self.case_simple_cpu)
        self.measure_media()
        return self.report()

    # --------------------------------------------------------------------------------- raw media
    def hit_bytes(self) -> int | None:
        """KV bytes a whole hit loads (every layer, the cached tokens), from the model's config.json."""
        from vllm_tiercache.tools.bench.kv.medium import kv_bytes_per_layer_token

        geometry = kv_bytes_per_layer_token(self.model, self.args.dtype)
        return None if geometry is None else geometry[0] * geometry[1] * self.min_hit_tokens

    def measure_media(self) -> None:
        """The raw media's times for the bytes a hit loads (`vllm_tiercache.tools.bench.kv.medium`)."""
        from vllm_tiercache.tools.bench.kv.medium import raw_medium_times

        self.media: dict[str, float | None] = {}
        nbytes = self.hit_bytes()
        if nbytes is None or not any(c in self.cases for c in MEDIUM_OF):
            return
        self.progress(f"raw media: moving {nbytes / 2**20:.1f} MiB through memory, the page cache, O_DIRECT"
                      f"{', Redis' if 'tiered-redis' in self.cases else ''}")
        if "tiered-redis" in self.cases and shutil.which("redis-server"):
            from vllm_tiercache.tools.redis_server import RedisServer

            with RedisServer() as server, delayed_url(server.url, self.store_rtt_ms) as url:
                self.media = raw_medium_times(nbytes, self.work / "media", url)
        else:
            self.media = raw_medium_times(nbytes, self.work / "media")
        # measured by the object case on its own SeaweedFS: (seconds, objects, bytes)
        self.media["s3_get"], self.media["s3_objects"], self.media["s3_bytes"] = self.object_get
        self.media_bytes = nbytes

    @property
    def model_name(self) -> str:
        choice = getattr(self.args, "model", "llama") or "llama"
        if choice == "gemma3":
            return "tiny Gemma 3 (sliding window + global)"
        if choice == "gemma3-bench":
            return "Gemma 3 BENCH_SPEC (12 layers, 5 sliding per global)"
        if choice == "llama":
            return "tiny" if self.args.quick else "BENCH_SPEC"
        return choice

    def report(self) -> dict[str, Any]:
        """Rows with medians, ratios and hit checks, plus the targets, as one JSON-able dict."""

        def median(name: str) -> float | None:
            row = self.rows.get(name)
            return row["ttft_median_s"] if row and row["status"] == "ok" else None

        self.rows: dict[str, dict[str, Any]] = {}
        for name in CASE_LABELS:
            if name not in self.cases:
                continue
            res = self.results.get(name, CaseResult(name, error="not run"))
            status = "ok"
            if res.error:
                status = "error"
            elif name in HIT_CASES and min(res.num_cached_tokens, default=0) < self.min_hit_tokens:
                status = "miss"
            self.rows[name] = {
                "case": name,
                "label": CASE_LABELS[name],
                "status": status,
                "error": res.error,
                "ttft_median_s": res.median_s,
                "ttft_min_s": res.min_s,
                "ttft_s": res.ttft_s,
                "num_cached_tokens": res.num_cached_tokens,
                "kv_blocks": res.kv_blocks,
                "hma": res.hma,
                # vLLM's resident hit in this case's own engine (paired steps), when every one really hit
                "own_resident_s": (res.own_resident_s if res.resident_cached_tokens and status == "ok"
                                   and min(res.resident_cached_tokens) >= self.min_hit_tokens else None),
            }
            if status == "ok":
                self.rows[name]["breakdown"] = hit_breakdown(res)
        resident, cold = median("resident"), median("cold")
        media = getattr(self, "media", {})
        for name, row in self.rows.items():
            own = median(name)
            row["ratio_to_resident"] = round(own / resident, 3) if own is not None and resident else None
            own_resident = row["own_resident_s"]
            row["ratio_to_own_resident"] = round(own / own_resident, 3) if own is not None and own_resident else None
            # the price of the load over a resident hit: against the same engine's where measured
            reference = own_resident or resident
            raw = media.get(MEDIUM_OF.get(name, ""))
            row["raw_medium_s"] = raw
            row["share_of_raw"] = (round(raw / (own - reference), 3) if raw is not None and own is not None
                                   and reference is not None and own > reference else None)
            row["ratio_to_cold"] = round(own / cold, 3) if own is not None and cold and name == "tiered-cold" else None
        targets = []
        for case, ref, limit in TARGETS:
            own, base = median(case), median(ref)
            if ref == "resident" and case in self.rows and self.rows[case]["own_resident_s"]:
                base, ref = self.rows[case]["own_resident_s"], "resident (same engine)"
            ratio = own / base if own is not None and base else None
            targets.append(
                {
                    "case": case,
                    "reference": ref,
                    "target": limit,
                    "ratio": round(ratio, 3) if ratio is not None else None,
                    "ok": ratio is not None and ratio <= limit,
                }
            )
        if (raw_get := object_case.raw_get_target(self.rows, resident)) is not None:
            targets.append(raw_get)
        return {
            "media": media,
            "hit_bytes": getattr(self, "media_bytes", None),
            "dtype": self.args.dtype,
            "admission": self.args.admission,
            "lookup_budget_ms": getattr(self.args, "lookup_budget_ms", None),
            "store_rtt_ms": self.store_rtt_ms,
            "prompt_len": self.prompt_len,
            "sealed": self.ring is not None,
            "prompts": self.num_prompts,
            "hit_repeats": self.hit_repeats,
            "model": self.model_name,
            "min_hit_tokens": self.min_hit_tokens,
            "rows": list(self.rows.values()),
            "targets": targets,
        }


def run(args: argparse.Namespace) -> int:
    """Entry point of `tiercache bench kv` (and of the engine processes it starts)."""
    if args.job:
        return run_job(args.job, args.job_out)
    check_model_positions(args)  # before any engine: one line, not every case NOT MEASURED
    object_case.require_weed(args.cases)
    if shutil.which("redis-server") is None and "tiered-redis" in args.cases:
        print("note: redis-server not found; the Redis case will be reported as not measured", file=sys.stderr)
    keep = args.work_dir is not None
    work = Path(args.work_dir) if keep else Path(tempfile.mkdtemp(prefix="tiercache-bench-kv-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        report = Bench(args, work).run()
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m vllm_tiercache.tools.bench.kv.command")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
