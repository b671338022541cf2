"""`tiercache bench trace TRACE.jsonl`: KV hit ratios of the store's memory tier on a production trace.

A Mooncake-format trace (`mooncake`) is replayed as the connector would replay it (`replay`): behind
vLLM's own prefix cache (``--gpu-blocks``, `gpu_pool`), through the REAL `MemoryTier` with each policy
the tier accepts, at each capacity of ``--capacities`` (tokens; ``--record-bytes`` per 512-token block).
Beside them: a plain LRU (no store code, the reference the tier's lru must match) and the offline optimum
(`optimum`: Belady with bypass). Each policy's cell shows, in brackets, the share of the gap from LRU to
the optimum it closes. A second table is each policy's cost per put against LRU's (`cost`).

``--disk-share S`` also replays each policy through a real store of memory + disk (`tiers`): at each
capacity, the share S of it on disk and the rest in memory, once write-through (every put on disk too)
and once exclusive (the disk written memory's evictions: admission ``evicted``); a second table prints
the hits each tier served against the same plain LRU and optimum at the combined capacity.
``--shared-share R`` (with ``--disk-share S``) replays memory + disk + a shared Redis tier instead
(`three_tiers`): R of each capacity in a private redis-server the bench starts and bounds (`shared_tier`),
S of the rest on disk, the rest in memory; the table prints memory + disk + Redis hits.

``--object`` also replays the object tier's capacity sweeps at each capacity, each of its policies
(`object_sweep`: the sweep's own ranking on one writer's ledger, no bucket), and measures one sweep's
ranking of 100,000 listed records. ``--object-bucket`` (implies ``--object``) also replays them through a
real object tier on a bucket (`object_bucket`: a private SeaweedFS, or ``--s3-endpoint``/``--s3-bucket``),
its janitor's real sweeps, and prints its hit ratios beside the simulated ones; minutes per thousand
requests: ``--requests`` replays a leading slice.
``--generate N`` first writes a generated trace of N requests to TRACE (`generate`): shared system
prompts, documents, multi-turn conversations; for tests and for sizing before production has a trace.
``--reuse`` prints, instead of the sweep, which features of a block an online policy could see separate
blocks asked again soon from the rest (`reuse`).
Exit status 1 when a policy beats the optimum (a bug in the replay or the bound).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.eviction import memory_tier_policies, policy_entry
from vllm_tiercache.shared.store.tiers.disk.config import DiskTierConfig
from vllm_tiercache.tools.bench.object_row import add_s3_arguments, check_s3_arguments, s3_target
from vllm_tiercache.tools.bench.trace.cost import cost_rows
from vllm_tiercache.tools.bench.trace.generate import generate_trace
from vllm_tiercache.tools.bench.trace.mooncake import BLOCK_TOKENS, format_tokens, read_trace, write_trace
from vllm_tiercache.tools.bench.trace.object_sweep import SWEEP_SHARE
from vllm_tiercache.tools.bench.trace.optimum import belady_hits
from vllm_tiercache.tools.bench.trace.replay import Asked, plain_lru_hits, replay_memory_tier, store_traffic
from vllm_tiercache.tools.bench.trace.reuse import format_reuse, reuse_tables
from vllm_tiercache.tools.bench.trace.shared_tier import shared_tier
from vllm_tiercache.tools.bench.trace.three_tiers import format_memory_disk_redis, memory_disk_redis
from vllm_tiercache.tools.bench.trace.tiers import ARRANGEMENTS, TierSplit, replay_memory_disk
from vllm_tiercache.tools.cli import UsageError, int_at_least

_SUFFIXES = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_tokens(text: str) -> int:
    """A token count: ``300000``, ``300k``, ``0.3M``, ``10M``; at least one block (512 tokens)."""
    raw = text.strip().lower()
    scale = _SUFFIXES.get(raw[-1:], 1)
    try:
        value = float(raw[:-1] if scale != 1 else raw) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid capacity {text!r}: a token count such as 300k or 1M") from None
    if not value >= BLOCK_TOKENS:  # also refuses nan
        raise argparse.ArgumentTypeError(f"invalid capacity {text!r}: at least {BLOCK_TOKENS} tokens (one block)")
    return int(value)


def capacity_list(text: str) -> list[int]:
    """``--capacities``: comma-separated token counts (`parse_tokens`), in the order given."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("invalid capacities: give token counts such as 1M,3M,10M")
    return [parse_tokens(p) for p in parts]


