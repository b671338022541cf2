"""`tiercache bench admission`: what admission to the slower tiers saves and costs, on bench serve's trace.

The question: with many one-off prompts among the repeated ones, how many bytes do the disk and Redis
tiers stop receiving when they admit only records used again (``admission: {policy: seen}``), and how
much of the repeated prompts' hits is lost for it? Each case (``--policies``: ``always`` and ``seen:N``)
replays the same request stream through a real `TieredStore` (memory, then a disk directory and a
private redis-server, both with the case's admission), in one process, one case after the other.

The stream: `tiercache bench serve`'s trace (`serve_trace.make_workload`: multi-turn sessions over a
Zipf-popular document pool, each turn resending the conversation; ``--users`` sessions at a time, their
turns interleaved), with one-off prompts (a document of the same length that no one asks about again)
mixed in at random until they are ``--one-off-share`` of the requests. Tokens are bytes, as with the
generated models' tokenizer. Each request does what the KV connector does with the store: full chunks of
``--chunk-size`` tokens, named by a chain hash of the prefix, one record per layer; the longest prefix of
chunks every layer of which the store returns (`get_many`, a load) is a hit, the rest is stored
(`put_many`, owned, with the share of the prompt's chunks that hit as each record's reused share, as
the KV saver does). The writer is flushed after each request, so no write is
dropped for a full queue and the counts are exact.

What it leaves out: vLLM's own prefix cache (in a server it answers some repeats before the store is
asked, so a repeat reaches the store later, or not at all), time (`tiercache bench kv` measures the
miss that stores) and other processes (a second instance's misses on records this one kept in memory).

Printed per case: bytes written to disk and to Redis, the records refused, the hit ratio (hit chunks /
full chunks) of the repeated prompts and of the one-off prompts, the share of the records hit that the
memory tier served (a hit from disk or Redis costs a read), and against the first case: the slower
tiers' bytes and the repeated prompts' hit ratio in points.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_tiercache.shared.store import build_store
from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.tools.bench.serve.trace import make_workload, messages_for, render
from vllm_tiercache.tools.cli import UsageError, float_in, int_at_least
from vllm_tiercache.tools.demo.corpus import sentences
from vllm_tiercache.tools.redis_server import optional_redis_url

if TYPE_CHECKING:
    from vllm_tiercache.shared.store.tiered import TieredStore

MIB = float(1 << 20)


def policy_arg(text: str) -> list[tuple[str, dict[str, Any]]]:
    """argparse ``type=``: ``always,seen:2,seen:3`` -> [(label, admission section)]."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, n = part.partition(":")
        if name == "always" and not n:
            out.append((part, {"policy": "always"}))
        elif name == "seen" and n.isdigit() and 2 <= int(n) <= 15:
            out.append((part, {"policy": "seen", "min_seen": int(n)}))
        elif name == "seen-only" and n.isdigit() and 2 <= int(n) <= 15:
            out.append((part, {"policy": "seen", "min_seen": int(n), "reused_prompt_share": None}))
        else:
            raise argparse.ArgumentTypeError(f"{part!r}: a case is always, seen:N or seen-only:N (N from 2 to 15)")
    if not out:
        raise argparse.ArgumentTypeError("name at least one case, e.g. always,seen:2")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", type=policy_arg, default=policy_arg("always,seen:2,seen:3"),
                        help="comma-separated cases, the first the reference: always, seen:N (the default "
                             "reused_prompt_share), seen-only:N (reused_prompt_share off) (default "
                             "always,seen:2,seen:3)")
    add_trace_arguments(parser)
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--one-off-ratio", type=float_in(0.0, 1e6, low_open=True), default=None,
                        help="memory tier capacity = the one-off prompts' bytes / this (default 10: the issue's "
                             "'one-off prompts 10x the memory tier')")
    memory.add_argument("--memory-share", type=float_in(0.0, 10.0, low_open=True), default=None,
                        help="memory tier capacity as a share of the repeated prompts' distinct records instead "
                             "(0.25: bench serve's working set 4x the cache)")
    parser.add_argument("--no-redis", action="store_true", help="memory and disk only (no redis-server)")
    parser.add_argument("--work-dir", type=Path, help="disk tiers (default: a temp dir, removed afterwards)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace's options (`build_stream`), shared with `tiercache bench pins`."""
    parser.add_argument("--one-off-share", type=float_in(0.0, 1.0, high_open=True), default=0.8,
                        help="share of the requests that are one-off prompts, in [0, 1) (default %(default)s)")
    parser.add_argument("--users", type=int_at_least(1, 1024), default=16,
                        help="sessions whose turns interleave (default %(default)s)")
    parser.add_argument("--sessions", type=int_at_least(1, 100_000), default=64,
                        help="conversations (default %(default)s)")
    parser.add_argument("--turns", type=int_at_least(1, 64), default=3, help="turns per conversation (default 3)")
    parser.add_argument("--docs", type=int_at_least(1, 100_000), default=24,
                        help="documents in the pool (default %(default)s)")
    parser.add_argument("--doc-tokens", type=int_at_least(16, 1_000_000), default=512,
                        help="tokens per document, one-off prompts too (default %(default)s)")
    parser.add_argument("--zipf-alpha", type=float_in(0.0, 5.0), default=1.1,
                        help="document popularity skew (default %(default)s)")
    parser.add_argument("--chunk-size", type=int_at_least(16, 1 << 20), default=64,
                        help="tokens per chunk (default %(default)s)")
    parser.add_argument("--layers", type=int_at_least(1, 1024), default=4,
                        help="records per chunk, one per layer (default %(default)s)")
    parser.add_argument("--record-kib", type=int_at_least(1, 1 << 20), default=8,
                        help="KiB per record (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default %(default)s)")


@dataclass(frozen=True)
class Request:
    """One prompt of the stream: its chunks' names; ``repeated``: a session's turn (else a one-off)."""

    chunks: tuple[str, ...]
    repeated: bool


def chunk_names(text: str, chunk_size: int) -> tuple[str, ...]:
    """The names of the prompt's full chunks: a chain hash of the prefix, as the KV connector names them."""
    data, names, previous = text.encode(), [], b""
    for end in range(chunk_size, len(data) + 1, chunk_size):
        previous = hashlib.blake2b(previous + data[end - chunk_size:end], digest_size=16).digest()
        names.append(previous.hex())
    return tuple(names)


def build_stream(args: argparse.Namespace) -> list[Request]:
    """Bench serve's sessions (``--users`` at a time, turns interleaved) with one-off prompts mixed in."""
    workload = make_workload(0, n_docs=args.docs, doc_tokens=args.doc_tokens, sessions=args.sessions,
                             turns=args.turns, zipf_alpha=args.zipf_alpha, seed=args.seed)
    repeated: list[Request] = []
    sessions = list(workload.sessions)
    for start in range(0, len(sessions), args.users):
        wave = sessions[start:start + args.users]
        for turn in range(args.turns):
            for session in wave:
                answers = [f"answer {session.index}-{t}".ljust(16, ".") for t in range(turn)]
                text = render(messages_for(workload, session, turn, answers))
                repeated.append(Request(chunk_names(text, args.chunk_size), True))
    rng = random.Random(f"{args.seed}:one-off")
    n_one_off = round(len(repeated) * args.one_off_share / (1.0 - args.one_off_share))
    one_off = []
    for i in range(n_one_off):
        memo = sentences(random.Random(f"{args.seed}:memo:{i}"), args.doc_tokens)[:args.doc_tokens]
        text = render([{"role": "user", "content": f"Memo {i}. {memo}\n\nQuestion: what is new here?"}])
        one_off.append(Request(chunk_names(text, args.chunk_size), False))
    slots = sorted(rng.sample(range(len(repeated) + n_one_off), n_one_off))
    stream, r, o = [], iter(repeated), iter(one_off)
    taken = set(slots)
    for i in range(len(repeated) + n_one_off):
        stream.append(next(o) if i in taken else next(r))
    return stream


def run_case(stream: list[Request], admission: dict[str, Any], *, args: argparse.Namespace, work: Path,
             redis_url: str | None, memory_bytes: int) -> dict[str, Any]:
    """Replay ``stream`` through a fresh store whose slower tiers have ``admission``; its counts."""
    record = torch.zeros(args.record_kib << 10, dtype=torch.uint8)
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    tiers: list[dict[str, Any]] = [
        {"kind": "memory", "capacity": max(memory_bytes, 1 << 16)},
        {"kind": "disk", "path": str(work / namespace), "capacity": "64GiB", "fsync": False,
         "admission": admission}]
    if redis_url:
        tiers.append({"kind": "redis", "url": redis_url, "key_prefix": f"{namespace}:", "admission": admission})
    chunks = {True: 0, False: 0}
    hits = {True: 0, False: 0}
    started = time.perf_counter()
    with build_store({"namespace": namespace, "tiers": tiers}) as store:
        for request in stream:
            hit = replay(store, namespace, request, record, args.layers)
            chunks[request.repeated] += len(request.chunks)
            hits[request.repeated] += hit
        stats = store.stats()["tiers"]
    seconds = time.perf_counter() - started
    slower = {name: tier for name, tier in stats.items() if name != "memory"}
    return {
        "bytes_written": {name: tier["bytes_written"] for name, tier in slower.items()},
        "writes_refused": {name: tier["writes_refused"] for name, tier in slower.items()},
        "writes_admitted": {name: tier["writes_admitted"] for name, tier in slower.items()},
        "memory_hit_share": (stats["memory"]["hits"] / total_hits
                             if (total_hits := sum(tier["hits"] for tier in stats.values())) else None),
        "repeated_hit": hits[True] / chunks[True] if chunks[True] else None,
        "one_off_hit": hits[False] / chunks[False] if chunks[False] else None,
        "seconds": seconds,
    }


def replay(store: TieredStore, namespace: str, request: Request, record: torch.Tensor, layers: int) -> int:
    """What the KV connector does with the store for one prompt: load the longest prefix of chunks every
    layer of which the store returns, store the rest (owned, as the KV saver does), flush the writer (no
    write dropped for a full queue: the counts are exact). Returns the chunks hit."""
    hit = 0
    for name in request.chunks:
        if any(rec is None for rec in store.get_many(keys(namespace, name, layers))):
            break
        hit += 1
    items = [(key, record, None) for name in request.chunks[hit:] for key in keys(namespace, name, layers)]
    if items:
        store.put_many(items, owned=True, reused_shares=[hit / len(request.chunks)] * len(items))
    store.flush()
    return hit


@contextmanager
def work_directory(parent: Path | None, prefix: str) -> Iterator[Path]:
    """A temporary directory for the cases' disk tiers (under ``--work-dir`` when given), removed afterwards;
    a directory that cannot be made or written is a usage error naming ``--work-dir``."""
    try:
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as exc:
        raise UsageError(f"--work-dir: {exc}") from exc
    try:
        yield work
    except OSError as exc:
        raise UsageError(f"--work-dir: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def keys(namespace: str, name: str, layers: int) -> list[StoreKey]:
    """The store keys of one chunk's records, one per layer (KV key syntax; the bench's model names)."""
    return [StoreKey(f"{namespace}|kv|bench|fp|tp1r0|{name}|L{layer}") for layer in range(layers)]


def format_table(results: list[dict[str, Any]], header: str) -> str:
    """One line per case; the ratios are against the first case."""
    base = results[0]
    base_bytes = sum(base["bytes_written"].values())
    head = (f"{'case':<11} {'disk MiB':>9} {'redis MiB':>9} {'refused':>8} {'slower x':>8} {'rep. hit':>8} "
            f"{'Δ points':>8} {'from mem.':>9} {'one-off hit':>11} {'s':>6}")
    lines = [header, "", head, "-" * len(head)]
    for r in results:
        written = sum(r["bytes_written"].values())
        ratio = f"{written / base_bytes:.2f}x" if base_bytes else "-"
        delta = (r["repeated_hit"] - base["repeated_hit"]) * 100 if r["repeated_hit"] is not None else 0.0
        lines.append(
            f"{r['case']:<11} {r['bytes_written'].get('disk', 0) / MIB:>9.1f} "
            f"{r['bytes_written'].get('redis', 0) / MIB:>9.1f} {r['writes_refused'].get('disk', 0):>8} "
            f"{ratio:>8} {pct(r['repeated_hit']):>8} {delta:>+8.1f} {pct(r['memory_hit_share']):>9} "
            f"{pct(r['one_off_hit']):>11} {r['seconds']:>6.1f}")
    lines += ["", "slower x = bytes written to disk and Redis / the first case's; rep. hit = hit chunks / full chunks "
              "of the repeated prompts (Δ: points against the first case); from mem. = the share of the records hit "
              "that the memory tier served (the rest: a disk or Redis read); refused = records the disk tier's "
              "admission kept in memory only"]
    return "\n".join(lines)


def pct(value: float | None) -> str:
    """A ratio as a percentage, '-' for none."""
    return "-" if value is None else f"{value:.1%}"


def run(args: argparse.Namespace) -> int:
    stream = build_stream(args)
    record_bytes = args.record_kib << 10
    distinct = len({name for request in stream if request.repeated for name in request.chunks})
    repeated_bytes = distinct * args.layers * record_bytes
    one_off_bytes = sum(len(r.chunks) for r in stream if not r.repeated) * args.layers * record_bytes
    if args.memory_share is not None:
        memory_bytes = int(repeated_bytes * args.memory_share)
    else:
        memory_bytes = int(one_off_bytes / (args.one_off_ratio or 10.0))
    header = (f"{len(stream)} requests ({sum(r.repeated for r in stream)} repeated-trace turns, "
              f"{args.one_off_share:.0%} one-off), {args.layers} records of {args.record_kib} KiB per "
              f"{args.chunk_size}-token chunk; memory tier {memory_bytes / MIB:.1f} MiB "
              f"({memory_bytes / repeated_bytes:.2f} of the repeated prompts' {distinct} distinct chunks); one-off "
              f"prompts {one_off_bytes / max(memory_bytes, 1):.0f}x the memory tier")
    results = []
    with work_directory(args.work_dir, "tiercache-bench-admission-") as work, \
            optional_redis_url(not args.no_redis) as redis_url:
        for label, admission in args.policies:
            result = run_case(stream, admission, args=args, work=work, redis_url=redis_url,
                              memory_bytes=memory_bytes)
            results.append({"case": label, **result})
    if args.json:
        print(json.dumps({"header": header, "cases": results}, indent=2))
    else:
        print(format_table(results, header))
    return 0
