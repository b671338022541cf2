"""`tiercache bench pins`: does a pinned corpus keep its hits while one-off prompts flood the tiers?

The question: a RAG operator precomputes a document corpus and serves it; the serving traffic also
carries prompts nobody asks again, many times the memory tier. Without pins the one-off records push the
corpus out of memory and disk (least recently used first); with the corpus pinned (`tiercache pin
--tag`), eviction takes unpinned records while there are any. Printed: the corpus's hit ratio with no
one-off traffic (the reference), and with one-off traffic without and with the pin, each against the
reference.

The trace is `tiercache bench admission`'s (`admission.build_stream`: bench serve's multi-turn sessions
over Zipf-popular documents, one-off prompts of the same length mixed in, the same chunk names and
records). Each case starts from an empty directory: the corpus, every document's ``user: <document>``
prefix as the chat template renders it, is stored first with the tag ``corpus`` (what `precompute docs
--tag corpus` writes), pinned or not (`vllm_tiercache.tools.pin_cmd.pin`, the command's own function),
then a fresh store (memory, then disk, both with ``--pin-budget``) replays the stream, each request
loading its longest stored prefix and storing the rest as the KV connector does. The memory tier learns
the pin from the disk tier's control entries, as a serving process does (`control_poll_s`); the replay
waits for that first poll.

The corpus's hit ratio: of the repeated prompts' chunks that are corpus chunks (a document's prefix),
the share that hit. Redis is left out: it evicts by TTL or by its server's ``maxmemory-policy`` (pinned
records are PERSISTed: docs/operations.md, pins), not by this store's least-recently-used order.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from vllm_tiercache.shared.store import build_store
from vllm_tiercache.tools.bench.admission import (
    MIB,
    Request,
    add_trace_arguments,
    build_stream,
    chunk_names,
    keys,
    pct,
    replay,
    work_directory,
)
from vllm_tiercache.tools.bench.serve.trace import make_workload
from vllm_tiercache.tools.cli import UsageError, float_in
from vllm_tiercache.tools.pin_cmd import pin

CORPUS_TAG = "corpus"
#: the cases, in the order they run and print: (label, one-off prompts in the stream, corpus pinned)
CASES = (("no one-off", False, False), ("one-off", True, False), ("one-off, pinned", True, True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--one-off-ratio", type=float_in(0.0, 1e6, low_open=True), default=10.0,
                        help="memory tier capacity = the one-off prompts' bytes / this (default %(default)s: the "
                             "issue's 'one-off prompts 10x the memory tier')")
    parser.add_argument("--disk-ratio", type=float_in(0.0, 1e6, low_open=True), default=2.0,
                        help="disk tier capacity = the memory tier's x this (default %(default)s)")
    parser.add_argument("--pin-budget", type=float_in(0.0, 0.9, low_open=True), default=0.9,
                        help="both tiers' pin_budget, the share of capacity pins may hold (default %(default)s)")
    parser.add_argument("--work-dir", type=Path, help="disk tiers (default: a temp dir, removed afterwards)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def corpus_chunks(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """Each document's prefix chunks as a served prompt about it starts (``user: <document>``)."""
    workload = make_workload(0, n_docs=args.docs, doc_tokens=args.doc_tokens, sessions=args.sessions,
                             turns=args.turns, zipf_alpha=args.zipf_alpha, seed=args.seed)
    return [chunk_names(f"user: {doc}", args.chunk_size) for doc in workload.docs]


