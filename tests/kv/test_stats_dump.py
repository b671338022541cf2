"""`vllm_tiercache.shared.stats_dump`: a throttled write is delayed, never dropped."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.waiting import wait_until
from vllm_tiercache.shared import stats_dump


def test_a_throttled_write_lands_when_the_interval_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stats_dump.ENV_VAR, str(tmp_path))
    name = f"throttle-{time.monotonic_ns()}"
    # an interval a loaded machine does not outlast between these calls and the read (at 0.3 s one did:
    # the delayed write had landed before the first read)
    interval_s = 5.0
    stats_dump.dump_stats(name, {"hits": 1}, min_interval_s=interval_s)
    stats_dump.dump_stats(name, {"hits": 2}, min_interval_s=interval_s)
    stats_dump.dump_stats(name, {"hits": 3}, min_interval_s=interval_s)
    (first,) = stats_dump.read_stats(str(tmp_path), name)
    assert first["hits"] == 1, "the first write is immediate; the next two wait for the interval"
    # the last payload submitted inside the interval must be written when it ends
    wait_until("the interval's last payload to be written",
               lambda: stats_dump.read_stats(str(tmp_path), name)[0]["hits"] == 3)
    (last,) = stats_dump.read_stats(str(tmp_path), name)
    assert last["hits"] == 3


def test_a_forced_write_is_immediate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stats_dump.ENV_VAR, str(tmp_path))
    name = f"forced-{time.monotonic_ns()}"
    stats_dump.dump_stats(name, {"hits": 1}, min_interval_s=60)
    stats_dump.dump_stats(name, {"hits": 2}, min_interval_s=60, force=True)
    (stats,) = stats_dump.read_stats(str(tmp_path), name)
    assert stats["hits"] == 2
