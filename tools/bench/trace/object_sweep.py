"""`tiercache bench trace --object`: the object tier's sweeps replayed on a trace, ranking alone (no bucket).

Why not through a real bucket: a sweep lists every record and the trace needs thousands of sweeps; a
replay of the janitor's choice is seconds, a bucket's would be hours (`object_bucket`, ``--object-bucket``,
replays a leading slice through one, and finds the same hit ratios). What is replayed is what decides the
hit ratio: one writer's usage ledger (per block its last use, its access count as `ledger.UsageLedger`
keeps it, and its parent; trimmed before each sweep to the bound the sweep before set, as the janitor's
rewrite trims it, so a block it forgot is known by its write alone and a rewrite of it counts a newcomer),
its grant (``sweep_share`` of capacity: a sweep when half of it is written, before a put that would pass
it), and each sweep's victims chosen by the tier's own ranking functions (`order.prefix_order`,
`order.lru_order`) down to the low-water mark (capacity less the grant). What is not: request latency,
several writers (their ledgers merge to the same figures), pins, LastModified's whole seconds (a block the
ledger forgot ranks by its exact write time).

The clock is the trace's (``timestamp`` ms, each request a microsecond after the one before: the tier's
ledger times are ns-resolution wall times). Traffic as `replay.serve` has it: the leading run of a
request's blocks held is read, the rest put, each naming the block before it as its parent.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_tiercache.shared.store.tiers.object.config import ObjectTierConfig
from vllm_tiercache.shared.store.tiers.object.sweeps.ledger import UsageLedger
from vllm_tiercache.shared.store.tiers.object.sweeps.order import (
    Candidate,
    half_life_s,
    lru_order,
    prefix_order,
    sweep_turnover,
)
from vllm_tiercache.tools.bench.trace.mooncake import format_tokens
from vllm_tiercache.tools.bench.trace.replay import Asked

#: the object tier's defaults (`ObjectTierConfig`)
SWEEP_SHARE = 0.02
HALF_LIFE = 1.0
OBJECT_POLICIES = ObjectTierConfig.POLICIES
#: records listed in the ranking's cost measure (a bucket of 100k records of 1 MiB: 100 GiB)
COST_RECORDS = 100_000


@dataclass
class SweepReplay:
    """Hits of one policy at one capacity, and what its sweeps cost."""

    found: int
    asked: int
    sweeps: int
    evicted: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.found / self.asked if self.asked else 0.0


def _name(block: int) -> str:
    """The block's object name: a digest-like hex (ties in last use break by name, as in the bucket)."""
    return f"{zlib.crc32(block.to_bytes(8, 'little')):08x}{block:x}"


def replay_object_sweeps(traffic: Sequence[Asked], policy: str, capacity: int, half_life: float = HALF_LIFE,
                         sweep_share: float = SWEEP_SHARE,
                         progress: Callable[[int], None] | None = None) -> SweepReplay:
    """``traffic`` through the object tier's sweeps with ``policy`` at ``capacity`` blocks of one byte each."""
    ledger = UsageLedger()
    held: dict[str, float] = {}  # name -> when it was written (the object's LastModified)
    grant = max(int(sweep_share * capacity), 2)
    low_water = max(0, capacity - grant)
    written = found = asked = sweeps = evicted = 0
    started = time.perf_counter()

    usage: dict[str, float] = {}  # sys/usage as the last sweep left it

    def sweep(now: float) -> None:
        nonlocal written, sweeps, evicted
        written = 0
        sweeps += 1
        ledger.trim(now)  # the janitor rewrites its ledger, trimmed to the last sweep's bound, before it lists
        candidates = [ledger.candidate(h, h, 1, t) for h, t in held.items()]
        usage["turnover_s"] = sweep_turnover(usage, len(held), now, capacity, candidates)
        usage["listed_at"] = now
        if policy == "prefix":  # the writer learns it from sys/usage (`Janitor._learn`): its counts decay by it
            ledger.half_life_s = half_life_s(usage["turnover_s"], half_life)
        if len(held) > low_water:
            ranked = prefix_order(candidates, ledger.half_life_s or 0.0) if policy == "prefix" else \
                lru_order(candidates)
            over = len(held) - low_water
            for _, name, _ in ranked[:over]:
                del held[name]
            evicted += over
        usage["bytes"] = len(held)
        ledger.learn(len(held), now)  # `Janitor._learn`: the records this sweep left bound the next trim

    for done, request in enumerate(traffic, 1):
        now = request.timestamp_ms / 1000.0 + done * 1e-6
        names = [_name(b) for b in request.blocks]
        hit = 0
        while hit < len(names) and names[hit] in held:
            hit += 1
        found += hit
        asked += len(names)
        if hit:
            ledger.read(names[:hit], now)
        parent = names[hit - 1] if hit else (_name(request.parent) if request.parent is not None else None)
        for name in names[hit:]:
            if written + 1 > grant:
                sweep(now)
            held[name] = now
            ledger.wrote([(name, parent)], now)
            written += 1
            parent = name
        if written >= grant / 2:
            sweep(now)
        if progress is not None and done % 256 == 0:
            progress(256)
    if progress is not None:
        progress(len(traffic) % 256)
    return SweepReplay(found, asked, sweeps, evicted, time.perf_counter() - started)


