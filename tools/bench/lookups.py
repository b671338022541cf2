"""`tiercache bench lookups`: a scheduler's lookup of N keys on the object tier, against ``lookup_budget_ms``.

Why: a lookup asks for every layer and rank of every chunk of a prompt (32 chunks of 256 tokens x 32 layers
is 1,024 keys for an 8K prompt of an 8B model), on the engine's scheduling thread, and the store waits at most
``lookup_budget_ms`` (default 100 ms) before it counts the whole lookup a miss. Measured per N: the tier's
``contains_many`` with every key asked by HEAD (``cold``: a process that never saw the records, ``concurrency``
in flight; the tier's listing off), after the first lookup's listing of the prefix (``listed``), and with
the records already seen (``cached``: the existence cache's one GET of ``sys/usage``,
`vllm_tiercache.shared.store.tiers.object.existence`); and how many of the N keys the store's bounded lookup
found within the budget, cold, listed and cached. Medians over ``--repeat`` runs, each with a fresh tier for the cold
case. Without ``--s3-endpoint`` a private SeaweedFS is started; the records are deleted afterwards.
``--store-rtt-ms N`` puts the store N ms of round trip away (`vllm_tiercache.tools.bench.rtt_proxy`): a local
SeaweedFS answers in a fraction of a millisecond, S3 in 10-30 ms, and the budget is about the latter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

from vllm_tiercache.tools.bench.object_row import add_s3_arguments, check_s3_arguments, s3_target
from vllm_tiercache.tools.bench.rtt_proxy import add_store_rtt_argument, delayed_item, store_rtt_header
from vllm_tiercache.tools.cli import float_in, int_at_least

#: how long a bounded lookup still outstanding past its budget may take to end before its store closes (its
#: HEADs in waves of ``--concurrency``, each within the tier's 10 s timeout)
LOOKUP_END_S = 120.0


def key_counts(text: str) -> list[int]:
    """argparse ``type=`` of --keys: comma-separated counts from 1 to 100,000."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(not 1 <= n <= 100_000 for n in counts):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: comma-separated counts from 1 to "
                                         "100000, e.g. 32,256,1024")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", type=key_counts, default="32,256,1024",
                        help="comma-separated key counts of one lookup (default %(default)s)")
    parser.add_argument("--concurrency", type=int_at_least(1, 256), default=16,
                        help="the tier's concurrency (default %(default)s, the tier's default)")
    parser.add_argument("--budget-ms", type=float_in(1.0, 60000.0), default=100.0,
                        help="the store's lookup_budget_ms (default %(default)s, the store's default)")
    parser.add_argument("--repeat", type=int_at_least(1, 1000), default=5, help="runs per case (default %(default)s)")
    add_s3_arguments(parser)
    add_store_rtt_argument(parser, "the object tier")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def bench_lookups(args: argparse.Namespace, item: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.store import StoreKey, TieredStore
    from vllm_tiercache.shared.store.writes.patience import put_patiently
    from vllm_tiercache.tools.bench.capacity import BULK_PATIENCE_S

    prefix = f"bench-lookups-{uuid.uuid4().hex[:8]}/"
    config = {"tiers": [{**item, "prefix": prefix, "concurrency": args.concurrency, "timeout_s": 10.0}],
              "lookup_budget_ms": args.budget_ms}
    keys = [StoreKey(f"bench|lookups|{prefix}|{i}") for i in range(max(args.keys))]
    writer = TieredStore(StoreConfig.from_dict(config))
    record = torch.zeros(1024, dtype=torch.uint8)
    for start in range(0, len(keys), 256):  # every record must land, or the lookups measure misses
        put_patiently(writer.tiers[0], [(key, record, None) for key in keys[start:start + 256]], BULK_PATIENCE_S)
    rows = []
    try:
        for n in args.keys:
            cold, listed, cached, found_cold, found_listed, found_cached = [], [], [], [], [], []
            for _ in range(args.repeat):
                for stage, times, found in (("cold", cold, found_cold), ("listed", listed, found_listed),
                                            ("cached", cached, found_cached)):
                    store = TieredStore(StoreConfig.from_dict(config))
                    tier = store.tiers[0]
                    tier.set_warming(stage == "listed")
                    if stage == "cached":
                        tier.contains_many(keys[:n])  # this process has seen them
                    elif stage == "listed":
                        tier.contains_many([])  # the first lookup starts the listing
                        tier.warmed()
                    started = time.perf_counter()
                    if not all(tier.contains_many(keys[:n])):
                        raise RuntimeError("the object tier missed records it was given")
                    times.append(time.perf_counter() - started)
                    store.close()
                    store = TieredStore(StoreConfig.from_dict(config))  # the bounded lookup, on a tier as fresh
                    store.tiers[0].set_warming(stage == "listed")
                    if stage == "cached":
                        store.tiers[0].contains_many(keys[:n])
                    elif stage == "listed":
                        store.tiers[0].contains_many([])
                        store.tiers[0].warmed()
                    found.append(sum(store.contains_many(keys[:n], shared_only=True)))
                    # a lookup still outstanding past the budget ends before the store closes (and before the
                    # proxy does, after the last one): closed under it, its requests would wait out their timeout
                    if not store.wait_for_lookups(LOOKUP_END_S):
                        raise RuntimeError(f"a bounded lookup of {n} keys was still running {LOOKUP_END_S:.0f} s "
                                           "after its budget")
                    store.close()
            rows.append({"keys": n, "concurrency": args.concurrency, "budget_ms": args.budget_ms,
                         "store_rtt_ms": args.store_rtt_ms,
                         "cold_ms": round(statistics.median(cold) * 1000, 1),
                         "listed_ms": round(statistics.median(listed) * 1000, 1),
                         "cached_ms": round(statistics.median(cached) * 1000, 1),
                         "found_cold": round(statistics.median(found_cold)),
                         "found_listed": round(statistics.median(found_listed)),
                         "found_cached": round(statistics.median(found_cached))})
    finally:
        writer.tiers[0].delete_stored(lambda rec: True)
        writer.close()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    rtt = store_rtt_header(rows[0].get("store_rtt_ms", 0.0) if rows else 0.0, "the object tier")
    head = (f"{'keys':>6} {'in flight':>9} | {'cold ms':>8} {'listed ms':>9} {'cached ms':>9} | {'budget ms':>9} "
            f"{'found: cold':>11} {'listed':>6} {'cached':>6}")
    lines = [*([rtt] if rtt else []), head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['keys']:>6} {r['concurrency']:>9} | {r['cold_ms']:>8.1f} {r['listed_ms']:>9.1f} "
                     f"{r['cached_ms']:>9.1f} | {r['budget_ms']:>9.0f} {r['found_cold']:>11} {r['found_listed']:>6} "
                     f"{r['found_cached']:>6}")
    lines.append("cold: every key HEADed (a process that never saw the records, no listing); listed: after the first "
                 "lookup's listing of the prefix; cached: the records seen by an earlier lookup (one GET of "
                 "sys/usage);")
    lines.append("found: keys the store's bounded lookup found within the budget; medians")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check_s3_arguments(args)
    with s3_target(args.s3_endpoint, args.s3_bucket) as target, delayed_item(target, args.store_rtt_ms) as item:
        assert item is not None
        rows = bench_lookups(args, item)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0
