"""Where a sealing store seals and opens: every tier that is not inside the process (`InProcessTier`).

Why in the store and not in each tier: the disk, GDS and Redis tiers (and any later shared tier, an object
store) then store sealed records without a line of their own; only the memory tier, inside the process,
keeps plaintext. `TieredStore` hands each put bound for a tier through `outgoing` (the background writer
through `prepare`, so a record written to two sealed tiers is sealed once) and each tier's answers through
`incoming`.

Failures are misses: a record that does not open is None to the caller, counted in the tier's
``sealed_rejected``; a damaged one (bad tag, truncated, malformed) is deleted where the tier can
(`DropsRecords`); one of an unknown or retired key, or a plaintext one, is left (another ring's, or for
`tiercache evict --key-id`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from vllm_tiercache.shared.store.api import DropsRecords, InProcessTier, Item, Record, StoreKey, Tier
from vllm_tiercache.shared.store.sealing.config import EncryptionConfig
from vllm_tiercache.shared.store.sealing.ring import load_ring
from vllm_tiercache.shared.store.sealing.sealer import Sealer, SealRejected

log = logging.getLogger(__name__)


def seals(tier: Tier) -> bool:
    """Whether a sealing store seals what it writes to ``tier`` (every tier but an in-process one)."""
    return not isinstance(tier, InProcessTier)


class SealedTiers:
    """A sealing store's seal and open steps (module docstring)."""

    def __init__(self, sealer: Sealer) -> None:
        self.sealer = sealer

    def outgoing(self, tier: Tier, items: Sequence[Item]) -> Sequence[Item]:
        """``items`` as ``tier`` stores them: sealed unless it is an in-process tier."""
        if not seals(tier):
            return items
        return [(key, *self.sealer.seal(key, tensor, meta)) for key, tensor, meta in items]

    def prepare(self, groups: list[tuple[Tier, list[Item]]]) -> list[tuple[Tier, list[Item]]]:
        """The background writer's (tier, items) groups as the tiers store them, each record sealed once."""
        sealed: dict[int, Item] = {}
        out = []
        for tier, items in groups:
            if not seals(tier):
                out.append((tier, items))
                continue
            mine = []
            for item in items:
                done = sealed.get(id(item))
                if done is None:
                    key, tensor, meta = item
                    done = sealed[id(item)] = (key, *self.sealer.seal(key, tensor, meta))
                mine.append(done)
            out.append((tier, mine))
        return out

    def incoming(self, tier: Tier, keys: Sequence[StoreKey], found: Sequence[Record | None],
                 into: Sequence[Sequence[memoryview] | None] | None = None) -> list[Record | None]:
        """``tier``'s answers for ``keys`` opened; a record that does not open is a miss (counted, and
        deleted when damaged). ``into``: per key, where the caller wants the plaintext (`Sealer.open`)."""
        if not seals(tier):
            return list(found)
        out: list[Record | None] = []
        damaged: list[StoreKey] = []
        rejected = 0
        for i, (key, record) in enumerate(zip(keys, found, strict=True)):
            if record is None:
                out.append(None)
                continue
            try:
                out.append(self.sealer.open(key, record, into[i] if into is not None else None))
            except SealRejected as exc:
                rejected += 1
                out.append(None)
                if exc.damaged:
                    damaged.append(key)
                log.debug("tiercache: %s tier: sealed record %s did not open (%s)", tier.name, key.hex, exc.reason)
        if rejected:
            tier.counters.add(sealed_rejected=rejected)
        if damaged and isinstance(tier, DropsRecords):
            try:
                tier.drop_many(damaged)
            except Exception as exc:  # a tier bug: the record stays a miss
                tier.counters.add(errors=1)
                log.warning("tiercache: %s tier: deleting %d records that do not open failed: %s",
                            tier.name, len(damaged), exc)
        return out


def sealed_tiers(encryption: EncryptionConfig | None) -> SealedTiers | None:
    """The seal and open steps of a store with this ``encryption`` section (None: no sealing); reads the
    ring now, raising `ConfigError` (one line, no secret) when it cannot."""
    if encryption is None:
        return None
    return SealedTiers(Sealer(load_ring(encryption.ring)))
