"""Patient writes (`vllm_tiercache.shared.store.writes.patience`), the piece alone: what a tier left unwritten is put
again after a backoff, the patience restarts whenever the tier writes something, and records are given up
(counted, one line) only after the tier wrote nothing for the whole patience. The real stores' bad days
(hung, refusing, 503 SlowDown) are in `tests/store/tiers/object/test_patient_writes.py`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store.api import ReportsUnwritten, StoreKey, Unwritten
from vllm_tiercache.shared.store.counters import TierCounters
from vllm_tiercache.shared.store.writes.patience import Backoff, put_patiently

QUICK = Backoff(first_s=0.001, cap_s=0.002, floor_s=0.0)


class Flaky(ReportsUnwritten):
    """A tier that leaves ``fail[i]`` records unwritten at its i-th try (the last ones of the put)."""

    name, kind, shared_across_processes = "flaky", "flaky", True

    def __init__(self, fail: Sequence[int], throttled: bool = False) -> None:
        self.fail = list(fail)
        self.throttled = throttled
        self.counters = TierCounters()
        self.written: list[str] = []
        self.tries = 0

    def try_put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]
                     ) -> Unwritten | None:
        left = self.fail[self.tries] if self.tries < len(self.fail) else 0
        self.tries += 1
        landed = len(items) - min(left, len(items))
        self.written += [key.text for key, _, _ in items[:landed]]
        if landed == len(items):
            return None
        return Unwritten(tuple(range(landed, len(items))), "throttled: SlowDown" if self.throttled else
                         "down: ReadTimeoutError", self.throttled)

    def put_many(self, items: Sequence[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None:
        unwritten = self.try_put_many(items)
        if unwritten is not None:
            self.counters.add(dropped_writes=len(unwritten.positions))


def _items(n: int) -> list[tuple[StoreKey, torch.Tensor, None]]:
    return [(StoreKey(f"k{i}"), torch.zeros(4), None) for i in range(n)]


def test_what_a_tier_left_unwritten_is_put_again_until_it_lands() -> None:
    tier = Flaky([6, 6, 3, 1])  # nothing lands twice, then part, then all
    assert put_patiently(tier, _items(6), 60.0, backoff=QUICK) is None  # type: ignore[arg-type]
    assert tier.written == [f"k{i}" for i in range(6)] and tier.tries == 5
    counters = tier.counters.snapshot()
    assert counters["dropped_writes"] == 0
    assert counters["write_retries"] == 6 + 6 + 3 + 1 and counters["write_wait_seconds"] > 0


def test_records_are_given_up_only_after_the_tier_wrote_nothing_for_the_whole_patience(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    tier = Flaky([4] * 1000)

    def sleep(seconds: float) -> None:  # a fake clock: the test takes no real time
        clock[0] += seconds

    import vllm_tiercache.shared.store.writes.patience as patience

    real = patience.time.monotonic
    patience.time.monotonic = lambda: clock[0]  # type: ignore[assignment]
    try:
        with caplog.at_level(logging.ERROR, logger="vllm_tiercache.shared.store.writes.patience"):
            gave_up = put_patiently(tier, _items(4), 30.0, backoff=Backoff(first_s=1.0, cap_s=4.0),  # type: ignore[arg-type]
                                    sleep=sleep)
    finally:
        patience.time.monotonic = real  # type: ignore[assignment]
    assert gave_up is not None and len(gave_up.positions) == 4
    assert "after waiting 30.0s" in gave_up.reason and "ReadTimeoutError" in gave_up.reason
    assert clock[0] == pytest.approx(30.0)  # the last pause is cut to the patience
    assert tier.counters.snapshot()["dropped_writes"] == 4
    (line,) = [r.getMessage() for r in caplog.records]
    assert "flaky tier wrote nothing for 30.0s" in line and "4 records given up" in line


def test_a_tier_that_writes_some_restarts_the_patience() -> None:
    clock = [0.0]
    # each try lands one record: 5 tries of 10 s pauses would pass a 15 s patience, were it not restarted
    tier = Flaky([5, 4, 3, 2, 1])

    def sleep(seconds: float) -> None:
        clock[0] += 10.0

    import vllm_tiercache.shared.store.writes.patience as patience

    real = patience.time.monotonic
    patience.time.monotonic = lambda: clock[0]  # type: ignore[assignment]
    try:
        assert put_patiently(tier, _items(5), 15.0, backoff=QUICK, sleep=sleep) is None  # type: ignore[arg-type]
    finally:
        patience.time.monotonic = real  # type: ignore[assignment]
    assert tier.written == [f"k{i}" for i in range(5)]


def test_without_patience_a_put_is_one_try_and_the_rest_is_dropped() -> None:
    tier = Flaky([2], throttled=True)
    assert put_patiently(tier, _items(3), 0.0) is None  # type: ignore[arg-type]
    assert tier.tries == 1 and tier.counters.snapshot()["dropped_writes"] == 2


def test_a_closing_store_ends_a_patient_wait_at_once() -> None:
    tier = Flaky([1] * 1000)
    stop = threading.Event()
    stop.set()
    gave_up = put_patiently(tier, _items(1), 3600.0, stop=stop)  # type: ignore[arg-type]
    assert gave_up is not None and tier.tries == 1


def test_backoff_pauses_double_up_to_the_cap_with_jitter() -> None:
    delays = Backoff(first_s=0.1, cap_s=1.0, floor_s=0.0).delays()
    pauses = [next(delays) for _ in range(40)]
    assert all(0 <= p <= 0.1 * 2 ** i for i, p in enumerate(pauses[:4]))
    assert all(p <= 1.0 for p in pauses) and len(set(pauses)) > 30  # jittered, never in step


def test_write_patience_is_validated_and_leaves_a_serving_configs_identity_alone() -> None:
    assert StoreConfig.from_dict({}).write_patience_s == 0.0
    assert "write_patience_s" not in StoreConfig.from_dict({}).cache_key()
    assert StoreConfig.from_dict({"write_patience_s": 600.0}).cache_key() != StoreConfig.from_dict({}).cache_key()
    for bad in (-1.0, 1e9, "soon"):
        with pytest.raises(Exception, match="write_patience_s"):
            StoreConfig.from_dict({"write_patience_s": bad})


def test_the_janitor_deletes_again_what_the_store_throttled_and_leaves_other_failures_to_the_next_sweep() -> None:
    from vllm_tiercache.shared.store.tiers.object.calls import Failure
    from vllm_tiercache.shared.store.tiers.object.client import ERROR, THROTTLED
    from vllm_tiercache.shared.store.tiers.object.sweeps.evictions import delete_backing_off

    class Calls:  # the tier's requests, answering by name: "slow" throttled twice, "bad" always refused
        class health:
            closed = False

        def __init__(self) -> None:
            self.sent: list[str] = []

        def delete(self, name: str) -> dict:
            return {}

        def many(self, what: str, fn, names):
            self.sent += names
            return [Failure(ERROR) if n == "bad" else Failure(THROTTLED) if n == "slow" and self.sent.count(n) <= 2
                    else fn(n) for n in names]

    calls = Calls()
    done = delete_backing_off(calls, ["ok", "slow", "bad"], backoff=QUICK)  # type: ignore[arg-type]
    assert done[0] == {} and done[1] == {} and isinstance(done[2], Failure) and done[2].kind == ERROR
    assert calls.sent.count("slow") == 3 and calls.sent.count("bad") == 1 and calls.sent.count("ok") == 1
