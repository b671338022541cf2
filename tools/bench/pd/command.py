"""`tiercache bench pd`: the prefill/decode hand-off's time to first token, beside what it should cost.

Why these columns: disaggregated prefill is worth it when the decode instance gets the prompt's KV much
faster than it could compute it. So the decode instance's TTFT on a hand-off (the request sent as the
proxy sends it, right after the prefill instance answered) is set beside, in the same run and on the
same model: a plain server's prefill of the same prompt (what the hand-off saves), vLLM's own resident
prefix-cache hit of it on that plain server (the best any connector could do), and a raw redis-py read
of the same bytes (what moving them costs at all). The targets (docs/serving.md): decode <= 0.1x the
plain prefill, and <= the resident hit + 1.5x the raw read.

How: three real OpenAI servers (`python -m vllm.entrypoints.openai.api_server`) over one real
redis-server: a plain one (no connector, vLLM's prefix caching on), a producer (``kv_producer``) and a
consumer (``kv_consumer``), both on memory + Redis. TTFT is the client's wall time of a ``max_tokens=1``
completion request; each figure is the median over ``--prompts`` fresh random prompts per length, after a
warm-up prompt of that length through every path. The cases run one after the other, so at most one
server computes at a time; the consumer writes a load trace (`TIERCACHE_LOAD_TRACE`) from which the
table also shows where its load went (store reads, copies into the KV cache).

``--bind`` gives the producer's and the consumer's vLLM workers cores of their own
(``VLLM_CPU_OMP_THREADS_BIND``: the first half of this process's cores to the producer, and to the plain
server, which computes alone; the second half to the consumer). Without it vLLM binds every server's
worker to the same cores, where a hand-off's two sides take turns: a CPU worker keeps polling for its
next step for a second after each one, and the producer's write to Redis and the consumer's read then
run several times slower than alone.

Absolute seconds depend on the machine and what else runs on it (the three servers share its cores);
the ratios between columns of one run are the result.

Where a TTFT went inside the server comes from vLLM's own per-request histograms on each server's
`/metrics`, read before and after the request: ``vllm:request_queue_time_seconds`` (queued until first
scheduled to compute: for a hand-off, the wait for the records, their load and the steps until vLLM
schedules the rest of the prompt) and ``vllm:request_prefill_time_seconds`` (scheduled until the first
token); the rest of the client's TTFT is the API server's own work and the HTTP round trip.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.bench.pd.client import SERVED, TOKEN_RANGE, complete, metric_sum, promised_tokens

CHUNK_SIZE = 256
BLOCK_SIZE = 32  # the servers' --block-size (`Server`'s)


def worker_cores(cores: list[int]) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` of each server for ``--bind``: the producer and the plain server share
    the first half of ``cores`` (the plain server computes only while the others are idle), the consumer
    has the second half."""
    if len(cores) < 2:
        raise SystemExit(f"tiercache bench pd: --bind needs at least 2 cores; this process may use {len(cores)}")
    half = len(cores) // 2
    first, second = ",".join(map(str, cores[:half])), ",".join(map(str, cores[half:]))
    return {"plain": first, "producer": first, "consumer": second}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default="2048,8192", help="prompt lengths in tokens (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=3, help="measured prompts per length (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smoke run: the 2-layer tiny model, 512-token prompts")
    parser.add_argument("--wait-ms", type=float, default=1000.0, help="the consumer's handoff_wait_ms")
    parser.add_argument("--bind", action="store_true",
                        help="give the producer's and the consumer's vLLM workers cores of their own (the plain "
                             "server shares the producer's): VLLM_CPU_OMP_THREADS_BIND; needs 2 cores or more")
    parser.add_argument("--reserved-cpus", type=int, default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every server (the same for all: comparable)")
    parser.add_argument("--work-dir", help="where the model, logs and traces go (default: a temp dir)")
    parser.add_argument("--handoffs", type=int, default=0, metavar="N",
                        help="instead of timing: N prompts (--lengths in turn) through tiercache pd-proxy, counted "
                             "(tokens taken from the store, fallbacks, silent recomputes) and each output compared "
                             "with the plain server's (tools/bench/pd/handoffs.py)")
    parser.add_argument("--redis-cluster", action="store_true",
                        help="the shared tier on a local Redis Cluster (3 masters + 3 replicas) instead of one "
                             "redis-server (the raw-read column is then n/a)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def kv_bytes(model: Path, tokens: int, itemsize: int = 2) -> int:
    """The KV bytes of ``tokens`` tokens of every layer, from the model's config.json."""
    config = json.loads((model / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim * itemsize * tokens


def _handoff_wait(server: Any) -> tuple[float, float, float]:
    """(seconds waited in all, hand-off loads, records waited for) from the consumer's `/metrics`."""
    text = server.metrics()
    prefix = "vllm:tiercache_kv_handoff_"
    return (metric_sum(text, prefix + "wait_seconds_sum"), metric_sum(text, prefix + "wait_seconds_count"),
            metric_sum(text, prefix + "records_waited_total"))


#: vLLM's per-request histograms whose sums split a TTFT inside the server (module docstring)
QUEUE_SUM, PREFILL_SUM = "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum"


def _engine_split(server: Any, tokens: list[int], params: dict[str, Any] | None = None
                  ) -> tuple[float, Any, float, float]:
    """`complete` one request on ``server`` and return (its client seconds, its answer, its queued seconds,
    its prefill seconds), the last two from the server's `/metrics` before and after (vLLM records a
    request's stats as it finishes, before its response goes out)."""
    before = server.metrics()
    seconds, answer = complete(server.base_url, tokens, params)
    after = server.metrics()
    return (seconds, answer, metric_sum(after, QUEUE_SUM) - metric_sum(before, QUEUE_SUM),
            metric_sum(after, PREFILL_SUM) - metric_sum(before, PREFILL_SUM))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def format_table(report: dict[str, Any]) -> str:
    """The human table: one row per prompt length, the decode's ratios against the other columns."""
    lines = [f"tiercache bench pd: {report['model']}, {report['prompts']} prompts per length, medians; "
             f"the consumer waits at most {report['wait_ms']:.0f} ms",
             "",
             "| prompt | plain prefill | resident hit | raw redis-py read | decode (hand-off) | decode / plain "
             "| decode / (resident + 1.5 x raw) | decode load: wait + reads + copies "
             "| resident in vLLM: queued + prefill | decode in vLLM: queued + prefill | fallbacks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.0f} ms"

    def ratio(a: float | None, b: float | None) -> str:
        return "n/a" if a is None or not b else f"{a / b:.2f}x"

    for row in report["rows"]:
        resident, raw = row["resident_s"], row["redis_s"]
        bound = None if resident is None or raw is None else resident + 1.5 * raw
        load = "n/a" if row["fetch_s"] is None else (
            f"{ms(row['wait_s'])} + {ms(row['fetch_s'])} + {ms(row['copy_s'])}")
        lines.append(f"| {row['tokens']} | {ms(row['plain_s'])} | {ms(row['resident_s'])} | {ms(row['redis_s'])} "
                     f"| {ms(row['decode_s'])} | {ratio(row['decode_s'], row['plain_s'])} "
                     f"| {ratio(row['decode_s'], bound)} | {load} "
                     f"| {ms(row.get('resident_queued_s'))} + {ms(row.get('resident_prefill_s'))} "
                     f"| {ms(row.get('decode_queued_s'))} + {ms(row.get('decode_prefill_s'))} | {row['fallbacks']} |")
    lines += ["", "Targets: decode / plain <= 0.10x; decode / (resident + 1.5 x raw) <= 1.00x. "
              f"Every server: VLLM_CPU_NUM_OF_RESERVED_CPU={report['reserved_cpus']}, the same machine's cores"
              + (f"; workers bound to cores {report['bind']}." if report.get("bind") else "; workers bound by vLLM.")]
    return "\n".join(lines)


class PDBench:
    """Starts the servers, sends the prompts, builds the report."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        #: each server's VLLM_CPU_OMP_THREADS_BIND with --bind, else None (vLLM binds them)
        self.bind = worker_cores(sorted(os.sched_getaffinity(0))) if getattr(args, "bind", False) else None
        self.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        if args.quick and not args.handoffs:
            self.lengths = [512]
        if args.handoffs < 0 or not self.lengths or min(self.lengths) < 2:
            raise SystemExit("tiercache bench pd: --handoffs must be >= 0 and --lengths positive token counts")
        self.rng = random.Random(20261126)

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(*TOKEN_RANGE) for _ in range(length)]

    def server(self, model: Path, name: str, role: str | None, redis_url: str, extra_env: dict[str, str]) -> Any:
        from vllm_tiercache.tools.demo.prompts import CHAT_TEMPLATE
        from vllm_tiercache.tools.demo.server import Server

        template = self.work / "chat_template.jinja"
        template.write_text(CHAT_TEMPLATE)
        kv = None
        if role is not None:
            kv = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "vllm_tiercache.kvcache.connector",
                  "kv_role": role, "kv_connector_extra_config": {
                      "namespace": "bench-pd", "chunk_size": CHUNK_SIZE, "handoff_wait_ms": self.args.wait_ms,
                      "tiers": [{"kind": "memory", "capacity": "2GiB"}, {"kind": "redis", "url": redis_url}]}}
        extra = ["--dtype", "bfloat16"]
        if role is None:
            extra.append("--enable-prefix-caching")  # the plain server's resident hits
        server = Server(model, self.work / f"{name}.log", served_name=SERVED, chat_template=template,
                        max_model_len=max(self.lengths) + 64, kv_transfer=kv, extra_args=extra)
        server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(self.args.reserved_cpus)
        if self.bind:
            server.env["VLLM_CPU_OMP_THREADS_BIND"] = self.bind[name]
        server.env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        server.env.update(extra_env)
        return server

    def run(self) -> dict[str, Any]:
        from vllm_tiercache.kvcache.load.trace import LOAD_TRACE_ENV, read_load_trace
        from vllm_tiercache.tools.bench.kv.medium import redis_get_s
        from vllm_tiercache.tools.redis_server import LocalRedisCluster, RedisServer
        from vllm_tiercache.tools.tiny_models.llama import BENCH_SPEC, TinyLlamaSpec, make_tiny_llama

        # bench kv's 12-layer model, its positions raised for the longest prompt (no weight depends on them)
        positions = max(4096, max(self.lengths) + 64)
        base = TinyLlamaSpec() if self.args.quick else BENCH_SPEC
        spec = dataclasses.replace(base, max_position_embeddings=positions)
        model = make_tiny_llama(self.work / f"model-{'quick' if self.args.quick else 'bench'}-{positions}", spec)
        trace = self.work / "consumer-loads.jsonl"
        rows = []
        handoffs: dict[str, Any] = {}
        with LocalRedisCluster() if self.args.redis_cluster else RedisServer() as redis_server:
            url = redis_server.url
            plain = self.server(model, "plain", None, url, {})
            producer = self.server(model, "producer", "kv_producer", url, {})
            consumer = self.server(model, "consumer", "kv_consumer", url, {LOAD_TRACE_ENV: str(trace)})
            with plain, producer, consumer:
                for server in (plain, producer, consumer):
                    server.wait_healthy()
                print("servers up", file=sys.stderr, flush=True)
                if self.args.handoffs:
                    from vllm_tiercache.tools.bench.pd.handoffs import run_handoffs

                    handoffs = run_handoffs(
                        plain=plain, producer=producer, consumer=consumer, served=SERVED, lengths=self.lengths,
                        count=self.args.handoffs, prompt=self.prompt, block_size=BLOCK_SIZE,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
                for length in [] if self.args.handoffs else self.lengths:
                    rows.append(self.measure(length, plain, producer, consumer, trace, read_load_trace))
                    rows[-1]["redis_s"] = (None if self.args.redis_cluster else
                                           redis_get_s(kv_bytes(model, promised_tokens(length, BLOCK_SIZE)), url))
                    print(f"{length} tokens done", file=sys.stderr, flush=True)
        report = {"model": "tiny Llama" if self.args.quick else "BENCH_SPEC (12 layers)", "prompts": self.args.prompts,
                  "redis": "a 3+3 Redis Cluster" if self.args.redis_cluster else "one redis-server",
                  "wait_ms": self.args.wait_ms, "reserved_cpus": self.args.reserved_cpus, "bind": self.bind,
                  "rows": rows}
        if self.args.handoffs:
            report["handoff_run"] = handoffs
        return report

    def measure(self, length: int, plain: Any, producer: Any, consumer: Any, trace: Path,
                read_load_trace: Any) -> dict[str, Any]:
        times: dict[str, list[float]] = {"plain": [], "resident": [], "prefill": [], "decode": [],
                                         "resident_queued": [], "resident_prefill": [], "decode_queued": [],
                                         "decode_prefill": []}
        fetch: list[float] = []
        copy: list[float] = []
        fallbacks = 0
        offset = trace.stat().st_size if trace.exists() else 0
        waits: list[float] = []
        for i in range(self.args.prompts + 1):  # the first prompt of each length is a warm-up
            tokens = self.prompt(length)
            plain_s, _ = complete(plain.base_url, tokens)
            resident_s, _, resident_queued, resident_prefill = _engine_split(plain, tokens)
            prefill_s, answer = complete(producer.base_url, tokens,
                                          {"do_remote_decode": True, "do_remote_prefill": False})
            wait_before = _handoff_wait(consumer)
            decode_s, _, decode_queued, decode_prefill = _engine_split(consumer, tokens,
                                                                       answer.get("kv_transfer_params"))
            for _ in range(50):  # the wait reaches /metrics with a later engine step's stats
                wait_after = _handoff_wait(consumer)
                if wait_after[1] > wait_before[1]:
                    break
                complete(consumer.base_url, self.prompt(8))
            waits.append(wait_after[0] - wait_before[0])
            lines, offset = read_load_trace(str(trace), offset) if trace.exists() else ([], offset)
            if i == 0:
                continue
            for name, value in (("plain", plain_s), ("resident", resident_s), ("prefill", prefill_s),
                                ("decode", decode_s), ("resident_queued", resident_queued),
                                ("resident_prefill", resident_prefill), ("decode_queued", decode_queued),
                                ("decode_prefill", decode_prefill)):
                times[name].append(value)
            fetch += [line["fetch_s"] for line in lines]
            copy += [line["copy_s"] for line in lines]
            fallbacks += sum(1 for line in lines if line.get("failed"))
        return {"tokens": length, "plain_s": _median(times["plain"]), "resident_s": _median(times["resident"]),
                "prefill_s": _median(times["prefill"]), "decode_s": _median(times["decode"]),
                "resident_queued_s": _median(times["resident_queued"]),
                "resident_prefill_s": _median(times["resident_prefill"]),
                "decode_queued_s": _median(times["decode_queued"]),
                "decode_prefill_s": _median(times["decode_prefill"]),
                "fetch_s": _median(fetch), "copy_s": _median(copy), "wait_s": _median(waits[1:]),
                "fallbacks": fallbacks}


def run(args: argparse.Namespace) -> int:
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        report = PDBench(args, work).run()
    else:
        with tempfile.TemporaryDirectory(prefix="tiercache-bench-pd-") as tmp:
            report = PDBench(args, Path(tmp)).run()
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.handoffs:
        from vllm_tiercache.tools.bench.pd.handoffs import format_handoffs

        print(format_handoffs(report))
    else:
        print(format_table(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