def _share(text: str) -> float:
    """``--disk-share``: a fraction strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"invalid share {text!r}: a fraction between 0 and 1, such as 0.75")
    return value


def _sweep_share(text: str) -> float:
    """``--sweep-share``: above 0, at most 0.5 (the object tier's bound)."""
    value = _share(text)
    if value > 0.5:
        raise argparse.ArgumentTypeError(f"invalid sweep share {text!r}: above 0 and at most 0.5, such as 0.02")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, help="a Mooncake-format trace (JSON lines with hash_ids)")
    parser.add_argument("--capacities", type=capacity_list, default=capacity_list("1M,3M,10M"),
                        help="memory tier capacities in tokens, comma-separated (default 1M,3M,10M)")
    parser.add_argument("--gpu-blocks", type=int_at_least(0), default=0,
                        help="vLLM's own prefix cache in front, in 512-token blocks (default 0: none)")
    parser.add_argument("--record-bytes", type=int_at_least(1, 1 << 30), default=1024,
                        help="bytes of one block's record (default 1024)")
    parser.add_argument("--requests", type=int_at_least(1), default=None, help="replay only the first N requests")
    parser.add_argument("--policies", nargs="+", choices=memory_tier_policies(), default=list(memory_tier_policies()),
                        help="memory tier policies to replay (default: all)")
    parser.add_argument("--disk-share", type=_share, default=None, metavar="S",
                        help="also replay a store of memory + disk, the share S (0 < S < 1) of each capacity on "
                             "disk, the rest in memory (e.g. 0.75; default: memory alone)")
    parser.add_argument("--disk-policy", choices=DiskTierConfig.POLICIES, default=DiskTierConfig.policy,
                        help="with --disk-share: the disk tier's eviction policy (default: the tier's, "
                             f"{DiskTierConfig.policy})")
    parser.add_argument("--shared-share", type=_share, default=None, metavar="R",
                        help="with --disk-share S: replay memory + disk + a shared Redis tier instead (a "
                             "redis-server started here), the share R (0 < R < 1) of each capacity in Redis, S "
                             "of the rest on disk, the rest in memory (e.g. 0.5)")
    parser.add_argument("--object", action="store_true",
                        help="also replay the object tier's capacity sweeps (lru and prefix: each sweep's ranking "
                             "on one writer's usage ledger, no bucket) at each capacity")
    parser.add_argument("--object-bucket", action="store_true",
                        help="with --object's replay, the same through a real object tier on a bucket (its "
                             "janitor's ledgers, grants, listings and deletes; slow: a few minutes per thousand "
                             "requests and capacity, see --requests)")
    parser.add_argument("--sweep-share", type=_sweep_share, default=SWEEP_SHARE, metavar="G",
                        help="with --object: the object tier's sweep_share in both replays (each writer's grant, "
                             f"a share of capacity; default {SWEEP_SHARE:g}, the tier's; larger: fewer sweeps, a "
                             "faster --object-bucket, a lower low-water mark)")
    add_s3_arguments(parser, " for --object-bucket")
    parser.add_argument("--generate", type=int_at_least(1), metavar="N", default=None,
                        help="first write a generated trace of N requests to TRACE")
    parser.add_argument("--seed", type=int, default=0, help="the generated trace's seed (default 0)")
    parser.add_argument("--cost-puts", type=int_at_least(0), default=100_000,
                        help="puts per policy in the cost micro-benchmark (default 100000; 0: skip it)")
    parser.add_argument("--plot", type=Path, help="also write hit ratio vs capacity to this PNG (matplotlib)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--reuse", action="store_true",
                        help="only print which features of a block separate blocks asked again soon from the rest "
                             "(per feature value, the share asked again within 65/300/1000 requests and ever)")


