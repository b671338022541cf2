"""`tiercache demo` (and `make demo`): RAG serving with both caches, end to end, on a fresh machine.

What it shows, with real parts only (a real `api_server`, the real `openai` client, real files):

1. models: a BLIP-2-style model generated locally with random weights (no download). Its vision tower is
   ViT-B/16-sized, so encoding a page costs real CPU time, and its language model is big enough that a
   ~900-token prefill costs clearly more than loading the prefix's KV.
2. corpus: N synthetic document pages, each a PNG and a text (`vllm_tiercache.tools.demo.corpus`).
3. precompute: the page images into the encoder cache (`vllm_tiercache.tools.precompute.ec.precompute_images`) and the
   document prompts into the KV cache (`vllm_tiercache.tools.precompute.kv.precompute_docs`), in fresh processes, into
   the demo's store (disk tier under the work dir; no Redis).
4. serve and measure: a Zipf trace of RAG queries (page image + its text + a question) goes through the
   OpenAI API to a server without our connectors ("no cache"), then to a consumer server with
   `TieredKVConnector` (kv_consumer) and `TieredECConnector` (ec_consumer). One server at a time, on a
   2-core machine, so one cannot slow the other down. TTFT is read from the stream.
5. report: a table (TTFT median/p90 per serving path, hit rates, ratio to no cache) and the same as a PNG.

The baseline server starts while the precompute jobs run (its start-up is mostly imports); nothing is
measured until both are done. Servers run in their own process groups, which are killed on every exit
path (`vllm_tiercache.tools.demo.server`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.demo.corpus import Document, make_corpus
from vllm_tiercache.tools.demo.load import Query, Result, run_queries, zipf_trace
from vllm_tiercache.tools.demo.prompts import CHAT_TEMPLATE
from vllm_tiercache.tools.demo.report import build_rows, connector_stats, format_table, subtract_stats, write_plot
from vllm_tiercache.tools.demo.server import Server, ServerError

MAX_MODEL_LEN = 1024  # the generated OPT language model has 1024 positions
SERVED_NAME = "tiercache-demo-blip2"
#: The language model behind the large vision tower: 4 OPT layers of width 1024 (head size 64).
TEXT_LAYERS = 4


class DemoError(RuntimeError):
    """A failure the demo explains in one message (bad option, server or job that failed)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "RAG serving demo: precompute page images and documents, then compare TTFT " \
                         "without and with tiercache on a real OpenAI-compatible vLLM server."
    parser.add_argument("--work-dir", type=Path, default=Path(".tiercache/demo"),
                        help="models, corpus, store, logs, results and the plot (default: %(default)s)")
    parser.add_argument("--docs", type=int, default=None, help="documents in the corpus (default 12, quick 4)")
    parser.add_argument("--queries", type=int, default=None, help="queries per run (default 30, quick 12)")
    parser.add_argument("--quick", action="store_true",
                        help="small corpus, trace and model: the tests' tiny BLIP-2 instead of the ViT-B/16 vision "
                             "tower (the test suite uses it; its timings say nothing)")
    parser.add_argument("--keep-server", action="store_true",
                        help="leave the tiercache consumer server running at the end (prints how to stop it)")
    parser.add_argument("--zipf-alpha", type=float, default=1.1, help="popularity skew (default %(default)s)")
    parser.add_argument("--visual-every", type=int, default=4,
                        help="every N-th query is a page-only question (image, no text), 0 for none "
                             "(default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="corpus and trace seed (default %(default)s)")


def _validate(args: argparse.Namespace) -> tuple[int, int]:
    docs = args.docs if args.docs is not None else (4 if args.quick else 12)
    queries = args.queries if args.queries is not None else (12 if args.quick else 30)
    if docs < 1 or docs > 500:
        raise DemoError(f"--docs must be between 1 and 500, got {docs}")
    if queries < 1 or queries > 2000:
        raise DemoError(f"--queries must be between 1 and 2000, got {queries}")
    if args.visual_every < 0:
        raise DemoError(f"--visual-every must be 0 (none) or positive, got {args.visual_every}")
    if not args.zipf_alpha >= 0:
        raise DemoError(f"--zipf-alpha must be >= 0, got {args.zipf_alpha}")
    work = args.work_dir
    if work.exists() and not work.is_dir():
        raise DemoError(f"--work-dir {work} exists and is not a directory")
    try:
        work.mkdir(parents=True, exist_ok=True)
        probe = work / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise DemoError(f"--work-dir {work} is not writable: {exc}") from exc
    return docs, queries


class _Progress:
    """Phase lines with the time since the demo started: what is running now, and how long things took."""

    def __init__(self, total: int) -> None:
        self.start = time.monotonic()
        self.total = total
        self.n = 0

    def phase(self, text: str) -> None:
        self.n += 1
        print(f"[{self.elapsed():6.1f}s] ({self.n}/{self.total}) {text}", flush=True)

    def note(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s]        {text}", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def _store_configs(store_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(consumer, producer) store configs: same namespace and chunk size, so the same keys.

    The producers write the disk tier only: it is what outlives their processes, and writing it directly
    (not through the background queue behind a memory tier) means nothing is lost when they exit.
    """
    disk = {"kind": "disk", "path": str(store_dir), "capacity": "4GiB"}
    # chunk_size 64 (two blocks): small, so little of a document's prefix is lost to the last partial chunk,
    # but larger than the image's 32 tokens. With 32, a page-only query would find the page's first block
    # (the image tokens) in the KV store and never need the encoder cache, which the demo also shows.
    common = {"namespace": "demo", "chunk_size": 64}
    consumer = {**common, "tiers": [{"kind": "memory", "capacity": "1GiB"}, disk]}
    producer = {**common, "tiers": [disk]}
    return consumer, producer


def _spawn_job(spec: dict[str, Any], work: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    spec_path = work / "jobs" / f"{name}.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec["out"] = str(work / "jobs" / f"{name}.result.json")
    Path(spec["out"]).unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    log_path = work / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("TIERCACHE_STATS_DIR", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_tiercache.tools.demo.producer", str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    return proc, log_path


def _run_jobs(jobs: list[tuple[str, dict[str, Any]]], work: Path, progress: _Progress,
              children: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    """Run the producer jobs side by side; raise DemoError with the log tail if one fails.

    Side by side because most of a job's time is vLLM's start-up (imports, one core each), so two jobs
    and the booting baseline server share the 2 cores better than one after the other.
    """
    started = time.monotonic()
    running = []
    for name, spec in jobs:
        proc, log_path = _spawn_job(spec, work, name)
        children.append(proc)
        running.append((name, spec, proc, log_path))
    summaries: dict[str, Any] = {}
    pending = list(running)
    deadline = time.monotonic() + 900
    while pending:
        if time.monotonic() > deadline:
            raise DemoError(f"producer jobs {[p[0] for p in pending]} did not finish within 900 s")
        for item in list(pending):
            name, spec, proc, log_path = item
            code = proc.poll()
            if code is None:
                continue
            pending.remove(item)
            _kill_group(proc)  # the job's own engine processes, should any outlive it
            out = Path(spec["out"])
            if code != 0 or not out.exists():
                tail = log_path.read_text(errors="replace")[-4000:]
                raise DemoError(f"producer job {name!r} failed (exit code {code}); log {log_path}:\n{tail}")
            summary = json.loads(out.read_text())
            summaries[name] = summary
            failed = summary.get("failed") or []
            progress.note(f"{name}: {summary.get('stored', 0)} stored, {summary.get('skipped', 0)} skipped, "
                          f"{len(failed)} failed, {summary.get('bytes_stored', 0) / 2**20:.1f} MiB "
                          f"({time.monotonic() - started:.0f}s)")
            if failed:
                raise DemoError(f"producer job {name!r} could not precompute {failed[:3]}; log {log_path}")
        time.sleep(0.5)
    return summaries


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _warmup(server: Server, docs: list[Document], work: Path) -> None:
    """One request on a page outside the corpus: pays first-request costs without touching the trace's entries."""
    from vllm_tiercache.tools.demo.corpus import make_corpus as _make

    extra = _make(work / "warmup", 1, seed=10_000)
    extra = [Document(-1, extra[0].text_path, extra[0].image_path)]
    results = run_queries(server.base_url, SERVED_NAME, extra, [Query(-1, "Warm up.", visual=False)], max_tokens=2)
    if results[0].error:
        raise DemoError(f"the warm-up request to {server.base_url} failed: {results[0].error}\n{server.log_tail()}")


def _trace_progress(label: str, total: int) -> Any:
    """A callback printing one compact line every few queries (tqdm would fill a captured log with \\r)."""
    done: list[Result] = []
    step = max(1, total // 4)

    def on_result(result: Result) -> None:
        done.append(result)
        if len(done) % step == 0 or len(done) == total:
            ok = [r.ttft_s for r in done if r.ttft_s is not None]
            failed = sum(1 for r in done if r.error)
            last = f"{ok[-1] * 1e3:.0f}ms" if ok else "-"
            print(f"           {label}: {len(done)}/{total} queries, last TTFT {last}, failed {failed}", flush=True)

    return on_result


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except DemoError as exc:
        print(f"tiercache demo: error: {exc}", file=sys.stderr)
        return 1
    except ServerError as exc:
        print(f"tiercache demo: server error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tiercache demo: interrupted; servers and jobs stopped", file=sys.stderr)
        return 130


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # same clean-up path as Ctrl-C


def _run(args: argparse.Namespace) -> int:
    n_docs, n_queries = _validate(args)
    work: Path = args.work_dir.resolve()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    # Python leaves SIGINT ignored when it was ignored at start (background jobs of a script): restore the
    # KeyboardInterrupt handler so Ctrl-C / kill -INT always takes the clean-up path below.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    children: list[subprocess.Popen[bytes]] = []
    servers: list[Server] = []
    progress = _Progress(total=6)
    kept: Server | None = None
    try:
        print(f"tiercache demo: {n_docs} documents, {n_queries} queries per run, work dir {work}", flush=True)
        # ---- 1. models and corpus
        from vllm_tiercache.tools.tiny_models.blip2 import LARGE_VISION_SPEC, TinyBlip2Spec, make_tiny_blip2

        # --quick proves the pipeline, not the speed-up: the tiny model runs it in a fraction of the CPU time
        # (a ViT-B/16 tower encodes an image in about a second on a 2-core machine)
        if args.quick:
            spec, name, about = TinyBlip2Spec(seed=7), "rag-blip2-tiny", "tiny BLIP-2"
        else:
            spec = replace(LARGE_VISION_SPEC, text_layers=TEXT_LAYERS, seed=7)
            name, about = "rag-blip2", "ViT-B/16 vision tower + 4-layer OPT"
        progress.phase(f"generating the model (random weights, {about}) and corpus")
        with contextlib.redirect_stderr(io.StringIO()):  # transformers' "Writing model shards" bars
            model = make_tiny_blip2(work / "models" / name, spec=spec)
        docs = make_corpus(work / "corpus", n_docs, seed=args.seed)
        template = work / "chat_template.jinja"
        template.write_text(CHAT_TEMPLATE)
        store_dir = work / "store"
        shutil.rmtree(store_dir, ignore_errors=True)  # every run measures a store filled by this run's producers
        consumer_store, producer_store = _store_configs(store_dir)
        trace = zipf_trace(n_docs, n_queries, alpha=args.zipf_alpha, visual_every=args.visual_every,
                           seed=args.seed)
        progress.note(f"model {model}, corpus {work / 'corpus'} ({n_docs} pages + texts)")

        # ---- 2. precompute (while the baseline server boots)
        jobs = [("precompute-images", {"job": "images", "model": str(model), "store": producer_store,
                                       "images": [str(d.image_path) for d in docs]}),
                ("precompute-docs", {"job": "docs", "model": str(model), "store": producer_store,
                                     "docs": [str(d.text_path) for d in docs]})]
        progress.phase(f"precomputing {n_docs} page images and {n_docs} documents into {store_dir}; "
                       "the no-cache server starts meanwhile")
        baseline = Server(model, work / "logs" / "server-nocache.log", served_name=SERVED_NAME,
                          chat_template=template, max_model_len=MAX_MODEL_LEN)
        servers.append(baseline)
        baseline.start()
        summaries = _run_jobs(jobs, work, progress, children)

        # ---- 3. no-cache run
        progress.phase(f"no-cache run: waiting for {baseline.base_url}/health, then {n_queries} queries")
        boot = baseline.wait_healthy()
        progress.note(f"server healthy ({boot:.1f}s after the precompute finished)")
        _warmup(baseline, docs, work)
        base_results = run_queries(baseline.base_url, SERVED_NAME, docs, trace,
                                   on_result=_trace_progress("no cache", n_queries))
        baseline.stop()

        # ---- 4. tiercache run
        stats_dir = work / "stats" / "tiercache"
        shutil.rmtree(stats_dir, ignore_errors=True)
        cached = Server(
            model, work / "logs" / "server-tiercache.log", served_name=SERVED_NAME, chat_template=template,
            max_model_len=MAX_MODEL_LEN, stats_dir=stats_dir,
            kv_transfer={"kv_connector": "TieredKVConnector", "kv_role": "kv_consumer",
                         "kv_connector_extra_config": consumer_store},
            ec_transfer={"ec_connector": "TieredECConnector", "ec_role": "ec_consumer",
                         "ec_connector_extra_config": consumer_store},
            ec_manager={"encoder_cache_manager_cls": "vllm_tiercache.eccache.managers.LFUEncoderCacheManager"},
        )
        servers.append(cached)
        progress.phase("tiercache run: consumer server with TieredKVConnector + TieredECConnector, "
                       f"then the same {n_queries} queries")
        cached.start()
        boot = cached.wait_healthy()
        progress.note(f"server healthy after {boot:.1f}s ({cached.base_url})")
        _warmup(cached, docs, work)
        time.sleep(1.0)  # let the throttled stats files catch up, then count only the trace from here
        stats_before = connector_stats(stats_dir)
        tc_results = run_queries(cached.base_url, SERVED_NAME, docs, trace,
                                 on_result=_trace_progress("tiercache", n_queries))
        metrics_text = cached.metrics()
        if args.keep_server:
            kept = cached
            servers.remove(cached)
        else:
            cached.stop()  # SIGINT: the connectors flush and write their final stats files

        # ---- 5. report
        progress.phase("report")
        stats = subtract_stats(connector_stats(stats_dir), stats_before)
        rows = build_rows(base_results, tc_results)
        table = format_table(rows, stats)
        plot = write_plot(rows, base_results, tc_results, work / "demo-ttft.png")
        (work / "metrics-tiercache.txt").write_text(metrics_text)
        (work / "results.json").write_text(json.dumps({
            "docs": n_docs, "queries": n_queries, "precompute": summaries, "stats": stats,
            "rows": [{k: v for k, v in r.items() if k != "ttfts"} for r in rows],
            "no_cache": [_result_dict(r) for r in base_results],
            "tiercache": [_result_dict(r) for r in tc_results],
        }, indent=1, default=str))
        print()
        print(table)
        print()
        print(f"plot:    {plot}")
        print(f"results: {work / 'results.json'}   server logs: {work / 'logs'}")
        tc_metrics = [line for line in metrics_text.splitlines()
                      if line.startswith("vllm:tiercache_") and not line.rstrip().endswith(" 0.0")]
        if tc_metrics:
            print(f"/metrics of the tiercache server: {len(tc_metrics)} non-zero vllm:tiercache_* samples "
                  f"(saved to {work / 'metrics-tiercache.txt'})")

        # ---- 6. verdict
        failed = sum(1 for r in base_results + tc_results if r.error)
        hit_tokens = sum(r.cached_tokens for r in tc_results)
        progress.phase(f"done in {progress.elapsed():.0f}s")
        if kept is not None:
            pgid = kept.proc.pid if kept.proc else "?"
            print(f"tiercache server left running at {kept.base_url} (process group {pgid}); "
                  f"stop it with: kill -INT -- -{pgid}")
        if failed:
            errors = sorted({r.error for r in base_results + tc_results if r.error})
            print(f"tiercache demo: {failed} requests failed: {errors[:3]}", file=sys.stderr)
            return 1
        if hit_tokens == 0:
            print("tiercache demo: the consumer loaded nothing from the store (0 cached prompt tokens); "
                  f"see {cached.log_path}", file=sys.stderr)
            return 1
        return 0
    finally:
        for server in servers:
            server.stop(grace_s=10.0)
        for proc in children:
            if proc.poll() is None:
                _kill_group(proc)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _result_dict(r: Result) -> dict[str, Any]:
    return {**asdict(r.query), "ttft_s": r.ttft_s, "total_s": r.total_s, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "error": r.error}