def run_case(stream: list[Request], corpus: list[tuple[str, ...]], *, pinned: bool, args: argparse.Namespace,
             work: Path, memory_bytes: int) -> dict[str, Any]:
    """Store the corpus (pinned or not), then replay ``stream`` through a fresh store; its counts."""
    record = torch.zeros(args.record_kib << 10, dtype=torch.uint8)
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    config = {"namespace": namespace, "control_poll_s": 0.05, "tiers": [
        {"kind": "memory", "capacity": max(memory_bytes, 1 << 16), "pin_budget": args.pin_budget},
        {"kind": "disk", "path": str(work / namespace), "capacity": max(int(memory_bytes * args.disk_ratio), 1 << 16),
         "fsync": False, "pin_budget": args.pin_budget}]}
    in_corpus = {name for names in corpus for name in names}
    with build_store(config) as store:  # what `precompute docs --tag corpus` leaves on disk
        for names in corpus:
            store.put_many([(key, record, {"tags": [CORPUS_TAG]}) for name in names
                            for key in keys(namespace, name, args.layers)], owned=True, always_admit=True)
        store.flush()
    if pinned:
        pin(config, [CORPUS_TAG])
    hit_chunks = total_chunks = corpus_hit = corpus_total = 0
    started = time.perf_counter()
    with build_store(config) as store:
        polls = store.control.polls
        deadline = time.monotonic() + 30.0
        while store.control.polls < polls + 2 and time.monotonic() < deadline:  # the pin reached memory
            time.sleep(0.01)
        for request in stream:
            names = request.chunks
            hit = replay(store, namespace, request, record, args.layers)
            if request.repeated:
                hit_chunks += hit
                total_chunks += len(names)
                corpus_total += sum(name in in_corpus for name in names)
                corpus_hit += sum(name in in_corpus for name in names[:hit])
        stats = store.stats()["tiers"]
    return {
        "corpus_hit": corpus_hit / corpus_total if corpus_total else None,
        "repeated_hit": hit_chunks / total_chunks if total_chunks else None,
        "evictions": {name: tier.get("evictions", 0) for name, tier in stats.items()},
        "seconds": time.perf_counter() - started,
    }


def format_table(results: list[dict[str, Any]], header: str) -> str:
    """One line per case; "of reference" is the corpus hit ratio against the first case's."""
    base = results[0]["corpus_hit"] or 0.0
    head = f"{'case':<16} {'corpus hit':>10} {'of reference':>12} {'repeated hit':>12} {'s':>6}"
    lines = [header, "", head, "-" * len(head)]
    for r in results:
        share = f"{r['corpus_hit'] / base:.1%}" if base and r["corpus_hit"] is not None else "-"
        lines.append(f"{r['case']:<16} {pct(r['corpus_hit']):>10} {share:>12} {pct(r['repeated_hit']):>12} "
                     f"{r['seconds']:>6.1f}")
    lines += ["", "corpus hit = hit chunks / chunks of the repeated prompts that are a document's prefix (the "
              "precomputed corpus); of reference = against the case without one-off prompts; repeated hit = "
              "every chunk of the repeated prompts"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.one_off_share <= 0:
        raise UsageError("--one-off-share: give a share above 0; the cases compare traffic with one-off prompts "
                         "against the same trace without them")
    stream = build_stream(args)
    corpus = corpus_chunks(args)
    record_bytes = args.record_kib << 10
    corpus_bytes = sum(len(names) for names in corpus) * args.layers * record_bytes
    one_off_bytes = sum(len(r.chunks) for r in stream if not r.repeated) * args.layers * record_bytes
    memory_bytes = int(one_off_bytes / args.one_off_ratio)
    repeated_only = [r for r in stream if r.repeated]
    header = (f"{len(stream)} requests ({len(repeated_only)} repeated-trace turns, {args.one_off_share:.0%} "
              f"one-off), {args.layers} records of {args.record_kib} KiB per {args.chunk_size}-token chunk; "
              f"corpus {len(corpus)} documents, {corpus_bytes / MIB:.1f} MiB; memory tier {memory_bytes / MIB:.1f} "
              f"MiB (one-off prompts {one_off_bytes / max(memory_bytes, 1):.0f}x it), disk tier "
              f"{memory_bytes * args.disk_ratio / MIB:.1f} MiB; pin_budget {args.pin_budget:g}")
    results = []
    with work_directory(args.work_dir, "tiercache-bench-pins-") as work:
        for label, one_off, pinned in CASES:
            result = run_case(stream if one_off else repeated_only, corpus, pinned=pinned, args=args, work=work,
                              memory_bytes=memory_bytes)
            results.append({"case": label, **result})
    if args.json:
        print(json.dumps({"header": header, "corpus_bytes": corpus_bytes, "memory_bytes": memory_bytes,
                          "cases": results}, indent=2))
    else:
        print(format_table(results, header))
    return 0
