"""`BoundedLookup.wait_idle`: a tool that closes a tier next waits for the call its caller stopped waiting for."""

from __future__ import annotations

import threading

from vllm_tiercache.shared.store.api import StoreKey
from vllm_tiercache.shared.store.bounded_lookup import BoundedLookup
from vllm_tiercache.shared.store.counters import TierCounters


class _SlowTier:
    """A tier whose lookups answer once the test lets them."""

    name = "slow"

    def __init__(self) -> None:
        self.counters = TierCounters()
        self.release = threading.Event()

    def contains_many(self, keys: list[StoreKey]) -> list[bool]:
        self.release.wait(30)
        return [True] * len(keys)


def test_wait_idle_waits_for_a_call_past_its_budget_and_no_longer() -> None:
    tier = _SlowTier()
    lookup = BoundedLookup(tier, lambda *_: None)  # type: ignore[arg-type]
    try:
        assert lookup.ask([StoreKey("k")], 0.01) is None  # past the budget: the call is still outstanding
        assert lookup.wait_idle(0.05) is False
        tier.release.set()
        assert lookup.wait_idle(10.0) is True
        assert lookup.ask([StoreKey("k")], 10.0) == [True]  # free again
        assert lookup.wait_idle(0.0) is True
    finally:
        tier.release.set()
        lookup.close()
