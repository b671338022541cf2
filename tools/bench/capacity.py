"""`tiercache bench capacity`: how far the object tier's usage passes ``capacity`` while several writer
processes write many times that much (issue 49's target: within 5%).

Why processes and a listing: the bound is across writers that share nothing but the bucket (`janitor`:
usage ledgers, grants, one sweeper at a time by conditional PUT), so each writer is its own process with its
own tier, as on a fleet; and usage is what the bucket holds, so a monitor lists the prefix over and over
while they write (the peak is the largest listing, the final usage a listing after the last writer closed,
with no sweep after it). Each writer writes records of random sizes in ``--record-sizes`` (a KV chunk of
16 tokens of an 8B model is 2 MiB, one layer's 64 KiB) in batches, through the tier's own ``put_many``,
until all of them together wrote ``--volume`` times the capacity; a put the tier did not admit is a dropped
write (counted, as the store counts it), never a retry.

Printed per capacity: bytes written (x capacity), dropped and evicted records, the peak and final usage
and the last sweep's low-water mark (x capacity), and the seconds it took; ``--plot PNG`` also draws usage
over time per capacity (matplotlib, as `bench serve` does). Without ``--s3-endpoint`` a private SeaweedFS
is started; with it, the bucket must exist and credentials come from the AWS chain. Each capacity runs
under a prefix of its own, deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from vllm_tiercache.shared.store.tiers.object.config import (
    DEFAULT_SWEEP_EVERY_S,
    DEFAULT_SWEEP_SHARE,
    MAX_SWEEP_SHARE,
    SWEEP_EVERY_S_RANGE,
)
from vllm_tiercache.tools.bench.object_row import add_s3_arguments, check_s3_arguments, s3_target
from vllm_tiercache.tools.bench.tiers import size_list
from vllm_tiercache.tools.cli import UsageError, float_in, int_at_least

MIB = 1 << 20
#: the issue's target: peak usage at most this many times capacity
PEAK_TARGET = 1.05
#: the monitor's pause between two listings (each listing takes a few ms on a local store)
MONITOR_PAUSE_S = 0.005


def size_range(text: str) -> tuple[int, int]:
    """argparse ``type=`` of --record-sizes: ``MIN-MAX`` (e.g. ``256KiB-2MiB``), sizes from 1KiB to 1GiB."""
    parts = text.split("-")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: MIN-MAX, e.g. 256KiB-2MiB")
    low, high = (size_list(p)[0] for p in parts)
    if low > high:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: MIN at most MAX")
    return low, high


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacities", type=size_list, default="16MiB,64MiB,256MiB",
                        help="comma-separated capacities, one run each (default %(default)s)")
    parser.add_argument("--record-sizes", type=size_range, default="256KiB-2MiB",
                        help="record sizes, uniform between MIN-MAX (default %(default)s)")
    parser.add_argument("--writers", type=int_at_least(1, 64), default=4,
                        help="writer processes (default %(default)s)")
    parser.add_argument("--volume", type=float_in(0.0, 1000.0, low_open=True), default=10.0,
                        help="bytes written by all writers together, in capacities (default %(default)s)")
    parser.add_argument("--batch", type=int_at_least(1, 1024), default=4,
                        help="records per put_many (default %(default)s)")
    parser.add_argument("--sweep-share", type=float_in(0.0, MAX_SWEEP_SHARE, low_open=True),
                        default=DEFAULT_SWEEP_SHARE,
                        help="the tier's sweep_share (default %(default)s, the tier's default)")
    parser.add_argument("--sweep-every-s", type=float_in(*SWEEP_EVERY_S_RANGE), default=DEFAULT_SWEEP_EVERY_S,
                        help="the tier's sweep_every_s (default %(default)s, the tier's default)")
    add_s3_arguments(parser)
    parser.add_argument("--plot", help="also write usage over time to this PNG (matplotlib)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _listed_bytes(client: Any, bucket: str, prefix: str) -> int:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sum(obj["Size"] for page in pages for obj in page.get("Contents", ()))


def run_capacity(capacity: int, args: argparse.Namespace, item: dict[str, Any]) -> dict[str, Any]:
    """One capacity: ``--writers`` processes write ``--volume`` x capacity while a monitor lists the prefix."""
    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.store.tiers.object.client import make_client

    prefix = f"bench-capacity-{uuid.uuid4().hex[:8]}/"
    tier = {**item, "capacity": capacity, "prefix": prefix, "sweep_share": args.sweep_share,
            "sweep_every_s": args.sweep_every_s}
    client = make_client(StoreConfig.from_dict({"tiers": [tier]}).tiers[0])
    bucket, records = item["bucket"], f"{prefix}r/"
    low, high = args.record_sizes
    per_writer = int(args.volume * capacity / args.writers)
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def monitor() -> None:
        while not done.is_set():
            samples.append((time.perf_counter() - start, _listed_bytes(client, bucket, records)))
            time.sleep(MONITOR_PAUSE_S)

    start = time.perf_counter()
    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "vllm_tiercache.tools.bench.capacity", json.dumps(
            {"tier": tier, "bytes": per_writer, "low": low, "high": high, "batch": args.batch, "seed": w})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(args.writers)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"a writer failed (exit {proc.returncode}): {err[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        done.set()
        watcher.join()
    seconds = time.perf_counter() - start
    final = _listed_bytes(client, bucket, records)
    usage = client.get_object(Bucket=bucket, Key=f"{prefix}sys/usage")["Body"].read()
    import cbor2

    low_water = int(cbor2.loads(usage).get("low_water") or 0)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", ()):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.close()
    peak = max([b for _, b in samples] + [final])
    return {"capacity": capacity, "record_min": low, "record_max": high, "writers": args.writers,
            "written_bytes": sum(r["bytes"] for r in results), "puts": sum(r["puts"] for r in results),
            "dropped": sum(r["dropped"] for r in results), "evicted": sum(r["evictions"] for r in results),
            "throttled": sum(r["throttled"] for r in results), "retries": sum(r["retries"] for r in results),
            "peak": peak, "final": final, "low_water": low_water, "peak_ratio": round(peak / capacity, 4),
            "final_ratio": round(final / capacity, 4), "low_water_ratio": round(low_water / capacity, 4),
            "listings": len(samples), "seconds": round(seconds, 2), "target": PEAK_TARGET,
            "samples": [(round(t, 3), b) for t, b in samples]}


#: how long a bench's bulk writer waits out a store that writes nothing (`vllm_tiercache.shared.store.writes.patience`)
BULK_PATIENCE_S = 120.0


def writer(opts: dict[str, Any]) -> dict[str, Any]:
    """One writer process: records of random sizes, batch after batch, through the tier's ``put_many``."""
    import torch

    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.store import StoreKey
    from vllm_tiercache.shared.store.tiers.object.tier import ObjectTier
    from vllm_tiercache.shared.store.writes.patience import put_patiently

    torch.set_num_threads(1)
    tier = ObjectTier(StoreConfig.from_dict({"tiers": [opts["tier"]]}).tiers[0])
    rng = random.Random(int(opts["seed"]))
    data = torch.randint(0, 255, (int(opts["high"]),), dtype=torch.uint8)
    left, i = int(opts["bytes"]), 0
    run = uuid.uuid4().hex[:8]
    while left > 0:
        batch = []
        for _ in range(int(opts["batch"])):
            size = rng.randint(int(opts["low"]), int(opts["high"]))
            batch.append((StoreKey(f"bench|capacity|{run}|{i}"), data[:size], None))
            left -= size
            i += 1
        # a bulk writer: a throttling or stalled store is waited out (what the janitor refuses is still dropped)
        put_patiently(tier, batch, BULK_PATIENCE_S)
    tier.close()
    counters = tier.counters
    return {"puts": counters.get("puts"), "bytes": counters.get("bytes_written"),
            "dropped": counters.get("dropped_writes"), "evictions": counters.get("evictions"),
            "throttled": counters.get("throttled"), "retries": counters.get("write_retries")}


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    high = args.record_sizes[1]
    for capacity in args.capacities:
        if high > capacity:
            raise UsageError(f"--record-sizes: a record of {high} bytes is larger than the capacity {capacity}; "
                             "allowed: records smaller than every capacity")
    check_s3_arguments(args)
    with s3_target(args.s3_endpoint, args.s3_bucket) as item:
        return [run_capacity(capacity, args, {**item, "timeout_s": 10.0}) for capacity in args.capacities]


