"""`tiercache bench route`: does a router that reads the tiers' events send a prompt where it is fastest?

Two real OpenAI servers, A (worker 1) and B (worker 2), run TieredKVConnector over a memory tier of their
own and one shared redis-server, with vLLM's KV event publisher on (zmq); NVIDIA Dynamo's standalone
indexer (`router_index`) subscribes to both, as a Dynamo router would. vLLM's own KV cache holds one
prompt, so it soon lets every document go: what remains is each instance's memory tier, and Redis that
both can read.

1. Home: document i is sent to A when i is even, to B when odd (its KV lands in that instance's memory
   tier and in Redis). One filler prompt per instance then pushes the last document out of vLLM's cache.
2. Route: for each document with a new question, the indexer is asked; the router's pick is the instance
   with the longest host-tier (``cpu``) match, then the longest lower-tier (``disk``) match: host above
   disk, as Dynamo's tier weights rank them (its router sums weighted overlaps; with documents of one
   length both orders agree). The prompt is sent to the pick, and the same document with
   another question to the other instance (which can load it from Redis), and a fresh document of the
   same length to the pick (what neither cache helps: the prefill).

Printed: per document the indexer's matches per instance and tier, the pick, and each request's time to
first token and reused tokens; then the medians and their ratios. Timings are printed, never asserted
(CI's quick run checks only the counts: tests/tools/bench/test_route.py). The requests run one at a
time with a pause between them (a vLLM CPU worker keeps polling for a second after its last step, and
would otherwise slow the other server).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.bench.pd.client import TOKEN_RANGE
from vllm_tiercache.tools.bench.router_index import (
    INSTALL_HINT,
    TIERS,
    Completion,
    DynamoIndexer,
    RouterIndexError,
    complete,
    events_config,
    wait_until_indexed,
)
from vllm_tiercache.tools.cli import UsageError, int_at_least

SERVED = "bench-route"
BLOCK_SIZE = 32  # the servers' --block-size (`Server`'s)
CHUNK_SIZE = 256
QUESTION_TOKENS = 24
#: Seconds between requests: the other server's CPU worker stops polling, the events of the last step go out.
PAUSE_S = 1.5
WORKERS = (1, 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--docs", type=int_at_least(2, 1000), default=6,
                        help="documents, homed on A and B in turn (default %(default)s)")
    parser.add_argument("--doc-tokens", type=int_at_least(CHUNK_SIZE, 32_000), default=2048,
                        help="tokens per document (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smoke run: the 2-layer tiny model, 4 documents of 512")
    parser.add_argument("--reserved-cpus", type=int, default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU of both servers (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="document seed (default %(default)s)")
    parser.add_argument("--work-dir", help="model, logs (default: a temp dir, removed afterwards)")
    parser.add_argument("--json", type=Path, dest="json_path", help="also write the results as JSON here")


@dataclasses.dataclass
class _Row:
    doc: int
    home: int
    matches: dict[int, dict[str, int]]
    pick: int
    picked: Completion
    other: Completion
    cold: Completion


def pick_worker(matches: dict[int, dict[str, int]], workers: tuple[int, ...] = WORKERS) -> int:
    """A router's choice from the indexer's answer: the longest host-tier match, then the longest lower-tier
    match (Dynamo's tiers are cumulative, so these include the GPU's), then the lowest worker id."""
    return max(workers, key=lambda w: (matches.get(w, {}).get("cpu", 0), matches.get(w, {}).get("disk", 0), -w))


class RouteBench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.rng = random.Random(args.seed)
        self.doc_tokens = 512 if args.quick else args.doc_tokens
        self.docs = 4 if args.quick else args.docs

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    def _server(self, model: Path, name: str, redis_url: str, zmq_port: int, max_model_len: int) -> Any:
        from vllm_tiercache.tools.demo.prompts import CHAT_TEMPLATE
        from vllm_tiercache.tools.demo.server import Server

        template = self.work / "chat_template.jinja"
        template.write_text(CHAT_TEMPLATE)
        kv = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "vllm_tiercache.kvcache.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": {
                  "namespace": "bench-route", "chunk_size": CHUNK_SIZE,
                  "tiers": [{"kind": "memory", "capacity": "2GiB"}, {"kind": "redis", "url": redis_url}]}}
        # vLLM's own cache: one prompt and a little more, so the documents leave it (the tiers keep them)
        blocks = max_model_len // BLOCK_SIZE + 4
        server = Server(model, self.work / f"server-{name}.log", served_name=SERVED, chat_template=template,
                        max_model_len=max_model_len, kv_transfer=kv,
                        extra_args=["--enable-prefix-caching", "--num-gpu-blocks-override", str(blocks),
                                    "--kv-events-config", json.dumps(events_config(zmq_port))])
        server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(self.args.reserved_cpus)
        return server

    def _send(self, server: Any, tokens: list[int]) -> Completion:
        time.sleep(PAUSE_S)
        return complete(server.base_url, SERVED, tokens)

    def run(self) -> dict[str, Any]:
        from vllm_tiercache.tools.demo.server import free_port
        from vllm_tiercache.tools.redis_server import RedisServer
        from vllm_tiercache.tools.tiny_models.llama import BENCH_SPEC, TinyLlamaSpec, make_tiny_llama

        spec = TinyLlamaSpec() if self.args.quick else BENCH_SPEC
        model = make_tiny_llama(self.work / f"model-{'quick' if self.args.quick else 'bench'}", spec)
        max_model_len = -(-(self.doc_tokens + 2 * QUESTION_TOKENS + 64) // BLOCK_SIZE) * BLOCK_SIZE
        docs = [self.tokens(self.doc_tokens) for _ in range(self.docs)]
        ports = {worker: free_port() for worker in WORKERS}
        rows: list[_Row] = []
        with RedisServer() as redis_server:
            servers = {w: self._server(model, "AB"[w - 1], redis_server.url, ports[w], max_model_len)
                       for w in WORKERS}
            with servers[1], servers[2]:
                for server in servers.values():
                    server.wait_healthy()
                with DynamoIndexer(ports, block_size=BLOCK_SIZE, model_name=SERVED,
                                   log_path=self.work / "indexer.log") as indexer:
                    _progress("servers and indexer up; warming up")
                    for worker, server in servers.items():  # first-request costs, outside the measurement
                        wait_until_indexed(indexer, server.base_url, SERVED, worker, block_size=BLOCK_SIZE)
                        self._send(server, self.tokens(self.doc_tokens + QUESTION_TOKENS))
                    for i, doc in enumerate(docs):
                        self._send(servers[WORKERS[i % 2]], doc + self.tokens(QUESTION_TOKENS))
                    for server in servers.values():  # vLLM's own cache lets the last documents go
                        self._send(server, self.tokens(self.doc_tokens + QUESTION_TOKENS))
                    _progress(f"{len(docs)} documents homed on A and B in turn; routing")
                    for i, doc in enumerate(docs):
                        home = WORKERS[i % 2]
                        prompt = doc + self.tokens(QUESTION_TOKENS)
                        time.sleep(PAUSE_S)
                        matches = indexer.query(prompt)
                        pick = pick_worker(matches)
                        other = WORKERS[1 - WORKERS.index(pick)]
                        picked = self._send(servers[pick], prompt)
                        elsewhere = self._send(servers[other], doc + self.tokens(QUESTION_TOKENS))
                        cold = self._send(servers[pick], self.tokens(self.doc_tokens + QUESTION_TOKENS))
                        rows.append(_Row(i, home, matches, pick, picked, elsewhere, cold))
                        _progress(f"document {i}: home {'AB'[home - 1]}, picked {'AB'[pick - 1]}, TTFT "
                                  f"{picked.ttft_s * 1e3:.0f} ms there, {elsewhere.ttft_s * 1e3:.0f} ms on the other")
        return _report(rows, self.doc_tokens, self.args.quick)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _report(rows: list[_Row], doc_tokens: int, quick: bool) -> dict[str, Any]:
    def median_ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    picked = median_ms([r.picked.ttft_s for r in rows])
    other = median_ms([r.other.ttft_s for r in rows])
    cold = median_ms([r.cold.ttft_s for r in rows])
    return {
        "model": "tiny Llama (2 layers)" if quick else "BENCH_SPEC (12 layers)", "doc_tokens": doc_tokens,
        "rows": [{"doc": r.doc, "home": r.home, "pick": r.pick, "matches": r.matches,
                  "picked": dataclasses.asdict(r.picked), "other": dataclasses.asdict(r.other),
                  "cold": dataclasses.asdict(r.cold)} for r in rows],
        "picked_home": sum(r.pick == r.home for r in rows), "docs": len(rows),
        "ttft_ms": {"picked": picked, "other": other, "cold": cold},
    }


def format_report(report: dict[str, Any]) -> str:
    def tiers(m: dict[str, int]) -> str:
        return "/".join(str(m.get(t, 0)) for t in TIERS)

    lines = [f"bench route: {report['model']}, documents of {report['doc_tokens']} tokens, two instances on one "
             "redis-server; Dynamo's indexer matches per instance as gpu/cpu/disk tokens (cumulative)",
             f"{'doc':>3} {'home':>4} {'A gpu/cpu/disk':>16} {'B gpu/cpu/disk':>16} {'pick':>4} "
             f"{'TTFT pick':>10} {'reused':>7} {'TTFT other':>11} {'reused':>7} {'TTFT cold':>10}"]
    for r in report["rows"]:
        matches = {int(k): v for k, v in r["matches"].items()}
        lines.append(f"{r['doc']:>3} {'AB'[r['home'] - 1]:>4} {tiers(matches.get(1, {})):>16} "
                     f"{tiers(matches.get(2, {})):>16} {'AB'[r['pick'] - 1]:>4} "
                     f"{r['picked']['ttft_s'] * 1e3:>8.0f}ms {r['picked']['cached_tokens']:>7} "
                     f"{r['other']['ttft_s'] * 1e3:>9.0f}ms {r['other']['cached_tokens']:>7} "
                     f"{r['cold']['ttft_s'] * 1e3:>8.0f}ms")
    t = report["ttft_ms"]
    lines.append(f"picked the document's home (its memory tier) for {report['picked_home']}/{report['docs']} documents")
    lines.append(f"TTFT medians: picked {t['picked']:.0f} ms, the other instance (Redis) {t['other']:.0f} ms "
                 f"({t['other'] / t['picked']:.2f}x the pick), a new document (prefill) {t['cold']:.0f} ms "
                 f"({t['cold'] / t['picked']:.2f}x)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("dynamo") is None:
        raise UsageError(INSTALL_HINT)
    try:
        if args.work_dir:
            work = Path(args.work_dir)
            work.mkdir(parents=True, exist_ok=True)
            report = RouteBench(args, work).run()
        else:
            with tempfile.TemporaryDirectory(prefix="tiercache-bench-route-") as tmp:
                report = RouteBench(args, Path(tmp)).run()
    except RouterIndexError as exc:
        print(f"tiercache bench route: error: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json_path:
        args.json_path.write_text(json.dumps(report, indent=1))
        print(f"json: {args.json_path}")
    return 0
