"""Demotion: the memory tier's evictions written down to the slower tiers whose admission is ``evicted``.

Why: with write-through (admission ``always``) every put lands in memory and on disk, so memory holds
copies of what the disk holds and the pair holds about the disk's capacity of distinct records; replaying
Mooncake's trace, memory 1/4 + disk 3/4 served less than a memory tier alone of the combined size
(docs/benchmarks-kv.md, issue 56). An ``evicted`` tier is exclusive of memory instead: a put stays in
memory, and what memory lets go of for room (evicted, or refused on arrival) is written down, so the two
hold different records and together hold their sum. A hit in such a tier is promoted into memory and
dropped from that tier (`promoted`, when the tier `DropsRecords`): memory writes it down again when it
evicts it, so keeping it would hold a copy of what memory holds. Measured on Mooncake's trace (memory 1/4,
disk 3/4; docs/benchmarks-kv.md, 2026-11-29): kept, 0.144 / 0.297 at 1M / 3M tokens; dropped, 0.147 /
0.314 (write-through 0.118 / 0.258, plain LRU over the combined capacity 0.139 / 0.309). The price: one
index transaction and unlinks per promoting read, and a promoted record lives in memory only until
evicted again (a crash loses it; a clean close writes it down). The drop runs on a thread of its own, never
on the reading thread: a disk read may be a KV load inside vLLM's forward pass, and an index transaction
(an fsync where the tier syncs) would stall every user's step. It drops only what memory still holds then:
a record memory refused or evicted meanwhile was written down again, and stays.

How: the memory tier hands each put's let-go records to `Demotion.on_let_go` (`HandsOverEvictions`),
on the putting thread, before its eviction listeners hear of them; they go to the store's write-down
(the write-behind buffer, then the background writer), so they stay readable until written, and an
eviction reaches listeners (residency reports, KV events) only once the record is on the slower tier:
a record demoted is never announced gone while the store holds it. A full write queue drops them, as any
write-down (counted ``dropped_writes``): the record is then lost, as a dropped write-through would be.

`Demotion.write_down_held` runs on a clean close, before the writer's last flush: what memory still holds
and the tier lacks is written down, least recently written first, ahead of the bounded queue (none is
dropped for a full queue; memory already holds the tensors), so a clean restart finds everything.
A crash loses what only memory held: the trade the config's docstring states.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from vllm_tiercache.shared.store.api import DropsRecords, HandsOverEvictions, StoreKey, Tier
from vllm_tiercache.shared.store.writes.background import Item
from vllm_tiercache.shared.threads import widen_affinity

log = logging.getLogger(__name__)

#: The store's write-down: (tiers, items) groups, each held readable until written; ``urgent=True``: never
#: dropped for a full queue.
WriteDown = Callable[..., None]
#: Records per write-down job on close (one `contains_many` per tier, then one job).
CLOSE_BATCH = 256


class Demotion:
    """Writes the memory tier's let-go records down to ``tiers`` (see the module docstring)."""

    @classmethod
    def of(cls, tiers: Sequence[Tier], demote_to: Sequence[Tier], write_down: WriteDown) -> Demotion | None:
        """A store's demotion from its fastest tier: None when no tier's admission is ``evicted``."""
        return cls(tiers[0], demote_to, write_down) if demote_to else None

    def __init__(self, memory: Tier, tiers: Sequence[Tier], write_down: WriteDown) -> None:
        """``memory``: the store's fastest tier. An ``evicted`` tier is written nothing on puts, so a fastest
        tier that cannot hand over its evictions (`HandsOverEvictions`) would never write it: refused (the
        config refuses it first, at start)."""
        if not isinstance(memory, HandsOverEvictions):
            raise ValueError(f"admission evicted needs a memory tier first (tiers[0] is {memory.kind}): the "
                             f"{tiers[0].name} tier would be written only by its evictions")
        #: the same tier, as a tier (asked what it holds) and as what hands over its evictions
        self.memory: Tier = memory
        self._handover: HandsOverEvictions = memory
        self.tiers = list(tiers)
        self._write_down = write_down
        self._handover.set_eviction_sink(self.on_let_go)
        #: the promoted records' drops, one at a time in order (`promoted`), and the last one asked
        self._dropper = ThreadPoolExecutor(1, thread_name_prefix="tiercache-demotion-drop",
                                           initializer=lambda: widen_affinity(beside_forward=True))
        self._last_drop: Future[None] | None = None

    def on_let_go(self, items: list[Item]) -> None:
        """The memory tier let go of ``items`` for room: written down (counted admitted on each tier)."""
        for tier in self.tiers:
            tier.counters.add(writes_admitted=len(items))
        self._write_down([(self.tiers, items)])

    def promoted(self, tier: Tier, keys: list[StoreKey]) -> None:
        """``tier`` served ``keys``, just promoted into memory: dropped from it, in the background, when it is
        one of the demotion's tiers and memory still holds them then (module docstring)."""
        if tier in self.tiers and isinstance(tier, DropsRecords):
            self._last_drop = self._dropper.submit(self._drop, tier, keys)

    def _drop(self, tier: DropsRecords, keys: list[StoreKey]) -> None:
        """Drop from ``tier`` the ``keys`` memory holds now (the others were written down again meanwhile)."""
        held = [key for key, found in zip(keys, self.memory.contains_many(keys), strict=True) if found]
        if not held:
            return
        try:
            tier.drop_many(held)
        except Exception as exc:  # a copy left behind costs capacity, never a hit
            tier.counters.add(errors=1)
            log.warning("tiercache: dropping promoted records from %s failed: %s", tier.name, exc)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the drops asked so far; False when ``timeout`` passed first."""
        last = self._last_drop
        return last is None or not wait([last], timeout).not_done

    def write_down_held(self) -> int:
        """Write down what memory holds and a demotion tier lacks (a clean close); how many records.

        The memory tier stops handing over evictions first: after this nothing more is written down; the
        drops still queued run first."""
        self._handover.set_eviction_sink(None)
        self._dropper.shutdown(wait=True)
        held = self._handover.held_items()
        queued = 0
        for start in range(0, len(held), CLOSE_BATCH):
            batch = held[start:start + CLOSE_BATCH]
            groups = []
            for tier in self.tiers:
                try:
                    has = tier.contains_many([key for key, _, _ in batch])
                except Exception:  # a tier that does not answer now: write it all (a rewrite is harmless)
                    has = [False] * len(batch)
                missing = [item for item, found in zip(batch, has, strict=True) if not found]
                if missing:
                    tier.counters.add(writes_admitted=len(missing))
                    groups.append(([tier], missing))
                    queued += len(missing)
            self._write_down(groups, urgent=True)  # more than the queue holds: none dropped on a clean close
        return queued