def _progress(total: int) -> Any:
    """A tqdm bar on stderr (silent when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, disable=None, leave=False)


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Every capacity's hit ratios: plain LRU, each policy through the real tier, the optimum."""
    requests = read_trace(args.trace, args.requests)
    traffic = store_traffic(requests, args.gpu_blocks)
    asked = sum(len(t.blocks) for t in traffic)
    rows = []
    passes = len(args.capacities) * len(args.policies) * (1 + len(ARRANGEMENTS) if args.disk_share is not None else 1)
    passes += len(args.capacities) * 2 * (2 if args.object_bucket else 1) if args.object else 0
    largest = max((b for t in traffic for b in t.blocks), default=0)
    server = shared_tier(args.record_bytes, largest) if args.shared_share is not None else nullcontext()
    bucket = s3_target(args.s3_endpoint, args.s3_bucket) if args.object_bucket else nullcontext()
    with _progress(len(traffic) * passes) as bar, server as shared, bucket as item:
        for tokens in args.capacities:
            blocks = tokens // BLOCK_TOKENS
            row: dict[str, Any] = {"capacity_tokens": tokens, "capacity_blocks": blocks,
                                   "lru_reference": plain_lru_hits(traffic, blocks) / max(1, asked),
                                   "policies": {}, "seconds": {}}
            for policy in args.policies:
                result = replay_memory_tier(traffic, policy, blocks * args.record_bytes, args.record_bytes, bar.update)
                row["policies"][policy] = result.ratio
                row["seconds"][policy] = round(result.seconds, 2)
            if shared is not None:
                row["memory_disk_redis"] = memory_disk_redis(traffic, args, blocks, bar.update, shared)
            elif args.disk_share is not None:
                row["memory_disk"] = _memory_disk(traffic, args, blocks, bar.update)
            if args.object:
                from vllm_tiercache.tools.bench.trace.object_sweep import object_cells

                row["object"] = object_cells(traffic, blocks, bar.update, args.sweep_share)
            if item is not None:
                from vllm_tiercache.tools.bench.trace.object_bucket import bucket_cells

                row["object_bucket"] = bucket_cells(traffic, blocks, args.record_bytes, item, bar.update,
                                                     args.sweep_share)
            row["optimum"] = belady_hits([t.blocks for t in traffic], blocks) / max(1, asked)
            rows.append(row)
    return {"trace": str(args.trace), "requests": len(requests), "blocks_asked": asked,
            **({"sweep_share": args.sweep_share} if args.object else {}),
            **({"object_bucket_at": args.s3_endpoint or "a private SeaweedFS"} if args.object_bucket else {}),
            "distinct_blocks": len({b for t in traffic for b in t.blocks}), "gpu_blocks": args.gpu_blocks,
            "record_bytes": args.record_bytes, "rows": rows}


def _memory_disk(traffic: list[Asked], args: argparse.Namespace, blocks: int, progress: Any) -> dict[str, Any]:
    """Each policy in memory, the disk tier behind it, in each arrangement (`ARRANGEMENTS`): the split and,
    per arrangement and policy, each tier's share of hits (``policies``: write-through, as before)."""
    split = TierSplit.of(blocks, args.disk_share)
    out: dict[str, Any] = {"memory_blocks": split.memory_blocks, "disk_blocks": split.disk_blocks,
                           "disk_policy": args.disk_policy, "arrangements": {}}
    for arrangement in ARRANGEMENTS:
        cells = out["arrangements"][arrangement] = {}
        for policy in args.policies:
            result = replay_memory_disk(traffic, policy, split, args.record_bytes, progress, arrangement,
                                        disk_policy=args.disk_policy)
            cells[policy] = {"memory": result.ratio(result.memory), "disk": result.ratio(result.disk),
                             "total": result.ratio(result.found), "seconds": round(result.seconds, 2)}
    out["policies"] = out["arrangements"]["write-through"]
    return out