def sweep_cost(records: int, policy: str, chain: int = 64, repeat: int = 3) -> float:
    """Seconds of CPU one sweep's ranking takes for ``records`` listed records (chains of ``chain`` blocks,
    varied last uses and counts): the best of ``repeat``."""
    candidates = []
    for i in range(records):
        head = i - i % chain
        candidates.append(Candidate(f"{i:032x}", f"tiercache/r/{i:032x}", 1 << 20, 1e9 + (i * 7919) % records,
                                    0.1 + (i % 5), f"{i - 1:032x}" if i > head else None))
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        if policy == "prefix":
            prefix_order(candidates, half_life_s(1000.0, HALF_LIFE))
        else:
            lru_order(candidates)
        best = min(best, time.process_time() - started)
    return best


def object_cells(traffic: Sequence[Asked], blocks: int, progress: Callable[[int], None] | None = None,
                 sweep_share: float = SWEEP_SHARE) -> dict[str, dict[str, float]]:
    """Per object tier policy (`ObjectTierConfig.POLICIES`): hit ratio, sweeps, records evicted and seconds at
    ``blocks``."""
    cells = {}
    for policy in OBJECT_POLICIES:
        result = replay_object_sweeps(traffic, policy, blocks, sweep_share=sweep_share, progress=progress)
        cells[policy] = {"ratio": result.ratio, "sweeps": result.sweeps, "evicted": result.evicted,
                         "seconds": round(result.seconds, 2)}
    return cells


def format_object_table(result: dict[str, Any]) -> str:
    """The object tier's table: per capacity, each policy's hit ratio (and sweeps), LRU (plain), optimum."""
    header = ["capacity", "blocks", "LRU (plain)", *(f"object {p} (sweeps)" for p in OBJECT_POLICIES), "optimum"]
    lines = []
    for row in result["rows"]:
        cells = row["object"]
        lines.append([format_tokens(row["capacity_tokens"]), str(row["capacity_blocks"]), f"{row['lru_reference']:.3f}",
                      *(f"{cells[p]['ratio']:.3f} ({cells[p]['sweeps']})" for p in OBJECT_POLICIES),
                      f"{row['optimum']:.3f}"])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    text = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in [header, *lines]]
    share = result.get("sweep_share", SWEEP_SHARE)
    text.append(f"(one writer, sweep_share {share:g}: a sweep every half grant written, down to capacity less "
                "the grant; the sweep's ranking alone, no bucket)")
    return "\n".join(text)


def sweep_costs(records: int = COST_RECORDS) -> list[dict[str, Any]]:
    """CPU seconds of one sweep's ranking of ``records`` listed records, per policy (`sweep_cost`)."""
    return [{"policy": p, "records": records, "seconds": sweep_cost(records, p)} for p in OBJECT_POLICIES]