def _fmt(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n >> 10} KiB"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'capacity':>10} {'records':>17} {'writers':>7} | {'written':>8} {'x cap':>6} {'dropped':>7} "
            f"{'evicted':>7} | {'peak':>6} {'final':>6} {'low-w':>6} | {'secs':>6} | target")
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = "ok" if r["peak_ratio"] <= r["target"] else "ABOVE"
        lines.append(
            f"{_fmt(r['capacity']):>10} {_fmt(r['record_min']) + '-' + _fmt(r['record_max']):>17} {r['writers']:>7} | "
            f"{r['written_bytes'] / MIB:>8.0f} {r['written_bytes'] / r['capacity']:>6.1f} {r['dropped']:>7} "
            f"{r['evicted']:>7} | {r['peak_ratio']:>6.3f} {r['final_ratio']:>6.3f} {r['low_water_ratio']:>6.3f} | "
            f"{r['seconds']:>6.1f} | peak <= {r['target']:.2f} {ok}")
    lines.append("written: MiB the writers' puts wrote (x cap: in capacities); peak: the largest of the monitor's "
                 "listings of the prefix during the run, final: a listing after the last writer closed, low-w: the "
                 "last sweep's low-water mark (capacity less the grants), each x capacity")
    if any(r["throttled"] or r["retries"] for r in rows):
        lines.append("the store slowed the writers down: " + "; ".join(
            f"{_fmt(r['capacity'])}: {r['throttled']} throttled answers, {r['retries']} records put again"
            for r in rows))
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in rows:
        ax.plot([t for t, _ in r["samples"]], [b / r["capacity"] for _, b in r["samples"]],
                label=f"capacity {_fmt(r['capacity'])}", linewidth=0.8)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.axhline(PEAK_TARGET, color="red", linestyle="--", linewidth=0.6, label=f"target {PEAK_TARGET}x")
    ax.set_xlabel("seconds")
    ax.set_ylabel("usage / capacity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    rows = run_bench(args)
    if args.plot:
        _plot(rows, args.plot)
    shown = [{k: v for k, v in r.items() if k != "samples"} for r in rows]
    print(json.dumps(shown, indent=2) if args.json else format_table(rows))
    return 0 if all(r["peak_ratio"] <= r["target"] for r in rows) else 1


if __name__ == "__main__":  # one writer process of `run_capacity`
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(writer(json.loads(sys.argv[1]))))