def format_memory_disk(result: dict[str, Any], policies: list[str], disk_share: float) -> str:
    """The memory + disk table: per capacity and memory policy, memory hits + disk hits = total."""
    header = ["capacity", "memory/disk blocks", "LRU (plain)",
              *(f"{policy_entry(p).label} ({p}) {a}: mem + disk = total" for p in policies for a in ARRANGEMENTS),
              "optimum"]
    lines = []
    for row in result["rows"]:
        pair = row["memory_disk"]
        cells = [format_tokens(row["capacity_tokens"]), f"{pair['memory_blocks']}/{pair['disk_blocks']}",
                 f"{row['lru_reference']:.3f}"]
        for p in policies:
            for arrangement in ARRANGEMENTS:
                r = pair["arrangements"][arrangement][p]
                cells.append(f"{r['memory']:.3f} + {r['disk']:.3f} = {r['total']:.3f}")
        lines.append([*cells, f"{row['optimum']:.3f}"])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    text = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in [header, *lines]]
    text.append(f"(memory {1 - disk_share:g} and disk {disk_share:g} of each capacity; the disk tier evicts by its "
                "own policy (--disk-policy) whatever the memory policy; write-through: every put on disk too; "
                "exclusive: the disk written memory's evictions (admission evicted); LRU (plain) and optimum at the "
                "combined capacity)")
    return "\n".join(text)


def gap_closed(value: float, lru: float, optimum: float) -> float:
    """The share of the gap from LRU to the optimum that ``value`` closes (0 when there is no gap)."""
    return (value - lru) / (optimum - lru) if optimum > lru else 0.0


def format_table(result: dict[str, Any], policies: list[str]) -> str:
    header = ["capacity", "blocks", "LRU (plain)", *(f"{policy_entry(p).label} ({p})" for p in policies), "optimum"]
    lines = []
    for row in result["rows"]:
        lru, best = row["lru_reference"], row["optimum"]
        cells = [format_tokens(row["capacity_tokens"]), str(row["capacity_blocks"]), f"{lru:.3f}"]
        cells += [f"{row['policies'][p]:.3f} ({gap_closed(row['policies'][p], lru, best):+.0%})" for p in policies]
        lines.append([*cells, f"{best:.3f}"])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    text = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in [header, *lines]]
    text.append("(hit ratio = blocks found / blocks asked of the memory tier; in brackets: share of the gap from "
                "LRU to the optimum closed; optimum: Belady with bypass)")
    return "\n".join(text)


def _plot(result: dict[str, Any], policies: list[str], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib (a dev dependency: pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [row["capacity_tokens"] for row in result["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["lru_reference"] for r in result["rows"]], "k--", label="LRU (plain)")
    for p in policies:
        ax.plot(xs, [r["policies"][p] for r in result["rows"]], marker="o", label=policy_entry(p).label)
    ax.plot(xs, [r["optimum"] for r in result["rows"]], "k:", label="optimum (Belady, bypass)")
    ax.set_xscale("log")
    ax.set_xlabel("memory tier capacity (tokens)")
    ax.set_ylabel("KV hit ratio (blocks)")
    ax.set_title(f"{Path(result['trace']).name}: {result['requests']} requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_object(result: dict[str, Any]) -> None:
    from vllm_tiercache.tools.bench.trace.object_sweep import format_object_table

    print("\n== the object tier's capacity sweeps, hit ratio per policy ==")
    print(format_object_table(result))
    if "object_bucket_at" in result:
        from vllm_tiercache.tools.bench.trace.object_bucket import format_bucket_table

        print("\n== the object tier through a real bucket beside the simulated sweeps, hit ratio per policy ==")
        print(format_bucket_table(result))
    for row in result.get("object_sweep_costs", []):
        print(f"object {row['policy']:6s} one sweep's ranking of {row['records']} listed records: "
              f"{row['seconds'] * 1000:.0f} ms CPU")


def run(args: argparse.Namespace) -> int:
    if args.shared_share is not None and args.disk_share is None:
        raise UsageError("--shared-share needs --disk-share (the split of the rest between memory and disk)")
    if (args.s3_endpoint or args.s3_bucket) and not args.object_bucket:
        raise UsageError("--s3-endpoint/--s3-bucket: only with --object-bucket")
    check_s3_arguments(args)
    args.object = args.object or args.object_bucket
    if args.generate is not None:
        try:
            write_trace(args.trace, generate_trace(args.generate, seed=args.seed))
        except OSError as exc:
            raise UsageError(f"cannot write the trace {args.trace}: {exc.strerror or exc}") from None
    if args.reuse:
        tables = reuse_tables(store_traffic(read_trace(args.trace, args.requests), args.gpu_blocks))
        print(json.dumps(tables, indent=2) if args.json else format_reuse(tables))
        return 0
    started = time.perf_counter()
    result = sweep(args)
    result["costs"] = cost_rows(args.policies, args.cost_puts) if args.cost_puts else []
    if args.object and args.cost_puts:
        from vllm_tiercache.tools.bench.trace.object_sweep import sweep_costs

        result["object_sweep_costs"] = sweep_costs()
    if args.plot:
        _plot(result, args.policies, args.plot)
    beaten = [(row["capacity_tokens"], p) for row in result["rows"] for p, v in row["policies"].items()
              if v > row["optimum"] + 1e-9]
    beaten += [(row["capacity_tokens"], f"{p} + disk {a}") for row in result["rows"]
               for a, cells in row.get("memory_disk", {}).get("arrangements", {}).items()
               for p, v in cells.items() if v["total"] > row["optimum"] + 1e-9]
    beaten += [(row["capacity_tokens"], f"{p} + disk {a} + redis") for row in result["rows"]
               for a, cells in row.get("memory_disk_redis", {}).get("arrangements", {}).items()
               for p, v in cells.items() if v["total"] > row["optimum"] + 1e-9]
    beaten += [(row["capacity_tokens"], f"object {p}") for row in result["rows"]
               for p, cell in row.get("object", {}).items() if cell["ratio"] > row["optimum"] + 1e-9]
    beaten += [(row["capacity_tokens"], f"object {p} (bucket)") for row in result["rows"]
               for p, cell in row.get("object_bucket", {}).items() if cell["ratio"] > row["optimum"] + 1e-9]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"== {result['trace']}: {result['requests']} requests, {result['blocks_asked']} blocks asked of the "
              f"store ({result['distinct_blocks']} distinct), vLLM prefix cache {args.gpu_blocks} blocks, "
              f"{args.record_bytes} B per block ==")
        print(format_table(result, args.policies))
        if args.shared_share is not None:
            rest = 1 - args.shared_share
            print(f"\n== memory + disk + Redis: a real store, memory {rest * (1 - args.disk_share):.3g} / disk "
                  f"{rest * args.disk_share:.3g} / Redis {args.shared_share:g} of each capacity, hit ratio per tier ==")
            print(format_memory_disk_redis(result, args.policies, args.disk_share, args.shared_share))
        elif args.disk_share is not None:
            print(f"\n== memory + disk: a real store, memory {1 - args.disk_share:g} / disk {args.disk_share:g} "
                  "of each capacity, hit ratio per tier ==")
            print(format_memory_disk(result, args.policies, args.disk_share))
        if args.object:
            _print_object(result)
        if result["costs"]:
            print("\n== policy cost per put (insert naming its parent, evict one when full) ==")
            for row in result["costs"]:
                print(f"{row['policy']:10s} {row['us_per_put']:7.2f} us/put  {row['x_lru']:.2f}x LRU")
        print(f"({time.perf_counter() - started:.0f} s)")
    for tokens, policy in beaten:
        print(f"tiercache: {policy} beats the optimum at {format_tokens(tokens)} tokens: a bug", file=sys.stderr)
    return 1 if beaten else 0
